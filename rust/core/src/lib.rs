//! llmserve-core: `Core`, the scheduler plus every request's output state, driven by the
//! engine thread. No PyO3: the bindings crate wraps it as `llmserve._core.Core`.
//!
//! A request (one HTTP call) becomes one scheduler request per prompt, each with `n`
//! sequences (greedy `n > 1` runs one sequence and fans its output out to `n` choices).
//! `commit` feeds each sampled token to its sequence's detokenizer, ends sequences whose
//! stop string matched, and lets the request's `ResponseBuilder` produce wire bytes.
//! Constrained requests (a grammar on `Prepared`) hold one llguidance matcher per sequence:
//! `schedule` computes a packed token mask for each sampling row that has one (rows without
//! a grammar cost nothing), `commit` feeds each sampled token to its matcher and ends the
//! sequence with "stop" as soon as the grammar is complete.
//! Beam search requests (`use_beam_search`) hold one `BeamSearch` per prompt: `commit` hands
//! it each step's rows (their top logprobs), the scheduler forks and releases the beams it
//! picks (`advance_beams`), and once the search ends its best beams are delivered as the
//! choices, token by token through the same path as sampled tokens.
//! Invariant: a handle is in `requests` exactly while some of its sequences may still
//! produce output; when its last choice finishes (or it is aborted/failed) its state and all
//! its scheduler requests are gone.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use llmserve_router::detokenizer::{Detokenizer, StopConfig};
use llmserve_router::json_guard::JsonGuard;
use llmserve_router::protocol::embeddings::Pooling;
use llmserve_router::protocol::{Endpoint, Prepared};
use llmserve_router::reasoning::{ThinkingBudget, CLOSE};
use llmserve_router::repetition::{self, RepetitionWatch};
use llmserve_router::response::{ChoiceDelta, FinishReason, ResponseBuilder, StopReason, TokenOut, UnsentDelta};
use llmserve_router::router::Router;
use llmserve_router::structured::Matcher;
use llmserve_router::ApiError;
use llmserve_scheduler::{
    FinishReason as SeqFinish, NewRequest, Plan, Policy, Pooling as SeqPooling, Scheduler, SchedulerConfig,
    SeqSampling, Speculation, StopRules,
};
use serde::Deserialize;

use crate::beam::{BeamEnd, BeamSearch, Limits};

mod beam;

/// The constrained rows of a step and their packed masks (`bits` is rows.len() x width).
#[derive(Debug, Default)]
pub struct Masks {
    pub rows: Vec<i64>,
    pub bits: Vec<i32>,
    pub width: usize,
}

/// `SchedulerConfig` as Python sends it (JSON).
#[derive(Deserialize)]
struct CoreConfig {
    num_blocks: usize,
    block_size: usize,
    max_num_seqs: usize,
    max_num_batched_tokens: usize,
    max_model_len: usize,
    #[serde(default = "yes")]
    enable_prefix_caching: bool,
    #[serde(default = "yes")]
    cache_decoded_blocks: bool,
    #[serde(default = "priority")]
    policy: String,
    #[serde(default)]
    max_loras: usize,
    /// N-gram speculation (`Speculation`'s fields); absent: off.
    #[serde(default)]
    speculation: Option<SpecConfig>,
    /// `SchedulerConfig::draft_step_tokens`; absent: no drafts.
    #[serde(default)]
    draft_step_tokens: usize,
    /// `SchedulerConfig::long_prefill_token_threshold`; absent: no cap.
    #[serde(default)]
    long_prefill_token_threshold: usize,
    /// `--stream-interval`: the tokens a stream's chunk waits for (after its first); absent: 1.
    #[serde(default = "one")]
    stream_interval: usize,
}

/// `Speculation` as Python sends it.
#[derive(Deserialize)]
struct SpecConfig {
    num_tokens: usize,
    lookup_min: usize,
    lookup_max: usize,
}

fn yes() -> bool {
    true
}
fn one() -> usize {
    1
}
fn priority() -> String {
    "priority".into()
}

struct RequestState {
    builder: ResponseBuilder,
    /// Scheduler request id per prompt.
    sched_ids: Vec<u64>,
    /// Sequences the scheduler runs per prompt (1 when greedy output is fanned out).
    seqs_per_prompt: u32,
    /// Choices per prompt (`n`).
    n: u32,
    /// One detokenizer per (prompt, sequence), indexed prompt * seqs_per_prompt + seq.
    detoks: Vec<Detokenizer>,
    /// Tokens whose text each detokenizer still holds back, indexed as `detoks`.
    held: Vec<HeldTokens>,
    /// Output each sequence has not pushed to its choices yet, indexed as `detoks`.
    unsent: Vec<UnsentDelta>,
    /// Constrained requests: one matcher per sequence, indexed as `detoks`; else empty.
    matchers: Vec<Matcher>,
    /// JSON schema and forced-call requests: one JSON guard per sequence, indexed as `detoks` (keeps
    /// each object's keys distinct and each number's digits bounded; see `json_guard`); else empty.
    guards: Vec<JsonGuard>,
    /// Constrained requests: their grammar's cache key (evicted when a matcher fails).
    grammar_key: Option<String>,
    /// Constrained requests: the request field their grammar came from (a grammar that runs
    /// past the engine's limits while generating is a 400 there).
    grammar_param: Option<String>,
    /// `thinking_token_budget`: one budget per sequence, indexed as `detoks` (each closes its
    /// sequence's think block once spent, by forcing `</think>` through its row's mask); else
    /// empty.
    budgets: Vec<ThinkingBudget>,
    /// `repetition_detection`: one watch per sequence, indexed as `detoks` (each says when its
    /// sequence's output ends in a repetition); else empty.
    repeats: Vec<RepetitionWatch>,
    /// `allowed_token_ids`: the packed mask of the only tokens its rows may sample (as
    /// `masks` packs them); it is the same at every step.
    allowed: Option<Vec<i32>>,
    /// Alternatives this request wants per token (`top_logprobs`, completions' `logprobs`):
    /// the runner returns as many as the most any row of the step wants.
    num_top: usize,
    /// `stop_token_ids` that are not also an ending eos: a finish by one of these names it
    /// in `stop_reason` (vLLM's rule: eos checks first and gives none).
    stop_token_reasons: Vec<u32>,
    /// A token that ends a choice by id (eos, stop_token_ids) is listed in logprobs: under
    /// `include_stop_str_in_output` (which shows its text), and always on completions, as
    /// vLLM's and OpenAI's legacy completions list it (lm-eval's loglikelihood reads the
    /// sampled token as the last entry). Otherwise (chat, as OpenAI's) it is only counted.
    list_stop_token: bool,
    /// `return_token_ids` or `return_tokens_as_token_ids` (clients that read the sampled tokens
    /// from logprobs): logprobs list every sampled token, as `token_ids` does (the one that
    /// ended the choice and those a stop string trimmed included), one entry per id, as vLLM's.
    list_every_token: bool,
    started: bool,
    /// An Anthropic Messages request: its errors have Anthropic's shape.
    anthropic: bool,
    /// Whether a plan has held this request yet (for the queue-time metric).
    scheduled: bool,
    new_tokens: u32,
    /// `max_tokens: 0` (completions with `echo`, embeddings): the answer is the prompt
    /// alone; the token its prefill step samples is dropped.
    prompt_only: bool,
    /// An embeddings request: each input ends "stop" once its prompt has run (pooled).
    embedding: bool,
    /// Beam search (`use_beam_search`): each prompt's search; else empty.
    beams: Vec<BeamSearch>,
    /// Beam search: the tokens that end a beam (eos unless ignored, `stop_token_ids`).
    beam_ends: Vec<u32>,
}

