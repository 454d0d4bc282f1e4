//! Behaviour of the scheduler through its public API: chunking, prefix reuse, preemption,
//! policies, abort, fork, stop rules and the sampling columns.

mod common;

use common::{check_plan, config, prompt, request, step};
use llmserve_scheduler::*;

#[test]
fn long_prompt_is_chunked_and_samples_only_at_the_end() {
    let mut s = Scheduler::new(config(101, 16, 8, 256));
    s.add(request(1, prompt(1000, 1), 4));
    let mut computed = 0;
    for k in 0..4 {
        let (plan, updates) = step(&mut s, 7);
        let expect = if k < 3 { 256 } else { 1000 - 768 };
        assert_eq!(plan.num_tokens, expect);
        assert_eq!(plan.positions[0], computed as i64);
        computed += expect;
        assert_eq!(plan.seq_lens, vec![computed as i32]);
        if k < 3 {
            assert_eq!(plan.num_rows, 0);
            assert!(updates.is_empty());
        } else {
            assert_eq!(plan.logits_indices, vec![expect as i64 - 1]);
            assert_eq!(plan.gen_index, vec![0]);
            assert_eq!(updates.len(), 1);
        }
    }
    // Then one token per step.
    let (plan, _) = step(&mut s, 7);
    assert_eq!((plan.num_tokens, plan.positions[0], plan.gen_index[0]), (1, 1000, 1));
    assert_eq!(plan.input_ids, vec![7]);
}

#[test]
fn long_prefill_threshold_leaves_room_for_other_prompts() {
    // The budget (256) holds the long prompt's first chunk alone; capped at 64 a step, it
    // leaves room for a short prompt sent beside it, which then samples in the first step.
    for (cap, short_first) in [(0, false), (64, true)] {
        let mut s = Scheduler::new(SchedulerConfig { long_prefill_token_threshold: cap, ..config(101, 16, 8, 256) });
        s.add(request(1, prompt(1000, 1), 2));
        s.add(request(2, prompt(20, 2), 2));
        let (plan, updates) = step(&mut s, 7);
        assert_eq!(updates.iter().any(|u| u.req_id == 2), short_first, "cap {cap}");
        if cap > 0 {
            assert_eq!((plan.num_seqs, plan.num_tokens), (2, 64 + 20));
            // the long prompt keeps its chunks at the cap until its last
            let mut computed = 64;
            while computed < 1000 {
                let (plan, _) = step(&mut s, 7);
                let long = plan.seq_lens[0] as usize - computed;
                assert_eq!(long, (1000 - computed).min(64));
                computed += long;
            }
        }
    }
}

#[test]
fn decode_runs_to_max_tokens_and_frees_blocks() {
    let mut s = Scheduler::new(config(17, 4, 8, 64));
    s.add(request(1, prompt(6, 1), 3));
    let mut finishes = vec![];
    for _ in 0..3 {
        let (_, u) = step(&mut s, 9);
        finishes.push(u[0].finish);
    }
    assert_eq!(finishes, vec![None, None, Some(FinishReason::Length)]);
    assert!(!s.has_work());
    assert_eq!(s.stats().used_blocks, 0);
    assert_eq!(s.num_requests(), 0);
    assert!(s.schedule().is_empty());
}

#[test]
fn identical_prompt_computes_only_the_tail() {
    let mut cfg = config(33, 16, 8, 256);
    cfg.enable_prefix_caching = true;
    let mut s = Scheduler::new(cfg);
    s.add(request(1, prompt(40, 1), 1));
    let (plan_a, u) = step(&mut s, 5);
    assert_eq!(plan_a.num_tokens, 40);
    assert_eq!(u[0].finish, Some(FinishReason::Length));
    assert_eq!(u[0].cached_prompt_tokens, Some(0));
    // A finished: its two full blocks stay cached in the LRU, the partial one is plain.
    assert_eq!(s.stats().used_blocks, 0);
    assert_eq!(s.stats().cached_blocks, 2);

    s.add(request(2, prompt(40, 1), 2));
    let (plan_b, u) = step(&mut s, 5);
    assert_eq!(u[0].cached_prompt_tokens, Some(32), "the request's first token says what it reused");
    assert_eq!(plan_b.num_tokens, 8, "only the tail after two cached blocks");
    assert_eq!(plan_b.positions[0], 32);
    assert_eq!(s.stats().prefix_hit_tokens, 32);
    assert_eq!(s.stats().prefix_query_tokens, 40 + 40, "A's prompt and B's");
    assert_eq!(&plan_b.block_table(0)[..2], &plan_a.block_table(0)[..2]);

    // While B runs, C with the same prompt shares B's blocks (ref count 2).
    s.add(request(3, prompt(40, 1), 1));
    let (plan, u) = step(&mut s, 5);
    assert_eq!(plan.num_tokens, 1 + 8);
    let by_id = |id| u.iter().find(|u| u.req_id == id).unwrap().cached_prompt_tokens;
    assert_eq!((by_id(2), by_id(3)), (None, Some(32)), "only a first token carries the count");
    let shared = plan.block_table(1)[0] as u32;
    assert_eq!(plan.block_table(0)[0] as u32, shared);
    assert_eq!(s.stats().prefix_hit_tokens, 64);
    assert_eq!(s.stats().prefix_query_tokens, 3 * 40);
}

#[test]
fn a_reset_prefix_cache_is_found_by_no_later_prompt() {
    let mut cfg = config(33, 16, 8, 256);
    cfg.enable_prefix_caching = true;
    let mut s = Scheduler::new(cfg);
    s.add(request(1, prompt(40, 1), 1));
    step(&mut s, 5);
    // B runs, holding the two cached blocks, when the cache is reset
    s.add(request(2, prompt(40, 1), 3));
    let (_, u) = step(&mut s, 5);
    assert_eq!(u[0].cached_prompt_tokens, Some(32));
    assert_eq!(s.reset_prefix_cache(), 2);
    s.validate().unwrap();
    assert_eq!(s.stats().cached_blocks, 0);
    assert_eq!(s.reset_prefix_cache(), 0, "nothing left to forget");
    // C computes its whole prompt although B still holds the blocks it would have found
    s.add(request(3, prompt(40, 1), 1));
    let (plan, u) = step(&mut s, 5);
    assert_eq!(plan.num_tokens, 1 + 40);
    assert_eq!(u.iter().find(|u| u.req_id == 3).unwrap().cached_prompt_tokens, Some(0));
    while s.has_work() {
        step(&mut s, 5);
    }
    s.validate().unwrap();
    assert_eq!(s.stats().used_blocks, 0);
    // C's own blocks are cached as usual
    assert_eq!(s.stats().cached_blocks, 2);
}

