//! `schedule_ahead`: the next Plan built while the current one runs. Unit cases for the
//! placeholder rules, then a property test that drives one scheduler step by step and a
//! twin that plans ahead whenever it can, with tokens that depend only on (request,
//! sequence, output index), and requires the same outputs, the same sampling columns for
//! every output, and model inputs that spell each sequence's true tokens. The same twins
//! check speculation (n-gram drafts): a twin that speculates, with or without planning
//! ahead, gives the same outputs and columns as one that does not.

mod common;

use std::collections::HashMap;

use common::{check_plan, config, prompt, request};
use llmserve_scheduler::*;
use proptest::prelude::*;

/// The placeholders' previous-plan rows (`-1 - id`) resolved with that plan's tokens.
fn resolve(plan: &Plan, prev: &[u32]) -> Vec<i64> {
    plan.input_ids.iter().map(|&id| if id < 0 { i64::from(prev[(-1 - id) as usize]) } else { id }).collect()
}

#[test]
fn placeholder_refers_to_the_awaiting_row_and_is_replaced_at_commit() {
    let mut s = Scheduler::new(config(33, 4, 8, 64));
    s.add(request(1, prompt(5, 1), 4));
    s.add(request(2, prompt(3, 2), 4));
    let first = s.schedule();
    assert_eq!(first.num_rows, 2);
    let ahead = s.schedule_ahead();
    check_plan(&s, &ahead);
    s.validate().unwrap();
    // One placeholder per sequence, naming its row of the first plan, at the next position.
    assert_eq!(ahead.input_ids, vec![-1, -2]);
    assert_eq!(ahead.positions, vec![5, 3]);
    assert_eq!(ahead.gen_index, vec![1, 1], "the placeholder counts as an output before this step");
    let u = s.commit(&[40, 41]);
    assert_eq!(u.iter().map(|u| (u.req_id, u.token)).collect::<Vec<_>>(), vec![(1, 40), (2, 41)]);
    s.validate().unwrap();
    assert_eq!(s.seq_progress(1, 0), Some((6, 6)));
    // The ahead plan is now the one awaiting commit; it can be followed in turn.
    let third = s.schedule_ahead();
    assert_eq!(third.input_ids, vec![-1, -2]);
    assert_eq!(third.positions, vec![6, 4]);
    s.commit(&[50, 51]);
    s.commit(&[60, 61]);
    s.validate().unwrap();
    assert_eq!(s.seq_progress(2, 0), Some((6, 5)));
}

#[test]
fn nothing_is_planned_ahead_without_exactly_one_awaiting_plan() {
    let mut s = Scheduler::new(config(33, 4, 8, 64));
    assert!(s.schedule_ahead().is_empty());
    s.add(request(1, prompt(5, 1), 8));
    let _ = s.schedule();
    assert!(!s.schedule_ahead().is_empty());
    assert!(s.schedule_ahead().is_empty(), "two plans already await commit");
    s.validate().unwrap();
}

#[test]
fn a_sequence_that_finishes_gets_no_update_from_the_plan_ahead() {
    let mut s = Scheduler::new(config(33, 4, 8, 64));
    s.add(request(1, prompt(5, 1), 4));
    let _ = s.schedule();
    let ahead = s.schedule_ahead();
    assert_eq!(ahead.num_rows, 1);
    // The router ends the sequence on the token the first plan samples (a stop string).
    s.commit(&[9]);
    s.finish_seq(1, 0);
    s.validate().unwrap();
    assert!(s.commit(&[10]).is_empty(), "its row in the plan ahead is stale");
    assert_eq!(s.stats().used_blocks, 0);
    assert!(!s.has_work());
}

#[test]
fn a_placeholder_at_max_tokens_is_not_scheduled() {
    let mut s = Scheduler::new(config(33, 4, 8, 64));
    s.add(request(1, prompt(5, 1), 1));
    s.add(request(2, prompt(5, 2), 3));
    let _ = s.schedule();
    let ahead = s.schedule_ahead();
    // Request 1's first output is its last: only request 2 follows.
    assert_eq!(ahead.seq_req_ids, vec![2]);
    assert_eq!(ahead.input_ids, vec![-2]);
    let u = s.commit(&[7, 8]);
    assert_eq!(u[0].finish, Some(FinishReason::Length));
    assert_eq!(u[1].finish, None);
    s.validate().unwrap();
}

