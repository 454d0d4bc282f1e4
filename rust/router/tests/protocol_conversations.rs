//! The Conversations API: a conversation's items come before a response's input, exactly as
//! if they had been sent in it, and the response's input and output items join it once the
//! response is done; the routes check what they are sent as `/v1/responses` checks input.

mod protocol_fixture;

use std::sync::Arc;

use llmserve_router::error::ApiError;
use llmserve_router::protocol::conversations::Target;
use llmserve_router::protocol::{Endpoint, Prepared};
use llmserve_router::response::{ChoiceDelta, FinishReason, ResponseBuilder};
use llmserve_router::router::Router;
use protocol_fixture::*;
use serde_json::{json, Value};

fn responses(r: &Router, body: Value) -> Result<Prepared, ApiError> {
    let mut b = json!({"model": "tiny"});
    merge(&mut b, body);
    r.prepare(Endpoint::Responses, &serde_json::to_vec(&b).unwrap())
}

/// `method` on `target` with `body` (and no query): the answer's JSON and its ignored-fields
/// header.
fn call(r: &Router, method: &str, target: Target<'_>, body: Value) -> Result<(Value, Option<String>), ApiError> {
    call_with(r, method, target, &[], body)
}

fn call_with(
    r: &Router,
    method: &str,
    target: Target<'_>,
    query: &[(&str, &str)],
    body: Value,
) -> Result<(Value, Option<String>), ApiError> {
    let query: Vec<(String, String)> = query.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    let body = if body.is_null() { Vec::new() } else { serde_json::to_vec(&body).unwrap() };
    let out = r.conversation_route(method, target, &query, &body)?;
    let ignored = out.headers.iter().find(|(k, _)| k == "llmserve-ignored-fields").map(|(_, v)| v.clone());
    Ok((serde_json::from_slice(&out.body).unwrap(), ignored))
}

/// A finished answer of `text` to `p`, streamed or not (as its request asked).
fn answer(p: &Prepared, text: &str) {
    let mut b = ResponseBuilder::new(p, Arc::new(tokenizer()));
    b.push(0, &ChoiceDelta { text, tokens: &[], ids: &[9], finish: Some(FinishReason::Stop), stop_reason: None });
    b.take();
    b.finish();
}

fn ids(items: &Value) -> Vec<String> {
    items["data"].as_array().unwrap().iter().map(|i| i["id"].as_str().unwrap().to_string()).collect()
}

fn chat_prompt(r: &Router, messages: Value) -> Vec<Vec<u32>> {
    let body = serde_json::to_vec(&json!({"model": "tiny", "messages": messages})).unwrap();
    r.prepare(Endpoint::Chat, &body).unwrap().prompts
}

#[test]
fn a_conversation_is_continued_and_grows_by_each_response() {
    let r = router();
    let (conv, _) = call(&r, "POST", Target::All, json!({"items": [{"role": "user", "content": "hello"}]})).unwrap();
    let id = conv["id"].as_str().unwrap().to_string();
    assert!(id.starts_with("conv_"));
    assert_eq!((conv["object"].clone(), conv["metadata"].clone()), (json!("conversation"), json!({})));

    for stream in [false, true] {
        let before = call(&r, "GET", Target::Items(&id), Value::Null).unwrap().0;
        let n = before["data"].as_array().unwrap().len();
        let p = responses(&r, json!({"input": "x", "conversation": id, "stream": stream})).unwrap();
        let echo = p.responses.as_ref().unwrap();
        assert_eq!(echo.fields["conversation"], json!({"id": id}));
        // the conversation's items come first, as if sent in `input`
        let mut messages = vec![json!({"role": "user", "content": "hello"})];
        if stream {
            messages.push(json!({"role": "user", "content": "x"}));
            messages.push(json!({"role": "assistant", "content": [{"type": "text", "text": "world"}]}));
        }
        messages.push(json!({"role": "user", "content": "x"}));
        assert_eq!(p.prompts, chat_prompt(&r, Value::Array(messages)));
        assert_eq!(header(&p, "llmserve-ignored-fields"), None);
        answer(&p, "world");
        // then its input and output join the conversation, newest first in the default order
        let (after, _) = call(&r, "GET", Target::Items(&id), Value::Null).unwrap();
        let data = after["data"].as_array().unwrap();
        assert_eq!(data.len(), n + 2);
        assert_eq!(
            (data[0]["role"].clone(), data[0]["content"][0]["text"].clone()),
            (json!("assistant"), json!("world"))
        );
        assert_eq!(
            (data[1]["role"].clone(), data[1]["content"][0]["type"].clone()),
            (json!("user"), json!("input_text"))
        );
        // the output item keeps the id the response gave it
        let stored: Value = serde_json::from_slice(&r.responses().body(&p.id).unwrap()).unwrap();
        assert_eq!(stored["output"][0]["id"], data[0]["id"]);
        assert_eq!(stored["conversation"], json!({"id": id}));
    }
    // an item of the conversation can be referenced from any request
    let (listed, _) = call_with(&r, "GET", Target::Items(&id), &[("order", "asc")], Value::Null).unwrap();
    let first = ids(&listed)[0].clone();
    let referenced =
        responses(&r, json!({"input": [{"type": "item_reference", "id": first}], "store": false})).unwrap();
    assert_eq!(referenced.prompts, chat_prompt(&r, json!([{"role": "user", "content": "hello"}])));
}