impl RequestState {
    /// The choices sequence `seq` of prompt `prompt` answers: its own, or all `n` of the
    /// prompt when greedy output is computed once and fanned out.
    fn choices_of(&self, prompt: u32, seq: u32) -> std::ops::Range<u32> {
        if self.seqs_per_prompt == self.n {
            let c = prompt * self.n + seq;
            c..c + 1
        } else {
            prompt * self.n..(prompt + 1) * self.n
        }
    }

    /// The bytes that end this request with `err`: a JSON body, or an SSE error frame once
    /// its stream has begun; a background response's `response.failed` event.
    fn error_bytes(&mut self, err: &ApiError) -> Vec<u8> {
        if let Some(failed) = self.builder.failed(err) {
            return failed;
        }
        match (self.started, self.anthropic) {
            (true, false) => match self.builder.responses_sequence() {
                Some(sequence_number) => err.to_responses_sse(sequence_number),
                None => err.to_sse(),
            },
            (false, false) => err.to_json(),
            (true, true) => err.to_anthropic_sse(),
            (false, true) => err.to_anthropic_json(),
        }
    }

    /// The bytes that end this request with `err`: once its stream has begun, what it still
    /// held unsent first (the output before the failure reaches the client as it would have
    /// token by token); before that, the error alone (a 500: nothing has gone out).
    fn failure(&mut self, err: &ApiError) -> Vec<u8> {
        let mut bytes = Vec::new();
        if self.started && self.builder.streams() {
            self.send_due(1);
            bytes = self.builder.take();
        }
        bytes.extend(self.error_bytes(err));
        bytes
    }

    /// Pushes what sequence `d` (indexed as `detoks`) has not sent to the choices it answers.
    fn send(&mut self, d: usize) {
        let (prompt, seq) = (d as u32 / self.seqs_per_prompt, d as u32 % self.seqs_per_prompt);
        let choices = self.choices_of(prompt, seq);
        let delta = self.unsent[d].delta();
        for c in choices {
            self.builder.push(c, &delta);
        }
        self.unsent[d].clear();
    }

    /// Pushes each sequence's unsent output that is due: all of it when not streaming; when
    /// streaming, a sequence's first tokens, its finish, and at least `interval` tokens.
    fn send_due(&mut self, interval: usize) {
        let interval = if self.builder.streams() { interval } else { 1 };
        for d in 0..self.unsent.len() {
            if self.unsent[d].due(interval) {
                self.send(d);
            }
        }
    }
}

/// One sequence's tokens whose text its detokenizer still holds back (for a possible stop
/// string, or as half a character), each with the char offset where its text ends. A token's
/// logprobs go out with the last of its text, and a token whose text a stop string trimmed
/// away entirely never goes out: no stop text reaches the client through logprobs either.
/// `usage` still counts every generated token.
#[derive(Default)]
struct HeldTokens(Vec<(TokenOut, usize)>);

impl HeldTokens {
    /// Where a token's text ends while it has none yet (see `Detokenizer::awaits_text`).
    const NO_TEXT_YET: usize = usize::MAX;

    /// Queues `token`, whose text ends at char `end` (None: it has no text yet, and its text
    /// ends where the next token with text ends); returns the queued tokens whose text has all
    /// been sent (the first `sent` chars).
    fn push(&mut self, token: TokenOut, end: Option<usize>, sent: usize) -> Vec<TokenOut> {
        if let Some(end) = end {
            for waiting in self.0.iter_mut().rev().take_while(|(_, e)| *e == Self::NO_TEXT_YET) {
                waiting.1 = end;
            }
        }
        self.0.push((token, end.unwrap_or(Self::NO_TEXT_YET)));
        let ready = self.0.iter().take_while(|(_, end)| *end <= sent).count();
        self.0.drain(..ready).map(|(t, _)| t).collect()
    }

    /// The sequence ended: every queued token, or after a stop string only those whose text
    /// begins before `cut` (the length of the returned text).
    fn finish(&mut self, token: TokenOut, cut: Option<usize>) -> Vec<TokenOut> {
        let cut = cut.unwrap_or(usize::MAX);
        self.0.drain(..).map(|(t, _)| t).chain([token]).filter(|t| t.text_offset < cut).collect()
    }
}

