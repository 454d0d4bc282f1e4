//! Scheduler: request and sequence state, the waiting queue, the running set, and the
//! verbs that are not a step: `add`, `abort`, `finish_seq`, `stats`. The step itself
//! (`schedule` / `commit`) lives in `step.rs`, the invariant check in `invariants.rs`.
//!
//! Invariants (checked by `validate`):
//! - a live sequence is either waiting (no blocks, nothing computed) or running (its blocks
//!   cover exactly its computed tokens, plus whatever this step will compute);
//! - every block's ref count equals the number of live sequences holding it plus pending
//!   fork copies reading it; finished and aborted sequences hold nothing;
//! - `running` is sorted by `Key` (policy order), so the preemption victim is its last
//!   element and the sequences served first are never preempted for later ones;
//! - a sequence's last token is a placeholder (`pending`) only while the plan whose row
//!   samples it awaits commit, and such a sequence is running;
//! - a sequence awaits a pick (`awaits_pick`) only in a beam search, and then, if running,
//!   has computed all its tokens.
//!
//! Costs: `add` O(log W) (W = waiting), `abort`/`finish_seq` O(B) (B = running, a Vec
//! removal), `stats` O(1). Sequences and requests live in slabs indexed by slot, so a step
//! touches no hash map except the prefix cache's.

use std::collections::{BTreeSet, HashMap, VecDeque};

use crate::block_pool::{root_hash, BlockPool};
use crate::types::{NewRequest, Policy, Pooling, SchedulerConfig, SeqSampling, Stats, StopRules};

/// Policy order of a sequence: lower runs first, higher is preempted first. Under Fcfs the
/// priority is always 0. `slot` makes keys unique.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Key {
    pub priority: i32,
    pub arrival: u64,
    pub index: u32,
    pub slot: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum State {
    Free,
    Waiting,
    Running,
}

/// One sequence of a request (n > 1 gives several after the fork).
#[derive(Debug)]
pub(crate) struct Seq {
    /// Bumped when the slot is released, so a Plan row never touches a reused slot.
    pub gen: u32,
    pub state: State,
    pub req: u32,
    pub index: u32,
    /// Prompt followed by outputs.
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    pub num_computed: usize,
    pub blocks: Vec<u32>,
    /// Leading blocks already passed to the prefix cache, and the hash of the last one
    /// (the request's root hash when none).
    pub num_hashed: usize,
    pub last_hash: u64,
    /// n > 1 and the prompt has not completed: the step that completes it samples n rows.
    pub fork_pending: bool,
    /// The first position whose K/V a decode step computed since the blocks were last
    /// freed (usize::MAX: none); without `cache_decoded_blocks`, blocks from there on are
    /// not passed to the prefix cache.
    pub decoded_from: usize,
    /// The last token is a placeholder for what row `r` of the plan awaiting commit samples
    /// (set by `schedule_ahead`, replaced by `commit`).
    pub pending: Option<u32>,
    /// A beam whose row `commit` gave and `advance_beams` has not answered: it runs nothing
    /// (while running it holds its blocks, all its tokens computed; preempted, it waits
    /// without being admitted) until the search has every beam's row.
    pub awaits_pick: bool,
    /// Drafts at the end of `tokens`, computed by the plan awaiting commit (speculation):
    /// `commit` keeps those its samples confirm.
    pub drafts: usize,
    /// Most drafts its next step may carry: one more than its last step with drafts
    /// confirmed, up to the speculation's `num_tokens` (where it starts).
    pub draft_limit: usize,
}

