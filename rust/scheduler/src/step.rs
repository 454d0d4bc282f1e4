//! One step: `schedule` builds a Plan, `commit` applies its sampled tokens.
//!
//! There are no prefill and decode phases. Each sequence has `tokens` and `num_computed`;
//! a step gives each running sequence up to `tokens - num_computed` new tokens within the
//! budget (long prompts are chunked), then admits waiting sequences in policy order while
//! the budget and the free blocks allow (passing over those whose LoRA adapter would run past
//! `max_loras`). A sequence samples only in the step where its computed tokens reach its full
//! length.
//!
//! Cost per step: O(B + T + R) for B running sequences, T tokens and R rows, plus the
//! prefix-cache hashing of blocks that became full and the hist_* copies of penalized rows.

use std::ops::Bound::{Excluded, Unbounded};

use crate::block_pool::{hash_block, BlockPool};
use crate::plan::{mix_seed, Plan};
use crate::scheduler::{blocks_for, Inflight, Key, PendingCopy, Req, Row, Scheduler, Seq, State, PLACEHOLDER};
use crate::speculate::{from_prediction, propose};
use crate::types::{FinishReason, Pooling, SeqUpdate, StopRules};

impl Scheduler {
    /// The next batch; empty (`is_empty()`) when there is nothing to run. A non-empty Plan
    /// is answered by `commit` (`commit(&[])` for a plan without rows).
    ///
    /// NOTE: calling `schedule` while plans await commit discards them exactly as
    /// `discard_plan` does (their sequences recompute). This is the recovery path when a
    /// forward fails, and it keeps a missed commit from corrupting state or panicking the
    /// engine thread.
    pub fn schedule(&mut self) -> Plan {
        self.discard_plan();
        self.plan_step(true)
    }

    /// The batch after the one awaiting commit, planned before its tokens are known, so the
    /// engine can build it while the model runs that one. Empty when it cannot be planned
    /// ahead; the engine then commits and calls `schedule`.
    ///
    /// Each sequence that samples in the awaiting plan gets a placeholder last token: its
    /// input id in this plan is `-1 - r`, for row `r` of the awaiting plan (the runner
    /// substitutes the token sampled there), and `commit` of the awaiting plan replaces it.
    /// A sequence that then finishes has computed one token for nothing: its row in this
    /// plan gets no update. One whose placeholder reaches max_tokens or max_model_len is not
    /// scheduled at all.
    ///
    /// Not planned ahead (empty): unless exactly one plan awaits commit; when one of its rows
    /// forks (n > 1), has penalties or bad words of several tokens, runs beam search or carries
    /// drafts (their next rows need the token itself, or how many drafts it confirms); when
    /// the running sequences would not fit in the free blocks (this never preempts).
    pub fn schedule_ahead(&mut self) -> Plan {
        if self.inflight.len() != 1 || !self.rows_plan_ahead() {
            return Plan::default();
        }
        let rows = std::mem::take(&mut self.inflight[0].rows);
        for (r, row) in rows.iter().enumerate() {
            let seq = &mut self.seqs[row.slot as usize];
            // (a sequence may hold its placeholder from an earlier call that planned nothing)
            if seq.gen == row.gen && seq.state == State::Running && seq.pending.is_none() {
                seq.tokens.push(PLACEHOLDER);
                seq.pending = Some(r as u32);
            }
        }
        self.inflight[0].rows = rows;
        if !self.fits_without_preemption() {
            self.drop_placeholders();
            return Plan::default();
        }
        self.plan_step(false)
    }

    /// Whether every live row of the plan awaiting commit can be followed before its token
    /// is known.
    fn rows_plan_ahead(&self) -> bool {
        self.inflight[0].rows.iter().all(|row| {
            let seq = &self.seqs[row.slot as usize];
            let live = seq.gen == row.gen && seq.state == State::Running;
            !live || {
                let req = self.req(seq.req);
                row.fork_n <= 1
                    && row.drafts == 0
                    && !req.penalized
                    && !req.sampling.reads_output()
                    && !req.sampling.beam
            }
        })
    }

    /// A placeholder that already ends its sequence by length: nothing follows it.
    fn ends_by_length(&self, seq: &Seq) -> bool {
        let req = self.req(seq.req);
        seq.pending.is_some()
            && (seq.tokens.len() - seq.prompt_len >= req.stop.max_tokens as usize
                || seq.tokens.len() >= self.cfg.max_model_len)
    }

    /// How many of a sequence's `left` uncomputed tokens this step computes: what the
    /// `budget` holds, and of a prompt no more than `long_prefill_token_threshold`.
    fn chunk(&self, left: usize, budget: usize) -> usize {
        match self.cfg.long_prefill_token_threshold {
            0 => left.min(budget),
            cap => left.min(budget).min(cap),
        }
    }