#[test]
fn prefix_cache_stats_count_only_lookups() {
    // Caching off: nothing is looked up, so nothing is queried (vLLM records no stats then).
    let mut s = Scheduler::new(config(33, 16, 8, 256));
    for id in 1..=2 {
        s.add(request(id, prompt(40, 1), 1));
        step(&mut s, 5);
    }
    assert_eq!((s.stats().prefix_hit_tokens, s.stats().prefix_query_tokens), (0, 0));
    // Caching on: a prompt that owes logprob rows skips the lookup and is not counted.
    let mut cfg = config(33, 16, 8, 256);
    cfg.enable_prefix_caching = true;
    let mut s = Scheduler::new(cfg);
    s.add(request(1, prompt(40, 1), 1));
    step(&mut s, 5);
    s.add(NewRequest { prompt_logprobs: Some(1), ..request(2, prompt(40, 1), 1) });
    step(&mut s, 5);
    assert_eq!((s.stats().prefix_hit_tokens, s.stats().prefix_query_tokens), (0, 40));
}

#[test]
fn block_with_the_last_prompt_token_is_never_reused() {
    let mut cfg = config(33, 16, 8, 256);
    cfg.enable_prefix_caching = true;
    let mut s = Scheduler::new(cfg);
    s.add(request(1, prompt(32, 1), 1));
    step(&mut s, 5);
    s.add(request(2, prompt(32, 1), 1));
    let (plan, _) = step(&mut s, 5);
    assert_eq!(plan.num_tokens, 16, "the second full block holds the last token: recomputed");
}

#[test]
fn cache_salt_prevents_sharing() {
    let mut cfg = config(33, 16, 8, 256);
    cfg.enable_prefix_caching = true;
    let mut s = Scheduler::new(cfg);
    let salted =
        |id, salt: Option<&str>| NewRequest { cache_salt: salt.map(String::from), ..request(id, prompt(40, 1), 1) };
    s.add(salted(1, Some("alice")));
    step(&mut s, 5);
    s.add(salted(2, Some("bob")));
    assert_eq!(step(&mut s, 5).0.num_tokens, 40);
    s.add(salted(3, None));
    assert_eq!(step(&mut s, 5).0.num_tokens, 40);
    s.add(salted(4, Some("alice")));
    assert_eq!(step(&mut s, 5).0.num_tokens, 8);
}

/// A request's LoRA adapter is listed for each of its scheduled sequences, and blocks are
/// shared only within one adapter (the same tokens make other K/V through another adapter).
#[test]
fn lora_adapters_are_planned_and_never_share_blocks() {
    let mut cfg = config(33, 16, 8, 256);
    cfg.enable_prefix_caching = true;
    let mut s = Scheduler::new(cfg);
    let adapted = |id, lora| NewRequest { lora, ..request(id, prompt(40, 1), 8) };
    s.add(adapted(1, 2));
    let (plan, _) = step(&mut s, 5);
    assert_eq!(plan.lora_ids, [2]);
    s.add(adapted(2, 0));
    let (plan, _) = step(&mut s, 5);
    assert_eq!(plan.num_tokens, 1 + 40, "the base model reuses nothing of adapter 2's blocks");
    assert_eq!((plan.seq_req_ids.clone(), plan.lora_ids.clone()), (vec![1, 2], vec![2, 0]));
    s.add(adapted(3, 1));
    assert_eq!(s.adapters(), (vec![2], vec![1]));
    assert_eq!(step(&mut s, 5).0.num_tokens, 2 + 40);
    assert_eq!(s.adapters(), (vec![1, 2], vec![]));
    s.add(adapted(4, 2));
    assert_eq!(step(&mut s, 5).0.num_tokens, 3 + 8);
}

/// `max_loras` bounds the adapters among the running sequences: a sequence of another adapter
/// waits, the base model's pass it, and so do none of the adapters' behind it (so the running
/// adapters drain and it is not starved).
#[test]
fn max_loras_bounds_the_adapters_running() {
    let mut s = Scheduler::new(SchedulerConfig { max_loras: 1, ..config(33, 16, 8, 256) });
    let adapted = |id, lora| NewRequest { lora, ..request(id, prompt(10, id as u32), 3) };
    s.add(adapted(1, 1));
    s.add(adapted(2, 2));
    s.add(adapted(3, 0));
    s.add(adapted(4, 1));
    let (plan, _) = step(&mut s, 5);
    assert_eq!((plan.seq_req_ids.clone(), plan.lora_ids.clone()), (vec![1, 3], vec![1, 0]));
    step(&mut s, 5);
    step(&mut s, 5); // 1 and 3 finish (3 tokens each)
    assert_eq!(s.adapters(), (vec![], vec![1, 2]));
    let (plan, _) = step(&mut s, 5);
    assert_eq!((plan.seq_req_ids.clone(), plan.lora_ids.clone()), (vec![2], vec![2]));
    step(&mut s, 5);
    step(&mut s, 5);
    let (plan, _) = step(&mut s, 5);
    assert_eq!((plan.seq_req_ids.clone(), plan.lora_ids.clone()), (vec![4], vec![1]));
    // unbounded (0), all three adapters share a step
    let mut s = Scheduler::new(config(33, 16, 8, 256));
    for (id, lora) in [(1, 1), (2, 2), (3, 0), (4, 1)] {
        s.add(adapted(id, lora));
    }
    assert_eq!(step(&mut s, 5).0.lora_ids, [1, 2, 0, 1]);
}

#[test]
fn output_blocks_are_cached_too() {
    let mut cfg = config(33, 4, 8, 256);
    cfg.enable_prefix_caching = true;
    let mut s = Scheduler::new(cfg);
    s.add(request(1, vec![1, 2, 3, 4, 5, 6], 4));
    for _ in 0..4 {
        step(&mut s, 9);
    }
    // Tokens were 1..6 then 9 9 9 9: blocks [1 2 3 4] [5 6 9 9] are full and cached.
    s.add(request(2, vec![1, 2, 3, 4, 5, 6, 9, 9, 9], 1));
    assert_eq!(step(&mut s, 9).0.num_tokens, 1);
}