#[derive(Debug)]
pub(crate) struct Req {
    pub id: u64,
    pub n: u32,
    pub sampling: SeqSampling,
    pub penalized: bool,
    pub stop: StopRules,
    /// Tokens banned (bias -inf) while a sequence has fewer than min_tokens outputs.
    pub bans: Vec<u32>,
    /// logit_bias without the banned tokens, used while bans apply (one entry per token).
    pub bias_unbanned: Vec<(u32, f32)>,
    pub priority: i32,
    pub arrival: u64,
    pub root: u64,
    /// Slots of live sequences.
    pub seqs: Vec<u32>,
    /// Sequences not yet finished, counting unborn forks.
    pub unfinished: u32,
    /// The index the next sequence of a beam search's fork gets (`advance_beams`).
    pub next_index: u32,
    /// Alternatives wanted per prompt logprob; None when prompt logprobs are not asked.
    pub prompt_logprobs: Option<u32>,
    /// Prompt positions below this have had their logprob row planned.
    pub prompt_lp_next: usize,
    /// Which positions the request's embedding pools; None when it wants none.
    pub pooling: Option<Pooling>,
    /// Prompt positions below this have had their pooling entry planned.
    pub pool_next: usize,
    pub prompt_len: usize,
    /// Prompt tokens the prefix cache held when the prompt was first admitted (a prompt
    /// preempted and admitted again finds its own blocks: not counted).
    pub cached_prompt_tokens: Option<u32>,
    /// The LoRA adapter its tokens run through (0: none).
    pub lora: u32,
    /// Its decode steps may carry drafts (`NewRequest::speculate`, when the scheduler
    /// speculates or it has a prediction).
    pub speculate: bool,
    /// `NewRequest::prediction`.
    pub prediction: Vec<u32>,
}

impl Req {
    /// Prompt positions still owe a logprob row (so their K/V must be computed, not reused).
    pub fn owes_prompt_logprobs(&self) -> bool {
        self.prompt_logprobs.is_some() && self.prompt_lp_next + 1 < self.prompt_len
    }

    /// Prompt positions still owe a pooling entry that the prefix cache could have skipped
    /// (mean pooling reads every position's hidden state; last-token pooling only the last
    /// position's, which is always computed).
    pub fn owes_pooled_positions(&self) -> bool {
        self.pooling == Some(Pooling::Mean) && self.pool_next < self.prompt_len
    }
}

/// A fork's partial last block to copy before the next forward. The copy holds a reference
/// on `src` until the Plan carrying it is built.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PendingCopy {
    pub slot: u32,
    pub src: u32,
    pub dst: u32,
}

/// One sampling row of the last Plan. `fork_n` is n on the first row of a fork group (the
/// next n - 1 rows belong to it and carry 0), 1 on an ordinary row. `drafts` is k on the
/// first row of a sequence's k + 1 rows in a step with drafts (the next k rows carry
/// `fork_n` 0), else 0.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Row {
    pub slot: u32,
    pub gen: u32,
    pub fork_n: u32,
    pub drafts: u32,
}

impl Row {
    /// The rows this one heads: its fork's, its drafts' (and its own), or itself.
    pub(crate) fn group(&self) -> usize {
        if self.drafts > 0 {
            self.drafts as usize + 1
        } else {
            self.fork_n.max(1) as usize
        }
    }
}

/// A Plan handed out and not yet committed: its rows, which `commit` answers, and what
/// `discard_plan` must undo (the sequences it computes into, scheduled ones and fork copy
/// targets; the blocks it registered in the prefix cache; each request's prompt_lp_next
/// and pool_next before it, as (request slot, request id, value)).
#[derive(Debug, Default)]
pub(crate) struct Inflight {
    pub rows: Vec<Row>,
    pub planned: Vec<(u32, u32)>,
    pub registered: Vec<u32>,
    pub lp_undo: Vec<(u32, u64, usize)>,
    pub pool_undo: Vec<(u32, u64, usize)>,
}

impl Inflight {
    pub(crate) fn clear(&mut self) {
        self.rows.clear();
        self.planned.clear();
        self.registered.clear();
        self.lp_undo.clear();
        self.pool_undo.clear();
    }
}

pub struct Scheduler {
    pub(crate) cfg: SchedulerConfig,
    pub(crate) pool: BlockPool,
    pub(crate) seqs: Vec<Seq>,
    free_seqs: Vec<u32>,
    pub(crate) reqs: Vec<Option<Req>>,
    free_reqs: Vec<u32>,
    pub(crate) req_index: HashMap<u64, u32>,
    pub(crate) waiting: BTreeSet<Key>,
    pub(crate) running: Vec<Key>,
    next_arrival: u64,
    pub(crate) pending_copies: Vec<PendingCopy>,
    /// Plans awaiting commit, oldest first: one, or two after `schedule_ahead`.
    pub(crate) inflight: VecDeque<Inflight>,
    /// A committed plan's buffers, kept to avoid reallocating every step.
    pub(crate) spare: Inflight,
    // Per-step scratch, kept to avoid reallocating every step.
    pub(crate) scheduled: Vec<(u32, usize)>,
    pub(crate) hits: Vec<u32>,
    pub(crate) last_num_tokens: usize,
    pub(crate) prefix_hit_tokens: u64,
    pub(crate) prefix_query_tokens: u64,
    pub(crate) preemptions: u64,
    pub(crate) spec_drafts: u64,
    pub(crate) spec_draft_tokens: u64,
    pub(crate) spec_accepted_per_pos: Vec<u64>,
}

