//! Step cost of the scheduler: schedule() + commit() with 256 running sequences
//! (prompts ~128 tokens, block_size 16), after their prompts have run. Prints the median,
//! p90 and mean microseconds per step. Plain std::time::Instant; `cargo bench -p
//! llmserve-scheduler`.

use std::hint::black_box;
use std::time::Instant;

use llmserve_scheduler::*;

const SEQS: usize = 256;
const STEPS: usize = 3000;

fn run(label: &str, prefix_caching: bool, penalized: bool) {
    let mut s = Scheduler::new(SchedulerConfig {
        num_blocks: 1 + SEQS * 4096 / 16,
        block_size: 16,
        max_num_seqs: SEQS,
        max_num_batched_tokens: 8192,
        max_model_len: 4096,
        enable_prefix_caching: prefix_caching,
        cache_decoded_blocks: true,
        max_loras: 0,
        policy: Policy::Fcfs,
        speculation: None,
        draft_step_tokens: 0,
        long_prefill_token_threshold: 0,
    });
    for id in 0..SEQS as u64 {
        let prompt: Vec<u32> = (0..120 + (id % 17) as u32).map(|i| (i * 31 + id as u32 * 7919) % 32000).collect();
        let sampling = SeqSampling {
            seed: (id % 2 == 0).then_some(id),
            repetition_penalty: if penalized { 1.1 } else { 1.0 },
            logit_bias: if id % 4 == 0 { vec![(5, 1.0)] } else { vec![] },
            ..SeqSampling::default()
        };
        let stop = StopRules { max_tokens: 100_000, eos_token_ids: vec![2], ..StopRules::default() };
        s.add(NewRequest {
            id,
            prompt,
            n: 1,
            sampling,
            stop,
            priority: 0,
            cache_salt: None,
            lora: 0,
            prompt_logprobs: None,
            pooling: None,
            speculate: false,
            prediction: Vec::new(),
        });
    }
    let mut tokens = vec![0u32; SEQS];
    let mut next = 1000u32;
    // Run the prompts (256 * ~128 tokens in chunks of 8192) until every sequence samples.
    loop {
        let plan = s.schedule();
        tokens.resize(plan.num_rows, 0);
        s.commit(&tokens);
        if plan.num_rows == SEQS {
            break;
        }
    }
    let mut times = Vec::with_capacity(STEPS);
    for _ in 0..STEPS {
        for t in tokens.iter_mut() {
            next = next.wrapping_mul(1_103_515_245).wrapping_add(12_345) % 30_000 + 100;
            *t = next;
        }
        let start = Instant::now();
        let plan = s.schedule();
        assert_eq!(plan.num_rows, SEQS);
        let updates = s.commit(&tokens);
        times.push(start.elapsed().as_secs_f64() * 1e6);
        black_box((plan, updates));
    }
    times.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let mean = times.iter().sum::<f64>() / times.len() as f64;
    println!(
        "{label:<40} median {:7.1} us/step   p90 {:7.1}   mean {:7.1}   ({} steps, {SEQS} seqs)",
        times[times.len() / 2],
        times[times.len() * 9 / 10],
        mean,
        STEPS
    );
}

fn main() {
    run("schedule+commit, prefix caching", true, false);
    run("schedule+commit, no prefix caching", false, false);
    run("schedule+commit, prefix caching, penalties", true, true);
}
