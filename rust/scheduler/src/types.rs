//! The scheduler's public value types: configuration, the request it is given, and what it
//! reports back (per-row updates and stats). Plain data, no behaviour beyond defaults.

/// Order in which waiting sequences are admitted and running ones are preempted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// Arrival order; preemption takes the latest arrival. Nothing starves.
    Fcfs,
    /// Lower `priority` value first (as vLLM), ties by arrival; preemption takes the
    /// lowest-priority (highest value), latest-arriving running sequence.
    Priority,
}

#[derive(Clone, Debug)]
pub struct SchedulerConfig {
    /// Total KV blocks including the null block 0, which is never allocated.
    pub num_blocks: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Most sequences in one step.
    pub max_num_seqs: usize,
    /// Most tokens (over all sequences) in one step; long prompts are chunked to fit.
    pub max_num_batched_tokens: usize,
    /// Longest a sequence (prompt + output) may grow; reaching it finishes with `Length`.
    pub max_model_len: usize,
    pub enable_prefix_caching: bool,
    /// Pass blocks holding tokens whose K/V a decode step computed (one generated token of
    /// a sequence per step) to the prefix cache too. Off where a decode step computes K/V
    /// with other numerics than a prompt step (CPU outside batch-invariant mode): a later
    /// prompt holding those tokens (the next turn of a chat) would then read other K/V than
    /// its own prefill computes, and its answer would depend on what ran before.
    pub cache_decoded_blocks: bool,
    /// Most LoRA adapters among the running sequences (vLLM's `--max-loras`); 0: no bound.
    /// The base model (adapter 0) does not count.
    pub max_loras: usize,
    pub policy: Policy,
    /// N-gram speculative decoding (prompt lookup); None: off.
    pub speculation: Option<Speculation>,
    /// Most tokens a step may hold with drafts (n-gram ones, or from a request's predicted
    /// output): one per running sequence comes first, drafts fill the rest in policy order
    /// (the engine sets the size its fast few-token path takes). 0: no drafts.
    pub draft_step_tokens: usize,
    /// Most of a prompt's tokens one step computes (vLLM's `--long-prefill-token-threshold`),
    /// so a long prompt's chunks leave room in the step for other sequences' prompts; 0: as
    /// many as the budget holds.
    pub long_prefill_token_threshold: usize,
}

/// N-gram speculative decoding (vLLM's `"method": "ngram"`): a decoding sequence whose last
/// tokens also occur earlier in its prompt or output proposes the tokens that followed them
/// there as drafts. (A request's predicted output, `NewRequest::prediction`, gives drafts the
/// same way.) The step computes its last token and the drafts together, one sampling row
/// each; `commit` keeps the samples while each equals the draft it followed (the first sample
/// always, then one more per confirmed draft). Each row samples as the sequence's next step
/// would (its own `gen_index`, history, bans), so the kept tokens are the ones decoding
/// without drafts samples, and a step can only add tokens.
#[derive(Clone, Debug, PartialEq)]
pub struct Speculation {
    /// Most drafts per sequence and step (>= 1).
    pub num_tokens: usize,
    /// The n-gram lengths looked up, longest first: `lookup_min..=lookup_max` (>= 1).
    pub lookup_min: usize,
    pub lookup_max: usize,
}

/// Per-sequence sampling parameters, copied into the Plan's sampling columns.
#[derive(Clone, Debug, PartialEq)]
pub struct SeqSampling {
    pub temperature: f32,
    pub top_p: f32,
    /// 0 = off.
    pub top_k: i32,
    pub min_p: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub repetition_penalty: f32,
    pub seed: Option<u64>,
    /// -1: no logprobs; else how many top alternatives.
    pub num_logprobs: i32,
    pub logit_bias: Vec<(u32, f32)>,
    /// Token sequences never generated (vLLM's `bad_words`, each non-empty): the last token of
    /// each is banned (bias -inf) wherever the output so far ends with the rest of it.
    pub bad_words: Vec<Vec<u32>>,
    /// Beam search: the caller chooses each step's tokens from the rows' logprobs, so
    /// `commit` appends nothing to these sequences and `advance_beams` continues them.
    pub beam: bool,
}

impl Default for SeqSampling {
    /// Neutral sampling: temperature 1, no truncation, no penalties, unseeded.
    fn default() -> Self {
        SeqSampling {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            seed: None,
            num_logprobs: -1,
            logit_bias: Vec::new(),
            bad_words: Vec::new(),
            beam: false,
        }
    }
}

impl SeqSampling {
    /// Whether a row's bans depend on the output's last tokens (a bad word longer than one
    /// token), so its next row cannot be planned before its token is known.
    pub fn reads_output(&self) -> bool {
        self.bad_words.iter().any(|w| w.len() > 1)
    }