#[test]
fn items_are_added_read_and_deleted_by_id() {
    let r = router();
    let (conv, _) = call(&r, "POST", Target::All, json!({"metadata": {"topic": "t"}})).unwrap();
    let id = conv["id"].as_str().unwrap().to_string();
    assert_eq!(call(&r, "GET", Target::One(&id), Value::Null).unwrap().0, conv);
    let items = json!({"items": [
        {"role": "user", "content": "a"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "b"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "out"},
    ]});
    let (added, _) = call(&r, "POST", Target::Items(&id), items).unwrap();
    let added_ids = ids(&added);
    assert_eq!(added_ids.len(), 4);
    assert_eq!((added["has_more"].clone(), added["first_id"].clone()), (json!(false), json!(added_ids[0])));
    assert!(added_ids[2].starts_with("fc_") && added_ids[3].starts_with("fco_"));
    // pages, newest first by default
    let (page, _) = call_with(&r, "GET", Target::Items(&id), &[("limit", "3")], Value::Null).unwrap();
    assert_eq!(ids(&page), [added_ids[3].as_str(), &added_ids[2], &added_ids[1]]);
    assert_eq!(page["has_more"], true);
    let last = page["last_id"].as_str().unwrap();
    let (rest, _) = call_with(&r, "GET", Target::Items(&id), &[("limit", "3"), ("after", last)], Value::Null).unwrap();
    assert_eq!((ids(&rest), rest["has_more"].clone()), (vec![added_ids[0].clone()], json!(false)));
    // one item, and deleting it
    let (item, _) = call(&r, "GET", Target::Item(&id, &added_ids[1]), Value::Null).unwrap();
    assert_eq!(item["content"], json!([{"type": "output_text", "text": "b", "annotations": []}]));
    let (after_delete, _) = call(&r, "DELETE", Target::Item(&id, &added_ids[1]), Value::Null).unwrap();
    assert_eq!(after_delete["id"], json!(id));
    assert_eq!(shape(call(&r, "GET", Target::Item(&id, &added_ids[1]), Value::Null)).0, 404);
    // the conversation's metadata, replaced
    let (updated, _) = call(&r, "POST", Target::One(&id), json!({"metadata": {"topic": "u"}})).unwrap();
    assert_eq!(updated["metadata"], json!({"topic": "u"}));
    let (deleted, _) = call(&r, "DELETE", Target::One(&id), Value::Null).unwrap();
    assert_eq!(deleted, json!({"id": id, "object": "conversation.deleted", "deleted": true}));
    assert_eq!(shape(call(&r, "GET", Target::One(&id), Value::Null)).0, 404);
    assert_eq!(shape(call(&r, "GET", Target::Items(&id), Value::Null)).0, 404);
}

