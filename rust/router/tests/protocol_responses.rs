//! The Responses API: a request prepares exactly the chat request it means (same prompt ids,
//! same parameters), its errors and ignored fields are named in its own terms, and its
//! answer is a `response` object or OpenAI's event sequence.

mod protocol_fixture;

use std::sync::Arc;

use llmserve_router::protocol::{Endpoint, Prepared};
use llmserve_router::response::{ChoiceDelta, FinishReason, ResponseBuilder};
use llmserve_router::router::Router;
use protocol_fixture::*;
use serde_json::{json, Value};

/// `body` (with the served model) prepared as an `endpoint` request.
fn prepare(r: &Router, endpoint: Endpoint, body: Value) -> Result<Prepared, llmserve_router::error::ApiError> {
    let mut b = json!({"model": "tiny"});
    merge(&mut b, body);
    r.prepare(endpoint, &serde_json::to_vec(&b).unwrap())
}

fn responses(r: &Router, body: Value) -> Result<Prepared, llmserve_router::error::ApiError> {
    prepare(r, Endpoint::Responses, body)
}

fn chat_of(r: &Router, body: Value) -> Prepared {
    prepare(r, Endpoint::Chat, body).expect("the chat equivalent prepares")
}

#[test]
fn a_request_prepares_its_chat_equivalent() {
    let r = router();
    let p = responses(
        &r,
        json!({
            "instructions": "a b",
            "input": [
                {"role": "user", "content": "hello"},
                {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
                 "content": [{"type": "output_text", "text": "world", "annotations": []}]},
                {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "x"},
                {"type": "function_call_output", "call_id": "c2", "output": "z"},
                {"role": "developer", "content": [{"type": "input_text", "text": "y"}]},
            ],
            "max_output_tokens": 3,
            "temperature": 0.5,
            "top_p": 0.9,
        }),
    )
    .unwrap();
    let calls = json!([
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}},
        {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}},
    ]);
    let c = chat_of(
        &r,
        json!({
            "messages": [
                {"role": "system", "content": "a b"},
                {"role": "user", "content": "hello"},
                {"role": "assistant", "content": [{"type": "text", "text": "world"}], "tool_calls": calls},
                {"role": "tool", "tool_call_id": "c1", "content": "x", "name": "get_weather"},
                {"role": "tool", "tool_call_id": "c2", "content": "z", "name": "get_weather"},
                {"role": "developer", "content": [{"type": "text", "text": "y"}]},
            ],
            "max_completion_tokens": 3,
            "temperature": 0.5,
            "top_p": 0.9,
        }),
    );
    assert_eq!(p.prompts, c.prompts);
    assert_eq!(p.params, c.params);
    assert_eq!(p.endpoint, Endpoint::Responses);
    assert!(p.id.starts_with("resp_"), "{}", p.id);
    let echo = &p.responses.as_ref().expect("echo").fields;
    assert_eq!(echo["instructions"], "a b");
    assert_eq!((echo["temperature"].clone(), echo["top_p"].clone()), (json!(0.5), json!(0.9)));
    // stored by default, as OpenAI's
    assert_eq!((echo["store"].clone(), echo["max_output_tokens"].clone()), (json!(true), json!(3)));
    // what the SDK's `Response` types: the tier that served it, and the keys as sent (or null)
    assert_eq!(echo["service_tier"], "default");
    assert_eq!((echo["prompt_cache_key"].clone(), echo["safety_identifier"].clone()), (json!(null), json!(null)));
    let keys = json!({"input": "hi", "prompt_cache_key": "k1", "safety_identifier": "u-9", "service_tier": "flex"});
    let keyed = responses(&r, keys).unwrap();
    let echo = &keyed.responses.as_ref().unwrap().fields;
    assert_eq!((echo["prompt_cache_key"].clone(), echo["safety_identifier"].clone()), (json!("k1"), json!("u-9")));
    assert_eq!(echo["service_tier"], "default");

    // a string input is one user message; the client's request_id names the response
    let p = responses(&r, json!({"input": "hello world", "request_id": "abc"})).unwrap();
    assert_eq!(p.prompts, chat(&r, json!({})).unwrap().prompts);
    assert_eq!(p.id, "resp_abc");
    // ... unless no URL could read the stored response back by that id
    let err = responses(&r, json!({"input": "hi", "request_id": "a/b"})).unwrap_err();
    assert_eq!((err.status(), err.param()), (400, Some("request_id")));
    assert_eq!(responses(&r, json!({"input": "hi", "request_id": "a/b", "store": false})).unwrap().id, "resp_a/b");
}

#[test]
fn logprobs_are_asked_for_by_include_and_counted_by_top_logprobs() {
    let r = router();
    let k = |body: Value| responses(&r, body).unwrap().params.logprobs;
    let include = json!(["message.output_text.logprobs"]);
    assert_eq!(k(json!({"input": "hello"})), None);
    assert_eq!(k(json!({"input": "hello", "include": include})), Some(0));
    assert_eq!(k(json!({"input": "hello", "include": include, "top_logprobs": 3})), Some(3));
    // alone (as OpenAI's and vLLM's) it asks for nothing; 0, the default every response
    // echoes, is not reported
    assert_eq!(k(json!({"input": "hello", "top_logprobs": 3})), None);
    let ignored = |body: Value| responses(&r, body).unwrap().ignored;
    assert_eq!(ignored(json!({"input": "hello", "top_logprobs": 3})), ["top_logprobs"]);
    assert!(ignored(json!({"input": "hello", "top_logprobs": 0})).is_empty());
    // out of range on either side is a range error; a decimal or a string is no integer
    for (bad, code, message) in [
        (json!(-1), "invalid_value", "`top_logprobs` must be between 0 and 20, got -1."),
        (json!(21), "invalid_value", "`top_logprobs` must be between 0 and 20, got 21."),
        (json!(1.5), "invalid_type", "`top_logprobs` must be an integer."),
        (json!("3"), "invalid_type", "`top_logprobs` must be an integer."),
    ] {
        let e = responses(&r, json!({"input": "hello", "top_logprobs": bad})).unwrap_err();
        assert_eq!((e.code(), e.param(), e.message().as_str()), (code, Some("top_logprobs"), message), "{bad}");
    }
    // `tools: []` and `parallel_tool_calls` beside no tools, as agent SDKs send them (A72-1)
    let p = responses(&r, json!({"input": "hello", "tools": [], "tool_choice": "auto", "parallel_tool_calls": true}))
        .unwrap();
    assert!(p.ignored.is_empty() && p.tools.is_none(), "{:?}", p.ignored);
}