    /// Whether the sampler needs this row's token history (hist_* columns).
    pub fn is_penalized(&self) -> bool {
        self.presence_penalty != 0.0 || self.frequency_penalty != 0.0 || self.repetition_penalty != 1.0
    }
}

/// When a sequence stops, applied in `commit`.
#[derive(Clone, Debug, PartialEq)]
pub struct StopRules {
    pub max_tokens: u32,
    /// Neither eos nor stop_token_ids end a sequence before this many outputs; the Plan
    /// bans them (bias -inf) until then.
    pub min_tokens: u32,
    pub stop_token_ids: Vec<u32>,
    pub eos_token_ids: Vec<u32>,
    pub ignore_eos: bool,
}

impl Default for StopRules {
    /// No limit but max_model_len, no stop tokens.
    fn default() -> Self {
        StopRules {
            max_tokens: u32::MAX,
            min_tokens: 0,
            stop_token_ids: Vec::new(),
            eos_token_ids: Vec::new(),
            ignore_eos: false,
        }
    }
}

#[derive(Clone, Debug)]
pub struct NewRequest {
    /// Caller-chosen, unique among live requests.
    pub id: u64,
    pub prompt: Vec<u32>,
    /// Sequences sampled from this prompt (the prompt runs once, then forks).
    pub n: u32,
    pub sampling: SeqSampling,
    pub stop: StopRules,
    pub priority: i32,
    /// Separates prefix-cache namespaces: blocks are shared only between equal salts.
    pub cache_salt: Option<String>,
    /// The LoRA adapter the request's tokens run through (0: none, the base model). The
    /// Plan lists it per scheduled sequence; blocks are shared only within one adapter.
    pub lora: u32,
    /// Its decode steps may carry drafts when the scheduler speculates or it has a
    /// `prediction` (false: they never do). Beam searches never speculate.
    pub speculate: bool,
    /// OpenAI's predicted output (`prediction`), tokenized: each sequence drafts the tokens
    /// that follow the place its output has reached in it (`speculate::from_prediction`).
    /// Empty: none.
    pub prediction: Vec<u32>,
    /// Some(k): the Plan asks for the logprob of every prompt token after the first given
    /// the ones before it, plus k alternatives (completions `echo` with `logprobs`). Such a
    /// prompt does not reuse prefix-cache blocks until each of those positions has run.
    pub prompt_logprobs: Option<u32>,
    /// Some: the Plan lists the prompt positions whose final hidden states make this
    /// request's embedding (`/v1/embeddings`), each once over the request's life.
    pub pooling: Option<Pooling>,
}

/// Which prompt positions an embedding pools.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pooling {
    /// The last prompt token (decoder embedding models: it alone has seen the whole text).
    /// Prefix-cache reuse is unaffected: the last token is always computed.
    Last,
    /// Every prompt token (their mean). Such a prompt does not reuse prefix-cache blocks
    /// until each position has been listed, as for prompt logprobs.
    Mean,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    Stop,
    Length,
}

/// One sampled token applied by `commit`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SeqUpdate {
    pub req_id: u64,
    pub seq_index: u32,
    pub token: u32,
    pub finish: Option<FinishReason>,
    /// The Plan row (index into the sampling columns / commit tokens) this came from.
    pub sample_row: usize,
    /// On the request's first token: how many of its prompt tokens the prefix cache held when
    /// the prompt was first scheduled (OpenAI's `usage.prompt_tokens_details.cached_tokens`).
    pub cached_prompt_tokens: Option<u32>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    pub running: usize,
    pub waiting: usize,
    /// As configured, including the null block.
    pub num_blocks: usize,
    /// Blocks with ref count > 0.
    pub used_blocks: usize,
    /// Free blocks that still hold a prefix hash (reusable until evicted).
    pub cached_blocks: usize,
    /// Prompt (or resumed) tokens whose KV was found in the prefix cache.
    pub prefix_hit_tokens: u64,
    /// Prompt (or resumed) tokens looked up in the prefix cache (the hit rate's denominator,
    /// as vLLM's `prefix_cache_queries`).
    pub prefix_query_tokens: u64,
    pub preemptions: u64,
    /// Speculation: sequence steps that carried drafts, the drafts, and those confirmed
    /// (vLLM's `spec_decode_num_drafts`, `_num_draft_tokens`, `_num_accepted_tokens`).
    pub spec_drafts: u64,
    pub spec_draft_tokens: u64,
    pub spec_accepted_tokens: u64,
    /// Confirmed drafts by position (index 0: the first draft), `num_tokens` long.
    pub spec_accepted_per_pos: Vec<u64>,
}