#[test]
fn what_the_routes_cannot_take_is_a_clear_error() {
    let r = router();
    let (conv, _) = call(&r, "POST", Target::All, Value::Null).unwrap();
    let id = conv["id"].as_str().unwrap().to_string();
    let bad = |method: &str, target: Target<'_>, body: Value| shape(call(&r, method, target, body));
    assert_eq!(
        bad("POST", Target::All, json!({"items": [{"role": "robot", "content": "a"}]})),
        (400, "invalid_value", Some("items[0].role".into()))
    );
    assert_eq!(
        bad("POST", Target::All, json!({"items": [{"type": "web_search_call"}]})),
        (400, "unsupported_parameter", Some("items[0].type".into()))
    );
    assert_eq!(bad("POST", Target::All, json!({"items": "a"})), (400, "invalid_type", Some("items".into())));
    // what a response's input could not hold (every later response would be refused)
    for (item, param) in [
        (json!({"type": "message", "role": "user", "content": []}), "items[1].content"),
        (json!({"role": "developer", "content": []}), "items[1].content"),
        (json!({"type": "function_call_output", "call_id": "c", "output": []}), "items[1].output"),
    ] {
        let items = json!([{"role": "user", "content": "a"}, item]);
        assert_eq!(
            bad("POST", Target::Items(&id), json!({"items": items})),
            (400, "invalid_value", Some(param.into()))
        );
        assert_eq!(bad("POST", Target::All, json!({"items": items})).2, Some(param.into()));
    }
    let many: Vec<Value> = (0..21).map(|_| json!({"role": "user", "content": "a"})).collect();
    assert_eq!(bad("POST", Target::All, json!({"items": many})), (400, "invalid_value", Some("items".into())));
    assert_eq!(
        bad("POST", Target::All, json!({"metadata": {"k": 1}})),
        (400, "invalid_type", Some("metadata.k".into()))
    );
    assert_eq!(bad("POST", Target::Items(&id), json!({})), (400, "missing_required_parameter", Some("items".into())));
    assert_eq!(bad("POST", Target::Items(&id), json!({"items": []})), (400, "invalid_value", Some("items".into())));
    assert_eq!(bad("POST", Target::One(&id), json!({})), (400, "missing_required_parameter", Some("metadata".into())));
    assert_eq!(bad("POST", Target::Items("conv_nope"), json!({"items": []})).0, 404);
    assert_eq!(
        bad("POST", Target::Items(&id), json!({"items": [{"type": "item_reference", "id": "msg_nope"}]})),
        (400, "item_not_found", Some("items[0].id".into()))
    );
    let q = |query: &[(&str, &str)]| shape(call_with(&r, "GET", Target::Items(&id), query, Value::Null));
    assert_eq!(q(&[("limit", "0")]), (400, "invalid_value", Some("limit".into())));
    assert_eq!(q(&[("order", "up")]), (400, "invalid_value", Some("order".into())));
    // what asks for nothing is reported
    let (_, ignored) =
        call(&r, "POST", Target::All, json!({"items": [{"role": "user", "content": "a", "x": 1}], "y": 2})).unwrap();
    assert_eq!(ignored.as_deref(), Some("items[0].x, y"));
    let include = |value: &str| {
        call_with(&r, "GET", Target::Items(&id), &[("include[]", value), ("x", "1")], Value::Null).unwrap().1
    };
    assert_eq!(include("file_search_call.results").as_deref(), Some("include, x"));
    assert_eq!(include("message.output_text.logprobs").as_deref(), Some("x"));
    let strict = router_with(json!({"strict_fields": true}), Some(TEMPLATE));
    assert_eq!(
        shape(call(&strict, "POST", Target::All, json!({"y": 2}))),
        (400, "unsupported_parameter", Some("y".into()))
    );

    // on /v1/responses
    assert_eq!(shape(responses(&r, json!({"input": "x", "conversation": "conv_nope"}))).0, 404);
    assert_eq!(
        shape(responses(&r, json!({"input": "x", "conversation": id, "previous_response_id": "resp_1"}))),
        (400, "invalid_value", Some("conversation".into()))
    );
    assert_eq!(
        shape(responses(&r, json!({"input": "x", "conversation": 3}))),
        (400, "invalid_type", Some("conversation".into()))
    );
    let p = responses(&r, json!({"input": "x", "conversation": {"id": id, "z": 1}})).unwrap();
    assert_eq!(header(&p, "llmserve-ignored-fields"), Some("conversation.z"));
    // a store turned off keeps no conversations
    let storeless = router_with(json!({"responses_store_bytes": 0}), Some(TEMPLATE));
    assert_eq!(shape(call(&storeless, "POST", Target::All, Value::Null)).0, 404);
    assert_eq!(
        shape(responses(&storeless, json!({"input": "x", "conversation": id}))),
        (400, "unsupported_parameter", Some("conversation".into()))
    );
}

/// A response's items that would make its conversation larger than the store's whole bound
/// forget the conversation, so that its next use is a 404 rather than a conversation missing
/// a turn.
#[test]
fn a_conversation_past_the_bound_is_forgotten_not_cut() {
    let r = router_with(json!({"responses_store_bytes": 4096}), Some(TEMPLATE));
    let (conv, _) = call(&r, "POST", Target::All, Value::Null).unwrap();
    let id = conv["id"].as_str().unwrap().to_string();
    let p = responses(&r, json!({"input": "hello", "conversation": id, "store": false})).unwrap();
    answer(&p, &"w".repeat(8192));
    assert_eq!(shape(responses(&r, json!({"input": "x", "conversation": id}))).0, 404);
}

