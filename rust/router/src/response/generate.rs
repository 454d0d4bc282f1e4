//! The answer of vLLM's tokens-in, tokens-out route (`/inference/v1/generate`,
//! [`crate::protocol::generate`]): each choice's sampled token ids, with their logprobs (named
//! `token_id:<id>`, as chat's `logprobs.content`) when asked, and no text.
//!
//! Not streamed: `{"request_id", "choices": [{"index", "logprobs", "finish_reason",
//! "stop_reason", "token_ids"}], "usage", "prompt_logprobs", "kv_transfer_params": null}`.
//! Streamed: one `{"request_id", "choices": [one choice with the new `token_ids`]}` chunk per
//! step that sampled tokens (with `usage` under `continuous_usage_stats`), the choice's last
//! chunk holding its `finish_reason`; `include_usage` adds a last chunk with `choices: []`;
//! `data: [DONE]` ends the stream. Each chunk's logprobs are those of its own ids.

use serde::Serialize;

use super::{ChatLogprob, ChatLogprobs, PromptEntry, StopReason, Usage};

#[derive(Serialize)]
pub(super) struct Choice<'a> {
    pub index: u32,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
    pub stop_reason: Option<StopReason<'a>>,
    pub token_ids: &'a [u32],
}

#[derive(Serialize)]
pub(super) struct Body<'a> {
    pub request_id: &'a str,
    pub choices: Vec<Choice<'a>>,
    pub usage: Usage,
    pub prompt_logprobs: Option<&'a [Option<PromptEntry>]>,
    /// (no KV transfer connector runs here)
    pub kv_transfer_params: Option<()>,
}

#[derive(Serialize)]
pub(super) struct Chunk<'a> {
    pub request_id: &'a str,
    pub choices: Vec<Choice<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// The logprobs a choice carries: None unless the request asked for them.
pub(super) fn logprobs(asked: bool, content: Vec<ChatLogprob>) -> Option<ChatLogprobs> {
    asked.then_some(ChatLogprobs { content, refusal: None })
}

/// One SSE frame.
pub(super) fn frame(out: &mut Vec<u8>, chunk: &Chunk) {
    super::sse_frame(out, None, &serde_json::to_vec(chunk).expect("chunks serialize"));
}
