//! Shared fixture of the protocol tests: a tiny word-level tokenizer (20 ids, `<s>`/`</s>`
//! special, BOS added by its post-processor), a tiny chat template, and a router serving
//! "tiny" (alias "tiny-alias") with a 32-token context.
#![allow(dead_code)]

use llmserve_router::error::ApiError;
use llmserve_router::protocol::{Endpoint, Prepared};
use llmserve_router::router::{Router, RouterConfig};
use llmserve_router::template::{TemplateSet, TemplateSources};
use llmserve_router::tokenizer::Tokenizer;
use serde_json::{json, Value};

pub const WORDS: [&str; 20] = [
    "<s>",
    "</s>",
    "<unk>",
    "user",
    "assistant",
    "system",
    "tool",
    "developer",
    ":",
    "hello",
    "world",
    "tools",
    "think",
    "a",
    "b",
    "c",
    "get_weather",
    "x",
    "y",
    "z",
];

pub const VOCAB: usize = WORDS.len();
pub const MAX_LEN: u32 = 32;

/// Renders roles and string contents with spaces between words, tools (names) when given,
/// and reads the `enable_thinking` kwarg.
pub const TEMPLATE: &str = "{{ bos_token }}{% if tools %}tools : {% for t in tools %}{{ t.function.name }} {% endfor %}</s> {% endif %}{% for m in messages %}{{ m.role }} : {% if m.content is string %}{{ m.content }}{% endif %} </s> {% endfor %}{% if add_generation_prompt %}assistant :{% if enable_thinking %} think{% endif %}{% endif %}";

/// TEMPLATE's shape with Qwen3's think block: opened after the generation prompt, or closed
/// empty with `enable_thinking: false`.
pub const THINK_TEMPLATE: &str = "{% for m in messages %}{{ m.role }} : {{ m.content }} </s> {% endfor %}{% if add_generation_prompt %}assistant :{% if enable_thinking is not defined or enable_thinking %}<think>\n{% else %}<think>\n\n</think>\n\n{% endif %}{% endif %}";

pub fn tokenizer_json() -> String {
    let vocab: serde_json::Map<String, Value> =
        WORDS.iter().enumerate().map(|(i, w)| (w.to_string(), json!(i))).collect();
    let added: Vec<Value> = (0..3)
        .map(|i| {
            json!({"id": i, "content": WORDS[i], "single_word": false, "lstrip": false, "rstrip": false,
                   "normalized": false, "special": true})
        })
        .collect();
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [0], "tokens": ["<s>"]}}
        },
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
    })
    .to_string()
}

pub fn tokenizer() -> Tokenizer {
    Tokenizer::from_json_str(&tokenizer_json()).expect("fixture tokenizer loads")
}

pub fn config(extra: Value) -> RouterConfig {
    let mut base = json!({
        "served_model_names": ["tiny", "tiny-alias"],
        "max_model_len": MAX_LEN,
        "special_tokens": {"bos_token": "<s>", "eos_token": "</s>"},
        "eos_token_ids": [1],
    });
    merge(&mut base, extra);
    serde_json::from_value(base).expect("fixture config")
}

pub fn templates(template: Option<&str>) -> TemplateSet {
    TemplateSet::resolve(TemplateSources { cli: template.map(str::to_string), ..Default::default() })
        .expect("fixture template resolves")
}

pub fn router_with(extra_config: Value, template: Option<&str>) -> Router {
    Router::new(tokenizer(), templates(template), config(extra_config))
}

pub fn router() -> Router {
    router_with(json!({}), Some(TEMPLATE))
}

/// Shallow merge of `extra`'s keys into `base`; a null value removes the key.
pub fn merge(base: &mut Value, extra: Value) {
    let (Value::Object(b), Value::Object(e)) = (base, extra) else { panic!("objects only") };
    for (k, v) in e {
        if v.is_null() {
            b.remove(&k);
        } else {
            b.insert(k, v);
        }
    }
}

pub fn chat_body(extra: Value) -> Vec<u8> {
    let mut b = json!({"model": "tiny", "messages": [{"role": "user", "content": "hello world"}]});
    merge(&mut b, extra);
    serde_json::to_vec(&b).unwrap()
}

pub fn completion_body(extra: Value) -> Vec<u8> {
    let mut b = json!({"model": "tiny", "prompt": "hello world"});
    merge(&mut b, extra);
    serde_json::to_vec(&b).unwrap()
}

pub fn chat(r: &Router, extra: Value) -> Result<Prepared, ApiError> {
    r.prepare(Endpoint::Chat, &chat_body(extra))
}

pub fn completion(r: &Router, extra: Value) -> Result<Prepared, ApiError> {
    r.prepare(Endpoint::Completion, &completion_body(extra))
}

/// (status, code, param) of an error.
pub fn shape<T: std::fmt::Debug>(r: Result<T, ApiError>) -> (u16, &'static str, Option<String>) {
    let e = r.expect_err("expected an error");
    (e.status(), e.code(), e.param().map(str::to_string))
}

pub fn header<'a>(p: &'a Prepared, name: &str) -> Option<&'a str> {
    p.headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
}

/// The SSE events of `bytes` (a Responses or Messages stream, which sends no `[DONE]`): (event
/// name, data), each data's `type` checked to be its event's name.
pub fn sse_events(bytes: &[u8]) -> Vec<(String, Value)> {
    let text = std::str::from_utf8(bytes).unwrap();
    assert!(!text.contains("[DONE]"));
    text.split_terminator("\n\n")
        .map(|frame| {
            let (event, data) = frame.split_once('\n').expect("event and data lines");
            let event = event.strip_prefix("event: ").expect("an event line").to_string();
            let data: Value = serde_json::from_str(data.strip_prefix("data: ").expect("a data line")).unwrap();
            assert_eq!(data["type"], event.as_str());
            (event, data)
        })
        .collect()
}

/// The JSON chunks of a chat or completions stream (which ends with `data: [DONE]`).
pub fn frames(bytes: &[u8]) -> Vec<Value> {
    let s = std::str::from_utf8(bytes).unwrap();
    assert!(s.ends_with("data: [DONE]\n\n"), "{s}");
    s.split("\n\n")
        .filter(|f| !f.is_empty() && *f != "data: [DONE]")
        .map(|f| serde_json::from_str(f.strip_prefix("data: ").expect("data frame")).unwrap())
        .collect()
}
