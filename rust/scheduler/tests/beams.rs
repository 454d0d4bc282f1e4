//! Beam search: `commit` leaves beam rows to the caller, `advance_beams` continues them.

mod common;
use common::*;
use llmserve_scheduler::*;

fn beam_request(id: u64, prompt_len: usize) -> NewRequest {
    let mut r = request(id, prompt(prompt_len, id as u32), 64);
    r.sampling = SeqSampling { beam: true, temperature: 0.0, num_logprobs: 4, ..SeqSampling::default() };
    r
}

/// The last input id each row's sequence ran in `plan`, by sequence index.
fn last_inputs(plan: &Plan) -> Vec<(u32, i64)> {
    let mut out: Vec<(u32, i64)> =
        (0..plan.num_rows).map(|r| (plan.row_seq_index[r], plan.input_ids[plan.logits_indices[r] as usize])).collect();
    out.sort_unstable();
    out
}

#[test]
fn commit_leaves_beam_rows_to_the_caller() {
    let mut s = Scheduler::new(config(32, 4, 8, 64));
    s.add(beam_request(1, 6));
    let plan = s.schedule();
    assert_eq!(plan.num_rows, 1);
    let updates = s.commit(&[9]);
    assert_eq!(updates.len(), 1);
    assert_eq!((updates[0].seq_index, updates[0].finish), (0, None));
    assert_eq!(updates[0].cached_prompt_tokens, Some(0));
    // nothing appended: the prompt is all the sequence holds
    assert_eq!(s.seq_progress(1, 0), Some((6, 6)));
    s.validate().unwrap();
}

#[test]
fn advance_forks_shares_full_blocks_and_copies_the_partial_one() {
    let mut s = Scheduler::new(config(32, 4, 8, 64));
    s.add(beam_request(1, 6));
    s.schedule();
    s.commit(&[9]);
    let indices = s.advance_beams(1, &[(0, 50), (0, 51), (0, 52)]);
    assert_eq!(indices, vec![0, 1, 2]);
    s.validate().unwrap();
    let parent = s.seq_blocks(1, 0).unwrap().to_vec();
    for i in [1, 2] {
        let child = s.seq_blocks(1, i).unwrap();
        assert_eq!(child[0], parent[0], "the full block is shared");
        assert_ne!(child[1], parent[1], "the partial block is a copy");
        assert_eq!(s.seq_progress(1, i), Some((7, 6)));
    }
    let plan = s.schedule();
    check_plan(&s, &plan);
    assert_eq!(plan.copy_src, vec![parent[1] as i64; 2]);
    assert_eq!(last_inputs(&plan), vec![(0, 50), (1, 51), (2, 52)]);
    assert!(s.schedule_ahead().is_empty(), "beam rows are never planned ahead");
    s.commit(&[0, 0, 0]);
    s.validate().unwrap();
}

#[test]
fn advance_releases_unpicked_beams_and_reindexes_forks() {
    let mut s = Scheduler::new(config(32, 4, 8, 64));
    s.add(beam_request(1, 6));
    s.schedule();
    s.commit(&[9]);
    s.advance_beams(1, &[(0, 50), (0, 51), (0, 52)]);
    s.schedule();
    s.commit(&[0, 0, 0]);
    // beam 0 dies, beam 1 has two children, beam 2 one
    let indices = s.advance_beams(1, &[(1, 60), (2, 61), (1, 62)]);
    assert_eq!(indices, vec![1, 2, 3]);
    s.validate().unwrap();
    assert!(s.seq_blocks(1, 0).is_none());
    assert_eq!(s.stats().running, 3);
    let plan = s.schedule();
    check_plan(&s, &plan);
    assert_eq!(last_inputs(&plan), vec![(1, 60), (2, 61), (3, 62)]);
    // the fork of beam 1 ran its tokens: prompt, 51, then 62
    let r3 = (0..plan.num_rows).find(|&r| plan.row_seq_index[r] == 3).unwrap();
    let pos = plan.positions[plan.logits_indices[r3] as usize];
    assert_eq!(pos, 7);
    s.commit(&[0, 0, 0]);
    // no pick: the request ends and frees everything
    assert!(s.advance_beams(1, &[]).is_empty());
    assert_eq!(s.num_requests(), 0);
    assert_eq!(s.block_pool().num_used(), 0);
    s.validate().unwrap();
}