    /// How many of a sequence's tokens from `computed` on this step computes: `chunk`'s
    /// count, but a fork's choice that recomputes its prompt (it waited for a place or for a
    /// block to copy) leaves its first token to a step of its own. That token then runs as
    /// its siblings' ran, in a decode step: prompt and decode steps round differently (on CPU
    /// a prompt's matmuls run in bf16), and a seeded choice would otherwise depend on whether
    /// it had to wait.
    fn step_tokens(&self, seq: &Seq, computed: usize, budget: usize) -> usize {
        let len = seq.tokens.len();
        let n = self.chunk(len - computed, budget);
        // (a beam spawned without a block for its copy too: its search waits a step for it)
        let first_apart = seq.index > 0 && len == seq.prompt_len + 1 && computed + 1 < len && computed + n == len;
        n - usize::from(first_apart)
    }

    /// Whether `schedule_running` would find the blocks for every running sequence it
    /// serves without preempting.
    fn fits_without_preemption(&self) -> bool {
        let bs = self.cfg.block_size;
        let (mut budget, mut free, mut served) = (self.cfg.max_num_batched_tokens, self.pool.num_free(), 0);
        for key in &self.running {
            if budget == 0 || served >= self.cfg.max_num_seqs {
                break;
            }
            let seq = &self.seqs[key.slot as usize];
            if seq.awaits_pick || self.ends_by_length(seq) {
                continue;
            }
            let num_new = self.step_tokens(seq, seq.num_computed, budget);
            let need = blocks_for(seq.num_computed + num_new, bs) - seq.blocks.len();
            if need > free {
                return false;
            }
            free -= need;
            budget -= num_new;
            served += 1;
        }
        true
    }

    /// Undo `schedule_ahead`'s placeholders (they are only ever for the oldest plan's rows).
    fn drop_placeholders(&mut self) {
        let Some(oldest) = self.inflight.front() else { return };
        for (r, row) in oldest.rows.iter().enumerate() {
            let seq = &mut self.seqs[row.slot as usize];
            if seq.gen == row.gen && seq.pending == Some(r as u32) {
                seq.tokens.pop();
                seq.pending = None;
            }
        }
    }

    fn plan_step(&mut self, may_preempt: bool) -> Plan {
        let mut plan = Plan::with_capacity(self.last_num_tokens, self.running.len() + 1, self.running.len() + 1);
        let mut cur = std::mem::take(&mut self.spare);
        cur.clear();
        // Forks from the last commit: the runner copies before the forward, so the source
        // reference can be dropped now even if the block is reallocated in this step.
        for c in self.pending_copies.drain(..) {
            cur.planned.push((c.slot, self.seqs[c.slot as usize].gen));
            plan.copy_src.push(i64::from(c.src));
            plan.copy_dst.push(i64::from(c.dst));
            self.pool.free(c.src);
        }
        self.scheduled.clear();
        let mut budget = self.cfg.max_num_batched_tokens;
        let preempted = self.schedule_running(&mut budget, may_preempt);
        // NOTE: as vLLM, admit nothing in a step that had to preempt: memory is short, and a
        // just-preempted sequence must not bounce straight back in.
        if !preempted {
            self.schedule_drafts(&mut budget);
            self.schedule_waiting(&mut budget);
        }
        if may_preempt {
            self.make_room_for_waiting_beams(&mut budget);
        }
        self.build_plan(&mut plan, &mut cur);
        self.last_num_tokens = plan.num_tokens;
        if plan.is_empty() {
            self.spare = cur;
        } else {
            self.inflight.push_back(cur);
        }
        plan
    }

    /// Serve running sequences in policy order, preempting from the back when blocks run
    /// out (or, without `may_preempt`, stopping there). Returns whether anything was
    /// preempted.
    fn schedule_running(&mut self, budget: &mut usize, may_preempt: bool) -> bool {
        let bs = self.cfg.block_size;
        let mut preempted = false;
        let mut i = 0;
        while i < self.running.len() && *budget > 0 && self.scheduled.len() < self.cfg.max_num_seqs {
            let slot = self.running[i].slot;
            let seq = &self.seqs[slot as usize];
            if seq.awaits_pick || self.ends_by_length(seq) {
                i += 1;
                continue;
            }
            let num_new = self.step_tokens(seq, seq.num_computed, *budget);
            debug_assert!(num_new > 0, "a running sequence always has a token to compute");
            let need = blocks_for(seq.num_computed + num_new, bs) - seq.blocks.len();
            if !may_preempt && self.pool.num_free() < need {
                break;
            }
            let mut lost_self = false;
            while self.pool.num_free() < need {
                let victim = *self.running.last().expect("the current sequence is running");
                self.preempt(victim);
                preempted = true;
                if victim.slot == slot {
                    lost_self = true;
                    break;
                }
            }
            if lost_self {
                break;
            }
            self.grow(slot, need);
            self.scheduled.push((slot, num_new));
            *budget -= num_new;
            i += 1;
        }
        preempted
    }

    /// Drafts for the running sequences just scheduled, in policy order, from what serving
    /// every one of them left: of the budget, of the free blocks, and of the draft step size
    /// (`draft_step_tokens`, the running sequences' own tokens counted first).
    fn schedule_drafts(&mut self, budget: &mut usize) {
        let mut room = self.cfg.draft_step_tokens.saturating_sub(self.running.len());
        for i in 0..self.scheduled.len() {
            if room == 0 || *budget == 0 {
                break;
            }
            let (slot, num_new) = self.scheduled[i];
            if num_new == 1 {
                let drafts = self.draft(slot, room.min(*budget));
                self.scheduled[i].1 += drafts;
                *budget -= drafts;
                room -= drafts;
            }
        }
    }

