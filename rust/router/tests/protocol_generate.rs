//! vLLM's tokens-in, tokens-out route (`/inference/v1/generate`): the translation into a
//! completion of token ids, errors and ignored fields named in the route's terms, and the
//! answer (ids and their logprobs, streamed and not).

mod protocol_fixture;

use std::sync::Arc;

use llmserve_router::protocol::{Endpoint, Prepared};
use llmserve_router::response::{ChoiceDelta, FinishReason, ResponseBuilder, StopReason, TokenOut};
use protocol_fixture::*;
use serde_json::{json, Value};

fn generate(r: &llmserve_router::router::Router, body: Value) -> Result<Prepared, llmserve_router::error::ApiError> {
    r.prepare(Endpoint::Generate, &serde_json::to_vec(&body).unwrap())
}

fn ignored(p: &Prepared) -> Vec<String> {
    p.ignored.clone()
}

#[test]
fn token_ids_and_sampling_params_become_a_completion_of_ids() {
    let r = router();
    let p = generate(
        &r,
        json!({"token_ids": [0, 9, 10], "sampling_params": {"temperature": 0.5, "top_k": 3, "max_tokens": 4, "n": 2,
               "logprobs": 1, "stop": ["a b"], "stop_token_ids": [13], "seed": 7}}),
    )
    .unwrap();
    assert_eq!(p.endpoint, Endpoint::Generate);
    assert_eq!(p.prompts, vec![vec![0, 9, 10]]);
    // the first served name when the body names no model
    assert_eq!(p.model, "tiny");
    assert!(p.id.starts_with("generate-tokens-"), "{}", p.id);
    assert_eq!(header(&p, "x-request-id"), Some(p.id.as_str()));
    let s = &p.params;
    assert_eq!((s.temperature, s.top_k, s.max_tokens, s.n, s.logprobs), (0.5, 3, Some(4), 2, Some(1)));
    assert_eq!(s.stop, vec!["a b".to_string()]);
    assert_eq!(s.stop_token_ids, vec![13]);
    // every sampled token comes back, named by its id
    assert!(s.include_stop_str_in_output);
    assert!(p.return_token_ids && p.tokens_as_ids);
    assert!(ignored(&p).is_empty(), "{:?}", ignored(&p));

    // omitted max_tokens is the rest of the context (None), as the completions route's
    let p = generate(&r, json!({"token_ids": [0, 9], "sampling_params": {}, "model": "tiny-alias"})).unwrap();
    assert_eq!(p.params.max_tokens, None);
    assert_eq!(p.model, "tiny-alias");
    let p = generate(&r, json!({"token_ids": [9], "sampling_params": {}, "request_id": "abc"})).unwrap();
    assert_eq!(p.id, "generate-tokens-abc");
}

