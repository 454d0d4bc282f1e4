//! The context budget: a prompt must leave room for the completion, and what the request
//! asks for (`max_tokens`, `min_tokens`) must fit in `max_model_len` with every prompt.

use super::SamplingParams;
use crate::error::{ApiError, Overflow};

/// The context budget of one prompt: the prompt must leave room for at least one token (or
/// fill the context exactly when it asks for none, `max_tokens` 0), and
/// with an explicit `max_tokens` the two must fit together.
pub fn check_context(
    prompt_len: usize,
    max_tokens: Option<u32>,
    max_tokens_param: Option<&'static str>,
    max_model_len: u32,
    prompt_param: &str,
) -> Result<(), ApiError> {
    let limit = max_model_len as u64;
    let p = prompt_len as u64;
    // "the messages have", "the prompt has", "the prompt `prompt[1]` has".
    let (noun, verb) = match prompt_param {
        "messages" => ("messages".to_string(), "have"),
        "prompt" => ("prompt".to_string(), "has"),
        other => (format!("prompt `{other}`"), "has"),
    };
    // A prompt may fill the context only when it asks for no completion (`echo` with
    // `max_tokens` 0: prompt scoring).
    if p > limit || (p == limit && max_tokens != Some(0)) {
        // (a prompt that asks for no completion only has to fit)
        let room = if max_tokens == Some(0) {
            "which is more than the context holds"
        } else {
            "which leaves no room for the completion"
        };
        return Err(ApiError::ContextLengthExceeded {
            message: format!(
                "This model's maximum context length is {limit} tokens, but the {noun} {verb} {p} tokens, \
                 {room}. Please shorten the {noun}."
            ),
            param: Some(prompt_param.to_string()),
            sizes: Some(Overflow { prompt: p, max_tokens: max_tokens.map(u64::from), limit }),
        });
    }
    if let (Some(m), Some(param)) = (max_tokens, max_tokens_param) {
        let m = m as u64;
        if p + m > limit {
            return Err(ApiError::ContextLengthExceeded {
                message: format!(
                    "This model's maximum context length is {limit} tokens. However, you requested {} \
                     tokens ({p} in the {noun}, {m} in the completion via `{param}`). Please \
                     reduce the length of the {noun} or of the completion.",
                    p + m
                ),
                param: Some(param.to_string()),
                sizes: Some(Overflow { prompt: p, max_tokens: Some(m), limit }),
            });
        }
    }
    Ok(())
}

/// After `check_context`: the budget questions that involve the room every prompt leaves.
/// `min_tokens` must fit that room. A `max_tokens` from generation_config.json is the
/// server's choice, not the client's, so it shrinks to the room (at least 1 after
/// `check_context`); thus a `Some` in [`SamplingParams::max_tokens`] always fits every prompt.
pub fn settle_budget(
    params: &mut SamplingParams,
    max_tokens_param: Option<&'static str>,
    prompt_lens: impl Iterator<Item = usize>,
    max_model_len: u32,
) -> Result<(), ApiError> {
    // (the longest prompt leaves the least room)
    let longest = prompt_lens.max().unwrap_or(0);
    let room = (max_model_len as usize).saturating_sub(longest).min(u32::MAX as usize) as u32;
    if params.min_tokens > room {
        return Err(ApiError::ContextLengthExceeded {
            message: format!(
                "This model's maximum context length is {max_model_len} tokens; the prompt ({longest} tokens) \
                 leaves room for {room} tokens, fewer than `min_tokens` ({}).",
                params.min_tokens
            ),
            param: Some("min_tokens".into()),
            sizes: None,
        });
    }
    if max_tokens_param.is_none() {
        params.max_tokens = params.max_tokens.map(|m| m.min(room).max(1));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn context_messages_read_as_english() {
        let msg = |param| check_context(40, None, None, 32, param).unwrap_err().message().to_string();
        assert!(msg("messages").contains("but the messages have 40 tokens"), "{}", msg("messages"));
        assert!(msg("prompt").contains("but the prompt has 40 tokens"), "{}", msg("prompt"));
        assert!(msg("prompt[1]").contains("but the prompt `prompt[1]` has 40 tokens"), "{}", msg("prompt[1]"));
        let over = check_context(10, Some(30), Some("max_tokens"), 32, "messages").unwrap_err();
        assert!(over.message().contains("(10 in the messages, 30 in the completion"), "{}", over.message());
    }
}