#[test]
fn errors_are_named_in_the_responses_terms() {
    let r = router();
    let err = |body: Value| shape(responses(&r, body));
    let bad = |param: &str| (400, "invalid_value", Some(param.to_string()));
    assert_eq!(err(json!({"input": "hello", "temperature": 9})), bad("temperature"));
    // a range error is invalid_value, a wrong kind invalid_type (audit R: -1 said invalid_type)
    assert_eq!(err(json!({"input": "hello", "max_tool_calls": -1})), bad("max_tool_calls"));
    assert_eq!(
        err(json!({"input": "hello", "max_tool_calls": "3"})),
        (400, "invalid_type", Some("max_tool_calls".into()))
    );
    assert_eq!(
        err(json!({"input": "hello", "max_output_tokens": 100})),
        (400, "context_length_exceeded", Some("max_output_tokens".into()))
    );
    assert_eq!(
        err(json!({"input": "hello", "tools": [{"type": "function", "name": "no space"}]})),
        bad("tools[0].name")
    );
    assert_eq!(
        err(json!({"input": "hello", "tools": [{"type": "function", "name": "f"}],
                   "tool_choice": {"type": "function", "name": "g"}})),
        bad("tool_choice.name")
    );
    assert_eq!(
        err(json!({"input": "hello", "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": 3}}}})),
        bad("text.format.schema")
    );
    assert_eq!(
        err(
            json!({"input": [{"role": "user", "content": "hello"}, {"role": "user", "content": [{"type": "input_text"}]}]})
        ),
        (400, "missing_required_parameter", Some("input[1].content[0].text".into()))
    );
    assert_eq!(
        err(json!({"input": [{"type": "function_call_output", "call_id": "c", "output": 3}]})),
        (400, "invalid_type", Some("input[0].output".into()))
    );
    // OpenAI's rule: each call has one output after it, and each output a call before it
    let call = |id: &str| json!({"type": "function_call", "call_id": id, "name": "f", "arguments": "{}"});
    let output = |id: &str| json!({"type": "function_call_output", "call_id": id, "output": "x"});
    let user = json!({"role": "user", "content": "hello"});
    for (input, param) in [
        (json!([user, output("c")]), "input[1].call_id"),
        (json!([user, output("c"), call("c")]), "input[1].call_id"),
        (json!([user, call("c"), output("c"), output("c")]), "input[3].call_id"),
        (json!([user, call("c"), user]), "input[1]"),
        (json!([user, call("c"), call("d"), output("d")]), "input[1]"),
    ] {
        let e = responses(&r, json!({"input": input})).unwrap_err();
        assert_eq!((e.code(), e.param()), ("invalid_value", Some(param)), "{input}");
        assert!(e.message().contains("\"c\""), "{}", e.message());
    }
    responses(&r, json!({"input": [user, call("c"), call("d"), output("d"), output("c")]})).unwrap();
    let unsupported = |param: &str| (400, "unsupported_parameter", Some(param.to_string()));
    for (body, param) in [
        (json!({"input": "hello", "max_tokens": 3}), "max_tokens"),
        (json!({"messages": []}), "messages"),
        (json!({"input": "hello", "return_token_ids": true}), "return_token_ids"),
        (json!({"input": "hello", "tools": [{"type": "file_search"}]}), "tools[0].type"),
        (
            json!({"input": "hello", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "mcp"}}),
            "tool_choice.type",
        ),
    ] {
        assert_eq!(err(body.clone()), unsupported(param), "{body}");
    }
    // refusals do not blame a store this server has (audit 77)
    let e = responses(&r, json!({"input": "hello", "prompt": {"id": "pmpt_1"}})).unwrap_err();
    assert_eq!(e.code(), "unsupported_parameter");
    assert!(!e.message().contains("stores no"), "{}", e.message());
    // a negative max_output_tokens is told its bound, without chat's words about `echo`
    let e = responses(&r, json!({"input": "hello", "max_output_tokens": -1})).unwrap_err();
    assert_eq!(e.message(), "`max_output_tokens` must be at least 1, got -1.");
    // the message quotes the field the client sent
    let e = responses(&r, json!({"input": "hello", "max_output_tokens": 100})).unwrap_err();
    assert!(
        e.message().contains("`max_output_tokens`") && !e.message().contains("max_completion_tokens"),
        "{}",
        e.message()
    );
}

#[test]
fn fields_without_effect_are_reported_in_the_responses_terms() {
    let r = router();
    let p = responses(
        &r,
        json!({
            "input": [
                {"role": "user", "content": "hello", "foo": 1},
                {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "a"}]},
            ],
            "include": ["reasoning.encrypted_content", "message.output_text.logprobs"],
            "reasoning": {"effort": "low"},
            "text": {"verbosity": "low"},
            "parallel_tool_calls": false,
            "service_tier": "flex",
        }),
    )
    .unwrap();
    // (the reasoning item has no assistant turn after it to belong to)
    assert_eq!(
        header(&p, "llmserve-ignored-fields"),
        Some("include[0], input[0].foo, input[1], reasoning.effort, service_tier, text.verbosity")
    );
    // `store: false` and OpenAI's defaults ask for nothing
    let p = responses(&r, json!({"input": "hello", "store": false, "truncation": "disabled", "background": false}))
        .unwrap();
    assert_eq!(header(&p, "llmserve-ignored-fields"), None);
    // without a store, `store: true` asks for what cannot be done
    let storeless = router_with(json!({"responses_store_bytes": 0}), Some(TEMPLATE));
    let p = responses(&storeless, json!({"input": "hello", "store": true})).unwrap();
    assert_eq!(header(&p, "llmserve-ignored-fields"), Some("store"));
    assert_eq!(p.responses.as_ref().unwrap().fields["store"], false);
    // strict field checking refuses them, by their Responses name
    let strict = router_with(json!({"strict_fields": true, "responses_store_bytes": 0}), Some(TEMPLATE));
    assert_eq!(
        shape(responses(&strict, json!({"input": "hello", "store": true}))),
        (400, "unsupported_parameter", Some("store".into()))
    );
    assert_eq!(
        shape(responses(&strict, json!({"input": "hello", "top_logprobs": 3}))),
        (400, "unsupported_parameter", Some("top_logprobs".into()))
    );
}

fn push(b: &mut ResponseBuilder, text: &str, finish: Option<FinishReason>) {
    b.push(0, &ChoiceDelta { text, tokens: &[], ids: &[9], finish, stop_reason: None });
}