#[test]
fn errors_name_this_routes_fields() {
    let r = router();
    let cases = [
        (json!({"sampling_params": {}}), "token_ids", "missing_required_parameter"),
        (json!({"token_ids": [9]}), "sampling_params", "missing_required_parameter"),
        (json!({"token_ids": "hello", "sampling_params": {}}), "token_ids", "invalid_type"),
        (json!({"token_ids": [], "sampling_params": {}}), "token_ids", "invalid_value"),
        (json!({"token_ids": [9, 99], "sampling_params": {}}), "token_ids[1]", "invalid_value"),
        (json!({"token_ids": [9], "sampling_params": []}), "sampling_params", "invalid_type"),
        (
            json!({"token_ids": [9], "sampling_params": {"temperature": -1}}),
            "sampling_params.temperature",
            "invalid_value",
        ),
        (json!({"token_ids": [9], "sampling_params": {"top_p": "x"}}), "sampling_params.top_p", "invalid_type"),
        (
            json!({"token_ids": [9], "sampling_params": {"max_tokens": 40}}),
            "sampling_params.max_tokens",
            "context_length_exceeded",
        ),
        (
            json!({"token_ids": [9], "sampling_params": {"logits_processors": ["a.b"]}}),
            "sampling_params.logits_processors",
            "unsupported_parameter",
        ),
        (json!({"token_ids": [9], "sampling_params": {}, "features": {}}), "features", "unsupported_parameter"),
        (
            json!({"token_ids": [9], "sampling_params": {}, "stream_options": {"include_usage": true}}),
            "stream_options",
            "invalid_value",
        ),
    ];
    for (body, param, code) in cases {
        let err = generate(&r, body.clone()).expect_err(&body.to_string());
        assert_eq!(err.param(), Some(param), "{body}: {}", err.message());
        assert_eq!(err.code(), code, "{body}: {}", err.message());
        assert!(!err.message().contains("`prompt`"), "{}", err.message());
    }
    let err = generate(&r, json!({"token_ids": [9], "sampling_params": {"max_tokens": 40}})).unwrap_err();
    assert!(err.message().contains("`sampling_params.max_tokens`"), "{}", err.message());
    let err = generate(&r, json!({"token_ids": [9], "sampling_params": {}, "model": "other"})).unwrap_err();
    assert_eq!(err.status(), 404);
}

#[test]
fn fields_without_effect_here_are_reported() {
    let r = router();
    let p = generate(
        &r,
        json!({"token_ids": [9], "kv_transfer_params": {"do_remote_decode": true}, "extra": 1,
               "sampling_params": {"max_tokens": 2, "echo": true, "suffix": "x", "detokenize": false,
                                   "include_stop_str_in_output": false, "spaces_between_special_tokens": false,
                                   "output_kind": 1, "skip_reading_prefix_cache": true}}),
    )
    .unwrap();
    assert_eq!(
        ignored(&p),
        [
            "extra",
            "kv_transfer_params",
            "sampling_params.detokenize",
            "sampling_params.echo",
            "sampling_params.include_stop_str_in_output",
            "sampling_params.output_kind",
            "sampling_params.skip_reading_prefix_cache",
            "sampling_params.spaces_between_special_tokens",
            "sampling_params.suffix",
        ]
    );
    // (`echo` and `suffix` are not read: the completion neither echoes nor fills in the middle)
    assert!(!p.echo);
    assert!(header(&p, "llmserve-ignored-fields").unwrap().contains("sampling_params.echo"));
    // vLLM's defaults ask for nothing
    let p = generate(
        &r,
        json!({"token_ids": [9], "kv_transfer_params": null, "sampling_params": {"max_tokens": 2, "detokenize": true,
               "spaces_between_special_tokens": true, "flat_logprobs": false, "skip_reading_prefix_cache": false}}),
    )
    .unwrap();
    assert!(ignored(&p).is_empty(), "{:?}", ignored(&p));
    // completions' own reports come back in this route's terms; strict checking refuses them
    let strict = router_with(json!({"strict_fields": true}), Some(TEMPLATE));
    let err = generate(&strict, json!({"token_ids": [9], "sampling_params": {"detokenize": false}})).unwrap_err();
    assert_eq!(err.param(), Some("sampling_params.detokenize"));
}

fn lp(id: u32) -> TokenOut {
    TokenOut { id, logprob: -0.25, top: vec![(id, -0.25), (3, -2.0)], text_offset: 0 }
}

fn push(b: &mut ResponseBuilder, tokens: &[TokenOut], ids: &[u32], finish: Option<FinishReason>) {
    let stop_reason = finish.map(|_| StopReason::Token(ids.last().copied().unwrap_or(0)));
    b.push(0, &ChoiceDelta { text: "", tokens, ids, finish, stop_reason });
}

