//! Property tests: random add / abort / schedule / commit / finish_seq sequences against a
//! small block pool, checking the scheduler's invariants after every operation.

mod common;

use std::collections::{HashMap, HashSet};

use common::check_plan;
use llmserve_scheduler::*;
use proptest::prelude::*;

const BS: usize = 4;
const EOS: u32 = 0;

#[derive(Clone, Debug)]
enum Op {
    Add {
        prompt_len: usize,
        shared: bool,
        n: u32,
        max_tokens: u32,
        min_tokens: u32,
        priority: i32,
        salt: Option<u8>,
    },
    Abort(usize),
    Step {
        seed: u64,
        finish: Option<usize>,
    },
    /// Schedule, then drop the plan as if its forward failed.
    Discard,
}

fn op(allow_abort: bool) -> impl Strategy<Value = Op> {
    let add = (1usize..20, any::<bool>(), 1u32..4, 1u32..12, 0u32..3, 0i32..3, prop::option::of(0u8..2)).prop_map(
        |(prompt_len, shared, n, max_tokens, min_tokens, priority, salt)| Op::Add {
            prompt_len,
            shared,
            n,
            max_tokens,
            min_tokens,
            priority,
            salt,
        },
    );
    let step = (any::<u64>(), prop::option::of(0usize..64)).prop_map(|(seed, finish)| Op::Step { seed, finish });
    let abort = (0usize..64).prop_map(Op::Abort);
    if allow_abort {
        prop_oneof![3 => add, 1 => abort, 6 => step, 1 => Just(Op::Discard)].boxed()
    } else {
        prop_oneof![3 => add, 6 => step.prop_map(|o| match o {
            Op::Step { seed, .. } => Op::Step { seed, finish: None },
            o => o,
        })]
        .boxed()
    }
}

fn speculation_strategy() -> impl Strategy<Value = Option<Speculation>> {
    prop::option::of((1usize..5, 1usize..3, 0usize..2).prop_map(|(num_tokens, min, more)| Speculation {
        num_tokens,
        lookup_min: min,
        lookup_max: min + more,
    }))
}

fn config_strategy() -> impl Strategy<Value = SchedulerConfig> {
    let shape = (9usize..20, 1usize..6, 4usize..24, any::<bool>(), any::<bool>(), any::<bool>(), 0usize..3);
    (shape, speculation_strategy(), 0usize..12, 0usize..6).prop_map(
        |((num_blocks, seqs, tokens, caching, prio, decoded, max_loras), speculation, draft_step_tokens, chunk)| {
            SchedulerConfig {
                num_blocks,
                block_size: BS,
                max_num_seqs: seqs,
                max_num_batched_tokens: tokens,
                max_model_len: 32,
                enable_prefix_caching: caching,
                cache_decoded_blocks: decoded,
                max_loras,
                policy: if prio { Policy::Priority } else { Policy::Fcfs },
                speculation,
                draft_step_tokens,
                long_prefill_token_threshold: chunk,
            }
        },
    )
}

/// Drives a scheduler and mirrors what each request should still hold.
struct Harness {
    s: Scheduler,
    next_id: u64,
    ids: Vec<u64>,
    /// Live request -> (n, prompt_len, finished sequence indices).
    live: HashMap<u64, (u32, usize, HashSet<u32>)>,
    done: HashSet<u64>,
    /// Tokens computed at prompt positions, per request (to check a fork runs its prompt once).
    prompt_tokens_computed: HashMap<u64, usize>,
    first_scheduled: Vec<u64>,
}

impl Harness {
    fn new(cfg: SchedulerConfig) -> Self {
        Harness {
            s: Scheduler::new(cfg),
            next_id: 1,
            ids: vec![],
            live: HashMap::new(),
            done: HashSet::new(),
            prompt_tokens_computed: HashMap::new(),
            first_scheduled: vec![],
        }
    }