#[test]
fn a_streamed_answer_is_openais_event_sequence_and_adds_up_to_the_body() {
    let r = router();
    let run = |stream: bool| {
        let p = responses(&r, json!({"input": "hello", "stream": stream, "max_output_tokens": 2})).unwrap();
        let mut b = ResponseBuilder::new(&p, Arc::new(tokenizer()));
        let mut out = b.take();
        push(&mut b, "a", None);
        out.extend(b.take());
        push(&mut b, " b", Some(FinishReason::Length));
        out.extend(b.take());
        out.extend(b.finish());
        out
    };
    let evs = sse_events(&run(true));
    let kinds: Vec<&str> = evs.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        kinds,
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.incomplete",
        ]
    );
    for (i, (_, data)) in evs.iter().enumerate() {
        assert_eq!(data["sequence_number"], i);
    }
    assert_eq!(evs[0].1["response"]["status"], "in_progress");
    assert_eq!(evs[0].1["response"]["output"], json!([]));
    let item_id = evs[2].1["item"]["id"].as_str().unwrap().to_string();
    assert!(item_id.starts_with("msg_"));
    assert_eq!(evs[8].1["item"]["id"], item_id.as_str());
    for (_, data) in &evs[3..8] {
        assert_eq!((data["item_id"].as_str(), data["output_index"].as_u64()), (Some(item_id.as_str()), Some(0)));
    }
    assert_eq!(evs[6].1["text"], "a b");
    let streamed = &evs[9].1["response"];
    let body: Value = serde_json::from_slice(&run(false)).unwrap();
    for r in [streamed, &body] {
        assert_eq!(r["status"], "incomplete");
        assert_eq!(r["incomplete_details"], json!({"reason": "max_output_tokens"}));
        assert_eq!(r["output"][0]["status"], "incomplete");
        assert_eq!(r["output"][0]["content"], json!([{"type": "output_text", "text": "a b", "annotations": []}]));
        assert_eq!(r["usage"]["output_tokens"], 2);
        assert_eq!(r["usage"]["input_tokens"], r["usage"]["total_tokens"].as_u64().unwrap() - 2);
        assert_eq!(r["object"], "response");
        assert_eq!(r["store"], true);
    }
}