#[test]
fn a_plan_ahead_that_plans_nothing_can_be_asked_again() {
    let mut s = Scheduler::new(config(33, 4, 8, 64));
    s.add(request(1, prompt(5, 1), 1));
    let _ = s.schedule();
    // The only sequence ends by length on the awaiting token: nothing to plan, twice.
    assert!(s.schedule_ahead().is_empty());
    assert!(s.schedule_ahead().is_empty());
    s.validate().unwrap();
    assert_eq!(s.seq_progress(1, 0), Some((6, 5)), "one placeholder");
    let u = s.commit(&[4]);
    assert_eq!((u[0].token, u[0].finish), (4, Some(FinishReason::Length)));
    assert!(!s.has_work());
}

#[test]
fn penalized_bad_worded_and_forking_rows_are_not_planned_ahead() {
    let mut s = Scheduler::new(config(65, 4, 8, 64));
    let mut r = request(1, prompt(5, 1), 8);
    r.sampling.repetition_penalty = 1.2;
    s.add(r);
    let _ = s.schedule();
    assert!(s.schedule_ahead().is_empty());
    s.validate().unwrap();
    s.commit(&[3]);

    // a bad word of two tokens needs the token before its last one; one of one token does not
    for (words, ahead) in [(vec![vec![4, 6]], false), (vec![vec![6]], true)] {
        let mut s = Scheduler::new(config(65, 4, 8, 64));
        let mut r = request(1, prompt(5, 1), 8);
        r.sampling.bad_words = words;
        s.add(r);
        let _ = s.schedule();
        assert_eq!(!s.schedule_ahead().is_empty(), ahead);
        s.validate().unwrap();
    }

    let mut s = Scheduler::new(config(65, 4, 8, 64));
    let mut r = request(1, prompt(5, 1), 8);
    r.n = 3;
    s.add(r);
    let _ = s.schedule();
    assert!(s.schedule_ahead().is_empty(), "the fork happens at commit");
    s.validate().unwrap();
    assert_eq!(s.commit(&[3, 4, 5]).len(), 3);
    // After the fork the three sequences decode and can be planned ahead.
    let _ = s.schedule();
    assert_eq!(s.schedule_ahead().num_seqs, 3);
    s.validate().unwrap();
}

#[test]
fn planning_ahead_never_preempts() {
    // 4 usable blocks of 4 tokens: two sequences at 8 tokens each fill them.
    let mut s = Scheduler::new(config(5, 4, 8, 64));
    s.add(request(1, prompt(7, 1), 8));
    s.add(request(2, prompt(7, 2), 8));
    let _ = s.schedule();
    // Both placeholders fit in the blocks the prompts hold (position 7 is in block 2).
    let ahead = s.schedule_ahead();
    assert_eq!(ahead.num_seqs, 2);
    s.commit(&[1, 2]);
    // The next tokens need new blocks that do not exist: no plan ahead, no preemption.
    assert!(s.schedule_ahead().is_empty());
    assert_eq!(s.stats().preemptions, 0);
    s.validate().unwrap();
    s.commit(&[3, 4]);
    let _ = s.schedule();
    assert_eq!(s.stats().preemptions, 1, "the ordinary schedule preempts");
    s.validate().unwrap();
}

#[test]
fn discard_drops_both_plans_and_the_placeholders() {
    let mut s = Scheduler::new(config(33, 4, 8, 64));
    s.add(request(1, prompt(7, 1), 8));
    let _ = s.schedule();
    let _ = s.commit(&[5]);
    let _ = s.schedule();
    let _ = s.schedule_ahead();
    s.discard_plan();
    s.validate().unwrap();
    // The sequence keeps its committed tokens and recomputes them.
    assert_eq!(s.seq_progress(1, 0), Some((8, 0)));
    assert_eq!(s.stats().used_blocks, 0);
    let plan = s.schedule();
    assert_eq!(plan.num_tokens, 8);
    assert!(plan.input_ids.iter().all(|&id| id >= 0));
}

