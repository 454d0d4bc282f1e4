//! Helpers shared by the scheduler's integration tests.
#![allow(dead_code)]

use llmserve_scheduler::*;

pub fn config(num_blocks: usize, block_size: usize, max_num_seqs: usize, max_batched: usize) -> SchedulerConfig {
    SchedulerConfig {
        num_blocks,
        block_size,
        max_num_seqs,
        max_num_batched_tokens: max_batched,
        max_model_len: (num_blocks - 1) * block_size,
        enable_prefix_caching: false,
        cache_decoded_blocks: true,
        max_loras: 0,
        policy: Policy::Fcfs,
        speculation: None,
        draft_step_tokens: 0,
        long_prefill_token_threshold: 0,
    }
}

pub fn request(id: u64, prompt: Vec<u32>, max_tokens: u32) -> NewRequest {
    NewRequest {
        id,
        prompt,
        n: 1,
        sampling: SeqSampling::default(),
        stop: StopRules { max_tokens, ..StopRules::default() },
        priority: 0,
        cache_salt: None,
        lora: 0,
        prompt_logprobs: None,
        pooling: None,
        speculate: false,
        prediction: Vec::new(),
    }
}

pub fn prompt(len: usize, seed: u32) -> Vec<u32> {
    (0..len as u32).map(|i| 100 + (i * 7 + seed * 13) % 1000).collect()
}

/// Schedule and commit one step, sampling `token` on every row.
pub fn step(s: &mut Scheduler, token: u32) -> (Plan, Vec<SeqUpdate>) {
    let plan = s.schedule();
    check_plan(s, &plan);
    let updates = if plan.is_empty() { Vec::new() } else { s.commit(&vec![token; plan.num_rows]) };
    s.validate().unwrap();
    (plan, updates)
}

/// Structural checks every Plan must pass.
pub fn check_plan(s: &Scheduler, plan: &Plan) {
    let bs = s.config().block_size as i64;
    assert_eq!(plan.input_ids.len(), plan.num_tokens);
    assert_eq!(plan.positions.len(), plan.num_tokens);
    assert_eq!(plan.slot_mapping.len(), plan.num_tokens);
    assert_eq!(plan.query_start_loc.len(), plan.num_seqs + 1);
    assert_eq!(plan.seq_lens.len(), plan.num_seqs);
    assert_eq!(plan.block_tables.len(), plan.num_seqs * plan.block_table_width);
    assert_eq!(plan.copy_src.len(), plan.copy_dst.len());
    assert_eq!(plan.pool_indices.len(), plan.pool_req_ids.len());
    assert!(plan.pool_indices.iter().all(|&row| row >= 0 && (row as usize) < plan.num_tokens));
    assert!(plan.num_tokens <= s.config().max_num_batched_tokens);
    assert!(plan.num_seqs <= s.config().max_num_seqs);
    for col in [
        plan.logits_indices.len(),
        plan.temperature.len(),
        plan.top_p.len(),
        plan.min_p.len(),
        plan.presence_penalty.len(),
        plan.frequency_penalty.len(),
        plan.repetition_penalty.len(),
        plan.top_k.len(),
        plan.seeds.len(),
        plan.gen_index.len(),
        plan.num_logprobs.len(),
        plan.hist_prompt_lens.len(),
        plan.row_req_ids.len(),
        plan.row_seq_index.len(),
    ] {
        assert_eq!(col, plan.num_rows);
    }
    assert_eq!(plan.bias_offsets.len(), plan.num_rows + 1);
    assert_eq!(plan.hist_offsets.len(), plan.num_rows + 1);
    assert_eq!(*plan.bias_offsets.last().unwrap() as usize, plan.bias_token_ids.len());
    assert_eq!(*plan.hist_offsets.last().unwrap() as usize, plan.hist_tokens.len());
    for sq in 0..plan.num_seqs {
        let table = plan.block_table(sq);
        let used: Vec<i32> = table.iter().copied().take_while(|&b| b != 0).collect();
        assert!(table[used.len()..].iter().all(|&b| b == 0), "padding only at the end");
        for &b in &used {
            assert!(s.block_pool().ref_count(b as u32) > 0, "block table references free block {b}");
        }
        let range = plan.token_range(sq);
        assert!(!range.is_empty());
        assert_eq!(plan.positions[range.end - 1] + 1, plan.seq_lens[sq] as i64);
        for t in range {
            let pos = plan.positions[t];
            let slot = plan.slot_mapping[t];
            assert_eq!(slot % bs, pos % bs, "slot offset matches position");
            assert_eq!(slot / bs, used[(pos / bs) as usize] as i64, "slot inside the sequence's block");
        }
    }
    for &li in &plan.logits_indices {
        assert!((li as usize) < plan.num_tokens);
    }
}
