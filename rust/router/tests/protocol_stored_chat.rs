//! Stored chat completions (`store: true`): the completion is kept as its non-streamed body,
//! streamed or not, with its request's messages and metadata, and the routes read, list,
//! edit and forget it.

mod protocol_fixture;

use std::sync::Arc;

use llmserve_router::error::ApiError;
use llmserve_router::protocol::stored_chat::Target;
use llmserve_router::protocol::Prepared;
use llmserve_router::response::{ChoiceDelta, FinishReason, ResponseBuilder};
use llmserve_router::router::Router;
use protocol_fixture::*;
use serde_json::{json, Value};

/// The finished answer "Paris." to `p`: its body (non-streamed) or frames (streamed).
fn answer(p: &Prepared) -> Vec<u8> {
    let mut b = ResponseBuilder::new(p, Arc::new(tokenizer()));
    b.push(0, &ChoiceDelta { text: "Par", tokens: &[], ids: &[9], finish: None, stop_reason: None });
    b.push(
        0,
        &ChoiceDelta { text: "is.", tokens: &[], ids: &[10], finish: Some(FinishReason::Stop), stop_reason: None },
    );
    let mut out = b.take();
    out.extend(b.finish());
    out
}

fn call(r: &Router, method: &str, target: Target<'_>, query: &[(&str, &str)], body: Value) -> Result<Value, ApiError> {
    let query: Vec<(String, String)> = query.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    let body = if body.is_null() { Vec::new() } else { serde_json::to_vec(&body).unwrap() };
    Ok(serde_json::from_slice(&r.stored_chat_route(method, target, &query, &body)?.body).unwrap())
}