    fn apply(&mut self, op: &Op) {
        match *op {
            Op::Add { prompt_len, shared, n, max_tokens, min_tokens, priority, salt } => {
                let id = self.next_id;
                self.next_id += 1;
                // Shared prompts start with the same tokens, so the prefix cache gets hits.
                let prompt: Vec<u32> = (0..prompt_len as u32)
                    .map(|i| if shared { 10 + i } else { 10 + (i * 31 + id as u32 * 17) % 50 })
                    .collect();
                self.s.add(NewRequest {
                    id,
                    prompt,
                    n,
                    sampling: SeqSampling {
                        seed: Some(id),
                        presence_penalty: (id % 2) as f32,
                        ..SeqSampling::default()
                    },
                    stop: StopRules {
                        max_tokens,
                        min_tokens,
                        stop_token_ids: vec![1],
                        eos_token_ids: vec![EOS],
                        ignore_eos: false,
                    },
                    priority,
                    prompt_logprobs: id.is_multiple_of(3).then_some(2),
                    pooling: [None, Some(Pooling::Mean), Some(Pooling::Last)][(id % 5).min(2) as usize],
                    cache_salt: salt.map(|x| x.to_string()),
                    // (the base model and three adapters)
                    lora: (id % 4) as u32,
                    speculate: !id.is_multiple_of(7),
                    // (some predict outputs of the harness's small vocabulary)
                    prediction: if id % 3 == 1 {
                        (0..8).map(|i| (i * 5 + id as u32) % 12).collect()
                    } else {
                        Vec::new()
                    },
                });
                self.ids.push(id);
                self.live.insert(id, (n, prompt_len, HashSet::new()));
            }
            Op::Abort(k) => {
                if self.ids.is_empty() {
                    return;
                }
                let id = self.ids[k % self.ids.len()];
                let was_live = self.live.remove(&id).is_some();
                assert_eq!(self.s.abort(id), was_live);
                self.done.insert(id);
                self.assert_gone(id);
            }
            Op::Step { seed, finish } => self.step(seed, finish),
            Op::Discard => {
                let plan = self.s.schedule();
                check_plan(&self.s, &plan);
                self.s.discard_plan();
            }
        }
        self.s.validate().unwrap();
        assert_eq!(self.s.num_requests(), self.live.len());
        let st = self.s.stats();
        assert_eq!(st.used_blocks + self.s.block_pool().num_free(), st.num_blocks - 1);
    }