#[test]
fn blocks_a_decode_step_computed_are_cached_only_when_asked() {
    // Prompt 1..6, then 9 9 9 9: block [5 6 9 9] holds K/V of two decode steps. Without
    // cache_decoded_blocks only the prompt's block [1 2 3 4] is reused.
    let mut cfg = config(33, 4, 8, 256);
    cfg.enable_prefix_caching = true;
    cfg.cache_decoded_blocks = false;
    let mut s = Scheduler::new(cfg);
    s.add(request(1, vec![1, 2, 3, 4, 5, 6], 4));
    for _ in 0..4 {
        step(&mut s, 9);
    }
    assert_eq!(s.stats().cached_blocks, 1);
    s.add(request(2, vec![1, 2, 3, 4, 5, 6, 9, 9, 9], 1));
    assert_eq!(step(&mut s, 9).0.num_tokens, 5);
    // That prompt computed 5 6 9 9 as prompt tokens: its block is cached now.
    assert_eq!(s.stats().cached_blocks, 2);
    s.add(request(3, vec![1, 2, 3, 4, 5, 6, 9, 9, 9], 1));
    assert_eq!(step(&mut s, 9).0.num_tokens, 1);
}

#[test]
fn a_preempted_sequence_caches_only_its_prompt_when_it_recomputes() {
    // 6 usable blocks of 4 tokens: two 8-token prompts that generate 12 outgrow them, and one
    // is preempted. Its generated tokens are recomputed as its decode steps computed them (the
    // runner: ModelRunner._parts), with their numerics: like a decode step's K/V, theirs is not
    // for the prefix cache (on CPU, a prompt holding them would compute them otherwise).
    let mut cfg = config(7, 4, 8, 64);
    cfg.enable_prefix_caching = true;
    cfg.cache_decoded_blocks = false;
    let mut s = Scheduler::new(cfg);
    s.add(request(1, prompt(8, 1), 12));
    s.add(request(2, prompt(8, 2), 12));
    let mut recomputed = false;
    for _ in 0..40 {
        let (plan, _) = step(&mut s, 9);
        let qsl = &plan.query_start_loc;
        recomputed |= (0..plan.num_seqs).any(|q| qsl[q + 1] - qsl[q] > 8);
        if plan.is_empty() {
            break;
        }
    }
    assert!(recomputed && s.stats().preemptions > 0);
    // prompt(8, 2) + 9s: only the prompt's blocks are found
    let mut tokens = prompt(8, 2);
    tokens.extend([9; 8]);
    s.add(request(3, tokens.clone(), 1));
    let (plan, _) = step(&mut s, 9);
    assert_eq!(plan.num_tokens, tokens.len() - 8, "hit only the prompt");
}

#[test]
fn a_recomputing_sequence_takes_no_block_another_prompt_computed_over_its_outputs() {
    // V's prompt is 1..8 and it generates 9s; B's prompt is V's tokens so far and more, so B's
    // prompt step computes blocks over V's generated tokens (audit Q: a continuation sent while
    // the first request runs). V, preempted, recomputes its 9s as its decode steps computed them,
    // not from B's blocks, which hold other numerics on CPU.
    let mut cfg = config(9, 4, 8, 64);
    cfg.enable_prefix_caching = true;
    cfg.cache_decoded_blocks = false;
    cfg.policy = Policy::Priority;
    let mut s = Scheduler::new(cfg);
    s.add(NewRequest { priority: 10, ..request(1, prompt(8, 1), 20) });
    for _ in 0..9 {
        step(&mut s, 9);
    }
    let mut continuation = prompt(8, 1);
    continuation.extend([9; 8]);
    continuation.push(7);
    s.add(NewRequest { priority: -1, ..request(2, continuation, 20) });
    // V's first row of more than one token, once it was preempted: its recompute
    let mut recompute = None;
    while recompute.is_none() && s.has_work() {
        let (plan, _) = step(&mut s, 9);
        let qsl = &plan.query_start_loc;
        let v = (0..plan.num_seqs).find(|&q| plan.seq_req_ids[q] == 1 && qsl[q + 1] - qsl[q] > 1);
        recompute = v.filter(|_| s.stats().preemptions > 0).map(|q| (plan.seq_lens[q], qsl[q + 1] - qsl[q]));
    }
    let (len, computed) = recompute.expect("V was preempted and recomputed");
    assert_eq!(computed, len - 8, "V found its prompt's two blocks and nothing past them");
    while s.has_work() {
        step(&mut s, 9);
    }
}

#[test]
fn a_prompt_that_fills_the_context_is_scored_when_it_asks_for_nothing() {
    // max_model_len 32 (8 usable blocks of 4): max_tokens 0 computes the prompt's logits only
    let mut s = Scheduler::new(config(9, 4, 8, 64));
    s.add(request(1, prompt(32, 1), 0));
    let (plan, updates) = step(&mut s, 5);
    assert_eq!((plan.num_tokens, plan.num_rows), (32, 1));
    assert_eq!(updates[0].finish, Some(FinishReason::Length));
    assert_eq!(s.stats().used_blocks, 0);
    assert!(step(&mut s, 5).0.is_empty());
}

#[test]
fn no_caching_means_no_hits() {
    let mut s = Scheduler::new(config(33, 16, 8, 256));
    s.add(request(1, prompt(40, 1), 1));
    step(&mut s, 5);
    s.add(request(2, prompt(40, 1), 1));
    assert_eq!(step(&mut s, 5).0.num_tokens, 40);
    assert_eq!(s.stats().cached_blocks, 0);
}