/// The token id a placeholder holds until `commit` replaces it (never a vocabulary id).
pub(crate) const PLACEHOLDER: u32 = u32::MAX;

/// The most drafts a sequence with a predicted output checks in one step.
pub(crate) const PREDICTION_DRAFTS: usize = 8;

pub(crate) fn blocks_for(tokens: usize, block_size: usize) -> usize {
    tokens.div_ceil(block_size)
}

impl Scheduler {
    pub fn new(config: SchedulerConfig) -> Self {
        assert!(config.max_num_seqs > 0, "max_num_seqs must be positive");
        assert!(config.max_num_batched_tokens > 0, "max_num_batched_tokens must be positive");
        assert!(config.max_model_len > 1, "max_model_len must leave room for one output");
        // NOTE: one sequence of max_model_len tokens must fit in the pool on its own,
        // otherwise it would preempt itself forever; this is what guarantees progress.
        assert!(
            (config.num_blocks.saturating_sub(1)) * config.block_size >= config.max_model_len,
            "{} usable blocks of {} tokens cannot hold one sequence of max_model_len {}",
            config.num_blocks.saturating_sub(1),
            config.block_size,
            config.max_model_len
        );
        Scheduler {
            pool: BlockPool::new(config.num_blocks, config.block_size),
            spec_accepted_per_pos: vec![0; config.speculation.as_ref().map_or(0, |s| s.num_tokens)],
            cfg: config,
            seqs: Vec::new(),
            free_seqs: Vec::new(),
            reqs: Vec::new(),
            free_reqs: Vec::new(),
            req_index: HashMap::new(),
            waiting: BTreeSet::new(),
            running: Vec::new(),
            next_arrival: 0,
            pending_copies: Vec::new(),
            inflight: VecDeque::new(),
            spare: Inflight::default(),
            scheduled: Vec::new(),
            hits: Vec::new(),
            last_num_tokens: 0,
            prefix_hit_tokens: 0,
            prefix_query_tokens: 0,
            preemptions: 0,
            spec_drafts: 0,
            spec_draft_tokens: 0,
        }
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    pub fn block_pool(&self) -> &BlockPool {
        &self.pool
    }

    /// Ok, or why a request of a `prompt_len`-token prompt, `max_tokens` and `n` sequences
    /// cannot be queued: an empty prompt, one that leaves no room under max_model_len (unless
    /// it asks for none: `max_tokens` 0, prompt scoring), or n == 0. The router rules these
    /// out; a caller checks every prompt of a request here before adding any of them.
    pub fn check(&self, prompt_len: usize, max_tokens: u32, n: u32) -> Result<(), String> {
        let max_model_len = self.cfg.max_model_len;
        if prompt_len == 0 {
            return Err("empty prompt".into());
        }
        if prompt_len > max_model_len || (prompt_len == max_model_len && max_tokens > 0) {
            return Err(format!("a prompt of {prompt_len} tokens leaves no room under max_model_len {max_model_len}"));
        }
        if n == 0 {
            return Err("n must be at least 1".into());
        }
        Ok(())
    }

    /// Queue a request. Its prefix-cache lookup happens when it is admitted (so waiting
    /// requests pin no blocks, and a preempted sequence finds its own cached blocks again).
    ///
    /// Panics on a usage error ([`Self::check`]), or an id that is already live.
    pub fn add(&mut self, req: NewRequest) {
        if let Err(why) = self.check(req.prompt.len(), req.stop.max_tokens, req.n) {
            panic!("request {}: {why}", req.id);
        }
        assert!(!self.req_index.contains_key(&req.id), "request id {} is already live", req.id);

        // (a set beside the list: a client's stop_token_ids may be long)
        let mut bans = Vec::new();
        let mut banned = std::collections::HashSet::new();
        if req.stop.min_tokens > 0 {
            let eos: &[u32] = if req.stop.ignore_eos { &[] } else { &req.stop.eos_token_ids };
            for &t in eos.iter().chain(&req.stop.stop_token_ids) {
                if banned.insert(t) {
                    bans.push(t);
                }
            }
        }
        let bias_unbanned = req.sampling.logit_bias.iter().copied().filter(|(t, _)| !banned.contains(t)).collect();
        let arrival = self.next_arrival;
        self.next_arrival += 1;
        let root = if self.cfg.enable_prefix_caching { root_hash(req.cache_salt.as_deref(), req.lora) } else { 0 };
        let speculate = req.speculate
            && !req.sampling.beam
            && self.cfg.draft_step_tokens > 0
            && (self.cfg.speculation.is_some() || !req.prediction.is_empty());
        let record = Req {
            id: req.id,
            n: req.n,
            penalized: req.sampling.is_penalized(),
            sampling: req.sampling,
            stop: req.stop,
            bans,
            bias_unbanned,
            priority: match self.cfg.policy {
                Policy::Fcfs => 0,
                Policy::Priority => req.priority,
            },
            arrival,
            root,
            seqs: Vec::with_capacity(req.n as usize),
            unfinished: req.n,
            next_index: req.n,
            prompt_logprobs: req.prompt_logprobs,
            prompt_lp_next: 0,
            pooling: req.pooling,
            pool_next: 0,
            prompt_len: req.prompt.len(),
            cached_prompt_tokens: None,
            lora: req.lora,
            speculate,
            prediction: req.prediction,
        };
        let req_slot = match self.free_reqs.pop() {
            Some(s) => {
                self.reqs[s as usize] = Some(record);
                s
            }
            None => {
                self.reqs.push(Some(record));
                (self.reqs.len() - 1) as u32
            }
        };
        self.req_index.insert(req.id, req_slot);
        let prompt_len = req.prompt.len();
        let slot = self.alloc_seq(req_slot, 0, req.prompt, prompt_len);
        self.seqs[slot as usize].fork_pending = req.n > 1;
        self.enqueue_waiting(slot);
    }

    /// Remove a whole request now, freeing every block it holds. False if it is not live.
    pub fn abort(&mut self, req_id: u64) -> bool {
        let Some(&req_slot) = self.req_index.get(&req_id) else {
            return false;
        };
        let slots = std::mem::take(&mut self.req_mut(req_slot).seqs);
        for slot in slots {
            self.drop_seq(slot);
        }
        self.remove_req(req_slot);
        true
    }

    /// Finish one sequence (the router matched a stop string). Unknown ids are ignored: the
    /// sequence may have finished in the same step.
    pub fn finish_seq(&mut self, req_id: u64, seq_index: u32) {
        let Some(&req_slot) = self.req_index.get(&req_id) else {
            return;
        };
        let found = self.req(req_slot).seqs.iter().copied().find(|&s| self.seqs[s as usize].index == seq_index);
        if let Some(slot) = found {
            self.retire(slot);
        }
    }

    pub fn stats(&self) -> Stats {
        // a request that has not forked yet counts each sequence it will run: those without a
        // place yet (`places`) as waiting
        let placed = self.places_of(&self.running);
        Stats {
            running: placed,
            waiting: self.width(&self.waiting) + self.width(&self.running) - placed,
            num_blocks: self.cfg.num_blocks,
            used_blocks: self.pool.num_used(),
            cached_blocks: self.pool.num_cached_free(),
            prefix_hit_tokens: self.prefix_hit_tokens,
            prefix_query_tokens: self.prefix_query_tokens,
            preemptions: self.preemptions,
            spec_drafts: self.spec_drafts,
            spec_draft_tokens: self.spec_draft_tokens,
            spec_accepted_tokens: self.spec_accepted_per_pos.iter().sum(),
            spec_accepted_per_pos: self.spec_accepted_per_pos.clone(),
        }
    }

    /// The LoRA adapters (non-zero ids, each once, ascending) of the running requests and of
    /// the waiting ones.
    pub fn adapters(&self) -> (Vec<u32>, Vec<u32>) {
        let of = |keys: &mut dyn Iterator<Item = &Key>| {
            let mut ids: Vec<u32> =
                keys.map(|k| self.req(self.seqs[k.slot as usize].req).lora).filter(|&l| l != 0).collect();
            ids.sort_unstable();
            ids.dedup();
            ids
        };
        (of(&mut self.running.iter()), of(&mut self.waiting.iter()))
    }

    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    /// Empty the prefix cache (vLLM's `/reset_prefix_cache`): every block forgets its hash, so
    /// no later prompt finds what came before. Blocks in use stay with their sequences (which
    /// do not register them again); free ones become plain memory. Returns how many blocks
    /// were cached. O(num_blocks).
    pub fn reset_prefix_cache(&mut self) -> usize {
        (1..self.pool.num_blocks() as u32)
            .filter(|&b| {
                let cached = self.pool.block_hash(b).is_some();
                self.pool.forget(b);
                cached
            })
            .count()
    }

    /// Live requests (not yet finished or aborted).
    pub fn num_requests(&self) -> usize {
        self.req_index.len()
    }

    /// The blocks a live sequence holds (empty while waiting); None if it is not live.
    pub fn seq_blocks(&self, req_id: u64, seq_index: u32) -> Option<&[u32]> {
        self.find_seq(req_id, seq_index).map(|s| self.seqs[s as usize].blocks.as_slice())
    }

    /// (tokens, num_computed) of a live sequence.
    pub fn seq_progress(&self, req_id: u64, seq_index: u32) -> Option<(usize, usize)> {
        self.find_seq(req_id, seq_index).map(|s| {
            let seq = &self.seqs[s as usize];
            (seq.tokens.len(), seq.num_computed)
        })
    }

    pub(crate) fn find_seq(&self, req_id: u64, seq_index: u32) -> Option<u32> {
        let &req_slot = self.req_index.get(&req_id)?;
        self.req(req_slot).seqs.iter().copied().find(|&s| self.seqs[s as usize].index == seq_index)
    }

    pub(crate) fn req(&self, req_slot: u32) -> &Req {
        self.reqs[req_slot as usize].as_ref().expect("live request slot")
    }

    pub(crate) fn req_mut(&mut self, req_slot: u32) -> &mut Req {
        self.reqs[req_slot as usize].as_mut().expect("live request slot")
    }

    pub(crate) fn key(&self, slot: u32) -> Key {
        let seq = &self.seqs[slot as usize];
        let req = self.req(seq.req);
        Key { priority: req.priority, arrival: req.arrival, index: seq.index, slot }
    }

    /// A fresh live sequence in state Free (the caller queues it).
    pub(crate) fn alloc_seq(&mut self, req_slot: u32, index: u32, tokens: Vec<u32>, prompt_len: usize) -> u32 {
        let root = self.req(req_slot).root;
        let slot = match self.free_seqs.pop() {
            Some(s) => s,
            None => {
                self.seqs.push(Seq {
                    gen: 0,
                    state: State::Free,
                    req: 0,
                    index: 0,
                    tokens: Vec::new(),
                    prompt_len: 0,
                    num_computed: 0,
                    blocks: Vec::new(),
                    num_hashed: 0,
                    last_hash: 0,
                    fork_pending: false,
                    decoded_from: usize::MAX,
                    pending: None,
                    awaits_pick: false,
                    drafts: 0,
                    draft_limit: 0,
                });
                (self.seqs.len() - 1) as u32
            }
        };
        let most_drafts = self.most_drafts(req_slot);
        let seq = &mut self.seqs[slot as usize];
        debug_assert!(seq.state == State::Free && seq.blocks.is_empty());
        seq.req = req_slot;
        seq.index = index;
        seq.tokens = tokens;
        seq.prompt_len = prompt_len;
        seq.num_computed = 0;
        seq.num_hashed = 0;
        seq.last_hash = root;
        seq.fork_pending = false;
        seq.decoded_from = usize::MAX;
        seq.pending = None;
        seq.awaits_pick = false;
        seq.drafts = 0;
        seq.draft_limit = most_drafts;
        self.req_mut(req_slot).seqs.push(slot);
        slot
    }

    pub(crate) fn enqueue_waiting(&mut self, slot: u32) {
        let key = self.key(slot);
        self.seqs[slot as usize].state = State::Waiting;
        self.waiting.insert(key);
    }

    pub(crate) fn enqueue_running(&mut self, slot: u32) {
        let key = self.key(slot);
        self.seqs[slot as usize].state = State::Running;
        let pos = self.running.binary_search(&key).unwrap_err();
        self.running.insert(pos, key);
    }

    fn dequeue(&mut self, slot: u32) {
        let key = self.key(slot);
        match self.seqs[slot as usize].state {
            State::Waiting => {
                self.waiting.remove(&key);
            }
            State::Running => {
                let pos = self.running.binary_search(&key).expect("running sequence is in the running list");
                self.running.remove(pos);
            }
            State::Free => unreachable!("dequeue of a free slot"),
        }
    }

    /// Free a sequence's blocks, tail first: freed cached blocks join the LRU tail in this
    /// order, so a sequence's last blocks are evicted before its (more shareable) first ones.
    pub(crate) fn free_blocks(&mut self, slot: u32) {
        let seq = &mut self.seqs[slot as usize];
        for &b in seq.blocks.iter().rev() {
            self.pool.free(b);
        }
        seq.blocks.clear();
        seq.num_computed = 0;
        seq.decoded_from = usize::MAX;
        seq.num_hashed = 0;
        seq.last_hash = self.reqs[seq.req as usize].as_ref().map_or(0, |r| r.root);
    }

    /// Dequeue, free and release a sequence; the caller fixes up its request.
    fn drop_seq(&mut self, slot: u32) {
        self.dequeue(slot);
        self.free_blocks(slot);
        let pool = &mut self.pool;
        self.pending_copies.retain(|c| {
            if c.slot == slot {
                pool.free(c.src);
            }
            c.slot != slot
        });
        let seq = &mut self.seqs[slot as usize];
        seq.state = State::Free;
        seq.gen = seq.gen.wrapping_add(1);
        seq.tokens = Vec::new();
        seq.pending = None;
        seq.drafts = 0;
        self.free_seqs.push(slot);
    }

    /// The most drafts a step of request `req_slot`'s sequences may carry: the speculation's
    /// `num_tokens`, or PREDICTION_DRAFTS where the request has a prediction if more.
    pub(crate) fn most_drafts(&self, req_slot: u32) -> usize {
        let ngram = self.cfg.speculation.as_ref().map_or(0, |s| s.num_tokens);
        let predicted = if self.req(req_slot).prediction.is_empty() { 0 } else { PREDICTION_DRAFTS };
        ngram.max(predicted)
    }

    /// The sequences these stand for, a request not yet forked counting each of its own.
    pub(crate) fn width<'a>(&self, keys: impl IntoIterator<Item = &'a Key>) -> usize {
        keys.into_iter().map(|k| self.group_size(k.slot) as usize).sum()
    }