    /// Append up to `room` drafts to a decoding sequence whose blocks hold its next token
    /// (from its request's prediction, else n-gram ones: `Speculation`), growing its blocks for
    /// them while free ones last; returns how many. 0 for a sequence that may not speculate; never
    /// past max_tokens or max_model_len (tokens sampled there would be dropped). At most its
    /// `draft_limit`: a sequence whose drafts keep failing checks one at a time (a failed
    /// draft costs a token's compute in a step), and grows back as they are confirmed.
    fn draft(&mut self, slot: u32, room: usize) -> usize {
        let bs = self.cfg.block_size;
        let seq = &self.seqs[slot as usize];
        let req = self.req(seq.req);
        let len = seq.tokens.len();
        if !req.speculate || seq.pending.is_some() || len <= seq.prompt_len || seq.num_computed + 1 != len {
            return 0;
        }
        // Row j samples output len - prompt_len + j + 1; every row's token must be one a
        // decode step could keep.
        let outputs_left = (req.stop.max_tokens as usize).saturating_sub(len - seq.prompt_len);
        let room = room.min(outputs_left.saturating_sub(1)).min(self.cfg.max_model_len.saturating_sub(len + 1));
        let k = room.min(seq.draft_limit);
        let mut drafts = from_prediction(&req.prediction, &seq.tokens[seq.prompt_len..], k);
        if let (true, Some(spec)) = (drafts.is_empty(), &self.cfg.speculation) {
            drafts = propose(&seq.tokens, spec.lookup_min, spec.lookup_max, k);
        }
        // (no preemption for drafts: only the blocks that are free)
        let fit = (blocks_for(len + drafts.len(), bs) - seq.blocks.len()).min(self.pool.num_free());
        let k = drafts.len().min((seq.blocks.len() + fit) * bs - len);
        if k == 0 {
            return 0;
        }
        let drafts = drafts[..k].to_vec();
        let need = blocks_for(len + k, bs) - seq.blocks.len();
        self.grow(slot, need);
        let seq = &mut self.seqs[slot as usize];
        seq.tokens.extend_from_slice(&drafts);
        seq.drafts = k;
        k
    }

    fn schedule_waiting(&mut self, budget: &mut usize) {
        // (a fork parent holds one place, or the n its children take when its prompt ends)
        let mut running = self.places_of(&self.running);
        // The adapters running, when `max_loras` bounds them. A sequence whose adapter would
        // pass the bound is passed over; from then on the ones behind it that run an adapter
        // wait too, so the running adapters drain and it is not starved. The base model's pass.
        let bounded = self.cfg.max_loras > 0;
        let mut adapters = if bounded { self.adapters().0 } else { Vec::new() };
        let mut lora_blocked = false;
        let mut next = self.waiting.first().copied();
        while let Some(key) = next {
            next = self.waiting.range((Excluded(key), Unbounded)).next().copied();
            if *budget == 0 || self.scheduled.len() >= self.cfg.max_num_seqs {
                break;
            }
            if self.seqs[key.slot as usize].awaits_pick {
                continue; // (a preempted beam whose row is given: it runs once picked)
            }
            let places = self.places(key.slot) as usize;
            if running > 0 && running + places > self.cfg.max_num_seqs {
                break;
            }
            let lora = self.req(self.seqs[key.slot as usize].req).lora;
            if bounded && lora != 0 {
                let new = !adapters.contains(&lora);
                if lora_blocked || (new && adapters.len() >= self.cfg.max_loras) {
                    lora_blocked = true;
                    continue;
                }
                if new {
                    adapters.push(lora);
                }
            }
            match self.admit(key, *budget) {
                Some(num_new) => {
                    self.scheduled.push((key.slot, num_new));
                    *budget -= num_new;
                    running += places;
                }
                // Policy order is strict: a sequence that does not fit blocks the ones
                // behind it (this is what keeps fcfs free of starvation).
                None => break,
            }
        }
    }

    /// A step with nothing to run while sequences wait: the blocks or places they need may
    /// all be held by beams that await their picks (a search steps only once every beam gave
    /// its row, and its other beams may be among the waiting). Preempt such beams, the last in
    /// policy order first, until a waiting sequence is admitted; their rows stay given.
    fn make_room_for_waiting_beams(&mut self, budget: &mut usize) {
        while self.scheduled.is_empty() && self.waiting.iter().any(|k| !self.seqs[k.slot as usize].awaits_pick) {
            let Some(pos) = self.running.iter().rposition(|k| self.seqs[k.slot as usize].awaits_pick) else {
                return;
            };
            let victim = self.running.remove(pos);
            self.free_blocks(victim.slot);
            self.enqueue_waiting(victim.slot);
            self.preemptions += 1;
            self.schedule_waiting(budget);
        }
    }

