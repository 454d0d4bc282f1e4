//! `/v1/embeddings`: each input becomes one prompt that samples nothing (`max_tokens` 0,
//! greedy, one choice), its fields are checked as OpenAI checks them, and the answer is a
//! list of pooled vectors.

mod protocol_fixture;

use llmserve_router::error::ApiError;
use llmserve_router::protocol::embeddings::{Pooling, MAX_INPUTS};
use llmserve_router::protocol::{Endpoint, Prepared};
use llmserve_router::response::{ChoiceDelta, FinishReason, ResponseBuilder};
use llmserve_router::router::Router;
use protocol_fixture::*;
use serde_json::{json, Value};

const EMBED: &str = r#"{"embeddings": {"pooling": "mean", "normalize": true, "hidden_size": 8}}"#;

fn embedding_router(embeddings: Value) -> Router {
    router_with(json!({ "embeddings": embeddings }), Some(TEMPLATE))
}

fn r() -> Router {
    let config: Value = serde_json::from_str(EMBED).unwrap();
    embedding_router(config["embeddings"].clone())
}

fn embed(r: &Router, body: Value) -> Result<Prepared, ApiError> {
    let mut b = json!({"model": "tiny", "input": "hello world"});
    merge(&mut b, body);
    r.prepare(Endpoint::Embeddings, &serde_json::to_vec(&b).unwrap())
}

fn err(r: &Router, body: Value) -> ApiError {
    embed(r, body).expect_err("the request is refused")
}

#[test]
fn each_input_is_one_prompt_that_samples_nothing() {
    let r = r();
    let tok = r.tokenizer().clone();
    let p = embed(&r, json!({"input": ["hello world", "foo"]})).unwrap();
    assert_eq!(p.endpoint, Endpoint::Embeddings);
    assert_eq!(p.prompts, vec![tok.encode("hello world", true), tok.encode("foo", true)]);
    assert_eq!((p.params.n, p.params.temperature, p.params.max_tokens), (1, 0.0, Some(0)));
    assert!(!p.stream && p.grammar.is_none() && p.responses.is_none());
    assert!(p.id.starts_with("embd-"));
    let plan = p.embedding.as_ref().unwrap();
    assert_eq!((plan.pooling, plan.normalize, plan.dimensions, plan.base64), (Pooling::Mean, true, None, false));
    // token ids, one list or several
    assert_eq!(embed(&r, json!({"input": [5, 6, 7]})).unwrap().prompts, vec![vec![5, 6, 7]]);
    assert_eq!(embed(&r, json!({"input": [[5], [6, 7]]})).unwrap().prompts, vec![vec![5], vec![6, 7]]);
    // vLLM's fields
    let p = embed(
        &r,
        json!({"input": [[5, 6, 7, 8]], "truncate_prompt_tokens": 2, "normalize": false,
                             "request_id": "abc", "priority": 3, "encoding_format": "base64"}),
    )
    .unwrap();
    assert_eq!(p.prompts, vec![vec![7, 8]]);
    assert_eq!((p.id.as_str(), p.priority), ("embd-abc", 3));
    let plan = p.embedding.unwrap();
    assert!(!plan.normalize && plan.base64);
    // the full size is always a valid `dimensions`
    assert_eq!(embed(&r, json!({"dimensions": 8})).unwrap().embedding.unwrap().dimensions, None);
}

