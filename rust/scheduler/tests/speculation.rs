//! Speculation (n-gram drafts): the plan a decoding sequence with drafts gets, what `commit`
//! keeps of its samples, and the limits on drafts. (`ahead.rs` checks, over random runs, that
//! speculation changes no output.)

mod common;

use common::{check_plan, config, request};
use llmserve_scheduler::*;

const SPEC: Speculation = Speculation { num_tokens: 3, lookup_min: 1, lookup_max: 2 };

fn speculating(num_blocks: usize, spec: Speculation) -> Scheduler {
    Scheduler::new(SchedulerConfig { speculation: Some(spec), draft_step_tokens: 24, ..config(num_blocks, 4, 8, 64) })
}

fn drafting(id: u64, prompt: Vec<u32>, max_tokens: u32) -> NewRequest {
    NewRequest { speculate: true, ..request(id, prompt, max_tokens) }
}

/// Prompt 10 11 12 13 10 11 (6 tokens), then its first output 12: "11 12" occurred at 1,
/// followed by 13 10 11.
fn after_first_token(s: &mut Scheduler, max_tokens: u32) {
    s.add(drafting(1, vec![10, 11, 12, 13, 10, 11], max_tokens));
    let plan = s.schedule();
    assert_eq!(plan.num_rows, 1, "a prompt step samples once");
    s.commit(&[12]);
    s.validate().unwrap();
}

#[test]
fn a_step_with_drafts_samples_after_each_and_keeps_what_they_confirm() {
    let mut s = speculating(33, SPEC);
    after_first_token(&mut s, 20);
    let plan = s.schedule();
    check_plan(&s, &plan);
    s.validate().unwrap();
    assert_eq!(plan.input_ids, vec![12, 13, 10, 11]);
    assert_eq!(plan.positions, vec![6, 7, 8, 9]);
    assert_eq!(plan.seq_lens, vec![10]);
    assert_eq!(plan.logits_indices, vec![0, 1, 2, 3]);
    assert_eq!(plan.gen_index, vec![1, 2, 3, 4], "each row samples as the step after its token would");
    assert!(s.schedule_ahead().is_empty(), "how many drafts survive is not known yet");

    // 13 confirms the first draft, 10 the second; 99 is not the third (11): the fourth row's
    // sample is dropped.
    let u = s.commit(&[13, 10, 99, 7]);
    let got: Vec<(u32, usize)> = u.iter().map(|u| (u.token, u.sample_row)).collect();
    assert_eq!(got, vec![(13, 0), (10, 1), (99, 2)]);
    s.validate().unwrap();
    // 6 prompt + 12 13 10 99; all but the last computed; block 2 (positions 8-11) kept for 9.
    assert_eq!(s.seq_progress(1, 0), Some((10, 9)));
    assert_eq!(s.seq_blocks(1, 0).map(<[u32]>::len), Some(3));
    let st = s.stats();
    assert_eq!((st.spec_drafts, st.spec_draft_tokens, st.spec_accepted_tokens), (1, 3, 2));
    assert_eq!(st.spec_accepted_per_pos, vec![1, 1, 0]);
}

#[test]
fn every_draft_confirmed_keeps_the_last_rows_sample_too() {
    let mut s = speculating(33, SPEC);
    after_first_token(&mut s, 20);
    let _ = s.schedule();
    let u = s.commit(&[13, 10, 11, 12]);
    assert_eq!(u.iter().map(|u| u.token).collect::<Vec<_>>(), vec![13, 10, 11, 12]);
    assert_eq!(s.seq_progress(1, 0), Some((11, 10)));
    assert_eq!(s.stats().spec_accepted_per_pos, vec![1, 1, 1]);
    s.validate().unwrap();
}

#[test]
fn a_stop_among_the_samples_ends_the_sequence_there() {
    let mut s = speculating(33, SPEC);
    s.add(NewRequest {
        stop: StopRules { max_tokens: 20, eos_token_ids: vec![10], ..StopRules::default() },
        ..drafting(1, vec![10, 11, 12, 13, 10, 11], 20)
    });
    let _ = s.schedule();
    s.commit(&[12]);
    let _ = s.schedule();
    // 10 is both the second draft and eos: the sequence ends at it.
    let u = s.commit(&[13, 10, 11, 12]);
    assert_eq!(
        u.iter().map(|u| (u.token, u.finish)).collect::<Vec<_>>(),
        vec![(13, None), (10, Some(FinishReason::Stop))]
    );
    s.validate().unwrap();
    assert_eq!(s.stats().used_blocks, 0);
    assert!(!s.has_work());
}