#[test]
fn preempted_sequence_recomputes_and_keeps_outputs() {
    // 6 usable blocks of 4 tokens; two sequences of 8-token prompts outgrow them.
    let mut s = Scheduler::new(config(7, 4, 8, 64));
    s.add(request(1, prompt(8, 1), 12));
    s.add(request(2, prompt(8, 2), 12));
    let mut outputs: std::collections::HashMap<u64, Vec<u32>> = Default::default();
    let mut resumed_plan_tokens = None;
    let mut tok = 0;
    for _ in 0..100 {
        if !s.has_work() {
            break;
        }
        let before = s.stats().preemptions;
        tok += 1;
        let (plan, updates) = step(&mut s, tok);
        for u in &updates {
            outputs.entry(u.req_id).or_default().push(u.token);
        }
        if before > 0 && resumed_plan_tokens.is_none() && plan.seq_req_ids.contains(&2) && plan.num_tokens > 2 {
            let k = plan.seq_req_ids.iter().position(|&r| r == 2).unwrap();
            resumed_plan_tokens = Some((plan.token_range(k).len(), plan.positions[plan.token_range(k).start]));
            // (the runner computes the tokens past the prompt as generated ones)
            assert_eq!(plan.prompt_lens[k], 8);
        }
        assert_eq!(plan.prompt_lens.len(), plan.num_seqs);
        // Request 1 is the earliest arrival: under fcfs it is never the victim.
        if let Some(blocks) = s.seq_blocks(1, 0) {
            assert!(!blocks.is_empty());
        }
    }
    assert!(s.stats().preemptions >= 1);
    let (n, start) = resumed_plan_tokens.expect("request 2 resumed");
    assert_eq!(start, 0, "recompute starts from position 0");
    assert!(n > 8, "prompt and the outputs it already had are recomputed");
    assert_eq!(outputs[&1].len(), 12);
    assert_eq!(outputs[&2].len(), 12, "outputs survive preemption");
    assert_eq!(s.stats().used_blocks, 0);
}

fn full_batch_order(policy: Policy) -> Vec<u64> {
    let mut cfg = config(65, 4, 1, 64);
    cfg.policy = policy;
    let mut s = Scheduler::new(cfg);
    let with_prio = |id, p| NewRequest { priority: p, ..request(id, prompt(5, id as u32), 2) };
    s.add(with_prio(1, 0));
    step(&mut s, 3);
    s.add(with_prio(2, 5));
    s.add(with_prio(3, 9));
    s.add(with_prio(4, 1));
    let mut order = vec![];
    while s.has_work() {
        let (plan, _) = step(&mut s, 3);
        for &r in &plan.seq_req_ids {
            if !order.contains(&r) {
                order.push(r);
            }
        }
    }
    order
}

#[test]
fn priority_admits_higher_priority_waiting_first() {
    assert_eq!(full_batch_order(Policy::Priority), vec![1, 4, 2, 3]);
}

#[test]
fn fcfs_admits_in_arrival_order() {
    assert_eq!(full_batch_order(Policy::Fcfs), vec![1, 2, 3, 4]);
}

#[test]
fn priority_preempts_the_lowest_priority_running() {
    let mut cfg = config(9, 4, 8, 64);
    cfg.policy = Policy::Priority;
    let mut s = Scheduler::new(cfg);
    // Low priority arrives first; high priority second; both grow until blocks run out.
    s.add(NewRequest { priority: 10, ..request(1, prompt(8, 1), 20) });
    s.add(NewRequest { priority: -1, ..request(2, prompt(8, 2), 20) });
    while s.stats().preemptions == 0 {
        step(&mut s, 1);
    }
    assert_eq!(s.seq_blocks(1, 0), Some(&[][..]), "the low-priority request was preempted");
    assert!(!s.seq_blocks(2, 0).unwrap().is_empty());
    while s.has_work() {
        step(&mut s, 1);
    }
}

#[test]
fn abort_frees_blocks_at_once() {
    let mut s = Scheduler::new(config(33, 4, 8, 64));
    s.add(request(1, prompt(10, 1), 50));
    s.add(request(2, prompt(10, 2), 50));
    step(&mut s, 1);
    let used = s.stats().used_blocks;
    assert_eq!(used, 6);
    let plan = s.schedule();
    assert!(s.abort(1));
    assert_eq!(s.stats().used_blocks, 3);
    assert_eq!(s.seq_blocks(1, 0), None);
    // The aborted request's row yields no update.
    let updates = s.commit(&vec![4; plan.num_rows]);
    assert_eq!(updates.iter().map(|u| u.req_id).collect::<Vec<_>>(), vec![2]);
    assert!(!s.abort(1));
    assert!(!s.abort(99));
    s.add(request(3, prompt(10, 3), 50));
    assert!(s.abort(3), "waiting requests abort too");
    s.validate().unwrap();
}

#[test]
fn finish_seq_stops_one_sequence() {
    let mut s = Scheduler::new(config(33, 4, 8, 64));
    s.add(request(1, prompt(10, 1), 50));
    step(&mut s, 1);
    s.finish_seq(1, 0);
    assert_eq!(s.stats().used_blocks, 0);
    assert_eq!(s.num_requests(), 0);
    s.finish_seq(1, 0); // unknown: ignored
    s.validate().unwrap();
}

fn fork_request(id: u64, prompt_len: usize, n: u32, max_tokens: u32) -> NewRequest {
    NewRequest {
        n,
        sampling: SeqSampling { seed: Some(1234), ..SeqSampling::default() },
        ..request(id, prompt(prompt_len, 1), max_tokens)
    }
}

#[test]
fn fork_runs_the_prompt_once_and_shares_blocks() {
    let mut s = Scheduler::new(config(33, 4, 8, 64));
    s.add(fork_request(1, 10, 3, 4));
    let plan = s.schedule();
    check_plan(&s, &plan);
    assert_eq!(plan.num_tokens, 10);
    assert_eq!(plan.num_seqs, 1);
    assert_eq!(plan.logits_indices, vec![9, 9, 9]);
    assert_eq!(plan.row_seq_index, vec![0, 1, 2]);
    assert_eq!(plan.row_req_ids, vec![1, 1, 1]);
    assert_eq!(plan.seeds[0], 1234);
    assert!(plan.seeds[1] != plan.seeds[0] && plan.seeds[2] != plan.seeds[1]);
    let updates = s.commit(&[11, 12, 13]);
    assert_eq!(
        updates.iter().map(|u| (u.seq_index, u.token, u.sample_row)).collect::<Vec<_>>(),
        vec![(0, 11, 0), (1, 12, 1), (2, 13, 2)]
    );
    s.validate().unwrap();

    let parent = s.seq_blocks(1, 0).unwrap().to_vec();
    for k in 1..3 {
        let child = s.seq_blocks(1, k).unwrap();
        assert_eq!(&child[..2], &parent[..2], "full blocks are shared");
        assert_ne!(child[2], parent[2], "the partial block is private");
    }
    assert_eq!(s.block_pool().ref_count(parent[0]), 3);

    let (plan, _) = step(&mut s, 7);
    assert_eq!(plan.copy_src, vec![parent[2] as i64; 2]);
    assert_eq!(plan.copy_dst, vec![s.seq_blocks(1, 1).unwrap()[2] as i64, s.seq_blocks(1, 2).unwrap()[2] as i64]);
    assert_eq!(plan.num_tokens, 3, "each sequence computes only its own token");
    assert_eq!(plan.input_ids, vec![11, 12, 13]);
    assert_eq!(plan.positions, vec![10, 10, 10]);
    assert_eq!(plan.gen_index, vec![1, 1, 1]);
    assert_eq!(plan.seeds[1], llmserve_scheduler::plan::mix_seed(Some(1234), 1));
    // The next plan has no copies left.
    let (plan, _) = step(&mut s, 7);
    assert!(plan.copy_src.is_empty());
    let (_, updates) = step(&mut s, 7);
    assert_eq!(updates.len(), 3);
    assert!(updates.iter().all(|u| u.finish == Some(FinishReason::Length)));
    assert_eq!(s.num_requests(), 0);
    assert_eq!(s.stats().used_blocks, 0);
}