#[test]
fn bad_fields_are_refused_with_their_path() {
    let r = r();
    let cases = [
        (json!({"input": ""}), "input", "invalid_value"),
        (json!({"input": []}), "input", "invalid_value"),
        (json!({"input": ["a", ""]}), "input[1]", "invalid_value"),
        (json!({"input": ["a", [5]]}), "input[1]", "invalid_type"),
        (json!({"input": ["a", null]}), "input[1]", "invalid_type"),
        (json!({"input": [[5, -1]]}), "input[0][1]", "invalid_value"),
        (json!({"input": [1_000_000]}), "input[0]", "invalid_value"),
        (json!({"input": {"text": "a"}}), "input", "invalid_type"),
        (json!({"input": null}), "input", "missing_required_parameter"),
        (json!({"encoding_format": "int8"}), "encoding_format", "invalid_value"),
        (json!({"dimensions": 0}), "dimensions", "invalid_value"),
        (json!({"dimensions": 9}), "dimensions", "invalid_value"),
        (json!({"dimensions": 4}), "dimensions", "unsupported_parameter"),
        (json!({"truncate_prompt_tokens": 0}), "truncate_prompt_tokens", "invalid_value"),
        (json!({"request_id": ""}), "request_id", "invalid_value"),
        (json!({"cache_salt": ""}), "cache_salt", "invalid_value"),
        (json!({"normalize": "yes"}), "normalize", "invalid_type"),
    ];
    for (body, param, code) in cases {
        let e = err(&r, body.clone());
        assert_eq!((e.status(), e.param(), e.code()), (400, Some(param), code), "{body}");
    }
    let e = err(&r, json!({"input": null, "model": null}));
    assert_eq!(e.status(), 400);
    let e = err(&r, json!({"model": "other"}));
    assert_eq!((e.status(), e.code()), (404, "model_not_found"));
    let many: Vec<Value> = (0..=MAX_INPUTS).map(|_| json!("a")).collect();
    assert_eq!(err(&r, json!({ "input": many })).param(), Some("input"));
}

#[test]
fn an_input_over_the_context_is_refused_unless_truncated() {
    let r = r();
    let long: Vec<u32> = (0..MAX_LEN + 1).map(|i| 5 + i % 10).collect();
    let e = err(&r, json!({"input": [[5], long]}));
    assert_eq!((e.code(), e.param()), ("context_length_exceeded", Some("input[1]")));
    assert!(e.to_string().contains(&format!("{} tokens", MAX_LEN + 1)), "{e}");
    // exactly the context fits (nothing is generated after it)
    let fits: Vec<u32> = long[..MAX_LEN as usize].to_vec();
    assert_eq!(embed(&r, json!({ "input": [fits] })).unwrap().prompts[0].len(), MAX_LEN as usize);
    let p = embed(&r, json!({"input": [long], "truncate_prompt_tokens": -1})).unwrap();
    assert_eq!(p.prompts[0], long[1..].to_vec());
}

#[test]
fn unknown_fields_are_reported_or_refused_under_strict_fields() {
    let r = r();
    let p = embed(&r, json!({"stream": true, "user": "u1"})).unwrap();
    assert_eq!(p.ignored, vec!["stream".to_string()]);
    assert_eq!(p.user.as_deref(), Some("u1"));
    let config: Value = serde_json::from_str(EMBED).unwrap();
    let strict = router_with(json!({"strict_fields": true, "embeddings": config["embeddings"]}), Some(TEMPLATE));
    let e = embed(&strict, json!({"stream": true})).unwrap_err();
    assert_eq!((e.param(), e.code()), (Some("stream"), "unsupported_parameter"));
    // `stream: false` asks for nothing: not a word, also under strict fields
    assert!(embed(&strict, json!({"stream": false})).unwrap().ignored.is_empty());
    // nor do vLLM's defaults, which its clients send; a right-side cut is refused
    let defaults = json!({"embed_dtype": "float32", "endianness": "native", "truncation_side": "left"});
    assert!(embed(&strict, defaults).unwrap().ignored.is_empty());
    assert_eq!(embed(&r, json!({"embed_dtype": "float16"})).unwrap().ignored, vec!["embed_dtype".to_string()]);
    // beside base64, where a client would decode what it asked for from float32 bytes: 400
    for (key, v) in [("embed_dtype", "float16"), ("embed_dtype", "bfloat16"), ("endianness", "big")] {
        let e = err(&r, json!({"encoding_format": "base64", key: v}));
        assert_eq!((e.param(), e.code()), (Some(key), "unsupported_parameter"), "{key} {v}");
    }
    assert!(embed(&r, json!({"encoding_format": "base64", "embed_dtype": "float32", "endianness": "little"})).is_ok());
    for (key, v) in [("embed_dtype", json!("binary")), ("endianness", json!("middle")), ("embed_dtype", json!(4))] {
        let e = err(&r, json!({key: v}));
        assert_eq!((e.param(), e.code()), (Some(key), "invalid_value"), "{key} {v}");
    }
    let e = err(&r, json!({"truncation_side": "right"}));
    assert_eq!((e.param(), e.code()), (Some("truncation_side"), "unsupported_parameter"));
}

