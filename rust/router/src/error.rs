//! The one error type of the OpenAI surface.
//!
//! Every error a client can see is an [`ApiError`]. It knows its HTTP status, the OpenAI
//! `type`, a stable machine-readable `code`, the `param` path it is about, its JSON body and
//! its mid-stream SSE frame. Nothing else in llmserve builds an error body.

use serde_json::json;
use std::fmt;

use crate::response::{sse_frame, SSE_DONE};

/// An error as the client sees it.
#[derive(Debug, Clone, PartialEq)]
pub enum ApiError {
    /// 400: malformed JSON, wrong type, missing field, out-of-range or conflicting values.
    InvalidRequest { message: String, param: Option<String>, code: &'static str },
    /// 400: prompt (plus requested tokens) does not fit the context window (`sizes`: the
    /// numbers, where a route that words it its own way needs them).
    ContextLengthExceeded { message: String, param: Option<String>, sizes: Option<Overflow> },
    /// 404: a `model` that is not served (`served`: the names that are, said in the message).
    ModelNotFound { model: String, served: Vec<String> },
    /// 404: a route or resource that does not exist.
    NotFound { message: String },
    /// 405: a route that exists, called with a method it does not serve.
    MethodNotAllowed { message: String },
    /// 401: missing or wrong API key.
    Unauthorized { message: String },
    /// 408: the client stopped sending its body for `seconds`.
    RequestTimeout { seconds: u32 },
    /// 413: request body over the size limit.
    PayloadTooLarge { limit: usize },
    /// 503: queue full, loading or draining (`retry_after` in seconds), or for good (a
    /// failed load: None, no `Retry-After`).
    Unavailable { message: String, retry_after: Option<u32> },
    /// 500: the engine failed. The message is meant for clients: no internal detail.
    Internal { message: String },
}

/// The numbers of a context overflow: the prompt's tokens, the completion's budget the
/// request asked for (None: no `max_tokens`), and the context.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Overflow {
    pub prompt: u64,
    pub max_tokens: Option<u64>,
    pub limit: u64,
}

/// Most characters of an error's `param`, and of its message: both can echo what the client
/// sent (a key of `logit_bias`, an unknown model's name), which can be megabytes long.
const MAX_PARAM_CHARS: usize = 256;
const MAX_MESSAGE_CHARS: usize = 2048;

/// `text` cut to `max` characters: its head, and for a message its tail too (where the
/// advice is), with a marker counting what was left out after them (so `max` plus the
/// marker's length in all).
fn bounded(text: String, max: usize, keep_tail: bool) -> String {
    let len = text.chars().count();
    if len <= max {
        return text;
    }
    let tail = if keep_tail { max / 4 } else { 0 };
    let head = max - tail;
    let head_end = text.char_indices().nth(head).map_or(text.len(), |(i, _)| i);
    let tail_start = text.char_indices().nth(len - tail).map_or(text.len(), |(i, _)| i);
    format!("{}... ({} characters left out) ...{}", &text[..head_end], len - head - tail, &text[tail_start..])
}