#[test]
fn a_stored_completion_is_its_non_streamed_body_streamed_or_not() {
    let r = router();
    let request = json!({"store": true, "metadata": {"run": "1"},
                         "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]});
    let plain = chat(&r, request.clone()).unwrap();
    let body: Value = serde_json::from_slice(&answer(&plain)).unwrap();
    let mut kept = call(&r, "GET", Target::One(&plain.id), &[], Value::Null).unwrap();
    assert_eq!(kept["metadata"], json!({"run": "1"}));
    kept.as_object_mut().unwrap().remove("metadata");
    assert_eq!(kept, body);
    assert_eq!(kept["choices"][0]["message"]["content"], "Paris.");

    let mut streamed_request = request.clone();
    streamed_request["stream"] = json!(true);
    streamed_request["return_token_ids"] = json!(true);
    let streamed = chat(&r, streamed_request).unwrap();
    let frames = String::from_utf8(answer(&streamed)).unwrap();
    assert!(frames.ends_with("data: [DONE]\n\n"));
    let kept = call(&r, "GET", Target::One(&streamed.id), &[], Value::Null).unwrap();
    assert_eq!(kept["object"], "chat.completion");
    assert_eq!(kept["choices"][0]["message"]["content"], "Paris.");
    assert_eq!(kept["usage"], body["usage"]);
    assert!(kept["choices"][0].get("token_ids").is_none_or(Value::is_null));

    // its messages, listed as OpenAI's (an id each, text parts joined and kept as parts)
    let messages = call(&r, "GET", Target::Messages(&plain.id), &[], Value::Null).unwrap();
    assert_eq!(messages["data"][0]["id"], json!(format!("{}-0", plain.id)));
    assert_eq!(
        (messages["data"][0]["content"].clone(), messages["data"][0]["role"].clone()),
        (json!("hi"), json!("user"))
    );
    assert_eq!(messages["data"][0]["content_parts"], json!([{"type": "text", "text": "hi"}]));

    // not kept without `store`
    let unkept = chat(&r, json!({})).unwrap();
    answer(&unkept);
    assert_eq!(shape(call(&r, "GET", Target::One(&unkept.id), &[], Value::Null)).0, 404);
}

#[test]
fn the_routes_list_filter_edit_and_forget() {
    let r = router();
    let mut ids = Vec::new();
    for run in ["a", "b", "a"] {
        let p = chat(&r, json!({"store": true, "metadata": {"run": run}})).unwrap();
        answer(&p);
        ids.push(p.id.clone());
    }
    let listed = |query: &[(&str, &str)]| -> Vec<String> {
        let page = call(&r, "GET", Target::All, query, Value::Null).unwrap();
        page["data"].as_array().unwrap().iter().map(|c| c["id"].as_str().unwrap().to_string()).collect()
    };
    assert_eq!(listed(&[]), ids);
    assert_eq!(listed(&[("metadata[run]", "a"), ("order", "desc")]), [ids[2].clone(), ids[0].clone()]);
    assert_eq!(listed(&[("model", "tiny"), ("limit", "1"), ("after", &ids[0])]), [ids[1].clone()]);
    assert!(listed(&[("model", "other")]).is_empty());
    let edited = call(&r, "POST", Target::One(&ids[1]), &[], json!({"metadata": {"run": "a"}})).unwrap();
    assert_eq!(edited["metadata"], json!({"run": "a"}));
    assert_eq!(listed(&[("metadata[run]", "a")]).len(), 3);
    let deleted = call(&r, "DELETE", Target::One(&ids[0]), &[], Value::Null).unwrap();
    assert_eq!(deleted, json!({"id": ids[0], "object": "chat.completion.deleted", "deleted": true}));
    assert_eq!(listed(&[]), ids[1..]);
    // errors
    assert_eq!(shape(call(&r, "GET", Target::One("chatcmpl-nope"), &[], Value::Null)).0, 404);
    assert_eq!(
        shape(call(&r, "POST", Target::One(&ids[1]), &[], json!({}))),
        (400, "missing_required_parameter", Some("metadata".into()))
    );
    assert_eq!(
        shape(call(&r, "POST", Target::One(&ids[1]), &[], json!({"metadata": {"k": 1}}))),
        (400, "invalid_type", Some("metadata.k".into()))
    );
    assert_eq!(shape(call(&r, "GET", Target::All, &[("limit", "0")], Value::Null)).2.as_deref(), Some("limit"));
    let storeless = router_with(json!({"responses_store_bytes": 0}), Some(TEMPLATE));
    assert_eq!(shape(call(&storeless, "GET", Target::All, &[], Value::Null)).0, 404);
}

/// Under --strict-fields a request that is refused for what it carries changes nothing.
#[test]
fn a_strictly_refused_edit_changes_nothing() {
    let r = router_with(json!({"strict_fields": true}), Some(TEMPLATE));
    let p = chat(&r, json!({"store": true, "metadata": {"run": "1"}})).unwrap();
    answer(&p);
    let edit = json!({"metadata": {"run": "2"}, "zzz": 1});
    assert_eq!(shape(call(&r, "POST", Target::One(&p.id), &[], edit)).2.as_deref(), Some("zzz"));
    assert_eq!(shape(call(&r, "DELETE", Target::One(&p.id), &[("zzz", "1")], Value::Null)).2.as_deref(), Some("zzz"));
    assert_eq!(call(&r, "GET", Target::One(&p.id), &[], Value::Null).unwrap()["metadata"], json!({"run": "1"}));
}

#[test]
fn a_kept_completion_is_named_by_an_id_a_path_can_carry() {
    let r = router();
    let kept = |id: &str| chat(&r, json!({"store": true, "request_id": id})).map(|p| p.id);
    assert_eq!(kept("run-1.a_b").unwrap(), "chatcmpl-run-1.a_b");
    for id in ["a/b", "a b", "a?b", "a#b"] {
        let err = kept(id).unwrap_err();
        assert_eq!((err.status(), err.param()), (400, Some("request_id")), "{id}");
    }
    // (not kept: any id a header can carry names it)
    assert_eq!(chat(&r, json!({"request_id": "a/b"})).unwrap().id, "chatcmpl-a/b");
    let body = chat_body(json!({"store": true}));
    let named = |header| r.prepare_as(llmserve_router::protocol::Endpoint::Chat, &body, Some(header)).unwrap().id;
    assert_eq!(named("trace-1"), "chatcmpl-trace-1");
    assert!(!named("trace/1").contains("trace")); // (a header that cannot name it names nothing)
}