#[test]
fn drafts_stop_short_of_max_tokens_and_the_step_size() {
    // 3 outputs allowed: after the first, two more, so one draft at most.
    let mut s = speculating(33, SPEC);
    after_first_token(&mut s, 3);
    let plan = s.schedule();
    assert_eq!(plan.input_ids, vec![12, 13]);
    let u = s.commit(&[13, 10]);
    assert_eq!(u.last().map(|u| u.finish), Some(Some(FinishReason::Length)));
    s.validate().unwrap();

    // A step of 2 tokens with one running sequence: one draft.
    let mut s =
        Scheduler::new(SchedulerConfig { speculation: Some(SPEC), draft_step_tokens: 2, ..config(33, 4, 8, 64) });
    after_first_token(&mut s, 20);
    assert_eq!(s.schedule().input_ids, vec![12, 13]);
}

#[test]
fn no_drafts_unless_the_request_allows_and_free_blocks_hold_them() {
    let mut s = speculating(33, SPEC);
    s.add(request(1, vec![10, 11, 12, 13, 10, 11], 20));
    let _ = s.schedule();
    s.commit(&[12]);
    assert_eq!(s.schedule().num_tokens, 1, "speculate: false");

    // 3 usable blocks of 4 tokens. Request 1 (7 tokens, position 6 computing next) holds two,
    // request 2 (3 + 1 tokens) the third: of three drafts only one fits, in the free slot of
    // request 1's last block, and nothing is preempted for drafts.
    let mut s = speculating(4, SPEC);
    s.add(drafting(1, vec![10, 11, 12, 13, 10, 11], 20));
    s.add(drafting(2, vec![20, 21, 22], 20));
    let _ = s.schedule();
    s.commit(&[12, 50]);
    let plan = s.schedule();
    assert_eq!(plan.input_ids, vec![12, 13, 50]);
    assert_eq!(plan.seq_req_ids, vec![1, 2]);
    assert_eq!(s.stats().preemptions, 0);
    s.validate().unwrap();
}

#[test]
fn a_penalized_row_after_a_draft_counts_it_in_its_history() {
    let mut s = speculating(33, SPEC);
    let mut r = drafting(1, vec![10, 11, 12, 13, 10, 11], 20);
    r.sampling.presence_penalty = 0.5;
    s.add(r);
    let _ = s.schedule();
    s.commit(&[12]);
    let plan = s.schedule();
    assert_eq!(plan.num_rows, 4);
    let hist = |r: usize| &plan.hist_tokens[plan.hist_offsets[r] as usize..plan.hist_offsets[r + 1] as usize];
    assert_eq!(hist(0), &[10, 11, 12, 13, 10, 11, 12]);
    assert_eq!(hist(3), &[10, 11, 12, 13, 10, 11, 12, 13, 10, 11]);
}

#[test]
fn a_discarded_step_drops_its_drafts() {
    let mut s = speculating(33, SPEC);
    after_first_token(&mut s, 20);
    let _ = s.schedule();
    s.discard_plan();
    s.validate().unwrap();
    // The sequence keeps its 7 tokens and recomputes them.
    assert_eq!(s.seq_progress(1, 0), Some((7, 0)));
    assert_eq!(s.stats().used_blocks, 0);
    let plan = s.schedule();
    assert_eq!(plan.num_tokens, 7);
    assert_eq!(plan.num_rows, 1);
}