#[test]
fn a_waiting_fork_counts_every_sequence_it_will_run() {
    let mut s = Scheduler::new(config(33, 4, 8, 64));
    s.add(fork_request(1, 10, 3, 4));
    s.add(request(2, prompt(5, 2), 4));
    assert_eq!((s.stats().running, s.stats().waiting), (0, 4));
    step(&mut s, 7);
    assert_eq!((s.stats().running, s.stats().waiting), (4, 0));
}

#[test]
fn an_unforked_request_counts_its_choices_against_max_num_seqs() {
    // The fork's prompt ends in a step with budget to spare: only one more fits beside its
    // three sequences.
    let mut s = Scheduler::new(config(65, 4, 4, 10));
    s.add(fork_request(1, 22, 3, 2));
    step(&mut s, 7);
    for id in 2..5 {
        s.add(request(id, prompt(3, id as u32), 2));
    }
    while s.has_work() {
        step(&mut s, 7);
        let running = s.stats().running;
        assert!(running <= 4, "{running} sequences run, max_num_seqs is 4");
    }
}

#[test]
fn with_the_prefix_cache_a_fork_starts_in_one_free_place_and_its_other_children_wait() {
    // Three sequences run in four places: the n = 3 request starts at once instead of waiting
    // for three free places. At its fork no place is free, so its children wait with their
    // first tokens; as places free, each recomputes only the prompt's partial last block (the
    // full ones are cached), and then that token alone, as a decode step (as its siblings').
    let mut s = Scheduler::new(SchedulerConfig { enable_prefix_caching: true, ..config(65, 4, 4, 64) });
    for id in 1..4 {
        s.add(request(id, prompt(3, id as u32 + 10), 2 + id as u32));
    }
    step(&mut s, 7);
    s.add(fork_request(9, 10, 3, 6));
    assert_eq!((s.stats().running, s.stats().waiting), (3, 3));
    let (plan, updates) = step(&mut s, 7);
    assert_eq!((plan.num_seqs, plan.num_rows), (4, 3 + 3), "the fork's prompt ran beside the three");
    assert_eq!(updates.iter().filter(|u| u.req_id == 9).count(), 3, "every choice has its first token");
    assert_eq!((s.stats().running, s.stats().waiting), (4, 2), "no place was free for the children");
    let mut first_steps = [None; 3];
    while s.has_work() {
        let (plan, _) = step(&mut s, 7);
        assert!(s.stats().running <= 4);
        for r in 0..plan.num_rows {
            let index = plan.row_seq_index[r] as usize;
            if plan.row_req_ids[r] == 9 && first_steps[index].is_none() {
                // the tokens the step computed for that sequence
                let t = plan.logits_indices[r] as i32;
                let q = &plan.query_start_loc;
                let seq = (0..plan.num_seqs).find(|&i| q[i] <= t && t < q[i + 1]).unwrap();
                first_steps[index] = Some((q[seq + 1] - q[seq]) as usize);
            }
        }
    }
    assert_eq!(first_steps, [Some(1), Some(1), Some(1)], "each choice samples from a decode step");
    assert_eq!(s.stats().prefix_hit_tokens, 2 * 8, "the waiting choices found the prompt's full blocks");
    assert_eq!(s.stats().used_blocks, 0);
}

#[test]
fn a_parent_its_first_token_ends_leaves_its_place_to_a_choice() {
    let mut s = Scheduler::new(SchedulerConfig { enable_prefix_caching: true, ..config(65, 4, 4, 64) });
    for id in 1..4 {
        s.add(request(id, prompt(3, id as u32 + 10), 20));
    }
    step(&mut s, 7);
    let mut r = fork_request(9, 10, 3, 6);
    r.stop.eos_token_ids = vec![2];
    s.add(r);
    s.schedule();
    // the three decodes, then the fork's rows: choice 0 draws eos, 1 and 2 go on
    let updates = s.commit(&[7, 7, 7, 2, 5, 5]);
    assert_eq!(updates.iter().filter(|u| u.req_id == 9).count(), 3);
    s.validate().unwrap();
    assert_eq!((s.stats().running, s.stats().waiting), (4, 1), "one choice took the place choice 0 left");
}

#[test]
fn without_the_prefix_cache_a_fork_waits_for_a_place_per_choice() {
    let mut s = Scheduler::new(config(65, 4, 4, 64));
    for id in 1..4 {
        s.add(request(id, prompt(3, id as u32 + 10), 4));
    }
    step(&mut s, 7);
    s.add(fork_request(9, 10, 3, 6));
    let (plan, _) = step(&mut s, 7);
    assert_eq!(plan.num_seqs, 3, "three places are taken: the fork's three choices wait");
    assert_eq!((s.stats().running, s.stats().waiting), (3, 3));
}

#[test]
fn fork_of_block_aligned_prompt_needs_no_copy() {
    let mut s = Scheduler::new(config(33, 4, 8, 64));
    s.add(fork_request(1, 8, 2, 3));
    step(&mut s, 1);
    let (plan, _) = step(&mut s, 1);
    assert!(plan.copy_src.is_empty());
    assert_eq!(plan.positions, vec![8, 8]);
    assert_ne!(plan.block_table(0)[2], plan.block_table(1)[2]);
}