#[test]
fn a_block_holding_a_placeholder_is_not_cached_until_its_token_is_known() {
    let mut cfg = config(33, 4, 8, 64);
    cfg.enable_prefix_caching = true;
    let mut s = Scheduler::new(cfg);
    // 7 prompt tokens: the placeholder at position 7 completes block 1.
    s.add(request(1, prompt(7, 1), 8));
    let _ = s.schedule();
    let _ = s.schedule_ahead();
    s.commit(&[5]);
    // A second request with the same 8 tokens (and more) finds only block 0 cached so far...
    let mut second = prompt(7, 1);
    second.extend([5, 6, 7, 8]);
    s.add(request(2, second.clone(), 2));
    let plan = s.schedule_ahead();
    let r2 = plan.seq_req_ids.iter().position(|&id| id == 2).unwrap();
    assert_eq!(plan.positions[plan.token_range(r2).start], 4);
    s.validate().unwrap();
    s.commit(&[6]);
    s.commit(&vec![6; plan.num_rows]);
    // ...and once the token is known, the block that held the placeholder is cached too.
    s.add(request(3, second, 2));
    let plan = s.schedule();
    let r3 = plan.seq_req_ids.iter().position(|&id| id == 3).unwrap();
    assert_eq!(plan.positions[plan.token_range(r3).start], 8);
}

// ---- sync vs ahead ----------------------------------------------------------------------

#[derive(Clone, Debug)]
struct Arrival {
    prompt_len: usize,
    shared: bool,
    n: u32,
    max_tokens: u32,
    min_tokens: u32,
    priority: i32,
    penalized: bool,
    logprobs: bool,
    speculate: bool,
}

fn arrival() -> impl Strategy<Value = Arrival> {
    let shape = (1usize..20, any::<bool>(), 1u32..4, 1u32..12, 0u32..3, 0i32..3);
    (shape, prop::bool::weighted(0.2), any::<bool>(), prop::bool::weighted(0.8)).prop_map(
        |((prompt_len, shared, n, max_tokens, min_tokens, priority), penalized, logprobs, speculate)| Arrival {
            prompt_len,
            shared,
            n,
            max_tokens,
            min_tokens,
            priority,
            penalized,
            logprobs,
            speculate,
        },
    )
}

/// What a row's sequence samples: a function of (request, sequence, output index) alone, so
/// every schedule gives the same outputs. 0 is eos and 1 a stop id; 2 makes the "router"
/// end the sequence (a stop string). Outputs repeat every 4 tokens, so n-gram drafts are
/// often right.
fn token(id: u64, index: u32, gen: i64) -> u32 {
    let x = id.wrapping_mul(0x9E37_79B9).wrapping_add(u64::from(index) * 7919 + (gen % 4) as u64 * 104_729);
    ((x ^ (x >> 7)) % 23) as u32
}

type Columns = (i64, f32, i64, Vec<i64>);
/// (request, sequence) -> its outputs with how each ended.
type Outputs = HashMap<(u64, u32), Vec<(u32, Option<FinishReason>)>>;
/// A plan's sampled tokens and its rows' columns.
type Sampled = (Vec<u32>, Vec<Columns>);

#[derive(Default)]
struct Record {
    outputs: Outputs,
    /// (request, sequence, output index) -> (seed, temperature, gen index, bias ids) of the
    /// row that sampled it.
    columns: HashMap<(u64, u32, i64), Columns>,
    prompts: HashMap<u64, Vec<u32>>,
    ahead_plans: usize,
    /// Drafts the samples confirmed.
    accepted: u64,
}

impl Record {
    /// The tokens a plan's rows sample, and each row's columns.
    fn rows(plan: &Plan) -> Sampled {
        (0..plan.num_rows)
            .map(|r| {
                let (id, idx, gen) = (plan.row_req_ids[r], plan.row_seq_index[r], plan.gen_index[r]);
                let (a, b) = (plan.bias_offsets[r] as usize, plan.bias_offsets[r + 1] as usize);
                (token(id, idx, gen), (plan.seeds[r], plan.temperature[r], gen, plan.bias_token_ids[a..b].to_vec()))
            })
            .unzip()
    }

