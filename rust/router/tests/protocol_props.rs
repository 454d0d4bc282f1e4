//! Property tests: whatever bytes or JSON arrive, the router answers Ok or an ApiError with
//! a 4xx/5xx status; it never panics. Near-valid bodies (a valid request with one field
//! replaced by an arbitrary value) reach the deep validation paths.

mod protocol_fixture;

use llmserve_router::protocol::Endpoint;
use llmserve_router::router::Router;
use proptest::prelude::*;
use protocol_fixture::*;
use serde_json::{json, Map, Value};

const FIELDS: [&str; 59] = [
    "model",
    "messages",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "n",
    "seed",
    "stop",
    "stop_token_ids",
    "min_tokens",
    "ignore_eos",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "logit_bias",
    "response_format",
    "priority",
    "request_id",
    "cache_salt",
    "user",
    "store",
    "metadata",
    "service_tier",
    "stream",
    "stream_options",
    "logprobs",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "documents",
    "chat_template",
    "echo",
    "suffix",
    "best_of",
    "tokens",
    "add_special_tokens",
    "role",
    "content",
    // Anthropic's Messages API
    "system",
    "stop_sequences",
    "thinking",
    "output_config",
    "tool_use_id",
    "input",
    "input_schema",
    "type",
    "name",
    "id",
    "is_error",
];

const ENDPOINTS: [Endpoint; 9] = [
    Endpoint::Chat,
    Endpoint::Completion,
    Endpoint::Responses,
    Endpoint::Messages,
    Endpoint::MessagesCountTokens,
    Endpoint::Tokenize,
    Endpoint::Detokenize,
    Endpoint::ChatRender,
    Endpoint::CompletionRender,
];

/// The Messages API's block types (and one it does not know).
const BLOCKS: [&str; 6] = ["text", "tool_use", "tool_result", "thinking", "redacted_thinking", "image"];

fn key() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => proptest::sample::select(&FIELDS[..]).prop_map(str::to_string),
        1 => "[a-z_]{1,8}",
    ]
}

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        (-3i64..40).prop_map(|i| json!(i)),
        any::<i64>().prop_map(|i| json!(i)),
        any::<u64>().prop_map(|i| json!(i)),
        (-1e6f64..1e6).prop_map(|f| json!(f)),
        prop_oneof![
            Just("tiny".to_string()),
            Just("user".to_string()),
            Just("text".to_string()),
            Just("function".to_string()),
            Just("tool_use".to_string()),
            Just("tool_result".to_string()),
            Just("assistant".to_string()),
            Just("hello world".to_string()),
            "[ -~]{0,12}",
            "\\PC{0,6}",
        ]
        .prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
            prop::collection::vec((key(), inner), 0..6)
                .prop_map(|kv| Value::Object(kv.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

fn valid_chat() -> Value {
    json!({"model": "tiny", "messages": [{"role": "user", "content": "hello world"}]})
}

fn valid_completion() -> Value {
    json!({"model": "tiny", "prompt": "hello world"})
}

fn run_all(r: &Router, body: &[u8]) {
    for ep in ENDPOINTS {
        let status = match ep {
            Endpoint::Chat | Endpoint::Completion | Endpoint::Responses | Endpoint::Messages => {
                r.prepare(ep, body).err().map(|e| e.status())
            }
            _ => r.handle(ep, body).err().map(|e| e.status()),
        };
        if let Some(s) = status {
            assert!((400..600).contains(&s), "{ep:?}: status {s}");
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 192, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let r = router();
        run_all(&r, &bytes);
    }

    #[test]
    fn arbitrary_json_never_panics(v in json_value()) {
        let r = router();
        run_all(&r, &serde_json::to_vec(&v).unwrap());
    }

    #[test]
    fn near_valid_requests_never_panic(fields in prop::collection::vec((key(), json_value()), 1..4), chat in any::<bool>()) {
        let r = router();
        let mut body = if chat { valid_chat() } else { valid_completion() };
        for (k, v) in fields {
            body.as_object_mut().unwrap().insert(k, v);
        }
        run_all(&r, &serde_json::to_vec(&body).unwrap());
        let strict = router_with(json!({"strict_fields": true}), Some(TEMPLATE));
        run_all(&strict, &serde_json::to_vec(&body).unwrap());
    }

    #[test]
    fn near_valid_anthropic_blocks_never_panic(
        blocks in prop::collection::vec((proptest::sample::select(&BLOCKS[..]), json_value(), json_value()), 1..5),
        roles in prop::collection::vec(any::<bool>(), 1..4),
        tools in json_value(),
    ) {
        // Messages turns of text, tool_use, tool_result and thinking blocks whose fields are
        // arbitrary: the translation and chat's validation answer, whatever they hold
        let r = router_with(json!({"tool_call_format": "hermes"}), Some(TEMPLATE));
        let messages: Vec<Value> = roles
            .iter()
            .map(|&user| {
                let content: Vec<Value> = blocks
                    .iter()
                    .map(|(kind, a, b)| json!({"type": kind, "text": a, "thinking": a, "input": a, "id": "t",
                                               "name": "get_weather", "tool_use_id": "t", "content": b}))
                    .collect();
                json!({"role": if user { "user" } else { "assistant" }, "content": content})
            })
            .collect();
        let body = json!({"model": "tiny", "max_tokens": 2, "messages": messages, "tools": tools});
        run_all(&r, &serde_json::to_vec(&body).unwrap());
    }

    #[test]
    fn near_valid_messages_never_panic(msgs in prop::collection::vec(json_value(), 0..4), tools in json_value()) {
        let r = router();
        let body = json!({"model": "tiny", "messages": msgs, "tools": tools});
        run_all(&r, &serde_json::to_vec(&body).unwrap());
    }
}
