//! llmserve-scheduler: continuous batching over a paged KV cache.
//!
//! The engine speaks four verbs: `add` a request, `schedule` the next step (a [`Plan`] of
//! flat columns), `commit` the tokens the model sampled for it, `abort` a request (plus
//! `finish_seq` for a stop string the router matched, and `discard_plan` when a forward
//! failed). Every non-empty Plan is committed or discarded before the next `schedule`;
//! `schedule_ahead` makes one more while one awaits commit, and commits answer them in
//! order. There are no prefill or decode phases: each sequence's computed tokens catch up
//! with its tokens, which covers chunked prompts, prefix-cache hits and recompute after
//! preemption alike.
//!
//! Owns: request and sequence state, the waiting queue (fcfs or priority), the running set,
//! the [`BlockPool`] (ref-counted blocks, LRU free list, chained block hashes for prefix
//! reuse), the token budget, preemption by recompute, the fork of n > 1 sequences, and the
//! forks and releases of a beam search's sequences (`advance_beams`; the caller picks).
//! Knows nothing of PyO3, tensors or the model.
//!
//! Invariants (checked by [`Scheduler::validate`], exercised by property tests): free + used
//! blocks = all blocks but the null block; every ref count equals its holders; finished and
//! aborted requests hold no blocks; block tables reference only allocated blocks; no step
//! writes into a block another sequence shares.

pub mod block_pool;
mod invariants;
pub mod plan;
mod scheduler;
mod speculate;
mod step;
pub mod types;

pub use block_pool::{BlockPool, NULL_BLOCK};
pub use plan::Plan;
pub use scheduler::Scheduler;
pub use types::{
    FinishReason, NewRequest, Policy, Pooling, SchedulerConfig, SeqSampling, SeqUpdate, Speculation, Stats, StopRules,
};