/// A call made whole, then text that `max_output_tokens` cut: the body lists the message before
/// the call (FIELDS), and the item cut off, `incomplete`, is the message, as the stream's final
/// object has it, not the call by its place (audit F).
#[test]
fn the_item_cut_off_is_the_incomplete_one_wherever_the_body_lists_it() {
    let r = router_with(json!({"tool_call_format": "hermes"}), Some(TEMPLATE));
    let tools = json!([{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]);
    let run = |stream: bool, pieces: &[&str]| {
        let p =
            responses(&r, json!({"input": "hi", "tools": tools, "stream": stream, "max_output_tokens": 9})).unwrap();
        let mut b = ResponseBuilder::new(&p, Arc::new(tokenizer()));
        let mut out = b.take();
        for (i, piece) in pieces.iter().enumerate() {
            push(&mut b, piece, (i + 1 == pieces.len()).then_some(FinishReason::Length));
            out.extend(b.take());
        }
        out.extend(b.finish());
        out
    };
    let status = |output: &Value| -> Vec<(String, String)> {
        let items = output.as_array().unwrap().iter();
        items.map(|i| (i["type"].as_str().unwrap().into(), i["status"].as_str().unwrap().into())).collect()
    };
    let whole_call = ["<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {}}\n</tool_call>", "\n<tool"];
    let body: Value = serde_json::from_slice(&run(false, &whole_call)).unwrap();
    let s = |a: &str, b: &str| (a.to_string(), b.to_string());
    assert_eq!(status(&body["output"]), [s("message", "incomplete"), s("function_call", "completed")]);
    let streamed = sse_events(&run(true, &whole_call)).pop().unwrap().1;
    assert_eq!(status(&streamed["response"]["output"]), [s("function_call", "completed"), s("message", "incomplete")]);
    // a call cut inside its arguments is the one
    let cut_call = ["<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"ci"];
    let body: Value = serde_json::from_slice(&run(false, &cut_call)).unwrap();
    assert_eq!(status(&body["output"]), [s("function_call", "incomplete")]);
}

#[test]
fn an_empty_answer_is_one_empty_message() {
    let r = router();
    for stream in [false, true] {
        let p = responses(&r, json!({"input": "hello", "stream": stream})).unwrap();
        let mut b = ResponseBuilder::new(&p, Arc::new(tokenizer()));
        let mut out = b.take();
        push(&mut b, "", Some(FinishReason::Stop));
        out.extend(b.take());
        out.extend(b.finish());
        let body = if stream {
            sse_events(&out).pop().unwrap().1["response"].clone()
        } else {
            serde_json::from_slice(&out).unwrap()
        };
        assert_eq!(body["status"], "completed");
        assert_eq!(body["output"].as_array().unwrap().len(), 1);
        assert_eq!(body["output"][0]["content"][0]["text"], "", "stream: {stream}");
    }
}

/// The stored body of response `id`.
fn stored(r: &Router, id: &str) -> Value {
    serde_json::from_slice(&r.responses().body(id).unwrap()).unwrap()
}

#[test]
fn a_background_response_is_stored_queued_and_follows_its_run() {
    let r = router();
    for stream in [false, true] {
        let p = responses(&r, json!({"input": "hello", "background": true, "stream": stream})).unwrap();
        // stored as it is prepared: the request returns at once, and is read back by its id
        assert!(p.background() && p.stream == stream);
        let queued = stored(&r, &p.id);
        assert_eq!((queued["status"].as_str(), queued["background"].as_bool()), (Some("queued"), Some(true)));
        assert_eq!(queued["output"], json!([]));
        // its bytes are its events whether or not its client streams them
        let mut b = ResponseBuilder::new(&p, Arc::new(tokenizer()));
        let evs = sse_events(&b.take());
        let kinds: Vec<&str> = evs.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(kinds, ["response.created", "response.queued"]);
        assert_eq!(evs[0].1["response"]["status"], "queued");
        // its first output: in progress, in the events and in the store
        push(&mut b, "a", None);
        let evs = sse_events(&b.take());
        assert_eq!(
            (evs[0].0.as_str(), &evs[0].1["response"]["status"]),
            ("response.in_progress", &json!("in_progress"))
        );
        assert_eq!(evs[0].1["sequence_number"], 2);
        let running = stored(&r, &p.id);
        assert_eq!(running["status"], "in_progress");
        // its output so far: the message being written, as it stands
        assert_eq!(running["output"][0]["status"], "in_progress");
        assert_eq!(running["output"][0]["content"][0]["text"], "a");
        // brought up to date a few times a second, not at every token
        push(&mut b, " b", None);
        assert_eq!(stored(&r, &p.id)["output"][0]["content"][0]["text"], "a");
        std::thread::sleep(std::time::Duration::from_millis(120));
        push(&mut b, " c", None);
        assert_eq!(stored(&r, &p.id)["output"][0]["content"][0]["text"], "a b c");
        b.take();
        // continuing it while it runs is a 400 (its output is not known yet)
        let e = responses(&r, json!({"input": "more", "previous_response_id": p.id})).unwrap_err();
        assert_eq!((e.status(), e.param()), (400, Some("previous_response_id")));
        push(&mut b, "", Some(FinishReason::Stop));
        let last = sse_events(&b.finish()).pop().unwrap();
        assert_eq!(last.0, "response.completed");
        let done = stored(&r, &p.id);
        assert_eq!(done, last.1["response"]);
        assert_eq!((done["status"].as_str(), done["background"].as_bool()), (Some("completed"), Some(true)));
        assert_eq!(done["output"][0]["content"][0]["text"], "a b c");
        assert_eq!(done["output"][0]["status"], "completed");
        // done: it can be continued, and cancelling it answers it as it is
        responses(&r, json!({"input": "more", "previous_response_id": p.id})).unwrap();
        assert_eq!(serde_json::from_slice::<Value>(&r.responses().cancel(&p.id).unwrap()).unwrap(), done);
    }
    // a background response must be stored
    let e = responses(&r, json!({"input": "hello", "background": true, "store": false})).unwrap_err();
    assert_eq!((e.status(), e.code(), e.param()), (400, "invalid_value", Some("background")));
    let storeless = router_with(json!({"responses_store_bytes": 0}), Some(TEMPLATE));
    let e = responses(&storeless, json!({"input": "hello", "background": true})).unwrap_err();
    assert_eq!((e.code(), e.param()), ("unsupported_parameter", Some("background")));
    assert!(e.message().contains("--responses-store-mib"), "{}", e.message());
    // counting its tokens runs nothing: `background` asks for nothing there
    let counted =
        r.handle(Endpoint::ResponsesInputTokens, br#"{"model": "tiny", "input": "hi", "background": true}"#).unwrap();
    assert!(
        counted.headers.contains(&("llmserve-ignored-fields".into(), "background".into())),
        "{:?}",
        counted.headers
    );
}

#[test]
fn a_background_response_cancelled_failed_or_dropped_says_so() {
    let r = router();
    let background = |r: &Router| responses(r, json!({"input": "hello", "background": true})).unwrap();
    // cancelled while it runs: what it then produces changes nothing
    let p = background(&r);
    let mut b = ResponseBuilder::new(&p, Arc::new(tokenizer()));
    push(&mut b, "a", None);
    let cancelled: Value = serde_json::from_slice(&r.responses().cancel(&p.id).unwrap()).unwrap();
    assert_eq!(cancelled["status"], "cancelled");
    // it keeps the output it had, the message it was writing `incomplete`
    assert_eq!(cancelled["output"][0]["content"][0]["text"], "a");
    assert_eq!(cancelled["output"][0]["status"], "incomplete");
    // continued, it answers that output as the client saw it
    let next = responses(&r, json!({"input": "more", "previous_response_id": p.id})).unwrap();
    assert!(next.prompt_texts[0].contains("assistant : a </s> user : more"), "{}", next.prompt_texts[0]);
    push(&mut b, " b", Some(FinishReason::Stop));
    b.finish();
    drop(b);
    assert_eq!(stored(&r, &p.id), cancelled);
    assert_eq!(serde_json::from_slice::<Value>(&r.responses().cancel(&p.id).unwrap()).unwrap(), cancelled);
    // an engine failure: `response.failed`, and the store says why
    let p = background(&r);
    let mut b = ResponseBuilder::new(&p, Arc::new(tokenizer()));
    b.take();
    let err = llmserve_router::error::ApiError::Internal { message: "the step failed".into() };
    let evs = sse_events(&b.failed(&err).unwrap());
    assert_eq!((evs[0].0.as_str(), evs[0].1["sequence_number"].as_u64()), ("response.failed", Some(2)));
    let failed = stored(&r, &p.id);
    assert_eq!(evs[0].1["response"], failed);
    assert_eq!(failed["status"], "failed");
    assert_eq!(failed["error"], json!({"code": "server_error", "message": "the step failed"}));
    // a foreground request ends with the error as it always has; streamed, its client holds
    // its id, and it is kept `failed` with the output it had (audit V2: a 404)
    let p = responses(&r, json!({"input": "hello", "stream": true})).unwrap();
    let mut b = ResponseBuilder::new(&p, Arc::new(tokenizer()));
    push(&mut b, "a b", None);
    assert!(b.failed(&err).is_none());
    let kept = stored(&r, &p.id);
    assert_eq!((kept["status"].as_str(), &kept["error"]), (Some("failed"), &failed["error"]));
    assert_eq!(kept["output"][0]["content"][0]["text"], "a b");
    assert_eq!(kept["output"][0]["status"], "incomplete");
    // not streamed (the client gets the error, and no id), or not to be stored: nothing kept
    for body in [json!({"input": "hello"}), json!({"input": "hello", "stream": true, "store": false})] {
        let p = responses(&r, body).unwrap();
        assert!(ResponseBuilder::new(&p, Arc::new(tokenizer())).failed(&err).is_none());
        assert_eq!(r.responses().body(&p.id).unwrap_err().status(), 404);
    }
    // dropped after the engine took it (a shutdown): failed
    let p = background(&r);
    drop(ResponseBuilder::new(&p, Arc::new(tokenizer())));
    let id = p.id.clone();
    drop(p);
    assert_eq!(stored(&r, &id)["status"], "failed");
    // refused before the engine took it (a full queue): as if never made
    let p = background(&r);
    let id = p.id.clone();
    drop(p);
    assert_eq!(r.responses().body(&id).unwrap_err().status(), 404);
    // deleted while it runs: it stays deleted
    let p = background(&r);
    let mut b = ResponseBuilder::new(&p, Arc::new(tokenizer()));
    r.responses().delete(&p.id).unwrap();
    push(&mut b, "a", Some(FinishReason::Stop));
    b.finish();
    assert_eq!(r.responses().body(&p.id).unwrap_err().status(), 404);
    // a response that did not run in the background cannot be cancelled
    let p = responses(&r, json!({"input": "hello"})).unwrap();
    let mut b = ResponseBuilder::new(&p, Arc::new(tokenizer()));
    push(&mut b, "a", Some(FinishReason::Stop));
    b.finish();
    let e = r.responses().cancel(&p.id).unwrap_err();
    assert_eq!((e.status(), e.param()), (400, Some("response_id")));
    assert_eq!(r.responses().cancel("resp_nope").unwrap_err().status(), 404);
}

/// Audit 71's findings: names the client sent, and defaults it may send back.
#[test]
fn audit71_names_and_defaults() {
    let r = router();
    // calls a template without tool support drops are the function_call items (A71-3)
    let p = responses(
        &r,
        json!({"input": [
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "world"},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "x"},
            {"type": "function_call_output", "call_id": "c2", "output": "y"},
        ]}),
    )
    .unwrap();
    assert_eq!(header(&p, "llmserve-ignored-fields"), Some("input[2], input[3], input[4].call_id, input[5].call_id"));
    // a tool result's content is its `output` (A71-5)
    let out = json!({"input": [
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": []},
    ]});
    assert_eq!(shape(responses(&r, out)), (400, "invalid_value", Some("input[1].output".into())));
    // messages quote the Responses field (A71-6)
    let e = responses(&r, json!({"input": "hello", "tools": [{"type": "function"}]})).unwrap_err();
    assert_eq!(e.param(), Some("tools[0].name"));
    assert!(e.message().contains("`tools[0].name`"), "{}", e.message());
    let e = responses(&r, json!({"input": "a b c a b c a b c a b c a b c a b c a b c a b c a b c a b c a b c"}))
        .unwrap_err();
    assert!(e.message().contains("the input has"), "{}", e.message());
    // OpenAI's default tool_choice, which every response echoes, may come back without tools (A71-7)
    for choice in ["auto", "none"] {
        let p = responses(&r, json!({"input": "hello", "tool_choice": choice})).unwrap();
        assert_eq!(header(&p, "llmserve-ignored-fields"), None);
    }
    assert_eq!(
        shape(responses(&r, json!({"input": "hello", "tool_choice": "required"}))).2.as_deref(),
        Some("tool_choice")
    );
    // a named choice's other keys are reported (A71-8)
    let p = responses(
        &r,
        json!({"input": "hello", "tools": [{"type": "function", "name": "f"}],
               "tool_choice": {"type": "function", "name": "f", "strict": true}}),
    )
    .unwrap();
    assert!(p.ignored.contains(&"tool_choice.strict".to_string()), "{:?}", p.ignored);
    // a json_schema format needs its schema (A71-9)
    assert_eq!(
        shape(responses(&r, json!({"input": "hello", "text": {"format": {"type": "json_schema", "name": "x"}}}))),
        (400, "missing_required_parameter", Some("text.format.schema".into()))
    );
    // no stream is obfuscated (A71-10)
    let p = responses(&r, json!({"input": "hello", "stream": true, "stream_options": {"include_obfuscation": false}}))
        .unwrap();
    assert_eq!(header(&p, "llmserve-ignored-fields"), None);
    // OpenAI's metadata limits (A71-11)
    let many: serde_json::Map<String, Value> = (0..17).map(|i| (format!("k{i}"), json!("v"))).collect();
    assert_eq!(shape(responses(&r, json!({"input": "hello", "metadata": many}))).2.as_deref(), Some("metadata"));
}

/// Logprobs of tokens that showed no text yet go out with the next delta, and those of a
/// character the answer was cut inside with an empty one, so the deltas add up (A71-1).
#[test]
fn streamed_logprobs_add_up_to_the_done_event() {
    let r = router();
    let p =
        responses(&r, json!({"input": "hello", "stream": true, "include": ["message.output_text.logprobs"]})).unwrap();
    let mut b = ResponseBuilder::new(&p, Arc::new(tokenizer()));
    let tok = |id| llmserve_router::response::TokenOut { id, logprob: -0.5, top: vec![], text_offset: 0 };
    let (t1, t2, t3) = ([tok(13)], [tok(14)], [tok(15)]);
    let mut out = b.take();
    b.push(0, &ChoiceDelta { text: "", tokens: &t1, ids: &[13], finish: None, stop_reason: None });
    b.push(0, &ChoiceDelta { text: "a", tokens: &t2, ids: &[14], finish: None, stop_reason: None });
    b.push(
        0,
        &ChoiceDelta { text: "", tokens: &t3, ids: &[15], finish: Some(FinishReason::Length), stop_reason: None },
    );
    out.extend(b.take());
    out.extend(b.finish());
    let evs = sse_events(&out);
    let deltas: Vec<(String, usize)> = evs
        .iter()
        .filter(|(k, _)| k == "response.output_text.delta")
        .map(|(_, d)| (d["delta"].as_str().unwrap().to_string(), d["logprobs"].as_array().unwrap().len()))
        .collect();
    assert_eq!(deltas, [("a".to_string(), 2), (String::new(), 1)]);
    let done = &evs.iter().find(|(k, _)| k == "response.output_text.done").unwrap().1;
    assert_eq!(done["logprobs"].as_array().unwrap().len(), 3);
    let last = &evs.last().unwrap().1["response"]["output"][0]["content"][0];
    assert_eq!(last["logprobs"].as_array().unwrap().len(), 3);
}

/// The prompts of the chat request "hello", the answer "world", then "x": what a stored
/// response's continuation (or its items sent again by reference) reads.
fn hello_world_then_x(r: &Router) -> Vec<Vec<u32>> {
    chat_of(
        r,
        json!({"messages": [
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": [{"type": "text", "text": "world"}]},
            {"role": "user", "content": "x"},
        ]}),
    )
    .prompts
}

/// A stored response is read back and continued: `previous_response_id` prepends its
/// conversation (its input and output items, not its instructions) to the new input.
#[test]
fn a_stored_response_is_continued_by_its_id() {
    let r = router();
    let p = responses(&r, json!({"input": "hello", "instructions": "a"})).unwrap();
    let mut b = ResponseBuilder::new(&p, Arc::new(tokenizer()));
    push(&mut b, "world", Some(FinishReason::Stop));
    let body: Value = serde_json::from_slice(&b.finish()).unwrap();
    assert_eq!(body["store"], true);
    let stored: Value = serde_json::from_slice(&r.responses().body(&p.id).unwrap()).unwrap();
    assert_eq!(stored, body);

    let next = responses(&r, json!({"input": "x", "previous_response_id": p.id})).unwrap();
    assert_eq!(next.prompts, hello_world_then_x(&r));
    assert_eq!(next.responses.as_ref().unwrap().fields["previous_response_id"], json!(p.id));
    // nothing of the continued response is reported, and its items are listed with ids
    assert_eq!(header(&next, "llmserve-ignored-fields"), None);
    let query = [("order".to_string(), "asc".to_string())];
    let items: Value = serde_json::from_slice(&r.stored_response_route(&p.id, true, &query).unwrap().body).unwrap();
    assert_eq!(items["data"][0]["content"], json!([{"type": "input_text", "text": "hello"}]));
    assert!(items["data"][0]["id"].as_str().unwrap().starts_with("msg_"));

    // not stored, unknown, or a store turned off
    let unstored = responses(&r, json!({"input": "hello", "store": false})).unwrap();
    assert!(unstored.responses.as_ref().unwrap().store.is_none());
    assert_eq!(
        shape(responses(&r, json!({"input": "x", "previous_response_id": "resp_nope"}))),
        (400, "previous_response_not_found", Some("previous_response_id".into()))
    );
    let storeless = router_with(json!({"responses_store_bytes": 0}), Some(TEMPLATE));
    assert_eq!(
        shape(responses(&storeless, json!({"input": "x", "previous_response_id": p.id}))),
        (400, "unsupported_parameter", Some("previous_response_id".into()))
    );
    r.responses().delete(&p.id).unwrap();
    assert_eq!(r.responses().body(&p.id).unwrap_err().status(), 404);
}

/// `truncation: "auto"` drops the conversation's first turns (at user messages) until the
/// prompt fits: the fewest that make it fit, so the request prepares as the turns kept alone
/// would; `disabled`, and a conversation whose last turn alone is too long, stay 400s.
#[test]
fn truncation_auto_drops_the_first_turns_until_the_prompt_fits() {
    let r = router();
    let mut input: Vec<Value> = (0..6)
        .flat_map(|k| {
            [json!({"role": "user", "content": format!("hello {k}")}), json!({"role": "assistant", "content": "world"})]
        })
        .collect();
    input.push(json!({"role": "user", "content": "x"}));
    let body =
        |items: &[Value], truncation: &str| json!({"input": items, "max_output_tokens": 4, "truncation": truncation});
    assert_eq!(shape(responses(&r, body(&input, "disabled"))).1, "context_length_exceeded");
    let auto = responses(&r, body(&input, "auto")).unwrap();
    // the least number of first items dropped (at a user message) that fits
    let fits = |k: usize| responses(&r, body(&input[k..], "disabled")).ok();
    let k = (2..input.len()).step_by(2).find(|&k| fits(k).is_some()).expect("the last turns fit");
    assert!(k >= 4, "the test needs several turns dropped, got {k}");
    assert_eq!(auto.prompts, fits(k).unwrap().prompts);
    assert_eq!(auto.responses.as_ref().unwrap().fields["truncation"], "auto");
    // it keeps what it is told to: the instructions, and every item sent is stored
    let told =
        responses(&r, json!({"input": input, "max_output_tokens": 4, "truncation": "auto", "instructions": "a"}))
            .unwrap();
    let alone = responses(&r, json!({"input": input[k + 2..], "max_output_tokens": 4, "instructions": "a"})).unwrap();
    assert_eq!(told.prompts, alone.prompts, "one more turn goes for the instructions");
    assert_eq!(told.responses.as_ref().unwrap().store.as_ref().unwrap().1.len(), input.len());
    // the last user message alone too long: the 400
    let long = vec![json!({"role": "user", "content": "hello ".repeat(40)})];
    assert_eq!(shape(responses(&r, body(&long, "auto"))).1, "context_length_exceeded");

    // the items of a continued response are dropped first
    let first = responses(&r, json!({"input": input[..input.len() - 1]})).unwrap_err();
    assert_eq!(first.code(), "context_length_exceeded");
    let short = responses(&r, json!({"input": input[..4]})).unwrap();
    let mut b = ResponseBuilder::new(&short, Arc::new(tokenizer()));
    push(&mut b, "world", Some(FinishReason::Stop));
    b.finish();
    let next = json!({"input": "x", "previous_response_id": short.id, "max_output_tokens": 12});
    let mut auto_next = next.clone();
    auto_next["truncation"] = json!("auto");
    assert_eq!(shape(responses(&r, next)).1, "context_length_exceeded", "the test needs it too long");
    let p = responses(&r, auto_next).unwrap();
    // the cuts: before its second user message, or before the input (all of it dropped)
    let kept = json!([input[2], input[3], {"role": "assistant", "content": "world"}, {"role": "user", "content": "x"}]);
    let want = match responses(&r, json!({"input": kept, "max_output_tokens": 12})) {
        Ok(kept) => kept,
        Err(_) => responses(&r, json!({"input": "x", "max_output_tokens": 12})).unwrap(),
    };
    assert_eq!(p.prompts, want.prompts);
    assert!(p.prompts[0].len() + 12 <= MAX_LEN as usize);
}

/// An input item whose id an item before it has (a continued response's, by reference or sent
/// back whole, or another input item) is OpenAI's 400: it would stand twice in the prompt.
#[test]
fn duplicate_items_are_refused() {
    let r = router();
    let p = responses(&r, json!({"input": [{"role": "user", "content": "hello", "id": "msg_hello"}]})).unwrap();
    let mut b = ResponseBuilder::new(&p, Arc::new(tokenizer()));
    push(&mut b, "world", Some(FinishReason::Stop));
    let body: Value = serde_json::from_slice(&b.finish()).unwrap();
    let output = body["output"][0].clone();
    let ask = json!({"role": "user", "content": "x"});
    let dup = |input: Value, previous: bool| {
        let mut req = json!({"input": input});
        if previous {
            req["previous_response_id"] = body["id"].clone();
        }
        shape(responses(&r, req))
    };
    let refused = |i: usize| (400, "invalid_value", Some(format!("input[{i}]")));
    let reference = json!({"type": "item_reference", "id": output["id"]});
    assert_eq!(dup(json!([reference, ask]), true), refused(0));
    assert_eq!(dup(json!([output, ask]), true), refused(0));
    assert_eq!(dup(json!([ask, reference, reference]), false), refused(2));
    let e = responses(&r, json!({"input": [reference, reference]})).unwrap_err();
    assert!(e.message().starts_with("Duplicate item found with id msg_"), "{}", e.message());
    // once each is fine
    assert!(responses(&r, json!({"input": [reference, ask]})).is_ok());
    assert!(responses(&r, json!({"input": [ask], "previous_response_id": body["id"]})).is_ok());
}

/// An `item_reference` input item is the stored item with that id, from a stored response's
/// conversation or its output: the request prepares as if the item itself had been sent, and
/// the new response lists it under the same id.
#[test]
fn item_references_are_the_stored_items() {
    let r = router();
    let p = responses(&r, json!({"input": [{"role": "user", "content": "hello", "id": "msg_hello"}]})).unwrap();
    let mut b = ResponseBuilder::new(&p, Arc::new(tokenizer()));
    push(&mut b, "world", Some(FinishReason::Stop));
    let body: Value = serde_json::from_slice(&b.finish()).unwrap();
    let answer = body["output"][0]["id"].as_str().unwrap().to_string();

    let next = responses(
        &r,
        json!({"input": [
            {"type": "item_reference", "id": "msg_hello"},
            {"type": "item_reference", "id": answer},
            {"role": "user", "content": "x"},
        ]}),
    )
    .unwrap();
    assert_eq!(next.prompts, hello_world_then_x(&r));
    assert_eq!(header(&next, "llmserve-ignored-fields"), None);
    let (_, conversation) = next.responses.as_ref().unwrap().store.clone().unwrap();
    let conversation = conversation.values();
    let ids: Vec<&str> = conversation.iter().map(|i| i["id"].as_str().unwrap()).collect();
    assert_eq!(ids[..2], ["msg_hello", answer.as_str()]);
    assert_eq!(conversation[1]["content"][0]["text"], "world");

    // a reference may leave its type out (OpenAI's schema), or send it null
    for reference in [json!({"id": "msg_hello"}), json!({"id": "msg_hello", "type": null})] {
        let p = responses(&r, json!({"input": [reference, {"role": "user", "content": "x"}]})).unwrap();
        let by_hand =
            chat_of(&r, json!({"messages": [{"role": "user", "content": "hello"}, {"role": "user", "content": "x"}]}));
        assert_eq!(p.prompts, by_hand.prompts);
    }
    // a reference's other keys are reported; unknown ids, a missing id and a store turned
    // off are 400s on the reference
    let extra = json!({"input": [{"type": "item_reference", "id": "msg_hello", "note": 1}]});
    assert_eq!(header(&responses(&r, extra).unwrap(), "llmserve-ignored-fields"), Some("input[0].note"));
    assert_eq!(
        shape(responses(&r, json!({"input": [{"type": "item_reference", "id": "msg_nope"}]}))),
        (400, "item_not_found", Some("input[0].id".into()))
    );
    assert_eq!(shape(responses(&r, json!({"input": [{"type": "item_reference"}]}))).2, Some("input[0].id".into()));
    let storeless = router_with(json!({"responses_store_bytes": 0}), Some(TEMPLATE));
    assert_eq!(
        shape(responses(&storeless, json!({"input": [{"type": "item_reference", "id": "msg_hello"}]}))),
        (400, "unsupported_parameter", Some("input[0].type".into()))
    );
    // deleted with the only response that held it
    r.responses().delete(&p.id).unwrap();
    let gone = json!({"input": [{"type": "item_reference", "id": "msg_hello"}]});
    assert_eq!(shape(responses(&r, gone)).1, "item_not_found");

    // a referenced item is the stored one itself: sent again by reference it is held once,
    // sent again in full it is held twice
    let r = router_with(json!({"max_model_len": 10_000}), Some(TEMPLATE));
    let long = "hello ".repeat(3000);
    let answered = |body: Value| {
        let mut b = ResponseBuilder::new(&responses(&r, body).unwrap(), Arc::new(tokenizer()));
        push(&mut b, "world", Some(FinishReason::Stop));
        b.finish();
    };
    answered(json!({"input": [{"role": "user", "content": long, "id": "msg_long"}]}));
    let held = r.responses().held();
    answered(json!({"input": [{"type": "item_reference", "id": "msg_long"}, {"role": "user", "content": "x"}]}));
    let by_reference = r.responses().held() - held;
    answered(json!({"input": [{"role": "user", "content": long, "id": "msg_long"}, {"role": "user", "content": "x"}]}));
    let in_full = r.responses().held() - held - by_reference;
    assert!(by_reference < 2_000 && in_full > long.len(), "{by_reference} {in_full}");
}

/// `POST /v1/responses/input_tokens` counts the prompt `POST /v1/responses` would read from the
/// same body (audit 78); what only shapes a generation is reported; errors are the route's.
#[test]
fn input_tokens_count_the_prompt_the_request_reads() {
    use llmserve_router::protocol::Endpoint;
    let r = router();
    let count = |body: Value| {
        let mut b = json!({"model": "tiny"});
        merge(&mut b, body);
        r.handle(Endpoint::ResponsesInputTokens, &serde_json::to_vec(&b).unwrap())
    };
    let body = json!({"input": [{"role": "user", "content": "hello world"}], "instructions": "a b"});
    let handled = count(body.clone()).unwrap();
    let answer: Value = serde_json::from_slice(&handled.body).unwrap();
    let prepared = responses(&r, body).unwrap();
    assert_eq!(answer, json!({"object": "response.input_tokens", "input_tokens": prepared.prompts[0].len()}));
    assert!(handled.headers.is_empty());
    // generation-only fields ask for nothing; nothing is stored
    let handled = count(json!({"input": "hello", "max_output_tokens": 3, "stream": true, "store": true})).unwrap();
    assert_eq!(
        handled.headers,
        [("llmserve-ignored-fields".to_string(), "max_output_tokens, store, stream".to_string())]
    );
    assert_eq!(shape(count(json!({"input": []}))), (400, "invalid_value", Some("input".into())));
    assert_eq!(shape(count(json!({"input": "x", "model": "nope"}))).1, "model_not_found");
    // sampling fields shape no prompt: reported, still checked
    let handled = count(json!({"input": "hello", "temperature": 0.3, "stop": ["x"], "seed": 1, "metadata": {"a": "b"},
                               "include": ["message.output_text.logprobs"], "top_k": 2}))
    .unwrap();
    assert_eq!(
        handled.headers,
        [("llmserve-ignored-fields".to_string(), "include, metadata, seed, stop, temperature, top_k".to_string())]
    );
    assert_eq!(shape(count(json!({"input": "hello", "temperature": 5}))).2, Some("temperature".into()));
    // `model` may be left out (the served model's); a continued response needs no new input
    let plain = r.handle(Endpoint::ResponsesInputTokens, &serde_json::to_vec(&json!({"input": "hello"})).unwrap());
    let with_model = count(json!({"input": "hello"})).unwrap();
    assert_eq!(plain.unwrap().body, with_model.body);
    let p = responses(&r, json!({"input": "hello"})).unwrap();
    let mut b = ResponseBuilder::new(&p, Arc::new(tokenizer()));
    push(&mut b, "world", Some(FinishReason::Stop));
    let id = serde_json::from_slice::<Value>(&b.finish()).unwrap()["id"].clone();
    let continued: Value = serde_json::from_slice(&count(json!({"previous_response_id": id})).unwrap().body).unwrap();
    assert!(continued["input_tokens"].as_u64().unwrap() > 0);
    // answered without input, only its output joins the conversation (no empty user turn)
    let p = responses(&r, json!({"previous_response_id": id})).unwrap();
    let (_, kept) = p.responses.as_ref().unwrap().store.clone().unwrap();
    let roles: Vec<Value> = kept.values().iter().map(|i| i["role"].clone()).collect();
    assert_eq!(roles, [json!("user"), json!("assistant")]);
    let mut b = ResponseBuilder::new(&p, Arc::new(tokenizer()));
    push(&mut b, "again", Some(FinishReason::Stop));
    let next = serde_json::from_slice::<Value>(&b.finish()).unwrap()["id"].clone();
    assert!(responses(&r, json!({"previous_response_id": next, "input": "x"})).is_ok());
    assert_eq!(shape(count(json!({}))), (400, "missing_required_parameter", Some("input".into())));
}

/// `stream_options` without `stream: true` is a 400, as on chat (audit 79).
#[test]
fn stream_options_need_a_stream() {
    let r = router();
    for options in [json!({"include_obfuscation": false}), json!({"include_obfuscation": true})] {
        assert_eq!(
            shape(responses(&r, json!({"input": "hello", "stream_options": options}))),
            (400, "invalid_value", Some("stream_options".into()))
        );
    }
    responses(&r, json!({"input": "hello", "stream": true, "stream_options": {"include_obfuscation": false}})).unwrap();
}

/// `reasoning.effort: "none"` asks for nothing where no thinking comes (audit 79), and is
/// reported where it does.
#[test]
fn reasoning_effort_none_is_reported_only_where_thinking_comes() {
    let none = json!({"input": "hello", "reasoning": {"effort": "none"}});
    let p = responses(&router(), none.clone()).unwrap();
    assert_eq!(header(&p, "llmserve-ignored-fields"), None);
    // nor does the SDK's default `image`
    let image = json!({"input": "hello", "image": {"context_compression": "auto"}});
    assert_eq!(header(&responses(&router(), image).unwrap(), "llmserve-ignored-fields"), None);
    let image = json!({"input": "hello", "image": {"context_compression": "off"}});
    assert_eq!(header(&responses(&router(), image).unwrap(), "llmserve-ignored-fields"), Some("image"));
    // a think block the template switches: "none" switches it off
    let think = router_with(json!({}), Some(THINK_TEMPLATE));
    let p = responses(&think, none.clone()).unwrap();
    assert!(p.prompt_texts[0].ends_with("</think>\n\n"), "{:?}", p.prompt_texts[0]);
    assert_eq!(header(&p, "llmserve-ignored-fields"), None);
    // one it cannot switch: reported, in the Responses request's terms
    let unswitched =
        router_with(json!({"reasoning_parser": "think"}), Some("{% for m in messages %}{{ m.content }}{% endfor %}"));
    let p = responses(&unswitched, none).unwrap();
    assert_eq!(header(&p, "llmserve-ignored-fields"), Some("reasoning.effort"));
    let high = json!({"input": "hello", "reasoning": {"effort": "high", "summary": "auto"}});
    let p = responses(&think, high.clone()).unwrap();
    assert_eq!(header(&p, "llmserve-ignored-fields"), Some("reasoning.effort, reasoning.summary"));
    let strict = router_with(json!({"strict_fields": true}), Some(THINK_TEMPLATE));
    let e = responses(&strict, high).unwrap_err();
    assert_eq!(e.param(), Some("reasoning.summary"));
    let e = responses(&strict, json!({"input": "hello", "reasoning": {"effort": "high"}})).unwrap_err();
    assert_eq!(e.param(), Some("reasoning.effort"));
    let e = responses(&think, json!({"input": "hello", "reasoning": {"effort": 5}})).unwrap_err();
    assert_eq!((e.status(), e.param()), (400, Some("reasoning.effort")));
    assert!(e.message().contains("`reasoning.effort`") && !e.message().contains("reasoning_effort"), "{}", e.message());
    // a template that reads it gets it
    let reads =
        router_with(json!({}), Some("{% for m in messages %}{{ m.content }}{% endfor %}:{{ reasoning_effort }}"));
    let p = responses(&reads, json!({"input": "hello", "reasoning": {"effort": "low"}})).unwrap();
    assert!(p.prompt_texts[0].ends_with(":low"), "{:?}", p.prompt_texts[0]);
    assert_eq!(header(&p, "llmserve-ignored-fields"), None);
    // nor is vLLM's chat switch for the thinking (a response has its reasoning item)
    let p = responses(&think, json!({"input": "hello", "include_reasoning": false})).unwrap();
    assert_eq!(header(&p, "llmserve-ignored-fields"), Some("include_reasoning"));
    assert!(!p.reasoning.unwrap().hidden);
    let p = responses(&think, json!({"input": "hello", "include_reasoning": true})).unwrap();
    assert_eq!(header(&p, "llmserve-ignored-fields"), None);
    // chat's name for it is no Responses field
    let p = responses(&reads, json!({"input": "hello", "reasoning_effort": "low"})).unwrap();
    assert_eq!(header(&p, "llmserve-ignored-fields"), Some("reasoning_effort"));
    assert!(p.prompt_texts[0].ends_with(':'), "{:?}", p.prompt_texts[0]);
}

#[test]
fn a_stored_response_is_replayed_from_the_event_its_query_names() {
    use llmserve_router::protocol::responses::replay_start;
    let q = |pairs: &[(&str, &str)]| pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<Vec<_>>();
    assert_eq!(replay_start(&q(&[])).unwrap(), None);
    assert_eq!(replay_start(&q(&[("stream", "false"), ("starting_after", "x")])).unwrap(), None);
    assert_eq!(replay_start(&q(&[("stream", "True")])).unwrap(), Some(-1));
    assert_eq!(replay_start(&q(&[("stream", "true"), ("starting_after", "7")])).unwrap(), Some(7));
    // (the last of a repeated key counts)
    assert_eq!(replay_start(&q(&[("stream", "false"), ("stream", "1"), ("starting_after", "0")])).unwrap(), Some(0));
    for (pairs, param) in [
        (&[("stream", "yes")][..], "stream"),
        (&[("stream", "true"), ("starting_after", "-1")], "starting_after"),
        (&[("stream", "true"), ("starting_after", "1.5")], "starting_after"),
    ] {
        let e = replay_start(&q(pairs)).unwrap_err();
        assert_eq!((e.status(), e.param()), (400, Some(param)), "{pairs:?}");
    }
}

#[test]
fn an_invocations_body_is_routed_by_its_keys() {
    use llmserve_router::protocol::invocation_endpoint;
    for (body, endpoint) in [
        (json!({"messages": [], "prompt": "x"}), Endpoint::Chat),
        (json!({"prompt": "x", "input": "y"}), Endpoint::Completion),
        (json!({"input": "y"}), Endpoint::Embeddings),
        (json!({"text_1": "a", "text_2": "b"}), Endpoint::Score),
        (json!({"query": "q", "documents": []}), Endpoint::Rerank),
        (json!([1, 2]), Endpoint::Chat),
    ] {
        assert_eq!(invocation_endpoint(body.to_string().as_bytes()).unwrap(), endpoint, "{body}");
    }
    assert_eq!(invocation_endpoint(b"{not json").unwrap(), Endpoint::Chat);
    let e = invocation_endpoint(br#"{"model": "m"}"#).unwrap_err();
    assert_eq!((e.status(), e.param()), (400, None));
    assert!(e.message().contains("`text_1`"), "{}", e.message());
}