#[test]
fn forks_finish_independently_and_the_request_when_all_do() {
    let mut s = Scheduler::new(config(33, 4, 8, 64));
    let mut r = fork_request(1, 6, 3, 10);
    r.stop.eos_token_ids = vec![2];
    s.add(r);
    s.schedule();
    // Child 1 draws eos at once; the parent and child 2 continue.
    let updates = s.commit(&[5, 2, 5]);
    assert_eq!(updates[1].finish, Some(FinishReason::Stop));
    assert!(s.seq_blocks(1, 1).is_none());
    s.validate().unwrap();
    let plan = s.schedule();
    assert_eq!(plan.copy_src.len(), 1);
    assert_eq!(plan.row_seq_index, vec![0, 2]);
    let updates = s.commit(&[2, 5]);
    assert_eq!(updates[0].finish, Some(FinishReason::Stop));
    assert_eq!(s.num_requests(), 1);
    let (_, updates) = step(&mut s, 2);
    assert_eq!(updates[0].finish, Some(FinishReason::Stop));
    assert_eq!(s.num_requests(), 0);
    assert_eq!(s.stats().used_blocks, 0);
}

#[test]
fn abort_of_a_forked_request_frees_everything() {
    let mut s = Scheduler::new(config(33, 4, 8, 64));
    s.add(fork_request(1, 10, 4, 10));
    step(&mut s, 3);
    assert!(s.stats().used_blocks > 3);
    assert!(s.abort(1));
    assert_eq!(s.stats().used_blocks, 0, "pending copies release their source too");
    s.validate().unwrap();
    assert!(s.schedule().is_empty());
}

#[test]
fn min_tokens_bans_eos_and_stop_ids() {
    let mut s = Scheduler::new(config(33, 4, 8, 64));
    let mut r = request(1, prompt(5, 1), 10);
    r.stop = StopRules {
        max_tokens: 10,
        min_tokens: 2,
        stop_token_ids: vec![5, 2],
        eos_token_ids: vec![2],
        ignore_eos: false,
    };
    r.sampling.logit_bias = vec![(2, 1.0), (7, 0.5)];
    s.add(r);
    let plan = s.schedule();
    assert_eq!(plan.bias_token_ids, vec![7, 2, 5]);
    assert_eq!(plan.bias_values, vec![0.5, f32::NEG_INFINITY, f32::NEG_INFINITY]);
    assert_eq!(plan.bias_offsets, vec![0, 3]);
    // Even if eos comes out (a runner bug), it does not stop before min_tokens.
    assert_eq!(s.commit(&[2])[0].finish, None);
    let plan = s.schedule();
    assert_eq!(plan.gen_index, vec![1]);
    assert_eq!(plan.bias_token_ids.len(), 3);
    assert_eq!(s.commit(&[8])[0].finish, None);
    let plan = s.schedule();
    assert_eq!(plan.bias_token_ids, vec![2, 7], "only the request's own bias after min_tokens");
    assert_eq!(plan.bias_values, vec![1.0, 0.5]);
    assert_eq!(s.commit(&[5])[0].finish, Some(FinishReason::Stop));
}

/// vLLM's bad words: a one-token word is banned from every row; a longer one's last token is
/// banned where the output so far ends with the rest of it (never matched in the prompt).
#[test]
fn bad_words_ban_their_last_token_after_the_rest() {
    let mut s = Scheduler::new(config(33, 4, 8, 64));
    let mut r = request(1, vec![7, 8], 10);
    r.sampling.logit_bias = vec![(4, 1.0)];
    r.sampling.bad_words = vec![vec![9], vec![7, 8, 4], vec![8, 4]];
    s.add(r);
    let bans = |plan: &Plan| -> Vec<(i64, f32)> {
        plan.bias_token_ids.iter().copied().zip(plan.bias_values.iter().copied()).collect()
    };
    // the prompt ends with 7, 8: not output, so only the one-token word
    let plan = s.schedule();
    assert_eq!(bans(&plan), [(4, 1.0), (9, f32::NEG_INFINITY)]);
    s.commit(&[7]);
    assert_eq!(bans(&s.schedule()), [(4, 1.0), (9, f32::NEG_INFINITY)]);
    s.commit(&[8]);
    // the output ends with 8 (and with 7, 8): both longer words end in 4
    let plan = s.schedule();
    assert_eq!(bans(&plan), [(4, 1.0), (9, f32::NEG_INFINITY), (4, f32::NEG_INFINITY), (4, f32::NEG_INFINITY)]);
    assert_eq!(plan.bias_offsets, vec![0, 4]);
    s.commit(&[3]);
    assert_eq!(bans(&s.schedule()), [(4, 1.0), (9, f32::NEG_INFINITY)]);
}

#[test]
fn stop_rules() {
    let run = |stop: StopRules, tokens: &[u32]| -> Vec<Option<FinishReason>> {
        let mut s = Scheduler::new(config(33, 4, 8, 64));
        s.add(NewRequest { stop, ..request(1, prompt(5, 1), 0) });
        let mut out = vec![];
        for &t in tokens {
            s.schedule();
            let u = s.commit(&[t]);
            out.push(u[0].finish);
            if u[0].finish.is_some() {
                break;
            }
        }
        out
    };
    let base =
        StopRules { max_tokens: 5, min_tokens: 0, stop_token_ids: vec![7], eos_token_ids: vec![2], ignore_eos: false };
    assert_eq!(run(base.clone(), &[1, 2, 1]), vec![None, Some(FinishReason::Stop)]);
    assert_eq!(run(base.clone(), &[1, 7]), vec![None, Some(FinishReason::Stop)]);
    let ignore = StopRules { ignore_eos: true, ..base.clone() };
    assert_eq!(run(ignore, &[2, 2, 2, 2, 2]), vec![None, None, None, None, Some(FinishReason::Length)]);
    // A stop token on the last allowed output reports Stop.
    let two = StopRules { max_tokens: 2, ..base.clone() };
    assert_eq!(run(two.clone(), &[1, 2]), vec![None, Some(FinishReason::Stop)]);
    assert_eq!(run(two, &[1, 1]), vec![None, Some(FinishReason::Length)]);
}

#[test]
fn max_model_len_finishes_with_length() {
    let mut cfg = config(33, 4, 8, 64);
    cfg.max_model_len = 8;
    let mut s = Scheduler::new(cfg);
    s.add(request(1, prompt(6, 1), 100));
    assert_eq!(step(&mut s, 1).1[0].finish, None);
    assert_eq!(step(&mut s, 1).1[0].finish, Some(FinishReason::Length));
}