/// While a response runs on a conversation, another may not start on it, nor may its items
/// change (OpenAI's `conversation_locked`): the second would answer from a history the first
/// is about to extend. Counting a request's tokens only reads it. The hold ends when the
/// response's items have joined, or when the request goes without finishing.
#[test]
fn a_conversation_runs_one_response_at_a_time() {
    let r = router();
    let (conv, _) = call(&r, "POST", Target::All, Value::Null).unwrap();
    let id = conv["id"].as_str().unwrap().to_string();
    let first = responses(&r, json!({"input": "hello", "conversation": id})).unwrap();
    let locked = (400, "conversation_locked", Some("conversation".into()));
    assert_eq!(shape(responses(&r, json!({"input": "x", "conversation": id}))), locked);
    assert_eq!(
        shape(call(&r, "POST", Target::Items(&id), json!({"items": [{"role": "user", "content": "a"}]}))),
        locked
    );
    let body = serde_json::to_vec(&json!({"model": "tiny", "input": "x", "conversation": id})).unwrap();
    assert!(r.handle(Endpoint::ResponsesInputTokens, &body).is_ok());
    assert!(call(&r, "GET", Target::Items(&id), Value::Null).is_ok());
    answer(&first, "world");
    let second = responses(&r, json!({"input": "x", "conversation": id})).unwrap();
    drop(second); // (never ran: its client went away)
    assert!(responses(&r, json!({"input": "x", "conversation": id})).is_ok());
}

/// An item id is in a conversation once (OpenAI: "Duplicate item found"), and an item id is a
/// string that a URL path can name.
#[test]
fn item_ids_are_unique_and_addressable() {
    let r = router();
    let item = |id: Value| json!({"type": "message", "role": "user", "content": "a", "id": id});
    let (conv, _) = call(&r, "POST", Target::All, json!({"items": [item(json!("msg_1"))]})).unwrap();
    let id = conv["id"].as_str().unwrap().to_string();
    let dup = |param: &str| (400, "invalid_value", Some(param.to_string()));
    assert_eq!(
        shape(call(&r, "POST", Target::Items(&id), json!({"items": [item(json!("msg_1"))]}))),
        dup("items[0].id")
    );
    assert_eq!(
        shape(call(&r, "POST", Target::All, json!({"items": [item(json!("m")), item(json!("m"))]}))),
        dup("items[1].id")
    );
    assert_eq!(shape(responses(&r, json!({"input": [item(json!("msg_1"))], "conversation": id}))), dup("input[0].id"));
    // a reference to an item of the same conversation is that item again
    let again = json!({"input": [{"type": "item_reference", "id": "msg_1"}], "conversation": id});
    assert_eq!(shape(responses(&r, again)), dup("input[0].id"));
    // and the refusals left the conversation free
    assert!(responses(&r, json!({"input": "x", "conversation": id})).is_ok());
    assert_eq!(
        shape(call(&r, "POST", Target::All, json!({"items": [item(json!(3))]}))),
        (400, "invalid_type", Some("items[0].id".into()))
    );
    for bad in ["", "a/b", "a b"] {
        assert_eq!(shape(call(&r, "POST", Target::All, json!({"items": [item(json!(bad))]}))), dup("items[0].id"));
    }
}

#[test]
fn a_conversation_too_long_for_the_context_is_named() {
    let r = router();
    let long = "word ".repeat(40);
    let (conv, _) =
        call(&r, "POST", Target::All, json!({"items": [{"type": "message", "role": "user", "content": long}]}))
            .unwrap();
    let id = conv["id"].as_str().unwrap();
    let err = responses(&r, json!({"input": "hi", "conversation": id})).unwrap_err();
    assert_eq!((err.status(), err.code(), err.param()), (400, "context_length_exceeded", Some("conversation")));
    assert!(err.message().contains("the conversation's items and the input have"), "{}", err.message());
    assert!(err.message().contains("delete items from the conversation"), "{}", err.message());
    // (alone, the input is what is too long)
    let err = responses(&r, json!({"input": long})).unwrap_err();
    assert_eq!(err.param(), Some("input"));
    assert!(err.message().contains("the input has") && err.message().contains("shorten the input"));
}