    fn step(&mut self, seed: u64, finish: Option<usize>) {
        let plan = self.s.schedule();
        check_plan(&self.s, &plan);
        let max_loras = self.s.config().max_loras;
        let adapters: HashSet<u32> = plan.lora_ids.iter().copied().filter(|&l| l != 0).collect();
        assert!(max_loras == 0 || adapters.len() <= max_loras, "{adapters:?} in one step past max_loras {max_loras}");
        for (k, &id) in plan.seq_req_ids.iter().enumerate() {
            assert!(self.live.contains_key(&id), "a dead request was scheduled");
            if !self.first_scheduled.contains(&id) {
                self.first_scheduled.push(id);
            }
            let prompt_len = self.live[&id].1;
            let r = plan.token_range(k);
            let in_prompt = plan.positions[r].iter().filter(|&&p| (p as usize) < prompt_len).count();
            *self.prompt_tokens_computed.entry(id).or_default() += in_prompt;
        }
        for r in 0..plan.num_rows {
            let (id, idx) = (plan.row_req_ids[r], plan.row_seq_index[r]);
            let (n, _, finished) = &self.live[&id];
            assert!(idx < *n && !finished.contains(&idx), "row for a finished sequence");
        }
        if plan.is_empty() {
            assert!(self.s.commit(&[]).is_empty());
            return;
        }
        // A row followed by the next row of its sequence checks a draft: the input token of
        // that row. Half the time it is sampled, so drafts are confirmed too.
        let drafted = |r: usize| {
            let same_seq = r + 1 < plan.num_rows
                && plan.row_req_ids[r + 1] == plan.row_req_ids[r]
                && plan.row_seq_index[r + 1] == plan.row_seq_index[r]
                && plan.logits_indices[r + 1] == plan.logits_indices[r] + 1;
            same_seq.then(|| plan.input_ids[plan.logits_indices[r] as usize + 1] as u32)
        };
        let mut x = seed | 1;
        let tokens: Vec<u32> = (0..plan.num_rows)
            .map(|r| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                match drafted(r) {
                    Some(d) if x.is_multiple_of(2) => d,
                    _ => (x % 12) as u32,
                }
            })
            .collect();
        let updates = self.s.commit(&tokens);
        // Every row gives its update, but for a sequence's rows after a draft its sample did
        // not confirm, or after it finished: those give none.
        let mut expected = Vec::new();
        let mut r = 0;
        while r < plan.num_rows {
            expected.push(r);
            let ends = |u: &SeqUpdate| u.sample_row == r && u.finish.is_some();
            if drafted(r).is_some_and(|d| d != tokens[r]) || updates.iter().any(ends) {
                // skip the rest of this sequence's rows
                while drafted(r).is_some() {
                    r += 1;
                }
            }
            r += 1;
        }
        let rows: Vec<usize> = updates.iter().map(|u| u.sample_row).collect();
        assert_eq!(rows, expected, "no abort between schedule and commit here");
        for u in &updates {
            assert_eq!(u.token, tokens[u.sample_row]);
            if u.finish.is_some() {
                self.mark_finished(u.req_id, u.seq_index);
            }
        }
        // The router side may end one sequence by a stop string.
        if let Some(k) = finish {
            if let Some(u) = updates.get(k % updates.len().max(1)) {
                // (a later update of a sequence with drafts may have ended it)
                let ended = self.live.get(&u.req_id).is_none_or(|(_, _, f)| f.contains(&u.seq_index));
                if u.finish.is_none() && !ended {
                    self.s.finish_seq(u.req_id, u.seq_index);
                    self.mark_finished(u.req_id, u.seq_index);
                }
            }
        }
    }

    fn mark_finished(&mut self, id: u64, idx: u32) {
        let (n, _, finished) = self.live.get_mut(&id).expect("update for a live request");
        assert!(finished.insert(idx), "sequence finished twice");
        assert_eq!(self.s.seq_blocks(id, idx), None, "a finished sequence holds no blocks");
        if finished.len() == *n as usize {
            self.live.remove(&id);
            self.done.insert(id);
            self.assert_gone(id);
        }
    }

    fn assert_gone(&self, id: u64) {
        for k in 0..4 {
            assert_eq!(self.s.seq_blocks(id, k), None, "request {id} still holds blocks");
        }
    }

    fn drain(&mut self) {
        for _ in 0..20_000 {
            if !self.s.has_work() {
                break;
            }
            self.step(7, None);
            self.s.validate().unwrap();
        }
        assert!(!self.s.has_work(), "work left after many steps: starvation or livelock");
        assert!(self.live.is_empty(), "requests never finished: {:?}", self.live.keys());
        assert_eq!(self.s.stats().used_blocks, 0);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn invariants_hold_under_random_operations(cfg in config_strategy(), ops in prop::collection::vec(op(true), 1..120)) {
        let mut h = Harness::new(cfg);
        for op in &ops {
            h.apply(op);
        }
        h.drain();
    }

    #[test]
    fn every_request_finishes_without_aborts(cfg in config_strategy(), ops in prop::collection::vec(op(false), 1..120)) {
        // (a sequence whose adapter is past `max_loras` is passed over)
        let fcfs = cfg.policy == Policy::Fcfs && cfg.max_loras == 0;
        let mut h = Harness::new(cfg);
        for op in &ops {
            h.apply(op);
        }
        h.drain();
        if fcfs {
            // Admission never skips ahead of an earlier arrival.
            let mut sorted = h.first_scheduled.clone();
            sorted.sort();
            prop_assert_eq!(&h.first_scheduled, &sorted);
        }
    }

    #[test]
    fn forked_prompt_is_computed_once(ops in prop::collection::vec(op(false), 1..60), caching in any::<bool>()) {
        // A pool big enough that nothing is preempted: every prompt token runs exactly once
        // (or not at all when the prefix cache already holds it), whatever n is.
        let cfg = SchedulerConfig {
            num_blocks: 1 + 60 * 3 * 8,
            block_size: BS,
            max_num_seqs: 256,
            max_num_batched_tokens: 64,
            max_model_len: 32,
            enable_prefix_caching: caching,
            cache_decoded_blocks: true,
            max_loras: 0,
            policy: Policy::Fcfs,
            speculation: None,
            draft_step_tokens: 0,
            long_prefill_token_threshold: 0,
        };
        let mut h = Harness::new(cfg);
        let mut prompt_lens = HashMap::new();
        for op in &ops {
            if let Op::Add { prompt_len, .. } = op {
                prompt_lens.insert(h.next_id, *prompt_len);
            }
            h.apply(op);
        }
        h.drain();
        prop_assert_eq!(h.s.stats().preemptions, 0);
        for (id, computed) in &h.prompt_tokens_computed {
            if caching {
                prop_assert!(*computed <= prompt_lens[id]);
            } else {
                prop_assert_eq!(*computed, prompt_lens[id], "request {}", id);
            }
        }
    }
}

#[test]
fn fcfs_does_not_starve_under_constant_arrivals() {
    let cfg = SchedulerConfig {
        num_blocks: 9,
        block_size: BS,
        max_num_seqs: 4,
        max_num_batched_tokens: 16,
        max_model_len: 32,
        enable_prefix_caching: false,
        cache_decoded_blocks: true,
        max_loras: 0,
        policy: Policy::Fcfs,
        speculation: None,
        draft_step_tokens: 0,
        long_prefill_token_threshold: 0,
    };
    let mut h = Harness::new(cfg);
    let mut finished_at = HashMap::new();
    for t in 0..600u64 {
        if t % 4 == 0 {
            h.apply(&Op::Add {
                prompt_len: 1 + (t as usize * 7) % 19,
                shared: false,
                n: 1,
                max_tokens: 1 + (t as u32 * 5) % 11,
                min_tokens: 0,
                priority: 0,
                salt: None,
            });
        }
        h.apply(&Op::Step { seed: t + 1, finish: None });
        for &id in &h.done {
            finished_at.entry(id).or_insert(t);
        }
    }
    // Every request that arrived in the first half finished while arrivals continued.
    for id in 1..=75 {
        assert!(finished_at.contains_key(&id), "request {id} starved");
    }
    assert!(h.s.stats().preemptions > 0, "the pool is small enough to preempt");
    h.drain();
}