    /// The places in the running set these hold (`places`).
    pub(crate) fn places_of<'a>(&self, keys: impl IntoIterator<Item = &'a Key>) -> usize {
        keys.into_iter().map(|k| self.places(k.slot) as usize).sum()
    }

    /// The running places `slot` holds of the `max_num_seqs`: one, but a request not yet
    /// forked holds one for each sequence it will run when nothing is cached. With the prefix
    /// cache its children take the places free at the fork and the others wait, to recompute
    /// only what the cache lacks of the prompt (its partial last block), as vLLM schedules
    /// each of n choices on its own; without it they would recompute the whole prompt.
    pub(crate) fn places(&self, slot: u32) -> u32 {
        if self.cfg.enable_prefix_caching {
            1
        } else {
            self.group_size(slot)
        }
    }

    /// The sequences `slot` stands for: itself, or a whole request not yet forked.
    pub(crate) fn group_size(&self, slot: u32) -> u32 {
        let seq = &self.seqs[slot as usize];
        if seq.fork_pending {
            self.req(seq.req).n
        } else {
            1
        }
    }

    /// A sequence finished: release it, and the request once none is left.
    pub(crate) fn retire(&mut self, slot: u32) {
        let req_slot = self.seqs[slot as usize].req;
        // A parent finished before its fork takes its unborn children with it.
        let group = self.group_size(slot);
        self.drop_seq(slot);
        let req = self.req_mut(req_slot);
        req.seqs.retain(|&s| s != slot);
        req.unfinished -= group;
        if req.unfinished == 0 {
            self.remove_req(req_slot);
        }
    }

    pub(crate) fn remove_req(&mut self, req_slot: u32) {
        let req = self.reqs[req_slot as usize].take().expect("live request slot");
        debug_assert!(req.seqs.is_empty());
        self.req_index.remove(&req.id);
        self.free_reqs.push(req_slot);
    }
}