#[test]
fn a_fork_without_a_free_block_runs_later_and_the_others_await_it() {
    // 6 usable blocks of 4: the prompt takes 2, six forks need a copy each
    let mut s = Scheduler::new(config(7, 4, 8, 64));
    s.add(beam_request(1, 6));
    s.schedule();
    s.commit(&[9]);
    s.advance_beams(1, &[(0, 50), (0, 51), (0, 52), (0, 53), (0, 54), (0, 55)]);
    s.validate().unwrap();
    let stats = s.stats();
    assert_eq!(stats.running + stats.waiting, 6);
    assert!(stats.waiting > 0);
    // every beam gives its row once, over several steps: one that gave it runs no further
    // (and, when blocks are short, makes room for one still waiting)
    let mut given: Vec<u32> = Vec::new();
    for _ in 0..12 {
        let plan = s.schedule();
        check_plan(&s, &plan);
        if plan.is_empty() {
            s.commit(&[]);
            break;
        }
        for &i in &plan.row_seq_index {
            assert!(!given.contains(&i), "beam {i} gave its row twice");
            given.push(i);
        }
        s.commit(&vec![0; plan.num_rows]);
        s.validate().unwrap();
    }
    given.sort_unstable();
    assert_eq!(given, vec![0, 1, 2, 3, 4, 5]);
    assert!(s.stats().preemptions > 0, "beams that gave their rows were preempted for the waiting ones");
    // every one is a parent to pick from, also one preempted after it gave its row
    let picks: Vec<(u32, u32)> = (0..6).map(|i| (i, 80)).chain([(5, 81)]).collect();
    assert_eq!(s.advance_beams(1, &picks), vec![0, 1, 2, 3, 4, 5, 6]);
    s.validate().unwrap();
    for i in 0..7 {
        assert_eq!(s.seq_progress(1, i).unwrap().0, 8, "beam {i}: prompt, its fork's token and its pick");
    }
    let plan = s.schedule();
    check_plan(&s, &plan);
    assert!(plan.num_rows > 0);
    assert!(s.abort(1));
    s.commit(&vec![0; plan.num_rows]);
    assert_eq!(s.block_pool().num_used(), 0);
    s.validate().unwrap();
}

#[test]
fn beams_beyond_a_steps_places_run_in_the_next_step() {
    // at most 2 sequences a step, 4 beams
    let mut s = Scheduler::new(config(32, 4, 2, 64));
    s.add(beam_request(1, 6));
    s.schedule();
    s.commit(&[9]);
    s.advance_beams(1, &[(0, 50), (0, 51), (0, 52), (0, 53)]);
    let (first, _) = step(&mut s, 0);
    let (second, _) = step(&mut s, 0);
    let mut ran: Vec<u32> = first.row_seq_index.iter().chain(&second.row_seq_index).copied().collect();
    ran.sort_unstable();
    assert_eq!((first.num_rows, second.num_rows, ran), (2, 2, vec![0, 1, 2, 3]));
    let (idle, _) = step(&mut s, 0);
    assert!(idle.is_empty(), "every beam awaits its pick");
    s.commit(&[]);
    s.advance_beams(1, &[(3, 60)]);
    let (next, _) = step(&mut s, 0);
    assert_eq!(last_inputs(&next), vec![(3, 60)]);
}

mod properties {
    use super::*;
    use proptest::prelude::*;

    /// A small xorshift stream for the picks.
    struct Draw(u64);

    impl Draw {
        fn next(&mut self, below: u64) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0 % below.max(1)
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]