    /// Move a waiting sequence to running, reusing cached prefix blocks. None when its
    /// first chunk does not fit in the free blocks.
    fn admit(&mut self, key: Key, budget: usize) -> Option<usize> {
        let bs = self.cfg.block_size;
        let slot = key.slot as usize;
        let mut parent = self.req(self.seqs[slot].req).root;
        self.hits.clear();
        // A prompt that owes logprob rows or pooled positions computes every position itself.
        let owes = |r: &Req| r.owes_prompt_logprobs() || r.owes_pooled_positions();
        let looked_up = self.cfg.enable_prefix_caching && !owes(self.req(self.seqs[slot].req));
        if looked_up {
            let seq = &self.seqs[slot];
            // Never the block holding the last token: at least one token is computed, so
            // the step that samples never writes into a shared block. A sequence that
            // recomputes its generated tokens (preempted, a beam that gave up its blocks)
            // computes them as its decode steps did (see `decoded_from`): without
            // `cache_decoded_blocks` it takes cached blocks of its prompt only, not blocks that
            // another request's prompt step computed over the same tokens, with other numerics.
            let mut end = seq.tokens.len() - 1;
            if !self.cfg.cache_decoded_blocks {
                end = end.min(seq.prompt_len);
            }
            for chunk in seq.tokens[..end].chunks_exact(bs) {
                let h = hash_block(parent, chunk);
                match self.pool.lookup(h, parent, chunk) {
                    Some(b) => {
                        self.hits.push(b);
                        parent = h;
                    }
                    None => break,
                }
            }
        }
        let len = self.seqs[slot].tokens.len();
        let computed = self.hits.len() * bs;
        let num_new = self.step_tokens(&self.seqs[slot], computed, budget);
        let need = blocks_for(computed + num_new, bs) - self.hits.len();
        let revived = self.hits.iter().filter(|&&b| self.pool.ref_count(b) == 0).count();
        if self.pool.num_free() < revived + need {
            return None;
        }
        for &b in &self.hits {
            self.pool.touch(b);
        }
        let seq = &mut self.seqs[slot];
        seq.blocks.extend_from_slice(&self.hits);
        seq.num_computed = computed;
        seq.num_hashed = self.hits.len();
        seq.last_hash = parent;
        let req_slot = seq.req;
        if looked_up {
            // (as vLLM: a sequence that never looked counts in neither, so with caching off
            // the hit rate has no data rather than 0%)
            self.prefix_hit_tokens += computed as u64;
            self.prefix_query_tokens += len as u64;
        }
        self.req_mut(req_slot).cached_prompt_tokens.get_or_insert(computed as u32);
        self.grow(key.slot, need);
        self.waiting.remove(&key);
        self.enqueue_running(key.slot);
        Some(num_new)
    }

    fn grow(&mut self, slot: u32, need: usize) {
        let seq = &mut self.seqs[slot as usize];
        for _ in 0..need {
            seq.blocks.push(self.pool.allocate().expect("caller checked num_free"));
        }
    }

    /// Preemption by recompute: drop the KV, keep the tokens (outputs included).
    fn preempt(&mut self, victim: Key) {
        let popped = self.running.pop();
        debug_assert_eq!(popped, Some(victim));
        self.free_blocks(victim.slot);
        self.enqueue_waiting(victim.slot);
        self.preemptions += 1;
    }