#[test]
fn sampling_columns_and_history() {
    let mut s = Scheduler::new(config(33, 4, 8, 64));
    let penalized = SeqSampling {
        temperature: 0.5,
        top_p: 0.9,
        top_k: 40,
        min_p: 0.1,
        repetition_penalty: 1.2,
        num_logprobs: 3,
        ..SeqSampling::default()
    };
    s.add(NewRequest { sampling: penalized, ..request(1, vec![10, 11, 12], 5) });
    s.add(request(2, vec![20, 21], 5));
    step(&mut s, 30);
    let plan = s.schedule();
    assert_eq!(plan.row_req_ids, vec![1, 2]);
    assert_eq!(plan.temperature, vec![0.5, 1.0]);
    assert_eq!(plan.top_k, vec![40, 0]);
    assert_eq!(plan.num_logprobs, vec![3, -1]);
    assert_eq!(plan.seeds, vec![-1, -1]);
    assert_eq!(plan.hist_offsets, vec![0, 4, 4]);
    assert_eq!(plan.hist_tokens, vec![10, 11, 12, 30]);
    assert_eq!(plan.hist_prompt_lens, vec![3, 0]);
    s.commit(&[1, 1]);
}

#[test]
fn max_num_seqs_caps_the_batch() {
    let mut s = Scheduler::new(config(65, 4, 2, 64));
    for id in 0..5 {
        s.add(request(id, prompt(3, id as u32), 3));
    }
    let (plan, _) = step(&mut s, 1);
    assert_eq!(plan.num_seqs, 2);
    assert_eq!(s.stats().waiting, 3);
    while s.has_work() {
        assert!(step(&mut s, 1).0.num_seqs <= 2);
    }
}

#[test]
fn token_budget_is_shared_running_first() {
    let mut s = Scheduler::new(config(65, 4, 8, 10));
    s.add(request(1, prompt(4, 1), 5));
    step(&mut s, 1);
    s.add(request(2, prompt(30, 2), 5));
    let (plan, _) = step(&mut s, 1);
    assert_eq!(plan.seq_req_ids, vec![1, 2]);
    assert_eq!(plan.token_range(0).len(), 1);
    assert_eq!(plan.token_range(1).len(), 9, "the rest of the budget chunks the new prompt");
}

#[test]
fn scheduling_again_without_commit_discards_the_plan() {
    let mut s = Scheduler::new(config(33, 4, 8, 64));
    s.add(request(1, prompt(5, 1), 5));
    let first = s.schedule();
    let second = s.schedule();
    assert_eq!(second.positions, first.positions, "the uncommitted work is planned again");
    assert_eq!(s.commit(&[1]).len(), 1);
    s.validate().unwrap();
}

#[test]
#[should_panic(expected = "one token per Plan row")]
fn commit_needs_one_token_per_row() {
    let mut s = Scheduler::new(config(33, 4, 8, 64));
    s.add(request(1, prompt(5, 1), 5));
    s.schedule();
    s.commit(&[1, 2]);
}

#[test]
fn discarded_plan_leaves_no_poisoned_cache_and_recomputes() {
    let mut cfg = config(33, 4, 8, 64);
    cfg.enable_prefix_caching = true;
    let mut s = Scheduler::new(cfg);
    s.add(request(1, prompt(10, 1), 3));
    let plan = s.schedule();
    assert_eq!(plan.num_tokens, 10);
    // The forward failed: nothing of this plan was written.
    s.discard_plan();
    s.validate().unwrap();
    assert_eq!(s.stats().used_blocks, 0);
    assert_eq!(s.stats().cached_blocks, 0, "blocks registered by the failed step are forgotten");
    assert_eq!(s.seq_progress(1, 0), Some((10, 0)));
    // A new identical prompt finds nothing cached; the discarded request runs again.
    s.add(request(2, prompt(10, 1), 3));
    let (plan, updates) = step(&mut s, 4);
    assert_eq!(plan.num_tokens, 20);
    assert_eq!(updates.len(), 2);
    s.discard_plan(); // no plan awaiting commit: a no-op
    while s.has_work() {
        step(&mut s, 4);
    }
}

#[test]
fn discard_after_a_fork_resets_the_children() {
    let mut s = Scheduler::new(config(33, 4, 8, 64));
    s.add(fork_request(1, 10, 3, 4));
    step(&mut s, 3);
    let plan = s.schedule();
    assert_eq!(plan.copy_src.len(), 2);
    s.discard_plan();
    s.validate().unwrap();
    assert_eq!(s.stats().used_blocks, 0);
    assert_eq!(s.seq_progress(1, 2), Some((11, 0)), "the child keeps its token and recomputes");
    let mut finished = 0;
    while s.has_work() {
        finished += step(&mut s, 3).1.iter().filter(|u| u.finish.is_some()).count();
    }
    assert_eq!(finished, 3);
}

#[test]
fn prompt_logprobs_list_each_prompt_position_once_across_chunks() {
    let mut cfg = config(101, 4, 8, 8);
    cfg.enable_prefix_caching = true;
    let mut s = Scheduler::new(cfg);
    let p = prompt(20, 3);
    // A first request fills the prefix cache with the same prompt.
    s.add(request(1, p.clone(), 1));
    while s.has_work() {
        step(&mut s, 5);
    }
    s.add(NewRequest { prompt_logprobs: Some(2), ..request(2, p.clone(), 2) });
    let mut targets = Vec::new();
    let mut computed = 0;
    while s.has_work() {
        let (plan, _) = step(&mut s, 5);
        assert_eq!(plan.positions[0], computed as i64, "no prefix-cache reuse while logprobs are owed");
        computed += plan.num_tokens;
        for (j, &row) in plan.prompt_lp_indices.iter().enumerate() {
            let pos = plan.positions[row as usize] as usize;
            assert_eq!(plan.input_ids[row as usize], i64::from(p[pos]));
            assert_eq!(plan.prompt_lp_targets[j], i64::from(p[pos + 1]));
            assert_eq!((plan.prompt_lp_req_ids[j], plan.prompt_lp_num[j]), (2, 2));
            targets.push(plan.prompt_lp_targets[j]);
        }
    }
    let expect: Vec<i64> = p[1..].iter().map(|&t| i64::from(t)).collect();
    assert_eq!(targets, expect, "every position after the first, once, in order");
}