#[test]
fn a_sequence_whose_drafts_fail_checks_fewer_until_they_are_confirmed() {
    let mut s = speculating(65, Speculation { num_tokens: 4, ..SPEC });
    // tokens cycle 1 2 3 4: every step finds drafts
    s.add(drafting(1, [1, 2, 3, 4].repeat(6), 40));
    let _ = s.schedule();
    s.commit(&[1]);
    // samples that confirm every draft (the token after the last: the next of the cycle)
    let confirm = |plan: &Plan| -> Vec<u32> {
        let ids: Vec<u32> = plan.input_ids.iter().map(|&t| t as u32).collect();
        (0..ids.len()).map(|r| ids.get(r + 1).copied().unwrap_or(ids[r] % 4 + 1)).collect()
    };
    let plan = s.schedule();
    assert_eq!(plan.input_ids, vec![1, 2, 3, 4, 1]);
    // the first sample (3) is not the first draft (2): none confirmed, one draft next
    s.commit(&[3, 4, 1, 2, 3]);
    s.validate().unwrap();
    let plan = s.schedule();
    assert_eq!(plan.input_ids, vec![3, 4]);
    // each step confirms all its drafts: one more draft the next time, up to num_tokens
    let mut plan = plan;
    for want in [2, 3, 4, 4] {
        s.commit(&confirm(&plan));
        s.validate().unwrap();
        plan = s.schedule();
        assert_eq!(plan.num_tokens - 1, want, "{:?}", plan.input_ids);
    }
}

#[test]
fn a_predicted_output_gives_drafts_without_the_ngram_speculation() {
    let mut s = Scheduler::new(SchedulerConfig { draft_step_tokens: 24, ..config(65, 4, 8, 64) });
    s.add(NewRequest { prediction: (50..70).collect(), ..drafting(1, vec![10, 11, 12], 30) });
    // no prediction, no speculation: no drafts
    s.add(drafting(2, vec![10, 11, 12], 30));
    let _ = s.schedule();
    s.commit(&[50, 7]);
    let plan = s.schedule();
    // request 1 drafts the prediction's next 8 (PREDICTION_DRAFTS); request 2 none
    assert_eq!(plan.input_ids, [50].into_iter().chain(51..59).chain([7]).collect::<Vec<i64>>());
    let samples: Vec<u32> = (51..60).chain([8]).collect();
    let u = s.commit(&samples);
    assert_eq!(u.len(), 10, "all 8 drafts and the token after them, and request 2's");
    s.validate().unwrap();
    assert_eq!(s.seq_progress(1, 0), Some((13, 12)));
    // off without a draft step size
    let mut s = Scheduler::new(config(65, 4, 8, 64));
    s.add(NewRequest { prediction: (50..70).collect(), ..drafting(1, vec![10, 11, 12], 30) });
    let _ = s.schedule();
    s.commit(&[50]);
    assert_eq!(s.schedule().num_tokens, 1);
}

#[test]
fn drafts_take_only_what_serving_every_running_sequence_left() {
    let predicted = |id, prompt: Vec<u32>| NewRequest { prediction: (50..70).collect(), ..drafting(id, prompt, 30) };
    // 4 usable blocks of 4 tokens. A (7 tokens, computing position 6) holds two, B (4 + 1
    // tokens) one and needs a second for position 4: B gets the free block, A's drafts only
    // the free slot of its own last block; nothing is preempted.
    let mut s = Scheduler::new(SchedulerConfig { draft_step_tokens: 24, ..config(5, 4, 8, 64) });
    s.add(predicted(1, vec![10, 11, 12, 13, 14, 15]));
    s.add(drafting(2, vec![20, 21, 22, 23], 30));
    let _ = s.schedule();
    s.commit(&[50, 7]);
    let plan = s.schedule();
    assert_eq!(plan.input_ids, vec![50, 51, 7]);
    assert_eq!(s.stats().preemptions, 0);
    s.validate().unwrap();

    // A budget of 4 tokens and three decoding sequences: each gets its token, drafts the rest.
    let mut s = Scheduler::new(SchedulerConfig { draft_step_tokens: 24, ..config(65, 4, 8, 4) });
    for id in 1..=3 {
        s.add(predicted(id, vec![10 + id as u32]));
    }
    let _ = s.schedule();
    s.commit(&[50, 50, 50]);
    let plan = s.schedule();
    assert_eq!(plan.seq_req_ids, vec![1, 2, 3]);
    assert_eq!(plan.input_ids, vec![50, 51, 50, 50]);
}