    fn build_plan(&mut self, plan: &mut Plan, cur: &mut Inflight) {
        let bs = self.cfg.block_size;
        let width = self.scheduled.iter().map(|&(s, _)| self.seqs[s as usize].blocks.len()).max().unwrap_or(0);
        plan.block_table_width = width;
        plan.block_tables = vec![0; self.scheduled.len() * width];
        plan.query_start_loc.push(0);
        plan.bias_offsets.push(0);
        plan.hist_offsets.push(0);
        for (s, &(slot, num_new)) in self.scheduled.iter().enumerate() {
            let seq = &mut self.seqs[slot as usize];
            let (start, end) = (seq.num_computed, seq.num_computed + num_new);
            let req = self.reqs[seq.req as usize].as_mut().expect("live request slot");
            if let Some(k) = req.prompt_logprobs {
                // Positions whose next token is still prompt, not yet planned for this request.
                let first = start.max(req.prompt_lp_next);
                let last = end.min(seq.prompt_len - 1);
                if first < last {
                    cur.lp_undo.push((seq.req, req.id, req.prompt_lp_next));
                    let base = plan.input_ids.len() as i64 - start as i64;
                    for pos in first..last {
                        plan.prompt_lp_indices.push(base + pos as i64);
                        plan.prompt_lp_targets.push(i64::from(seq.tokens[pos + 1]));
                        plan.prompt_lp_req_ids.push(req.id);
                        plan.prompt_lp_num.push(k as i32);
                    }
                    req.prompt_lp_next = last;
                }
            }
            if let Some(pooling) = req.pooling {
                // Positions this chunk computes that the embedding reads, not yet planned.
                let first = match pooling {
                    Pooling::Last => seq.prompt_len - 1,
                    Pooling::Mean => 0,
                };
                let first = first.max(start).max(req.pool_next);
                let last = end.min(seq.prompt_len);
                if first < last {
                    cur.pool_undo.push((seq.req, req.id, req.pool_next));
                    let base = plan.input_ids.len() as i64 - start as i64;
                    for pos in first..last {
                        plan.pool_indices.push(base + pos as i64);
                        plan.pool_req_ids.push(req.id);
                    }
                    req.pool_next = last;
                }
            }
            let req = &*req;
            for pos in start..end {
                let id = match seq.pending {
                    Some(r) if pos + 1 == seq.tokens.len() => -1 - i64::from(r),
                    _ => i64::from(seq.tokens[pos]),
                };
                plan.input_ids.push(id);
                plan.positions.push(pos as i64);
                plan.slot_mapping.push(i64::from(seq.blocks[pos / bs]) * bs as i64 + (pos % bs) as i64);
            }
            plan.query_start_loc.push(plan.input_ids.len() as i32);
            plan.seq_lens.push(end as i32);
            for (j, &b) in seq.blocks.iter().enumerate() {
                plan.block_tables[s * width + j] = b as i32;
            }
            plan.seq_req_ids.push(req.id);
            plan.seq_indices.push(seq.index);
            plan.lora_ids.push(req.lora);
            plan.prompt_lens.push(seq.prompt_len as i32);
            cur.planned.push((slot, seq.gen));
            seq.num_computed = end;
            // Generated tokens: a decode step's, or those a sequence recomputes past its prompt
            // (preempted, a beam that gave up its blocks), which the runner computes as the
            // decode steps did (worker/runner.py: ModelRunner._parts). On CPU those compute with
            // other numerics than prompt steps, and `decoded_from` keeps the prefix cache from
            // reusing the K/V they wrote.
            if end > seq.prompt_len {
                seq.decoded_from = seq.decoded_from.min(start.max(seq.prompt_len));
            }
            if self.cfg.enable_prefix_caching {
                let cacheable = if self.cfg.cache_decoded_blocks { usize::MAX } else { seq.decoded_from };
                register_full_blocks(&mut self.pool, seq, bs, cacheable, &mut cur.registered);
            }
            if seq.drafts > 0 {
                // One row per token: its last token's and each draft's; row j follows the
                // tokens up to draft j, as the step that samples after it would.
                let last = plan.input_ids.len() as i64 - 1;
                let k = seq.drafts;
                for j in 0..=k {
                    let upto = end - k + j;
                    push_row(plan, req, seq, upto, seq.index, last - (k - j) as i64);
                    let (fork_n, drafts) = if j == 0 { (1, k as u32) } else { (0, 0) };
                    cur.rows.push(Row { slot, gen: seq.gen, fork_n, drafts });
                }
            } else if end == seq.tokens.len() {
                let logits_index = plan.input_ids.len() as i64 - 1;
                let n = if seq.fork_pending { req.n } else { 1 };
                for k in 0..n {
                    let index = if seq.fork_pending { k } else { seq.index };
                    push_row(plan, req, seq, seq.tokens.len(), index, logits_index);
                    let fork_n = if k == 0 { n } else { 0 };
                    cur.rows.push(Row { slot, gen: seq.gen, fork_n, drafts: 0 });
                }
            }
        }
        plan.num_tokens = plan.input_ids.len();
        plan.num_seqs = self.scheduled.len();
        plan.num_rows = cur.rows.len();
    }

    /// The rows of the oldest Plan awaiting commit (0 when none awaits): the tokens its
    /// `commit` takes.
    pub fn awaited_rows(&self) -> usize {
        self.inflight.front().map_or(0, |plan| plan.rows.len())
    }

    /// Apply one sampled token per row of the oldest Plan awaiting commit, in row order:
    /// append (or replace the placeholder `schedule_ahead` gave it), check stop rules, free
    /// finished sequences, fork n > 1 prompts. Rows whose sequence was aborted or finished
    /// since `schedule` produce no update. A beam search's rows produce their update and
    /// nothing else: the caller answers them with `advance_beams` before the next `schedule`.
    ///
    /// Panics unless `tokens.len()` equals that Plan's `num_rows` (`awaited_rows`).
    pub fn commit(&mut self, tokens: &[u32]) -> Vec<SeqUpdate> {
        let Some(mut done) = self.inflight.pop_front() else {
            assert!(tokens.is_empty(), "Scheduler::commit called with tokens but no Plan is awaiting them");
            return Vec::new();
        };
        assert_eq!(tokens.len(), done.rows.len(), "commit takes exactly one token per Plan row");
        let rows = std::mem::take(&mut done.rows);
        let mut out = Vec::with_capacity(rows.len());
        let mut i = 0;
        while i < rows.len() {
            let row = rows[i];
            let group = row.group();
            let seq = &self.seqs[row.slot as usize];
            let live = seq.gen == row.gen && seq.state == State::Running;
            if live && self.req(seq.req).sampling.beam {
                // (the caller chooses the token: `advance_beams`)
                self.seqs[row.slot as usize].awaits_pick = true;
                let seq = &self.seqs[row.slot as usize];
                let req = self.req(seq.req);
                let first = seq.tokens.len() == seq.prompt_len;
                out.push(SeqUpdate {
                    req_id: req.id,
                    seq_index: seq.index,
                    token: tokens[i],
                    finish: None,
                    sample_row: i,
                    cached_prompt_tokens: first.then(|| req.cached_prompt_tokens.unwrap_or(0)),
                });
            } else if live && row.drafts > 0 {
                self.accept(row.slot, &tokens[i..i + group], i, &mut out);
            } else if live {
                let mark = out.len();
                if row.fork_n > 1 {
                    self.fork(row.slot, &tokens[i..i + group], i, &mut out);
                }
                self.append(row.slot, tokens[i], i, &mut out);
                // The parent's update was pushed after its children's: restore row order.
                out[mark..].rotate_right(1);
            }
            i += group;
        }
        done.rows = rows;
        self.spare = done;
        out
    }