    fn apply(&mut self, s: &mut Scheduler, updates: &[SeqUpdate], columns: &[Columns]) {
        // (a sequence with drafts may have more updates after the one the router ended it at:
        // the router drops them)
        let mut ended = Vec::new();
        for u in updates {
            if ended.contains(&(u.req_id, u.seq_index)) {
                continue;
            }
            let cols = columns[u.sample_row].clone();
            let gen = self.outputs.get(&(u.req_id, u.seq_index)).map_or(0, Vec::len) as i64;
            assert!(self.columns.insert((u.req_id, u.seq_index, gen), cols).is_none(), "one output twice");
            let mut finish = u.finish;
            if finish.is_none() && u.token == 2 {
                s.finish_seq(u.req_id, u.seq_index);
                finish = Some(FinishReason::Stop);
                ended.push((u.req_id, u.seq_index));
            }
            self.outputs.entry((u.req_id, u.seq_index)).or_default().push((u.token, finish));
        }
    }

    /// The model inputs of `plan` (placeholders resolved with `prev`) are the sequences'
    /// true tokens at their positions (drafts, past the known tokens, are not known yet).
    fn check_inputs(&self, plan: &Plan, prev: &[u32]) {
        let ids = resolve(plan, prev);
        for sq in 0..plan.num_seqs {
            let (id, idx) = (plan.seq_req_ids[sq], plan.seq_indices[sq]);
            let prompt = &self.prompts[&id];
            let outs = self.outputs.get(&(id, idx)).map_or(&[][..], Vec::as_slice);
            for t in plan.token_range(sq) {
                let pos = plan.positions[t] as usize;
                let truth = match pos.checked_sub(prompt.len()) {
                    None => prompt[pos],
                    Some(o) if o < outs.len() => outs[o].0,
                    Some(_) => continue,
                };
                assert_eq!(ids[t], i64::from(truth), "request {id} seq {idx} position {pos}");
            }
        }
    }
}

fn add(s: &mut Scheduler, rec: &mut Record, id: u64, a: &Arrival) {
    let prompt: Vec<u32> =
        (0..a.prompt_len as u32).map(|i| if a.shared { 30 + i } else { 30 + (i * 31 + id as u32 * 17) % 50 }).collect();
    rec.prompts.insert(id, prompt.clone());
    s.add(NewRequest {
        id,
        prompt,
        n: a.n,
        sampling: SeqSampling {
            seed: Some(id),
            temperature: 1.0,
            presence_penalty: if a.penalized { 0.5 } else { 0.0 },
            logit_bias: vec![(5, 1.0)],
            ..SeqSampling::default()
        },
        stop: StopRules {
            max_tokens: a.max_tokens,
            min_tokens: a.min_tokens,
            stop_token_ids: vec![1],
            eos_token_ids: vec![0],
            ignore_eos: false,
        },
        priority: a.priority,
        prompt_logprobs: a.logprobs.then_some(1),
        pooling: None,
        speculate: a.speculate,
        // (a prediction of the first sequence's true outputs, a wrong one, or none)
        prediction: match id % 3 {
            0 => (0..12).map(|g| token(id, 0, g)).collect(),
            1 => vec![3, 4, 5, 3, 4, 5],
            _ => Vec::new(),
        },
        cache_salt: None,
        lora: 0,
    });
}

/// Run the arrivals (`arrivals[k]` joins before step k) to completion, planning ahead
/// whenever the scheduler allows when `ahead`.
fn run(cfg: SchedulerConfig, arrivals: &[Vec<Arrival>], ahead: bool) -> Record {
    let mut s = Scheduler::new(cfg);
    let mut rec = Record::default();
    let mut next_id = 1;
    let mut inflight: Option<(Plan, Sampled)> = None;
    let mut prev: Vec<u32> = Vec::new();
    for k in 0..20_000 {
        for a in arrivals.get(k).into_iter().flatten() {
            add(&mut s, &mut rec, next_id, a);
            next_id += 1;
        }
        s.validate().unwrap();
        let (plan, (tokens, columns)) = match inflight.take() {
            Some(p) => p,
            None => {
                let plan = s.schedule();
                check_plan(&s, &plan);
                rec.check_inputs(&plan, &prev);
                let rows = Record::rows(&plan);
                (plan, rows)
            }
        };
        if plan.is_empty() && k >= arrivals.len() && !s.has_work() {
            break;
        }
        let next = if ahead { s.schedule_ahead() } else { Plan::default() };
        s.validate().unwrap();
        if !next.is_empty() {
            check_plan(&s, &next);
            rec.ahead_plans += 1;
        }
        let updates = if plan.is_empty() { Vec::new() } else { s.commit(&tokens) };
        rec.apply(&mut s, &updates, &columns);
        s.validate().unwrap();
        prev = tokens;
        if !next.is_empty() {
            rec.check_inputs(&next, &prev);
            let rows = Record::rows(&next);
            inflight = Some((next, rows));
        }
    }
    assert!(!s.has_work() && inflight.is_none(), "work left after many steps");
    assert_eq!(s.stats().used_blocks, 0);
    rec.accepted = s.stats().spec_accepted_tokens;
    rec
}