impl ApiError {
    /// 400 `invalid_value` for `param`.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self::with_code("invalid_value", Some(param.into()), message)
    }

    /// 400 with an explicit `code` (`missing_required_parameter`, `invalid_type`,
    /// `unsupported_parameter`, `invalid_json`, ...).
    pub fn with_code(code: &'static str, param: Option<String>, message: impl Into<String>) -> Self {
        let param = param.map(|p| bounded(p, MAX_PARAM_CHARS, false));
        Self::InvalidRequest { message: message.into(), param, code }
    }

    pub fn status(&self) -> u16 {
        match self {
            Self::InvalidRequest { .. } | Self::ContextLengthExceeded { .. } => 400,
            Self::Unauthorized { .. } => 401,
            Self::ModelNotFound { .. } | Self::NotFound { .. } => 404,
            Self::MethodNotAllowed { .. } => 405,
            Self::RequestTimeout { .. } => 408,
            Self::PayloadTooLarge { .. } => 413,
            Self::Internal { .. } => 500,
            Self::Unavailable { .. } => 503,
        }
    }

    /// The OpenAI error `type`.
    pub fn error_type(&self) -> &'static str {
        match self {
            Self::InvalidRequest { .. }
            | Self::ContextLengthExceeded { .. }
            | Self::PayloadTooLarge { .. }
            | Self::RequestTimeout { .. }
            | Self::MethodNotAllowed { .. } => "invalid_request_error",
            Self::Unauthorized { .. } => "authentication_error",
            Self::ModelNotFound { .. } | Self::NotFound { .. } => "not_found_error",
            Self::Internal { .. } => "server_error",
            Self::Unavailable { .. } => "service_unavailable_error",
        }
    }

    pub fn code(&self) -> &'static str {
        match self {
            Self::InvalidRequest { code, .. } => code,
            Self::ContextLengthExceeded { .. } => "context_length_exceeded",
            Self::ModelNotFound { .. } => "model_not_found",
            Self::NotFound { .. } => "not_found",
            Self::MethodNotAllowed { .. } => "method_not_allowed",
            Self::Unauthorized { .. } => "invalid_api_key",
            Self::PayloadTooLarge { .. } => "request_too_large",
            Self::RequestTimeout { .. } => "request_timeout",
            Self::Internal { .. } => "internal_error",
            Self::Unavailable { .. } => "service_unavailable",
        }
    }

    pub fn param(&self) -> Option<&str> {
        match self {
            Self::InvalidRequest { param, .. } | Self::ContextLengthExceeded { param, .. } => param.as_deref(),
            Self::ModelNotFound { .. } => Some("model"),
            _ => None,
        }
    }

    /// The message: past MAX_MESSAGE_CHARS characters, those many of its head and tail with
    /// a marker between them counting what was left out.
    pub fn message(&self) -> String {
        bounded(self.full_message(), MAX_MESSAGE_CHARS, true)
    }

    fn full_message(&self) -> String {
        match self {
            Self::InvalidRequest { message, .. }
            | Self::ContextLengthExceeded { message, .. }
            | Self::NotFound { message }
            | Self::MethodNotAllowed { message }
            | Self::Unauthorized { message }
            | Self::Unavailable { message, .. }
            | Self::Internal { message } => message.clone(),
            Self::ModelNotFound { model, served } => {
                // (names shortened and the list capped, so "does not exist" always shows)
                let short = |s: &str, most: usize| match s.char_indices().nth(most) {
                    Some((at, _)) => format!("{}...", &s[..at]),
                    None => s.to_string(),
                };
                let mut message = format!("The model `{}` does not exist.", short(model, 200));
                if !served.is_empty() {
                    let names: Vec<String> = served.iter().take(8).map(|n| format!("`{}`", short(n, 100))).collect();
                    let more = served.len().saturating_sub(8);
                    let more = if more > 0 { format!(" and {more} more") } else { String::new() };
                    message += &format!(" This server serves {}{more}.", names.join(", "));
                }
                message
            }
            Self::PayloadTooLarge { limit } => format!("Request body is larger than the limit of {limit} bytes."),
            Self::RequestTimeout { seconds } => {
                format!("The request body stopped arriving: nothing came for {seconds} s.")
            }
        }
    }

    /// Seconds for the `Retry-After` header, for 503s.
    pub fn retry_after(&self) -> Option<u32> {
        match self {
            Self::Unavailable { retry_after, .. } => *retry_after,
            _ => None,
        }
    }

    pub fn to_value(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.message(),
            "type": self.error_type(),
            "param": self.param(),
            "code": self.code(),
        }})
    }

    /// The response body: `{"error": {"message", "type", "param", "code"}}`.
    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(&self.to_value()).expect("error body serializes")
    }

    /// The error `type` on the Anthropic Messages routes: Anthropic's names where they differ
    /// from OpenAI's (`request_too_large`, `api_error`, `overloaded_error`).
    pub fn anthropic_type(&self) -> &'static str {
        match self {
            Self::PayloadTooLarge { .. } => "request_too_large",
            Self::Internal { .. } => "api_error",
            Self::Unavailable { .. } => "overloaded_error",
            _ => self.error_type(),
        }
    }

    /// The body on the Anthropic Messages routes: Anthropic's
    /// `{"type": "error", "error": {"type", "message"}}`, whose `error` also keeps this
    /// server's `param` and `code`.
    pub fn to_anthropic_json(&self) -> Vec<u8> {
        let mut body = json!({"type": "error", "error": {
            "type": self.anthropic_type(),
            "message": self.message(),
            "param": self.param(),
            "code": self.code(),
        }});
        // (Anthropic's `details` of a refused thread, which its SDK reads to send the turn
        // again without one)
        if self.code() == crate::protocol::messages::THREAD_UNSUPPORTED {
            body["error"]["details"] = json!({"error_code": self.code(), "unsupported": [self.param()]});
        }
        serde_json::to_vec(&body).expect("error body serializes")
    }

    /// The frame sent when an error happens after a Messages stream began: Anthropic's
    /// `error` event (its streams have no `[DONE]`).
    pub fn to_anthropic_sse(&self) -> Vec<u8> {
        let mut out = Vec::new();
        sse_frame(&mut out, Some("error"), &self.to_anthropic_json());
        out
    }

    /// A Responses stream's frame for an error after it began ([`responses_error_event`]).
    pub fn to_responses_sse(&self, sequence_number: u64) -> Vec<u8> {
        responses_error_event(self.to_value(), sequence_number)
    }

    /// The frame sent when an error happens after streaming began: the error, then `[DONE]`.
    pub fn to_sse(&self) -> Vec<u8> {
        let mut out = Vec::new();
        sse_frame(&mut out, None, &self.to_json());
        out.extend_from_slice(SSE_DONE);
        out
    }
}