    /// The Plans awaiting commit will never run (a forward failed): forget the prefix-cache
    /// entries they registered (their K/V was never written), drop placeholders, and send
    /// every live sequence they touched back to waiting, to recompute from scratch. Their
    /// rows get no updates. A no-op when no Plan awaits commit. The caller usually aborts
    /// the affected requests as well.
    pub fn discard_plan(&mut self) {
        self.drop_placeholders();
        while let Some(mut plan) = self.inflight.pop_back() {
            // Prompt positions this Plan listed are listed again when their sequence
            // recomputes (a request aborted since, whose slot may be reused, is left alone).
            for &(req_slot, id, next) in plan.lp_undo.iter().rev() {
                if let Some(req) = self.reqs[req_slot as usize].as_mut().filter(|r| r.id == id) {
                    req.prompt_lp_next = next;
                }
            }
            for &(req_slot, id, next) in plan.pool_undo.iter().rev() {
                if let Some(req) = self.reqs[req_slot as usize].as_mut().filter(|r| r.id == id) {
                    req.pool_next = next;
                }
            }
            for &b in &plan.registered {
                self.pool.forget(b);
            }
            for &(slot, gen) in &plan.planned {
                let seq = &mut self.seqs[slot as usize];
                if seq.gen == gen && seq.state == State::Running {
                    let kept = seq.tokens.len() - std::mem::take(&mut seq.drafts);
                    seq.tokens.truncate(kept);
                    let key = self.key(slot);
                    let pos = self.running.binary_search(&key).expect("running sequence is in the running list");
                    self.running.remove(pos);
                    self.free_blocks(slot);
                    self.enqueue_waiting(slot);
                }
            }
            plan.clear();
            self.spare = plan;
        }
    }

    /// Apply a sequence's samples from a step with drafts (one per row: after its last token,
    /// then after each draft): each sample is appended, while it equals the draft the next row
    /// followed; the sequence then has computed all but its last token, and gives back the
    /// blocks it grew for drafts beyond that.
    fn accept(&mut self, slot: u32, samples: &[u32], base_row: usize, out: &mut Vec<SeqUpdate>) {
        let seq = &mut self.seqs[slot as usize];
        let gen = seq.gen;
        let k = std::mem::take(&mut seq.drafts);
        debug_assert_eq!(samples.len(), k + 1);
        let drafts = seq.tokens.split_off(seq.tokens.len() - k);
        self.spec_drafts += 1;
        self.spec_draft_tokens += k as u64;
        let mut confirmed = 0;
        for (j, &token) in samples.iter().enumerate() {
            self.append(slot, token, base_row + j, out);
            let seq = &self.seqs[slot as usize];
            if seq.gen != gen || j == k || drafts[j] != token {
                break;
            }
            if self.spec_accepted_per_pos.len() <= j {
                self.spec_accepted_per_pos.resize(j + 1, 0); // (a prediction's drafts may be more)
            }
            self.spec_accepted_per_pos[j] += 1;
            confirmed += 1;
        }
        if self.seqs[slot as usize].gen != gen {
            return; // (finished: its blocks are gone)
        }
        let most = self.most_drafts(self.seqs[slot as usize].req);
        let seq = &mut self.seqs[slot as usize];
        seq.draft_limit = (confirmed + 1).min(most);
        seq.num_computed = seq.tokens.len() - 1;
        let keep = blocks_for(seq.num_computed, self.cfg.block_size);
        for b in seq.blocks.drain(keep..).rev() {
            self.pool.free(b);
        }
    }

    fn append(&mut self, slot: u32, token: u32, row: usize, out: &mut Vec<SeqUpdate>) {
        let seq = &mut self.seqs[slot as usize];
        if seq.pending.take().is_some() {
            *seq.tokens.last_mut().expect("a placeholder follows the prompt") = token;
        } else {
            seq.tokens.push(token);
        }
        let req = self.reqs[seq.req as usize].as_ref().expect("live request slot");
        let finish = stop_reason(&req.stop, seq.tokens.len(), seq.prompt_len, token, self.cfg.max_model_len);
        let first = seq.index == 0 && seq.tokens.len() == seq.prompt_len + 1;
        let cached_prompt_tokens = first.then(|| req.cached_prompt_tokens.unwrap_or(0));
        out.push(SeqUpdate {
            req_id: req.id,
            seq_index: seq.index,
            token,
            finish,
            sample_row: row,
            cached_prompt_tokens,
        });
        if finish.is_some() {
            self.retire(slot);
        }
    }