#[test]
fn the_answer_is_ids_with_their_logprobs() {
    let r = router();
    let p = generate(&r, json!({"token_ids": [0, 9], "sampling_params": {"max_tokens": 6, "logprobs": 1}})).unwrap();
    let mut b = ResponseBuilder::new(&p, Arc::new(tokenizer()));
    push(&mut b, &[lp(13)], &[13], None);
    push(&mut b, &[lp(14), lp(15)], &[14, 15], Some(FinishReason::Stop));
    let body: Value = serde_json::from_slice(&b.finish()).unwrap();
    assert_eq!(body["request_id"], json!(p.id));
    assert_eq!(body["kv_transfer_params"], Value::Null);
    assert_eq!(body["prompt_logprobs"], Value::Null);
    assert_eq!(body["usage"]["prompt_tokens"], 2);
    assert_eq!(body["usage"]["completion_tokens"], 3);
    let choice = &body["choices"][0];
    assert_eq!(choice["token_ids"], json!([13, 14, 15]));
    assert_eq!(choice["finish_reason"], "stop");
    assert_eq!(choice["stop_reason"], 15);
    assert!(choice.get("text").is_none());
    let content = choice["logprobs"]["content"].as_array().unwrap();
    let names: Vec<&str> = content.iter().map(|c| c["token"].as_str().unwrap()).collect();
    assert_eq!(names, ["token_id:13", "token_id:14", "token_id:15"]);
    assert_eq!(content[0]["top_logprobs"][0]["token"], "token_id:13");
    assert_eq!(content[0]["top_logprobs"].as_array().unwrap().len(), 2);

    // without logprobs: null
    let p = generate(&r, json!({"token_ids": [0, 9], "sampling_params": {"max_tokens": 6}})).unwrap();
    let mut b = ResponseBuilder::new(&p, Arc::new(tokenizer()));
    push(&mut b, &[], &[13], Some(FinishReason::Length));
    let body: Value = serde_json::from_slice(&b.finish()).unwrap();
    assert_eq!(body["choices"][0]["logprobs"], Value::Null);
    assert_eq!(body["choices"][0]["finish_reason"], "length");
}

#[test]
fn a_stream_sends_each_id_with_its_logprobs() {
    let r = router();
    let p = generate(
        &r,
        json!({"token_ids": [0, 9], "stream": true, "stream_options": {"include_usage": true, "continuous_usage_stats": true},
               "sampling_params": {"max_tokens": 6, "logprobs": 0}}),
    )
    .unwrap();
    let mut b = ResponseBuilder::new(&p, Arc::new(tokenizer()));
    push(&mut b, &[lp(13)], &[13], None);
    // a token held back (a possible stop string): its id waits for its logprobs
    push(&mut b, &[], &[14], None);
    push(&mut b, &[lp(14)], &[15], None);
    push(&mut b, &[lp(15), lp(16)], &[16], Some(FinishReason::Stop));
    let mut bytes = b.take();
    bytes.extend(b.finish());
    assert!(bytes.ends_with(b"data: [DONE]\n\n"));
    let chunks = frames(&bytes);
    let ids: Vec<Value> = chunks.iter().map(|c| c["choices"][0]["token_ids"].clone()).collect();
    assert_eq!(ids, [json!([13]), json!([14]), json!([15, 16]), Value::Null]);
    for c in &chunks[..3] {
        assert_eq!(c["request_id"], json!(p.id));
        let n = c["choices"][0]["token_ids"].as_array().unwrap().len();
        assert_eq!(c["choices"][0]["logprobs"]["content"].as_array().unwrap().len(), n, "{c}");
        assert!(c["usage"]["completion_tokens"].as_u64().unwrap() >= n as u64, "{c}");
    }
    let finishes: Vec<Value> = chunks.iter().map(|c| c["choices"][0]["finish_reason"].clone()).collect();
    assert_eq!(finishes, [Value::Null, Value::Null, json!("stop"), Value::Null]);
    assert_eq!(chunks[3]["choices"], json!([]));
    assert_eq!(chunks[3]["usage"]["completion_tokens"], 4);
}