/// A speculation and the step size for drafts.
fn speculation() -> impl Strategy<Value = (Speculation, usize)> {
    (1usize..5, 1usize..3, 0usize..2, 1usize..16).prop_map(|(num_tokens, min, more, step)| {
        (Speculation { num_tokens, lookup_min: min, lookup_max: min + more }, step)
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn planning_ahead_changes_no_output(
        (num_blocks, seqs, budget, caching, prio) in (9usize..24, 1usize..6, 4usize..24, any::<bool>(), any::<bool>()),
        arrivals in prop::collection::vec(prop::collection::vec(arrival(), 0..3), 1..30),
    ) {
        let cfg = SchedulerConfig {
            num_blocks,
            block_size: 4,
            max_num_seqs: seqs,
            max_num_batched_tokens: budget,
            max_model_len: 32,
            enable_prefix_caching: caching,
            cache_decoded_blocks: true,
            max_loras: 0,
            policy: if prio { Policy::Priority } else { Policy::Fcfs },
            speculation: None,
            draft_step_tokens: 0,
            long_prefill_token_threshold: 0,
        };
        let sync = run(cfg.clone(), &arrivals, false);
        let ahead = run(cfg, &arrivals, true);
        prop_assert_eq!(&sync.outputs, &ahead.outputs);
        prop_assert_eq!(&sync.columns, &ahead.columns);
    }

    #[test]
    fn speculation_changes_no_output(
        (num_blocks, seqs, budget, caching, prio) in (9usize..24, 1usize..6, 4usize..24, any::<bool>(), any::<bool>()),
        (spec, step) in speculation(),
        ahead in any::<bool>(),
        arrivals in prop::collection::vec(prop::collection::vec(arrival(), 0..3), 1..30),
    ) {
        let cfg = SchedulerConfig {
            enable_prefix_caching: caching,
            policy: if prio { Policy::Priority } else { Policy::Fcfs },
            max_model_len: 32,
            ..config(num_blocks, 4, seqs, budget)
        };
        let plain = run(cfg.clone(), &arrivals, false);
        let drafted = run(SchedulerConfig { speculation: Some(spec), draft_step_tokens: step, ..cfg }, &arrivals, ahead);
        prop_assert_eq!(&plain.outputs, &drafted.outputs);
        prop_assert_eq!(&plain.columns, &drafted.columns);
    }
}

#[test]
fn the_twin_runs_actually_speculate() {
    let arrivals: Vec<Vec<Arrival>> = (0..10)
        .map(|k| {
            vec![Arrival {
                prompt_len: 3 + k,
                shared: false,
                n: 1 + (k % 2) as u32,
                max_tokens: 11,
                min_tokens: 0,
                priority: 0,
                penalized: k % 3 == 0,
                logprobs: false,
                speculate: true,
            }]
        })
        .collect();
    let spec = Speculation { num_tokens: 3, lookup_min: 1, lookup_max: 2 };
    let cfg = config(65, 4, 8, 32);
    let plain = run(cfg.clone(), &arrivals, false);
    let drafted = run(SchedulerConfig { speculation: Some(spec), draft_step_tokens: 24, ..cfg }, &arrivals, false);
    assert_eq!(plain.outputs, drafted.outputs);
    assert_eq!(plain.columns, drafted.columns);
    assert!(drafted.accepted > 10, "only {} drafts were confirmed", drafted.accepted);
}

#[test]
fn the_twin_runs_actually_plan_ahead() {
    let arrivals: Vec<Vec<Arrival>> = (0..10)
        .map(|k| {
            vec![Arrival {
                prompt_len: 3 + k,
                shared: k % 2 == 0,
                n: 1,
                max_tokens: 10,
                min_tokens: 0,
                priority: 0,
                penalized: false,
                logprobs: false,
                speculate: false,
            }]
        })
        .collect();
    let cfg = SchedulerConfig { enable_prefix_caching: true, ..config(65, 4, 8, 32) };
    let sync = run(cfg.clone(), &arrivals, false);
    let ahead = run(cfg, &arrivals, true);
    assert_eq!(sync.outputs, ahead.outputs);
    assert!(ahead.ahead_plans > 10, "only {} plans were planned ahead", ahead.ahead_plans);
}

// ---- random interleavings ---------------------------------------------------------------

#[derive(Clone, Debug)]
enum Op {
    Add(Arrival),
    Abort(usize),
    Schedule,
    Ahead,
    Commit(u64),
    Discard,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => arrival().prop_map(Op::Add),
        1 => (0usize..64).prop_map(Op::Abort),
        3 => Just(Op::Schedule),
        3 => Just(Op::Ahead),
        5 => any::<u64>().prop_map(Op::Commit),
        1 => Just(Op::Discard),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    /// Aborts, discards and router stops at any point between planning ahead and the
    /// commits keep every invariant, and everything still finishes and frees its blocks.
    #[test]
    fn invariants_hold_when_planning_ahead(
        (num_blocks, seqs, budget, caching) in (9usize..24, 1usize..6, 4usize..24, any::<bool>()),
        ops in prop::collection::vec(op(), 1..150),
    ) {
        let cfg = SchedulerConfig {
            num_blocks,
            block_size: 4,
            max_num_seqs: seqs,
            max_num_batched_tokens: budget,
            max_model_len: 32,
            enable_prefix_caching: caching,
            cache_decoded_blocks: true,
            max_loras: 0,
            policy: Policy::Priority,
            speculation: None,
            draft_step_tokens: 0,
            long_prefill_token_threshold: 0,
        };
        let mut s = Scheduler::new(cfg);
        let mut rec = Record::default();
        // Rows of the plans awaiting commit, oldest first.
        let mut awaiting: std::collections::VecDeque<usize> = Default::default();
        let mut next_id = 1;
        let commit = |s: &mut Scheduler, awaiting: &mut std::collections::VecDeque<usize>, seed: u64| {
            let rows = awaiting.pop_front().unwrap_or(0);
            let tokens: Vec<u32> = (0..rows as u64).map(|r| ((seed >> (r % 60)) % 23) as u32).collect();
            for u in s.commit(&tokens) {
                if u.finish.is_none() && u.token == 2 {
                    s.finish_seq(u.req_id, u.seq_index);
                }
            }
        };
        for op in &ops {
            match op {
                Op::Add(a) => {
                    add(&mut s, &mut rec, next_id, a);
                    next_id += 1;
                }
                Op::Abort(k) => {
                    s.abort(1 + (*k as u64) % next_id);
                }
                Op::Schedule => {
                    let plan = s.schedule();
                    check_plan(&s, &plan);
                    awaiting.clear();
                    if !plan.is_empty() {
                        awaiting.push_back(plan.num_rows);
                    }
                }
                Op::Ahead => {
                    let plan = s.schedule_ahead();
                    if !plan.is_empty() {
                        check_plan(&s, &plan);
                        prop_assert!(plan.input_ids.iter().all(|&id| id >= -(awaiting[0] as i64)));
                        awaiting.push_back(plan.num_rows);
                    }
                }
                Op::Commit(seed) => commit(&mut s, &mut awaiting, *seed),
                Op::Discard => {
                    s.discard_plan();
                    awaiting.clear();
                }
            }
            s.validate().unwrap();
        }
        for k in 0..20_000u64 {
            if awaiting.is_empty() && !s.has_work() {
                break;
            }
            if awaiting.is_empty() {
                let plan = s.schedule();
                if !plan.is_empty() {
                    awaiting.push_back(plan.num_rows);
                }
            }
            let plan = s.schedule_ahead();
            if !plan.is_empty() {
                awaiting.push_back(plan.num_rows);
            }
            commit(&mut s, &mut awaiting, k.wrapping_mul(0x9E37_79B9_7F4A_7C15));
            s.validate().unwrap();
        }
        prop_assert!(!s.has_work() && awaiting.is_empty(), "work left after many steps");
        prop_assert_eq!(s.stats().used_blocks, 0);
        prop_assert_eq!(s.num_requests(), 0);
    }
}