    /// Create the n - 1 children of a parent whose prompt just completed (`spawn`), but for
    /// those whose first token already ends them. With the prefix cache, children beyond the
    /// running places free wait with their first token (`places`).
    fn fork(&mut self, parent: u32, tokens: &[u32], base_row: usize, out: &mut Vec<SeqUpdate>) {
        let p = &mut self.seqs[parent as usize];
        p.fork_pending = false;
        let (req_slot, prompt_len, computed) = (p.req, p.prompt_len, p.num_computed);
        debug_assert_eq!(computed, prompt_len, "a fork happens when the prompt completes");
        let mut free = if self.cfg.enable_prefix_caching {
            // (a parent its own first token ends gives its place up: `append` retires it next)
            let stop = &self.req(req_slot).stop;
            let parent_ends =
                stop_reason(stop, prompt_len + 1, prompt_len, tokens[0], self.cfg.max_model_len).is_some();
            (self.cfg.max_num_seqs + usize::from(parent_ends)).saturating_sub(self.places_of(&self.running))
        } else {
            usize::MAX // (the parent held a place for each)
        };
        for (k, &token) in tokens.iter().enumerate().skip(1) {
            let req = self.req(req_slot);
            let finish = stop_reason(&req.stop, prompt_len + 1, prompt_len, token, self.cfg.max_model_len);
            out.push(SeqUpdate {
                req_id: req.id,
                seq_index: k as u32,
                token,
                finish,
                sample_row: base_row + k,
                cached_prompt_tokens: None,
            });
            if finish.is_some() {
                self.req_mut(req_slot).unfinished -= 1;
                continue;
            }
            let child = self.spawn(parent, k as u32, token, free > 0);
            if self.seqs[child as usize].state == State::Running {
                free -= 1;
            }
        }
    }

    /// A new sequence `index` of `parent`'s request: the parent's tokens and `token`. It
    /// shares the parent's full blocks and gets a private copy of its partial last one
    /// (copied by the runner before the next forward); without a running place (`placed`
    /// false), with no block free for the copy, or a parent that waits (a beam preempted while
    /// it awaited its pick), it waits to recompute (with prefix caching it finds the parent's
    /// full blocks).
    fn spawn(&mut self, parent: u32, index: u32, token: u32, placed: bool) -> u32 {
        let bs = self.cfg.block_size;
        let p = &self.seqs[parent as usize];
        let (req_slot, prompt_len, computed) = (p.req, p.prompt_len, p.num_computed);
        let running = p.state == State::Running;
        debug_assert!(
            !running || computed == p.tokens.len(),
            "a running sequence spawns once all its tokens are computed"
        );
        let (full, partial) = (computed / bs, computed % bs != 0);
        let mut child_tokens = Vec::with_capacity(p.tokens.len() + 1 + bs);
        child_tokens.extend_from_slice(&p.tokens);
        child_tokens.push(token);
        let child = self.alloc_seq(req_slot, index, child_tokens, prompt_len);
        let dst = if running && placed && partial { self.pool.allocate() } else { None };
        if !running || !placed || (partial && dst.is_none()) {
            self.enqueue_waiting(child);
            return child;
        }
        let (p, c) = two_mut(&mut self.seqs, parent as usize, child as usize);
        for &b in &p.blocks[..full] {
            self.pool.touch(b);
            c.blocks.push(b);
        }
        if let Some(dst) = dst {
            let src = p.blocks[full];
            self.pool.touch(src);
            self.pending_copies.push(PendingCopy { slot: child, src, dst });
            c.blocks.push(dst);
        }
        c.num_computed = computed;
        c.num_hashed = p.num_hashed;
        c.last_hash = p.last_hash;
        c.decoded_from = p.decoded_from;
        self.enqueue_running(child);
        child
    }

    /// Beam search (`SeqSampling::beam`): `commit` gives each beam's row and then runs the
    /// beam no further (it awaits its pick); once every beam of request `req_id` has given
    /// its row (over one step or several: a beam may wait for blocks or a place in a step),
    /// its sequences become the chosen continuations, `picks`: (parent index, token) each,
    /// every parent a sequence whose row was given. A parent's first pick continues in the
    /// parent itself (keeping its index), each further one forks from it (`spawn`) under a new
    /// index. Every other sequence of the request is released. Returns each pick's sequence
    /// index; with no pick the request ends.
    ///
    /// Panics if a pick names no live sequence of the request (a caller error).
    pub fn advance_beams(&mut self, req_id: u64, picks: &[(u32, u32)]) -> Vec<u32> {
        let Some(&req_slot) = self.req_index.get(&req_id) else {
            return Vec::new();
        };
        let mut continued: Vec<(u32, u32)> = Vec::with_capacity(picks.len());
        let mut indices = Vec::with_capacity(picks.len());
        for &(parent, token) in picks {
            let slot = self.find_seq(req_id, parent).expect("a pick names a live sequence");
            if continued.iter().any(|&(s, _)| s == slot) {
                let req = self.req_mut(req_slot);
                let index = req.next_index;
                req.next_index += 1;
                req.unfinished += 1;
                self.spawn(slot, index, token, true);
                indices.push(index);
            } else {
                continued.push((slot, token));
                indices.push(parent);
            }
        }
        for &(slot, token) in &continued {
            let seq = &mut self.seqs[slot as usize];
            seq.tokens.push(token);
            seq.awaits_pick = false;
        }
        let others: Vec<u32> =
            self.req(req_slot).seqs.iter().copied().filter(|s| !continued.iter().any(|&(c, _)| c == *s)).collect();
        for slot in others {
            // (spawned forks are in `seqs` too, and `continued` does not name them)
            if !indices.contains(&self.seqs[slot as usize].index) {
                self.retire(slot);
            }
        }
        indices
    }
}