#[test]
fn a_conversation_is_not_embedded() {
    let mut body =
        serde_json::to_value(json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})).unwrap();
    let e = r().prepare(Endpoint::Embeddings, &serde_json::to_vec(&body).unwrap()).unwrap_err();
    assert_eq!((e.param(), e.code()), (Some("messages"), "unsupported_parameter"));
    body["input"] = json!("hi"); // (beside an `input`, `messages` is only reported)
    assert!(r().prepare(Endpoint::Embeddings, &serde_json::to_vec(&body).unwrap()).is_ok());
}

#[test]
fn use_activation_is_vllms_newer_normalize() {
    let r = r();
    let normalized = |body| embed(&r, body).unwrap().embedding.unwrap().normalize;
    assert!(!normalized(json!({"use_activation": false})));
    assert!(normalized(json!({"use_activation": true, "normalize": true})));
    let e = err(&r, json!({"use_activation": false, "normalize": true}));
    assert_eq!((e.param(), e.code()), (Some("use_activation"), "invalid_value"));
}

#[test]
fn matryoshka_models_take_the_lengths_they_declare() {
    let any = embedding_router(json!({"hidden_size": 8, "matryoshka": []}));
    assert_eq!(embed(&any, json!({"dimensions": 3})).unwrap().embedding.unwrap().dimensions, Some(3));
    let listed = embedding_router(json!({"hidden_size": 8, "matryoshka": [2, 4]}));
    assert_eq!(embed(&listed, json!({"dimensions": 4})).unwrap().embedding.unwrap().dimensions, Some(4));
    let e = embed(&listed, json!({"dimensions": 3})).unwrap_err();
    assert_eq!((e.param(), e.code()), (Some("dimensions"), "unsupported_parameter"));
    assert_eq!(e.message(), "This model's embeddings can be shortened to 2, 4, 8 dimensions, not 3.");
    // (a list that has the full size names it once)
    let full = embedding_router(json!({"hidden_size": 8, "matryoshka": [2, 8]}));
    let e = embed(&full, json!({"dimensions": 3})).unwrap_err();
    assert_eq!(e.message(), "This model's embeddings can be shortened to 2, 8 dimensions, not 3.");
    // defaults: last-token pooling, normalized
    let plan = embed(&any, json!({})).unwrap().embedding.unwrap();
    assert_eq!((plan.pooling, plan.normalize), (Pooling::Last, true));
}

#[test]
fn a_server_without_embeddings_refuses_the_route() {
    let e = router().prepare(Endpoint::Embeddings, br#"{"model": "tiny", "input": "a"}"#).unwrap_err();
    assert_eq!((e.status(), e.param()), (400, Some("model")));
    assert!(e.message().contains("--pooling"), "{}", e.message());
    let e = err(&r(), json!({"input": ["a", null]}));
    assert!(!e.message().contains("mix"), "{}", e.message());
}

#[test]
fn the_body_lists_each_inputs_vector_in_order_with_usage() {
    let r = r();
    let p = embed(&r, json!({"input": [[5, 6, 7], [8]]})).unwrap();
    let mut b = ResponseBuilder::new(&p, r.tokenizer().clone());
    // input 0 pools three rows (mean), input 1 one
    b.add_pooled(0, &[1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
    b.add_pooled(0, &[3.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
    b.add_pooled(1, &[0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -2.0]);
    for choice in 0..2 {
        let delta =
            ChoiceDelta { text: "", tokens: &[], ids: &[], finish: Some(FinishReason::Stop), stop_reason: None };
        b.push(choice, &delta);
    }
    assert!(b.all_finished());
    let body: Value = serde_json::from_slice(&b.finish()).unwrap();
    let one_hot = |i: usize, x: f64| {
        let mut v = vec![0.0; 8];
        v[i] = x;
        json!(v)
    };
    assert_eq!(
        body,
        json!({
            "object": "list",
            "data": [
                {"object": "embedding", "embedding": one_hot(0, 1.0), "index": 0},
                {"object": "embedding", "embedding": one_hot(7, -1.0), "index": 1},
            ],
            "model": "tiny",
            "usage": {"prompt_tokens": 4, "total_tokens": 4},
        })
    );
}