/// One item of a step's output: (handle, bytes, finished, error, new completion tokens,
/// ends). `finished` is how the request ended (its first choice's finish reason, or
/// "error"); None while it runs. `ends`: once it has ended normally, each choice's finish
/// reason and completion tokens, in choice order (for the metrics, which count each choice
/// as vLLM counts each sequence), else empty.
pub type Output = (u64, Vec<u8>, Option<&'static str>, bool, u32, ChoiceEnds);

/// (finish reason, completion tokens) per choice.
pub type ChoiceEnds = Vec<(&'static str, u32)>;

/// The engine core: owned by the engine thread.
pub struct Core {
    router: Arc<Router>,
    scheduler: Scheduler,
    policy: Policy,
    requests: HashMap<u64, RequestState>,
    /// Scheduler request id -> (handle, prompt index).
    owners: HashMap<u64, (u64, u32)>,
    next_handle: u64,
    next_sched_id: u64,
    max_model_len: u32,
    /// The plans awaiting commit, oldest first (two after `schedule_ahead`).
    inflight: VecDeque<PlanState>,
    /// Handles of the requests the last plan held for the first time.
    first_scheduled: Vec<u64>,
    /// Tokens a mask covers (the tokenizer's vocabulary).
    mask_vocab: usize,
    /// The EOS id allowed when a matcher has failed, so its sequence ends.
    eos: Option<u32>,
    /// `--stream-interval` (at least 1).
    stream_interval: usize,
}

/// What `commit` (or `fail_plan`) needs of a plan awaiting commit.
#[derive(Default)]
struct PlanState {
    /// Scheduler request ids in the plan (to fail them if the step fails).
    reqs: Vec<u64>,
    /// Its prompt-logprob entries: (scheduler request id, prompt token).
    prompt_lp: Vec<(u64, u32)>,
    /// Its pooling entries: the scheduler request id of each (`Plan::pool_req_ids`).
    pool: Vec<u64>,
    /// Requests whose grammar could not compute a mask for it, with why: the step lets
    /// only EOS through on their rows, and commit fails them.
    mask_failures: Vec<(u64, String)>,
    /// Draft rows whose mask the grammar failed to compute, with why (`DraftChain::failed`):
    /// a request whose sample from such a row is kept fails.
    draft_failures: Vec<(usize, String)>,
    /// Some row has a grammar mask, or a thinking budget that may close its block within two
    /// steps: the next plan cannot be made before its tokens are known.
    masked: bool,
}

fn finish_reason(f: SeqFinish) -> FinishReason {
    match f {
        SeqFinish::Stop => FinishReason::Stop,
        SeqFinish::Length => FinishReason::Length,
    }
}

impl Core {
    /// A core serving `router`'s requests with the scheduler `config_json` describes
    /// (`CoreConfig`'s fields, as Python sends them). Err: the config is not one, or its KV
    /// blocks cannot hold one sequence of `max_model_len`.
    pub fn new(router: Arc<Router>, config_json: &str) -> Result<Self, String> {
        let c: CoreConfig = serde_json::from_str(config_json).map_err(|e| format!("core config: {e}"))?;
        let policy = match c.policy.as_str() {
            "fcfs" => Policy::Fcfs,
            "priority" => Policy::Priority,
            other => return Err(format!("unknown scheduling policy {other:?}")),
        };
        if c.block_size == 0 || c.num_blocks.saturating_sub(1) * c.block_size < c.max_model_len {
            return Err(format!(
                "{} KV blocks of {} tokens cannot hold one sequence of max_model_len {}",
                c.num_blocks.saturating_sub(1),
                c.block_size,
                c.max_model_len
            ));
        }
        let speculation = match c.speculation {
            Some(sc) if sc.num_tokens == 0 || sc.lookup_min == 0 || sc.lookup_min > sc.lookup_max => {
                return Err("speculation needs num_tokens >= 1 and 1 <= lookup_min <= lookup_max".into());
            }
            sc => sc.map(|sc| Speculation {
                num_tokens: sc.num_tokens,
                lookup_min: sc.lookup_min,
                lookup_max: sc.lookup_max,
            }),
        };
        let mask_vocab = router.grammars().vocab_size();
        let eos = router.config().eos_token_ids.first().copied();
        let scheduler = Scheduler::new(SchedulerConfig {
            num_blocks: c.num_blocks,
            block_size: c.block_size,
            max_num_seqs: c.max_num_seqs,
            max_num_batched_tokens: c.max_num_batched_tokens,
            max_model_len: c.max_model_len,
            enable_prefix_caching: c.enable_prefix_caching,
            cache_decoded_blocks: c.cache_decoded_blocks,
            max_loras: c.max_loras,
            policy,
            speculation,
            draft_step_tokens: c.draft_step_tokens,
            long_prefill_token_threshold: c.long_prefill_token_threshold,
        });
        Ok(Self {
            router,
            scheduler,
            policy,
            requests: HashMap::new(),
            owners: HashMap::new(),
            next_handle: 1,
            next_sched_id: 1,
            max_model_len: c.max_model_len as u32,
            inflight: VecDeque::new(),
            first_scheduled: Vec::new(),
            mask_vocab,
            eos,
            stream_interval: c.stream_interval.max(1),
        })
    }

    pub fn router(&self) -> &Arc<Router> {
        &self.router
    }

    pub fn scheduler(&self) -> &Scheduler {
        &self.scheduler
    }

    /// Empty the prefix cache; how many blocks it held (`Scheduler::reset_prefix_cache`).
    pub fn reset_prefix_cache(&mut self) -> usize {
        self.scheduler.reset_prefix_cache()
    }

    /// Requests with output still to come.
    pub fn num_requests(&self) -> usize {
        self.requests.len()
    }

    /// Handles of the requests the last plan held for the first time (each handle is listed
    /// by one plan in its life): the engine times how long each waited in the queue.
    pub fn first_scheduled(&self) -> &[u64] {
        &self.first_scheduled
    }

    /// The prompt-logprob and pooling entries of the oldest plan awaiting commit (what
    /// `commit` must be given for it).
    pub fn awaited_entries(&self) -> (usize, usize) {
        self.inflight.front().map_or((0, 0), |plan| (plan.prompt_lp.len(), plan.pool.len()))
    }

    /// Drop a request (client gone): its blocks are freed now. False for an unknown handle.
    pub fn abort(&mut self, handle: u64) -> bool {
        self.forget(handle).is_some()
    }

    /// Queue a prepared request; returns its handle.
    pub fn add(&mut self, prepared: Prepared) -> Result<u64, ApiError> {
        let p = &prepared.params;
        if self.policy == Policy::Fcfs && prepared.priority != 0 {
            return Err(ApiError::with_code(
                "unsupported_parameter",
                Some("priority".into()),
                "`priority` needs the server started with --scheduling-policy priority",
            ));
        }
        let seqs_per_prompt = p.seqs_per_prompt();
        // (a beam search forks as it goes)
        let sched_n = if p.beam_search.is_some_and(|_| p.max_tokens != Some(0)) { 1 } else { seqs_per_prompt };
        let max_tokens_of =
            |prompt: &[u32]| p.max_tokens.unwrap_or(self.max_model_len.saturating_sub(prompt.len() as u32));
        // The router rules out what the scheduler cannot take; should one pass it, this request
        // fails, not the engine loop (every prompt is checked before any is queued).
        for prompt in &prepared.prompts {
            if let Err(why) = self.scheduler.check(prompt.len(), max_tokens_of(prompt), sched_n) {
                return Err(ApiError::Internal { message: format!("The engine cannot queue this request: {why}.") });
            }
        }
        let handle = self.next_handle;
        self.next_handle += 1;
        let tokenizer = self.router.tokenizer().clone();
        let stop = StopConfig {
            stop: p.stop.clone(),
            include_stop_str_in_output: p.include_stop_str_in_output,
            skip_special_tokens: p.skip_special_tokens,
            min_tokens: p.min_tokens,
        };
        let mut sched_ids = Vec::with_capacity(prepared.prompts.len());
        let mut detoks = Vec::new();
        let mut held = Vec::new();
        let mut matchers = Vec::new();
        let mut guards = Vec::new();
        let mut budgets = Vec::new();
        let budget = prepared.reasoning.and_then(|r| r.budget.map(|b| (b, r.prompt_opened)));
        let close: Option<Arc<[u32]>> = budget.map(|_| tokenizer.encode(CLOSE, false).into());
        let mut beams = Vec::new();
        // (`max_tokens: 0` answers with the prompt alone: nothing to search)
        let beam_search = p.beam_search.filter(|_| p.max_tokens != Some(0));
        let eos = &self.router.config().eos_token_ids;
        let beam_ends: Vec<u32> = if p.ignore_eos { Vec::new() } else { eos.clone() };
        let beam_ends = beam_ends.into_iter().chain(p.stop_token_ids.iter().copied()).collect();
        for (i, prompt) in prepared.prompts.iter().enumerate() {
            let id = self.next_sched_id;
            self.next_sched_id += 1;
            let max_tokens = max_tokens_of(prompt);
            for _ in 0..seqs_per_prompt {
                detoks.push(Detokenizer::new(tokenizer.clone(), prompt, stop.clone()));
                held.push(HeldTokens::default());
                if let Some(g) = &prepared.grammar {
                    matchers.push(g.matcher());
                    guards.extend(g.json_guard());
                }
                if let (Some((b, opened)), Some(close)) = (budget, &close) {
                    budgets.push(ThinkingBudget::new(b, close.clone(), opened));
                }
            }
            let sampling = match beam_search {
                // (each beam's row returns its candidates; its sampled token is not used)
                Some(b) => {
                    let limits = Limits {
                        max_tokens: max_tokens as usize,
                        max_model_len: self.max_model_len as usize,
                        min_tokens: p.min_tokens as usize,
                    };
                    let search = BeamSearch::new(p.n as usize, prompt.len(), b.length_penalty, limits);
                    let wanted = search.candidates().max(p.logprobs.unwrap_or(0) as usize);
                    beams.push(search);
                    SeqSampling { temperature: 0.0, num_logprobs: wanted as i32, beam: true, ..SeqSampling::default() }
                }
                None => SeqSampling {
                    temperature: p.temperature,
                    top_p: p.top_p,
                    top_k: p.top_k,
                    min_p: p.min_p,
                    presence_penalty: p.presence_penalty,
                    frequency_penalty: p.frequency_penalty,
                    repetition_penalty: p.repetition_penalty,
                    seed: p.seed,
                    num_logprobs: p.logprobs.map_or(-1, |k| k as i32),
                    logit_bias: p.logit_bias.clone(),
                    bad_words: p.bad_words.clone(),
                    beam: false,
                },
            };
            self.scheduler.add(NewRequest {
                id,
                prompt: prompt.clone(),
                n: sched_n,
                sampling,
                stop: StopRules {
                    max_tokens,
                    min_tokens: p.min_tokens,
                    stop_token_ids: p.stop_token_ids.clone(),
                    eos_token_ids: self.router.config().eos_token_ids.clone(),
                    ignore_eos: p.ignore_eos,
                },
                priority: prepared.priority,
                cache_salt: prepared.cache_salt.clone(),
                lora: prepared.lora,
                prompt_logprobs: prepared.prompt_logprobs(),
                pooling: prepared.embedding.as_ref().map(|e| match e.pooling {
                    Pooling::Last => SeqPooling::Last,
                    Pooling::Mean => SeqPooling::Mean,
                }),
                // (a grammar's and a thinking budget's draft rows are masked by `DraftChain`)
                speculate: true,
                prediction: prepared.prediction.clone(),
            });
            self.owners.insert(id, (handle, i as u32));
            sched_ids.push(id);
        }
        let builder = ResponseBuilder::new(&prepared, tokenizer);
        let repeats =
            p.repetition.map_or_else(Vec::new, |rule| vec![RepetitionWatch::new(rule, p.min_tokens); detoks.len()]);
        self.requests.insert(
            handle,
            RequestState {
                builder,
                sched_ids,
                seqs_per_prompt,
                n: p.n,
                unsent: detoks.iter().map(|_| UnsentDelta::default()).collect(),
                detoks,
                held,
                matchers,
                guards,
                grammar_key: prepared.grammar.as_ref().map(|g| g.key().to_string()),
                grammar_param: prepared.grammar.as_ref().map(|g| g.param().to_string()),
                budgets,
                repeats,
                allowed: p.allowed_token_ids.as_ref().map(|ids| {
                    let mut bits = vec![0i32; self.mask_vocab.div_ceil(32)];
                    for &t in ids.iter().filter(|&&t| (t as usize) < self.mask_vocab) {
                        bits[t as usize / 32] |= 1 << (t % 32);
                    }
                    bits
                }),
                num_top: p.logprobs.unwrap_or(0) as usize,
                stop_token_reasons: {
                    let eos = &self.router.config().eos_token_ids;
                    p.stop_token_ids.iter().copied().filter(|t| p.ignore_eos || !eos.contains(t)).collect()
                },
                list_stop_token: p.include_stop_str_in_output || prepared.endpoint == Endpoint::Completion,
                list_every_token: prepared.return_token_ids || prepared.tokens_as_ids,
                started: false,
                anthropic: prepared.endpoint == Endpoint::Messages,
                scheduled: false,
                new_tokens: 0,
                prompt_only: p.max_tokens == Some(0),
                embedding: prepared.embedding.is_some(),
                beams,
                beam_ends,
            },
        );
        Ok(handle)
    }

    fn forget(&mut self, handle: u64) -> Option<RequestState> {
        let state = self.requests.remove(&handle)?;
        for id in &state.sched_ids {
            self.scheduler.abort(*id);
            self.owners.remove(id);
        }
        Some(state)
    }

    /// The next step's plan and its grammar masks, or None when nothing can run. Discards any
    /// plan still awaiting commit.
    pub fn schedule(&mut self) -> Option<(Plan, Masks)> {
        // (the scheduler discards any plan still awaiting commit)
        self.inflight.clear();
        let plan = self.scheduler.schedule();
        self.begin(plan)
    }

    /// The plan after the one awaiting commit, made before its tokens are known
    /// (`Scheduler::schedule_ahead`); None when it cannot be, which includes an awaiting
    /// plan with grammar rows (their next masks need the tokens).
    pub fn schedule_ahead(&mut self) -> Option<(Plan, Masks)> {
        if self.inflight.len() != 1 || self.inflight[0].masked {
            return None;
        }
        let plan = self.scheduler.schedule_ahead();
        self.begin(plan)
    }

    fn begin(&mut self, plan: Plan) -> Option<(Plan, Masks)> {
        if plan.is_empty() {
            return None;
        }
        self.first_scheduled.clear();
        for id in &plan.seq_req_ids {
            let Some(&(handle, _)) = self.owners.get(id) else { continue };
            if let Some(state) = self.requests.get_mut(&handle) {
                if !state.scheduled {
                    state.scheduled = true;
                    self.first_scheduled.push(handle);
                }
            }
        }
        let (masks, mask_failures, draft_failures, masked) = self.masks(&plan);
        self.inflight.push_back(PlanState {
            reqs: plan.seq_req_ids.clone(),
            prompt_lp: plan
                .prompt_lp_req_ids
                .iter()
                .zip(&plan.prompt_lp_targets)
                .map(|(&id, &t)| (id, t as u32))
                .collect(),
            pool: plan.pool_req_ids.clone(),
            mask_failures,
            draft_failures,
            masked,
        });
        Some((plan, masks))
    }

    /// The packed allowed-token masks of the plan's constrained rows (a grammar's,
    /// `allowed_token_ids`', a thinking budget's `</think>`): bit `t % 32` of word `t / 32` of a
    /// row is set when token `t` may be sampled. Also the requests whose matcher could not
    /// compute one, with why, and whether the next plan must wait for this one's tokens (a
    /// grammar's next mask needs them, as may a thinking budget's).
    #[allow(clippy::type_complexity)]
    fn masks(&mut self, plan: &Plan) -> (Masks, Vec<(u64, String)>, Vec<(usize, String)>, bool) {
        let width = self.mask_vocab.div_ceil(32);
        let mut masks = Masks { rows: Vec::new(), bits: Vec::new(), width };
        let mut failures = Vec::new();
        let mut masked = false;
        // The grammar rows of the sequence before: its draft rows follow it.
        let mut chain: Option<DraftChain> = None;
        let mut draft_failures = Vec::new();
        for (row, (&req_id, &seq)) in plan.row_req_ids.iter().zip(&plan.row_seq_index).enumerate() {
            let Some(&(handle, prompt_idx)) = self.owners.get(&req_id) else { continue };
            let Some(state) = self.requests.get_mut(&handle) else { continue };
            let d = (prompt_idx * state.seqs_per_prompt + seq) as usize;
            // A row after the sequence's first in the plan samples after a draft: its mask is
            // the grammar's (and the thinking budget's) once the drafts before it are taken.
            if let Some(c) = chain.as_mut().filter(|c| c.row_of == (req_id, seq)) {
                let draft = plan.input_ids[plan.logits_indices[row] as usize] as u32;
                if c.mask_after(draft, state, d, &self.router, &mut masks.bits, width) {
                    masks.rows.push(row as i64);
                }
                if let Some(why) = c.failed.take() {
                    draft_failures.push((row, why));
                }
                continue;
            }
            // (a sequence whose masks follow its tokens)
            chain = (!state.matchers.is_empty() || !state.budgets.is_empty()).then(|| DraftChain {
                row_of: (req_id, seq),
                last: None,
                copies: None,
                dead: false,
                failed: None,
            });
            let budget = state.budgets.get(d);
            masked |= budget.is_some_and(ThinkingBudget::may_force_soon);
            let forced = budget.and_then(ThinkingBudget::forced);
            let matcher = state.matchers.get_mut(d);
            let Some(matcher) = matcher else {
                if state.allowed.is_some() || forced.is_some() {
                    let start = masks.bits.len();
                    match &state.allowed {
                        Some(allowed) => masks.bits.extend_from_slice(allowed),
                        None => masks.bits.resize(start + width, -1),
                    }
                    if let Some(t) = forced {
                        force(&mut masks.bits[start..], t);
                    }
                    masks.rows.push(row as i64);
                    if let Some(c) = chain.as_mut() {
                        c.last = Some(start);
                    }
                }
                continue;
            };
            masked = true;
            let start = masks.bits.len();
            if let Some(c) = chain.as_mut() {
                c.last = Some(start);
            }
            masks.bits.resize(start + width, 0);
            let out = &mut masks.bits[start..];
            match matcher.compute_mask_or_eos() {
                Ok(vob) => {
                    for (dst, &src) in out.iter_mut().zip(vob.as_slice()) {
                        *dst = src as i32;
                    }
                    if let Some(guard) = state.guards.get(d) {
                        guard.restrict(out);
                    }
                    if let Some(t) = forced {
                        force(out, t);
                    }
                }
                // NOTE: a matcher that cannot compute a mask (a grammar the engine gives up on
                // mid-way, or whose text this vocabulary cannot spell) lets only EOS through, so its row
                // cannot run unconstrained, and commit fails the request: output that stops
                // short of the grammar must not read as a normal "stop".
                Err(e) => {
                    if let Some(eos) = self.eos {
                        out[eos as usize / 32] |= 1 << (eos % 32);
                    }
                    failures.push((handle, grammar_failure(&e)));
                    if let Some(key) = &state.grammar_key {
                        self.router.grammars().evict(key);
                    }
                }
            }
            masks.rows.push(row as i64);
        }
        (masks, failures, draft_failures, masked)
    }

    /// Hand a plan's prompt logprobs (`entries`, as `PlanState::prompt_lp`) to their
    /// requests' builders, in plan order (before the step's first sampled tokens, which the
    /// builder puts after them).
    fn push_prompt_logprobs(&mut self, entries: &[(u64, u32)], lp: &PromptLogprobs) {
        let mut start = 0;
        while start < entries.len() {
            let req_id = entries[start].0;
            let end = start + entries[start..].iter().take_while(|e| e.0 == req_id).count();
            if let Some(&(handle, prompt_idx)) = self.owners.get(&req_id) {
                if let Some(state) = self.requests.get_mut(&handle) {
                    let toks: Vec<TokenOut> = (start..end)
                        .map(|i| TokenOut {
                            id: entries[i].1,
                            logprob: lp.logprobs[i],
                            top: top_of(&lp.top_ids, &lp.top_lps, lp.k, i),
                            text_offset: 0,
                        })
                        .collect();
                    let ranks = lp.ranks.get(start..end).unwrap_or_default();
                    state.builder.push_prompt_logprobs(prompt_idx, &toks, ranks);
                }
            }
            start = end;
        }
    }

    /// Hand a plan's pooled hidden states (`rows`: one of `width` floats per entry of
    /// `entries`, as `PlanState::pool`) to their requests' builders.
    fn push_pooled(&mut self, entries: &[u64], rows: &[f32], width: usize) {
        for (req_id, row) in entries.iter().zip(rows.chunks_exact(width.max(1))) {
            let Some(&(handle, prompt_idx)) = self.owners.get(req_id) else { continue };
            if let Some(state) = self.requests.get_mut(&handle) {
                state.builder.add_pooled(prompt_idx, row);
            }
        }
    }

    /// Apply the oldest awaiting plan's samples: per row its token, the token's logprob and
    /// `k` top alternatives (`top_ids`/`top_lps` [rows, k], ids < 0 are padding); and its
    /// prompt logprobs and pooled hidden states (`[Q, width]`), when it listed any. Err
    /// (nothing is applied): inputs whose sizes do not match each other or the plan's
    /// entries.
    #[allow(clippy::too_many_arguments)]
    pub fn commit(
        &mut self,
        tokens: &[u32],
        logprobs: &[f32],
        top_ids: &[i64],
        top_lps: &[f32],
        k: usize,
        prompt: Option<&PromptLogprobs>,
        pooled: Option<(&[f32], usize)>,
    ) -> Result<Vec<Output>, String> {
        let rows = tokens.len();
        let awaited = self.scheduler.awaited_rows();
        if rows != awaited {
            return Err(format!("the plan awaiting commit has {awaited} rows; got {rows} tokens"));
        }
        if logprobs.len() != rows || top_ids.len() != rows * k || top_lps.len() != rows * k {
            return Err(format!(
                "{rows} tokens need as many logprobs and {rows} x {k} top ids and logprobs; got {}, {} and {}",
                logprobs.len(),
                top_ids.len(),
                top_lps.len()
            ));
        }
        let (listed_prompt, listed_pool) = self.awaited_entries();
        match pooled {
            Some((rows, width)) if rows.len() == listed_pool * width && (width > 0 || listed_pool == 0) => {}
            None if listed_pool == 0 => {}
            other => {
                return Err(format!(
                    "pooled: the plan listed {listed_pool} pooling entries; got {:?}",
                    other.map(|(rows, width)| (rows.len() / width.max(1), width))
                ))
            }
        }
        if let Some(p) = prompt {
            let n = p.logprobs.len();
            if n != listed_prompt
                || p.top_ids.len() != n * p.k
                || p.top_lps.len() != n * p.k
                || !(p.ranks.is_empty() || p.ranks.len() == n)
            {
                return Err(format!(
                    "prompt logprobs: the plan listed {listed_prompt} entries; got {n} logprobs, {} top ids and \
                     {} top logprobs ({} each), {} ranks",
                    p.top_ids.len(),
                    p.top_lps.len(),
                    p.k,
                    p.ranks.len()
                ));
            }
        }
        let plan = self.inflight.pop_front().unwrap_or_default();
        if let Some(p) = prompt {
            self.push_prompt_logprobs(&plan.prompt_lp, p);
        }
        if let Some((rows, width)) = pooled {
            self.push_pooled(&plan.pool, rows, width);
        }
        let updates = self.scheduler.commit(tokens);
        let mut touched: Vec<u64> = Vec::new();
        // (handle, prompt, scheduler request id, sequence, row) of each beam search row
        let mut beam_rows: Vec<(u64, u32, u64, u32, usize)> = Vec::new();
        let mut failed: Vec<(u64, String)> = plan.mask_failures;
        // Sequences this commit ended here: a sequence with drafts may have updates after the
        // token a stop string (or the like) ended it at, which are dropped.
        let mut ended: Vec<(u64, u32)> = Vec::new();
        for u in updates {
            let Some(&(handle, prompt_idx)) = self.owners.get(&u.req_id) else { continue };
            if failed.iter().any(|(h, _)| *h == handle) || ended.contains(&(u.req_id, u.seq_index)) {
                continue;
            }
            if let Some((_, why)) = plan.draft_failures.iter().find(|(row, _)| *row == u.sample_row) {
                failed.push((handle, why.clone()));
                continue;
            }
            let Some(state) = self.requests.get_mut(&handle) else { continue };
            if !touched.contains(&handle) {
                touched.push(handle);
            }
            if let Some(cached) = u.cached_prompt_tokens {
                state.builder.add_cached_prompt_tokens(cached);
            }
            if state.prompt_only {
                // The scheduler ended the sequence at its first token (max_tokens 0).
                let delta = ChoiceDelta {
                    text: "",
                    tokens: &[],
                    ids: &[],
                    finish: Some(if state.embedding { FinishReason::Stop } else { FinishReason::Length }),
                    stop_reason: None,
                };
                for c in state.choices_of(prompt_idx, u.seq_index) {
                    state.builder.push(c, &delta);
                }
                continue;
            }
            if !state.beams.is_empty() {
                beam_rows.push((handle, prompt_idx, u.req_id, u.seq_index, u.sample_row));
                continue;
            }
            // (`best_of` ranks the choices by every token they sampled)
            let row = u.sample_row;
            let logprob = logprobs.get(row).copied().unwrap_or(0.0);
            for c in state.choices_of(prompt_idx, u.seq_index) {
                state.builder.score(c, logprob);
            }
            let mut top = top_of(top_ids, top_lps, k, row);
            top.truncate(state.num_top);
            let finish = u.finish.map(finish_reason);
            match deliver(state, &self.router, prompt_idx, u.seq_index, u.token, logprob, top, finish) {
                Delivery::Going => {}
                Delivery::Ended => {
                    self.scheduler.finish_seq(u.req_id, u.seq_index);
                    ended.push((u.req_id, u.seq_index));
                }
                Delivery::Failed(message) => failed.push((handle, message)),
            }
        }
        self.step_beams(beam_rows, top_ids, top_lps, k, &mut failed);
        let mut out = Vec::with_capacity(touched.len() + failed.len());
        for (handle, message) in failed {
            touched.retain(|&h| h != handle);
            if let Some(mut state) = self.forget(handle) {
                let err = failure_error(message, state.grammar_param.as_deref());
                out.push((handle, state.failure(&err), Some("error"), true, 0, Vec::new()));
            }
        }
        for handle in touched {
            let state = self.requests.get_mut(&handle).expect("touched requests exist");
            state.send_due(self.stream_interval);
            let mut bytes = state.builder.take();
            let finished = state.builder.all_finished();
            if finished {
                bytes.extend_from_slice(&state.builder.finish());
            }
            state.started |= !bytes.is_empty();
            let new_tokens = std::mem::take(&mut state.new_tokens);
            let reason = finished.then(|| state.builder.finish_reason(0).map_or("stop", FinishReason::as_str));
            let ends = if finished { state.builder.choice_ends() } else { Vec::new() };
            if finished {
                self.forget(handle);
            }
            out.push((handle, bytes, reason, false, new_tokens, ends));
        }
        Ok(out)
    }

    /// One step of each beam search that had rows in the plan just committed (`rows` as
    /// `commit` collected them, grouped by request as the plan lists them): its beams go on
    /// in the scheduler, and once none lives its best beams become the choices, token by
    /// token as sampled ones would.
    fn step_beams(
        &mut self,
        rows: Vec<(u64, u32, u64, u32, usize)>,
        top_ids: &[i64],
        top_lps: &[f32],
        k: usize,
        failed: &mut Vec<(u64, String)>,
    ) {
        let mut start = 0;
        while start < rows.len() {
            let (handle, prompt_idx, req_id, ..) = rows[start];
            let end = start + rows[start..].iter().take_while(|r| r.2 == req_id).count();
            let group = &rows[start..end];
            start = end;
            let Some(state) = self.requests.get_mut(&handle) else { continue };
            let tops: Vec<(u32, Vec<(u32, f32)>)> =
                group.iter().map(|&(.., seq, row)| (seq, top_of(top_ids, top_lps, k, row))).collect();
            let search = &mut state.beams[prompt_idx as usize];
            let ends = &state.beam_ends;
            let Some(picks) = search.step(&tops, state.num_top, |t| ends.contains(&t)) else {
                continue; // (some beam has yet to run this step)
            };
            let indices = self.scheduler.advance_beams(req_id, &picks);
            search.renumber(&indices);
            if !search.is_done() {
                continue;
            }
            let results = search.results();
            for c in 0..state.n {
                let Some(beam) = results.get(c as usize) else {
                    // (a search that found fewer beams than asked: the rest end empty)
                    let delta = ChoiceDelta {
                        text: "",
                        tokens: &[],
                        ids: &[],
                        finish: Some(FinishReason::Length),
                        stop_reason: None,
                    };
                    state.builder.push(prompt_idx * state.n + c, &delta);
                    continue;
                };
                let last = beam.tokens.len() - 1;
                for (i, t) in beam.tokens.iter().enumerate() {
                    let finish = (i == last).then_some(match beam.end {
                        BeamEnd::Token => FinishReason::Stop,
                        BeamEnd::Length => FinishReason::Length,
                    });
                    match deliver(state, &self.router, prompt_idx, c, t.id, t.logprob, t.top.clone(), finish) {
                        Delivery::Going => {}
                        Delivery::Ended => break,
                        Delivery::Failed(message) => {
                            failed.push((handle, message));
                            break;
                        }
                    }
                }
            }
        }
    }

    /// Fail every request of the plans awaiting commit: the step that ran one raised.
    pub fn fail_plan(&mut self, message: &str) -> Vec<Output> {
        // Drop what the failed steps registered (their K/V was never written).
        self.scheduler.discard_plan();
        let plans = std::mem::take(&mut self.inflight);
        let err = ApiError::Internal { message: message.to_string() };
        let mut handles: Vec<u64> =
            plans.iter().flat_map(|p| &p.reqs).filter_map(|id| self.owners.get(id).map(|&(h, _)| h)).collect();
        handles.sort_unstable();
        handles.dedup();
        handles
            .into_iter()
            .filter_map(|h| self.forget(h).map(|mut s| (h, s.failure(&err), Some("error"), true, 0, Vec::new())))
            .collect()
    }
}

/// The rows one plan holds of a sequence whose masks follow its tokens (a grammar's, a
/// thinking budget's): the first samples after the tokens it has, each after it after one
/// more of the step's drafts. Each draft row's mask is computed on copies of the sequence's
/// matcher, JSON guard and budget that have taken the drafts before it; once a draft is one
/// the row before may not sample, no later row can be kept (its sample never equals that
/// draft), and they copy that row's mask. The sequence's own state is never touched:
/// `deliver` feeds it the tokens the step keeps.
struct DraftChain {
    /// (scheduler request id, sequence) of the rows.
    row_of: (u64, u32),
    /// Where the mask of the chain's last row starts in the plan's mask bits; None when that
    /// row may sample any token.
    last: Option<usize>,
    /// The copies, once a draft row needed them.
    copies: Option<(Option<Matcher>, Option<JsonGuard>, Option<ThinkingBudget>)>,
    /// A draft the row before may not sample (or that a copy could not take) came.
    dead: bool,
    /// Why the copies could not mask the last row (the grammar failed after its drafts): the
    /// request fails if that row's sample is kept, as it would have failed without drafts.
    failed: Option<String>,
}

impl DraftChain {
    /// Appends the mask of the row after `draft` (sequence `d` of `state`) to `bits`; false
    /// when that row may sample any token (nothing appended).
    fn mask_after(
        &mut self,
        draft: u32,
        state: &RequestState,
        d: usize,
        router: &Router,
        bits: &mut Vec<i32>,
        width: usize,
    ) -> bool {
        let start = bits.len();
        let allowed =
            |last: usize| (draft as usize) < width * 32 && bits[last + draft as usize / 32] & (1 << (draft % 32)) != 0;
        self.dead |= !self.last.is_none_or(allowed);
        if !self.dead {
            let (matcher, guard, budget) = self.copies.get_or_insert_with(|| {
                (state.matchers.get(d).cloned(), state.guards.get(d).cloned(), state.budgets.get(d).cloned())
            });
            let mut taken = true;
            if let Some(m) = matcher.as_mut() {
                taken = match m.try_consume_tokens(&[draft]) {
                    Ok(n) => n == 1,
                    Err(e) => {
                        self.failed = Some(grammar_failure(&e));
                        false
                    }
                };
            }
            if let Some(g) = guard.as_mut().filter(|_| taken) {
                g.push(draft);
            }
            if let Some(b) = budget.as_mut() {
                let bytes = if b.reads_text() { router.tokenizer().token_bytes(draft) } else { Vec::new() };
                b.push(draft, &bytes);
            }
            let forced = budget.as_ref().and_then(ThinkingBudget::forced);
            let base = match matcher.as_mut() {
                Some(m) if taken => match m.compute_mask_or_eos() {
                    Ok(vob) => Some(Some(vob)),
                    Err(e) => {
                        self.failed = Some(grammar_failure(&e));
                        None
                    }
                },
                Some(_) => None,
                None => Some(None),
            };
            if let Some(vob) = base {
                match (vob, &state.allowed) {
                    (Some(vob), _) => bits.extend(vob.as_slice().iter().map(|&w| w as i32)),
                    (None, Some(allowed)) => bits.extend_from_slice(allowed),
                    (None, None) if forced.is_some() => {}
                    (None, None) => {
                        self.last = None;
                        return false;
                    }
                }
                bits.resize(start + width, if matcher.is_some() || state.allowed.is_some() { 0 } else { -1 });
                if let Some(g) = guard.as_ref() {
                    g.restrict(&mut bits[start..]);
                }
                if let Some(t) = forced {
                    force(&mut bits[start..], t);
                }
                self.last = Some(start);
                return true;
            }
            self.dead = true;
        }
        // (no later row is kept: the last row's mask, or none, keeps their samples possible)
        match self.last {
            Some(last) => {
                bits.extend_from_within(last..last + width);
                self.last = Some(start);
                true
            }
            None => false,
        }
    }
}

/// A grammar's failure as a request's error says it: the first line of llguidance's message
/// (its parser state follows). One of the engine's limits begins with [`GRAMMAR_LIMITS`].
fn grammar_failure(e: &dyn std::fmt::Display) -> String {
    let why = e.to_string();
    let why = why.lines().next().unwrap_or_default();
    if llmserve_router::structured::beyond_limits(why) {
        format!(
            "{GRAMMAR_LIMITS} while generating ({why}): a simpler grammar (fewer nested bounded repeats such as \
             `(.{{1,999}}){{1,999}}`, fewer alternatives) stays within them."
        )
    } else {
        format!("Constrained decoding failed: {why}")
    }
}

/// How a grammar that ran past the grammar engine's limits while generating is said: the
/// request's grammar, which does so in every run of it, so a 400 at its field (a client
/// retries a 500).
const GRAMMAR_LIMITS: &str = "The grammar ran past the grammar engine's limits";

/// A request's failure as its error: one of the grammar engine's limits is a 400 at the
/// grammar's field, anything else the server's (500).
fn failure_error(message: String, grammar_param: Option<&str>) -> ApiError {
    match grammar_param {
        Some(param) if message.starts_with(GRAMMAR_LIMITS) => ApiError::invalid(param, message),
        _ => ApiError::Internal { message },
    }
}

/// What `deliver` made of a token.
enum Delivery {
    /// The choice goes on, or ended as the scheduler ended its sequence.
    Going,
    /// The router ended the choice (a stop string, a complete grammar, the one allowed tool
    /// call): its sequence must end too.
    Ended,
    /// The request fails with this message.
    Failed(String),
}

/// Hand a token that sequence `seq` of prompt `prompt_idx` produced (`finish`: how the
/// scheduler ended the sequence with it, if it did) to its detokenizer, matcher and the
/// choices it answers.
#[allow(clippy::too_many_arguments)]
fn deliver(
    state: &mut RequestState,
    router: &Router,
    prompt_idx: u32,
    seq: u32,
    id: u32,
    logprob: f32,
    top: Vec<(u32, f32)>,
    mut finish: Option<FinishReason>,
) -> Delivery {
    let d = (prompt_idx * state.seqs_per_prompt + seq) as usize;
    if let Some(budget) = state.budgets.get_mut(d) {
        let bytes = if budget.reads_text() { router.tokenizer().token_bytes(id) } else { Vec::new() };
        budget.push(id, &bytes);
    }
    // (an end the scheduler gave, by eos, a stop token or length, comes first, as in vLLM)
    let repeated = finish.is_none() && state.repeats.get_mut(d).is_some_and(|w| w.push(id));
    let detok = &mut state.detoks[d];
    let text_offset = detok.decoded_len();
    let token = TokenOut { id, logprob, top, text_offset };
    let mut ended = false;
    // The grammar is complete once its matcher stops: the sequence ends here. (The token that
    // reaches max_tokens is read too: output the grammar completes there is complete, as it
    // would be with more room, so it finishes "stop", as a stop string there does.)
    let grammar_done = match state.matchers.get_mut(d) {
        Some(m) if finish != Some(FinishReason::Stop) => match m.consume_token(id) {
            Ok(_) => {
                if let Some(guard) = state.guards.get_mut(d) {
                    guard.push(id);
                }
                m.is_stopped()
            }
            // The mask allowed the token, so this is our fault, not the client's: the request
            // fails rather than ending "stop" on output the grammar does not accept.
            Err(e) => {
                // llguidance appends its parser state after the first line.
                let why = e.to_string();
                let why = why.lines().next().unwrap_or_default();
                if let Some(key) = &state.grammar_key {
                    router.grammars().evict(key);
                }
                if llmserve_router::structured::beyond_limits(why) {
                    return Delivery::Failed(grammar_failure(&why));
                }
                return Delivery::Failed(format!("Constrained decoding failed at token {id}: {why}"));
            }
        },
        _ => false,
    };
    // NOTE: a token that ends the sequence by id (eos, stop_token_ids) is counted but not
    // shown unless `include_stop_str_in_output`, as in vLLM (a special eos shows nothing under
    // skip_special_tokens); text held back for stop strings is released.
    let by_token = finish == Some(FinishReason::Stop);
    let mut text;
    let mut stop_reason = None;
    let mut stop_text = None;
    if by_token && state.stop_token_reasons.contains(&id) {
        stop_reason = Some(StopReason::Token(id));
    }
    if by_token {
        text = detok.finish_on_token(id);
    } else {
        let step = detok.push(id);
        text = step.text;
        if let Some(s) = step.stop {
            ended = finish.is_none();
            finish = Some(FinishReason::Stop);
            stop_text = Some(s);
        } else {
            if grammar_done {
                ended = finish.is_none();
                finish = Some(FinishReason::Stop);
            } else if repeated {
                ended = true;
                finish = Some(FinishReason::Repetition);
                stop_reason = Some(StopReason::Text(repetition::STOP_REASON));
            }
            if finish.is_some() {
                // Text held back as half a character was not searched for stop strings: one
                // found there now ends the sequence, as if it had been seen in time.
                let rest = detok.flush();
                text.push_str(&rest.text);
                if let Some(s) = rest.stop {
                    finish = Some(FinishReason::Stop);
                    stop_reason = None;
                    stop_text = Some(s);
                }
            }
        }
    }
    let tokens_out = if finish.is_some() {
        let every = state.list_every_token;
        let cut = stop_text.as_ref().filter(|_| !every).map(|_| detok.emitted_len());
        let mut out = state.held[d].finish(token, cut);
        // As for stop strings: on chat, a stopping token whose text is left out is counted in
        // usage but not listed, so the listed tokens spell the content (unless the request
        // reads the sampled tokens: `list_every_token`).
        if by_token && !state.list_stop_token && !every {
            out.pop();
        }
        out
    } else {
        let end = (!detok.awaits_text()).then(|| detok.decoded_len());
        state.held[d].push(token, end, detok.emitted_len())
    };
    let stop_reason = stop_reason.or(stop_text.as_deref().map(StopReason::Text));
    let choices = state.choices_of(prompt_idx, seq);
    let first_choice = choices.start;
    // NOTE: greedy n > 1 computes one sequence for n choices: each choice's token counts, as
    // in usage (and as vLLM, which runs n sequences, counts them).
    state.new_tokens += choices.len() as u32;
    // (the step's other tokens join it; `commit` pushes them to the choices)
    state.unsent[d].add(&text, tokens_out, std::slice::from_ref(&id), finish, stop_reason);
    // The builder may end the choice itself (its one allowed tool call complete): it reads
    // each token as it comes.
    if state.builder.pushes_each_token(first_choice) {
        state.send(d);
        if finish.is_none() && state.builder.choice_finished(first_choice) {
            ended = true;
        }
    }
    if ended {
        Delivery::Ended
    } else {
        Delivery::Going
    }
}

/// Narrows a packed mask row to token `t` alone, when it allows `t`; else leaves it as it is
/// (a grammar or `allowed_token_ids` that keeps `t` out wins over a thinking budget).
fn force(row: &mut [i32], t: u32) {
    let (word, bit) = (t as usize / 32, 1i32 << (t % 32));
    if row.get(word).is_some_and(|w| w & bit != 0) {
        row.fill(0);
        row[word] = bit;
    }
}

/// Row `row` of a `[_, k]` top-k pair of arrays, without the padding (negative ids).
fn top_of(top_ids: &[i64], top_lps: &[f32], k: usize, row: usize) -> Vec<(u32, f32)> {
    (0..k)
        .map(|j| (top_ids[row * k + j], top_lps[row * k + j]))
        .filter(|(id, _)| *id >= 0)
        .map(|(id, lp)| (id as u32, lp))
        .collect()
}

/// One step's prompt logprobs, one entry per Plan prompt-logprob entry (`[P]`, `[P, k]`).
pub struct PromptLogprobs {
    pub logprobs: Vec<f32>,
    pub top_ids: Vec<i64>,
    pub top_lps: Vec<f32>,
    pub k: usize,
    /// Each entry's rank (empty when the runner gave none).
    pub ranks: Vec<u32>,
}