#[test]
fn prompt_logprobs_are_listed_again_after_a_discarded_plan_but_not_after_preemption() {
    let mut s = Scheduler::new(config(101, 4, 8, 64));
    s.add(NewRequest { prompt_logprobs: Some(1), ..request(1, prompt(6, 1), 3) });
    let plan = s.schedule();
    assert_eq!(plan.prompt_lp_indices, vec![0, 1, 2, 3, 4]);
    s.discard_plan();
    let (plan, _) = step(&mut s, 5);
    assert_eq!(plan.prompt_lp_indices.len(), 5, "the discarded step's positions come back");
    // Later steps (decode) list nothing.
    let (plan, _) = step(&mut s, 5);
    assert!(plan.prompt_lp_indices.is_empty());
}

#[test]
fn prompt_logprobs_are_not_repeated_when_a_preempted_sequence_recomputes() {
    // 3 usable blocks of 4: two 5-token prompts fit, growing both forces a preemption.
    let mut s = Scheduler::new(config(5, 4, 8, 64));
    s.add(NewRequest { prompt_logprobs: Some(1), ..request(1, prompt(5, 1), 8) });
    s.add(NewRequest { prompt_logprobs: Some(1), ..request(2, prompt(5, 2), 8) });
    let mut listed = std::collections::HashMap::<u64, usize>::new();
    while s.has_work() {
        let (plan, _) = step(&mut s, 5);
        for &id in &plan.prompt_lp_req_ids {
            *listed.entry(id).or_default() += 1;
        }
    }
    assert!(s.stats().preemptions > 0, "the test needs a preemption");
    assert_eq!(listed.get(&1), Some(&4));
    assert_eq!(listed.get(&2), Some(&4));
}

#[test]
fn mean_pooling_lists_every_prompt_position_once_and_skips_the_prefix_cache() {
    let mut cfg = config(101, 4, 8, 8);
    cfg.enable_prefix_caching = true;
    let mut s = Scheduler::new(cfg);
    let p = prompt(20, 3);
    s.add(request(1, p.clone(), 1));
    while s.has_work() {
        step(&mut s, 5);
    }
    s.add(NewRequest { pooling: Some(Pooling::Mean), ..request(2, p.clone(), 0) });
    let mut positions = Vec::new();
    let mut computed = 0;
    while s.has_work() {
        let (plan, _) = step(&mut s, 5);
        assert_eq!(plan.positions[0], computed as i64, "no prefix-cache reuse while positions are owed");
        computed += plan.num_tokens;
        assert!(plan.pool_req_ids.iter().all(|&id| id == 2));
        positions.extend(plan.pool_indices.iter().map(|&row| plan.positions[row as usize]));
    }
    assert_eq!(positions, (0..20).collect::<Vec<i64>>(), "every prompt position, once, in order");
    s.validate().unwrap();
}

#[test]
fn last_pooling_lists_the_last_prompt_position_and_reuses_the_prefix_cache() {
    let mut cfg = config(101, 4, 8, 64);
    cfg.enable_prefix_caching = true;
    let mut s = Scheduler::new(cfg);
    let p = prompt(20, 3);
    s.add(request(1, p.clone(), 1));
    while s.has_work() {
        step(&mut s, 5);
    }
    s.add(NewRequest { pooling: Some(Pooling::Last), ..request(2, p.clone(), 0) });
    let (plan, updates) = step(&mut s, 5);
    assert_eq!(plan.positions[0], 16, "the cached blocks are reused");
    assert_eq!(plan.pool_req_ids, vec![2]);
    assert_eq!(plan.positions[plan.pool_indices[0] as usize], 19);
    assert_eq!(updates.len(), 1);
    assert!(updates[0].finish.is_some(), "max_tokens 0 ends at the prompt");
    assert!(!s.has_work());
    assert_eq!(s.stats().used_blocks, 0);
}

#[test]
fn pooled_positions_come_back_after_a_discarded_plan_but_not_after_preemption() {
    let mut s = Scheduler::new(config(101, 4, 8, 64));
    s.add(NewRequest { pooling: Some(Pooling::Mean), ..request(1, prompt(6, 1), 0) });
    let plan = s.schedule();
    assert_eq!(plan.pool_indices, vec![0, 1, 2, 3, 4, 5]);
    s.discard_plan();
    let (plan, _) = step(&mut s, 5);
    assert_eq!(plan.pool_indices.len(), 6, "the discarded step's positions come back");
    assert!(!s.has_work());

    // 3 usable blocks of 4: a generating request grows into the block the pooled prompt's
    // second chunk needs, and the pooled prompt (the later arrival) is preempted mid-prompt.
    let mut s = Scheduler::new(config(4, 4, 8, 5));
    s.add(request(1, prompt(5, 1), 8));
    s.add(NewRequest { pooling: Some(Pooling::Mean), ..request(2, prompt(5, 2), 0) });
    let mut listed = std::collections::HashMap::<u64, Vec<i64>>::new();
    while s.has_work() {
        let (plan, _) = step(&mut s, 5);
        for (&id, &row) in plan.pool_req_ids.iter().zip(&plan.pool_indices) {
            listed.entry(id).or_default().push(plan.positions[row as usize]);
        }
        s.validate().unwrap();
    }
    assert!(s.stats().preemptions > 0, "the test needs a preemption");
    assert_eq!(listed.keys().collect::<Vec<_>>(), vec![&2]);
    assert_eq!(listed[&2], (0..5).collect::<Vec<i64>>(), "each position once");
}

/// What `add` would panic on is told by `check` first, so a caller can fail the request alone.
#[test]
fn check_names_what_add_cannot_queue() {
    let s = Scheduler::new(config(5, 16, 8, 256)); // max_model_len 64
    assert_eq!(s.check(63, 1, 1), Ok(()));
    assert_eq!(s.check(64, 0, 1), Ok(())); // (asks for no token: prompt scoring)
    assert!(s.check(0, 1, 1).unwrap_err().contains("empty prompt"));
    assert!(s.check(64, 1, 1).unwrap_err().contains("leaves no room under max_model_len 64"));
    assert!(s.check(65, 0, 1).unwrap_err().contains("a prompt of 65 tokens"));
    assert!(s.check(8, 1, 0).unwrap_err().contains("n must be at least 1"));
}

#[test]
#[should_panic(expected = "request 3: n must be at least 1")]
fn add_panics_on_what_check_refuses() {
    let mut s = Scheduler::new(config(5, 16, 8, 256));
    s.add(NewRequest { n: 0, ..request(3, prompt(4, 1), 1) });
}