        /// Beam searches beside sampled requests on a small pool (forks that wait for blocks,
        /// more beams than a step's places, preemption, aborts), driven as the engine drives
        /// them (a request's beams are picked once each live one gave its row): the invariants
        /// hold after every verb, a beam gives one row per pick, each pick continues the
        /// sequence it names, nothing stalls while requests live, and once every request is
        /// gone no block is held.
        #[test]
        fn beams_keep_the_invariants(
            seed in 1u64..u64::MAX,
            num_blocks in 11usize..24,
            caching in any::<bool>(),
            widths in prop::collection::vec(1u32..9, 1..5),
        ) {
            let mut cfg = config(num_blocks, 4, 6, 24);
            cfg.enable_prefix_caching = caching;
            cfg.max_model_len = 40;
            // (10 usable blocks hold one sequence of 40)
            let mut s = Scheduler::new(cfg);
            let mut d = Draw(seed);
            for (i, &w) in widths.iter().enumerate() {
                let id = i as u64 + 1;
                let mut r = beam_request(id, 1 + d.next(12) as usize);
                r.sampling.num_logprobs = 2 * w as i32;
                s.add(r);
                // a sampled request beside each search
                s.add(request(100 + id, prompt(1 + d.next(10) as usize, 7), 1 + d.next(8) as u32));
            }
            let mut width: std::collections::HashMap<u64, u32> =
                widths.iter().enumerate().map(|(i, &w)| (i as u64 + 1, w)).collect();
            // each search's live beams, and those that gave their row since the last pick
            let mut live: std::collections::HashMap<u64, Vec<u32>> = width.keys().map(|&id| (id, vec![0])).collect();
            let mut given: std::collections::HashMap<u64, Vec<u32>> = Default::default();
            for _ in 0..80 {
                let plan = s.schedule();
                check_plan(&s, &plan);
                if plan.is_empty() {
                    prop_assert_eq!(s.num_requests(), 0, "a step with nothing to run while requests live");
                    s.commit(&[]);
                    break;
                }
                let tokens: Vec<u32> = (0..plan.num_rows).map(|_| 3 + d.next(20) as u32).collect();
                let updates = s.commit(&tokens);
                s.validate().unwrap();
                for u in updates.iter().filter(|u| width.contains_key(&u.req_id)) {
                    prop_assert_eq!(u.finish, None);
                    let gave = given.entry(u.req_id).or_default();
                    prop_assert!(!gave.contains(&u.seq_index), "a beam gave two rows for one pick");
                    prop_assert!(live[&u.req_id].contains(&u.seq_index));
                    gave.push(u.seq_index);
                }
                let ready: Vec<u64> = live
                    .iter()
                    .filter(|(id, beams)| given.get(id).is_some_and(|g| g.len() == beams.len()))
                    .map(|(&id, _)| id)
                    .collect();
                for id in ready {
                    let seqs = given.remove(&id).unwrap();
                    // each search's sequence must end below max_model_len: stop when close
                    let len = seqs.iter().filter_map(|&i| s.seq_progress(id, i)).map(|p| p.0).max().unwrap();
                    let m = if len + 1 >= 40 || d.next(10) == 0 { 0 } else { 1 + d.next(u64::from(width[&id])) };
                    let picks: Vec<(u32, u32)> =
                        (0..m).map(|_| (seqs[d.next(seqs.len() as u64) as usize], 3 + d.next(20) as u32)).collect();
                    let before: Vec<usize> = picks.iter().map(|&(p, _)| s.seq_progress(id, p).unwrap().0).collect();
                    let indices = s.advance_beams(id, &picks);
                    s.validate().unwrap();
                    prop_assert_eq!(indices.len(), picks.len());
                    for (k, &index) in indices.iter().enumerate() {
                        prop_assert_eq!(s.seq_progress(id, index).map(|p| p.0), Some(before[k] + 1));
                    }
                    if picks.is_empty() {
                        width.remove(&id);
                        live.remove(&id);
                    } else {
                        live.insert(id, indices);
                    }
                }
                if d.next(15) == 0 {
                    if let Some(&id) = width.keys().next() {
                        prop_assert!(s.abort(id));
                        width.remove(&id);
                        live.remove(&id);
                        given.remove(&id);
                        s.validate().unwrap();
                    }
                }
            }
            for id in 1..=widths.len() as u64 {
                s.abort(id);
                s.abort(100 + id);
            }
            s.validate().unwrap();
            prop_assert_eq!(s.num_requests(), 0);
            prop_assert_eq!(s.block_pool().num_used(), 0);
        }
    }
}