/// A Responses stream's frame for an error after it began, from its body `{"error": {...}}`:
/// the contract's error frame and `[DONE]` (the openai SDK raises it as an APIError, as it
/// raises any frame holding `error`), named `event: error` and holding OpenAI's `error` event
/// fields beside `error` (`type: "error"`, `code`, `message`, `param`, and `sequence_number`,
/// the stream's next), so a reader of the typed events sees one.
pub fn responses_error_event(mut body: serde_json::Value, sequence_number: u64) -> Vec<u8> {
    let error = body["error"].clone();
    for key in ["code", "message", "param"] {
        body[key] = error[key].clone();
    }
    body["type"] = json!("error");
    body["sequence_number"] = json!(sequence_number);
    let mut out = Vec::new();
    sse_frame(&mut out, Some("error"), &serde_json::to_vec(&body).expect("errors serialize"));
    out.extend_from_slice(SSE_DONE);
    out
}

impl fmt::Display for ApiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({}): {}", self.status(), self.code(), self.message())
    }
}

impl std::error::Error for ApiError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_has_openai_shape() {
        let e = ApiError::invalid("messages[2].content", "bad");
        let v: serde_json::Value = serde_json::from_slice(&e.to_json()).unwrap();
        assert_eq!(v["error"]["param"], "messages[2].content");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["code"], "invalid_value");
        assert_eq!(e.status(), 400);
    }

    #[test]
    fn sse_frame_ends_with_done() {
        let e = ApiError::Internal { message: "engine failed".into() };
        let s = String::from_utf8(e.to_sse()).unwrap();
        assert!(s.starts_with("data: {\"error\""));
        assert!(s.ends_with("\n\ndata: [DONE]\n\n"));
    }

    #[test]
    fn anthropic_shapes() {
        let e = ApiError::Unavailable { message: "busy".into(), retry_after: Some(1) };
        let v: serde_json::Value = serde_json::from_slice(&e.to_anthropic_json()).unwrap();
        assert_eq!(v["type"], "error");
        assert_eq!(v["error"]["type"], "overloaded_error");
        assert_eq!(v["error"]["message"], "busy");
        assert_eq!(v["error"]["code"], "service_unavailable");
        let frame = String::from_utf8(ApiError::Internal { message: "x".into() }.to_anthropic_sse()).unwrap();
        assert!(frame.starts_with("event: error\ndata: {"), "{frame}");
        assert!(frame.ends_with("}\n\n") && frame.contains("\"api_error\""), "{frame}");
        assert_eq!(ApiError::invalid("max_tokens", "bad").anthropic_type(), "invalid_request_error");
        let frame = String::from_utf8(ApiError::Internal { message: "x".into() }.to_responses_sse(7)).unwrap();
        let (data, done) = frame.strip_prefix("event: error\ndata: ").unwrap().split_once("\n\n").unwrap();
        let data: serde_json::Value = serde_json::from_str(data).unwrap();
        let error = json!({"message": "x", "type": "server_error", "param": null, "code": "internal_error"});
        assert_eq!(
            data,
            json!({"error": error, "type": "error", "code": "internal_error", "message": "x",
                                "param": null, "sequence_number": 7})
        );
        assert_eq!(done, "data: [DONE]\n\n");
    }

    #[test]
    fn echoed_values_are_bounded() {
        let e = ApiError::ModelNotFound { model: "m".repeat(1_000_000), served: vec!["s".repeat(300); 12] };
        let msg = e.message();
        let name = format!("`{}...`", "s".repeat(100));
        let want = format!(
            "The model `{}...` does not exist. This server serves {} and 4 more.",
            "m".repeat(200),
            vec![name; 8].join(", ")
        );
        assert_eq!(msg, want);
        let e = ApiError::invalid(format!("logit_bias.{}", "東".repeat(10_000)), "bad");
        let param = e.param().unwrap();
        assert!(param.starts_with("logit_bias.東") && param.ends_with("東... (9755 characters left out) ..."));
        // short ones are untouched
        assert_eq!(ApiError::invalid("n", "`n` must be at least 1.").message(), "`n` must be at least 1.");
    }

    #[test]
    fn model_not_found_is_404_with_param() {
        let e = ApiError::ModelNotFound { model: "x:y".into(), served: vec!["a".into(), "b/c".into()] };
        assert_eq!((e.status(), e.code(), e.param()), (404, "model_not_found", Some("model")));
        assert_eq!(e.message(), "The model `x:y` does not exist. This server serves `a`, `b/c`.");
    }
}