/// Why a sequence of `len` tokens whose last is `token` stops, if it does. A stop token
/// wins over the length limit, and neither stop tokens nor eos count before min_tokens.
pub(crate) fn stop_reason(
    stop: &StopRules,
    len: usize,
    prompt_len: usize,
    token: u32,
    max_model_len: usize,
) -> Option<FinishReason> {
    let out_len = len - prompt_len;
    if out_len >= stop.min_tokens as usize
        && (stop.stop_token_ids.contains(&token) || (!stop.ignore_eos && stop.eos_token_ids.contains(&token)))
    {
        return Some(FinishReason::Stop);
    }
    if out_len >= stop.max_tokens as usize || len >= max_model_len {
        return Some(FinishReason::Length);
    }
    None
}

/// Pass every block that is now full of computed tokens, all before position `cacheable`, to
/// the prefix cache (not one that holds a placeholder: its hash is not known yet; it is
/// passed once the token is).
fn register_full_blocks(pool: &mut BlockPool, seq: &mut Seq, bs: usize, cacheable: usize, registered: &mut Vec<u32>) {
    let known = seq.tokens.len() - usize::from(seq.pending.is_some()) - seq.drafts;
    while seq.num_hashed < seq.num_computed.min(known).min(cacheable) / bs {
        let i = seq.num_hashed;
        let chunk = &seq.tokens[i * bs..(i + 1) * bs];
        let h = hash_block(seq.last_hash, chunk);
        if pool.register(seq.blocks[i], h, seq.last_hash, chunk) {
            registered.push(seq.blocks[i]);
        }
        seq.last_hash = h;
        seq.num_hashed += 1;
    }
}

/// A sampling row of sequence `seq` (as its fork `index`) after its first `upto` tokens.
fn push_row(plan: &mut Plan, req: &Req, seq: &Seq, upto: usize, index: u32, logits_index: i64) {
    let s = &req.sampling;
    let gen = upto - seq.prompt_len;
    plan.logits_indices.push(logits_index);
    plan.temperature.push(s.temperature);
    plan.top_p.push(s.top_p);
    plan.min_p.push(s.min_p);
    plan.presence_penalty.push(s.presence_penalty);
    plan.frequency_penalty.push(s.frequency_penalty);
    plan.repetition_penalty.push(s.repetition_penalty);
    plan.top_k.push(s.top_k);
    plan.seeds.push(mix_seed(s.seed, index));
    plan.gen_index.push(gen as i64);
    plan.num_logprobs.push(s.num_logprobs);
    if gen < req.stop.min_tokens as usize && !req.bans.is_empty() {
        for &(t, v) in &req.bias_unbanned {
            plan.bias_token_ids.push(i64::from(t));
            plan.bias_values.push(v);
        }
        for &t in &req.bans {
            plan.bias_token_ids.push(i64::from(t));
            plan.bias_values.push(f32::NEG_INFINITY);
        }
    } else {
        for &(t, v) in &s.logit_bias {
            plan.bias_token_ids.push(i64::from(t));
            plan.bias_values.push(v);
        }
    }
    // (a bias and a ban of the same token add up to -inf)
    let output = &seq.tokens[seq.prompt_len..upto];
    for word in &s.bad_words {
        if let Some((&last, head)) = word.split_last() {
            if output.ends_with(head) {
                plan.bias_token_ids.push(i64::from(last));
                plan.bias_values.push(f32::NEG_INFINITY);
            }
        }
    }
    plan.bias_offsets.push(plan.bias_token_ids.len() as i32);
    if req.penalized {
        plan.hist_tokens.extend(seq.tokens[..upto].iter().map(|&t| i64::from(t)));
        plan.hist_prompt_lens.push(seq.prompt_len as i32);
    } else {
        plan.hist_prompt_lens.push(0);
    }
    plan.hist_offsets.push(plan.hist_tokens.len() as i32);
    plan.row_req_ids.push(req.id);
    plan.row_seq_index.push(index);
}

fn two_mut<T>(v: &mut [T], a: usize, b: usize) -> (&mut T, &mut T) {
    assert_ne!(a, b);
    if a < b {
        let (x, y) = v.split_at_mut(b);
        (&mut x[a], &mut y[0])
    } else {
        let (x, y) = v.split_at_mut(a);
        (&mut y[0], &mut x[b])
    }
}
