//! OpenAI's deprecated `functions` / `function_call` on chat: read as the tools they became,
//! answered as a `function_call`, errors and reported fields named as sent.

mod protocol_fixture;

use std::sync::Arc;

use llmserve_router::response::{ChoiceDelta, FinishReason, ResponseBuilder, TokenOut};
use llmserve_router::tools::ToolChoice;
use protocol_fixture::*;
use serde_json::{json, Value};

fn weather() -> Value {
    json!({"name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}})
}

fn hermes() -> llmserve_router::router::Router {
    router_with(json!({"tool_call_format": "hermes"}), Some(TEMPLATE))
}

#[test]
fn functions_run_as_one_call_tools() {
    let r = hermes();
    let legacy = chat(&r, json!({"functions": [weather()]})).unwrap();
    let tools = legacy.tools.as_ref().expect("read for calls");
    assert!(tools.functions && !tools.parallel && tools.choice == ToolChoice::Auto);
    // the same prompt as the tools they became
    let modern = chat(&r, json!({"tools": [{"type": "function", "function": weather()}]})).unwrap();
    assert_eq!(legacy.prompts, modern.prompts);
    assert!(legacy.prompt_texts[0].contains("tools : get_weather"));
    assert!(!modern.tools.as_ref().unwrap().functions);

    let named = chat(&r, json!({"functions": [weather()], "function_call": {"name": "get_weather"}})).unwrap();
    assert_eq!(named.tools.as_ref().unwrap().choice, ToolChoice::Named);
    assert!(named.grammar.is_some(), "a named function_call is enforced");
    // "none": not shown, not read
    let none = chat(&r, json!({"functions": [weather()], "function_call": "none"})).unwrap();
    assert!(none.tools.is_none() && !none.prompt_texts[0].contains("get_weather"));
    assert_eq!(header(&none, "llmserve-ignored-fields"), Some("functions"));
}

#[test]
fn errors_and_reported_fields_name_the_fields_sent() {
    let r = hermes();
    let cases = [
        (json!({"functions": [weather()], "function_call": {"name": "nope"}}), "function_call.name", "`functions`"),
        (json!({"functions": [{"name": "a b"}]}), "functions[0].name", "Function names"),
        (json!({"functions": [weather(), weather()]}), "functions[1].name", "more than once"),
        (json!({"functions": [{"name": "f", "parameters": {"type": "array"}}]}), "functions[0].parameters", "object"),
        (json!({"functions": ["f"]}), "functions[0]", "Each function must be an object"),
        (json!({"function_call": "auto"}), "function_call", "`functions`"),
    ];
    for (body, param, says) in cases {
        let err = chat(&r, body.clone()).expect_err("a 400");
        assert_eq!((err.status(), err.param()), (400, Some(param)), "{body}");
        assert!(err.message().contains(says), "{body}: {}", err.message());
        assert!(!err.message().contains("`tool"), "{body}: {}", err.message());
    }
    // (`parallel_tool_calls: true` asks for what the old API never does)
    let p = chat(&r, json!({"functions": [weather()], "parallel_tool_calls": true})).unwrap();
    assert_eq!(header(&p, "llmserve-ignored-fields"), Some("parallel_tool_calls"));
    let strict = router_with(json!({"tool_call_format": "hermes", "strict_fields": true}), Some(TEMPLATE));
    let f = json!({"name": "f", "parameters": {"type": "object"}, "x": 1});
    assert_eq!(shape(chat(&strict, json!({"functions": [f]}))).2.as_deref(), Some("functions[0].x"));
    // functions a template never shows: refused as `functions`, never as the
    // `parallel_tool_calls: false` the translation added
    let unread = router_with(json!({"strict_fields": true}), Some(THINK_TEMPLATE));
    let err = chat(&unread, json!({"functions": [weather()]})).expect_err("strict");
    assert_eq!(err.param(), Some("functions"));
    assert!(err.message().starts_with("`functions` would have no effect"), "{}", err.message());
}

#[test]
fn history_calls_and_results_render_as_tool_turns() {
    let r = hermes();
    let ask = json!({"role": "user", "content": "Paris?"});
    let legacy = chat(
        &r,
        json!({"functions": [weather()], "messages": [ask,
            {"role": "assistant", "content": null, "function_call": {"name": "get_weather", "arguments": "{}"}},
            {"role": "function", "name": "get_weather", "content": "sunny"}]}),
    )
    .unwrap();
    let modern = chat(
        &r,
        json!({"tools": [{"type": "function", "function": weather()}], "messages": [ask,
            {"role": "assistant", "content": null, "tool_calls": [{"id": "call00001", "type": "function",
             "function": {"name": "get_weather", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "call00001", "name": "get_weather", "content": "sunny"}]}),
    )
    .unwrap();
    assert_eq!(legacy.prompts, modern.prompts);
    assert!(legacy.prompt_texts[0].contains("tool : sunny"), "{}", legacy.prompt_texts[0]);
    // the fixture's template reads neither calls nor names: reported as sent (the result's
    // `tool_call_id` was made here, and is not)
    assert_eq!(header(&legacy, "llmserve-ignored-fields"), Some("messages[1].function_call, messages[2].name"));
    assert_eq!(
        header(&modern, "llmserve-ignored-fields"),
        Some("messages[1].tool_calls, messages[2].name, messages[2].tool_call_id")
    );
    // a result with no name is named by its field
    let nameless = json!({"messages": [ask, {"role": "function", "content": "sunny"}]});
    assert_eq!(shape(chat(&r, nameless)).2.as_deref(), Some("messages[1].name"));
}

fn tok() -> TokenOut {
    TokenOut { id: 9, logprob: -0.5, top: vec![], text_offset: 0 }
}

/// The body (or SSE bytes) of `pieces` pushed through the builder of `extra`'s request.
fn answer(extra: Value, stream: bool, pieces: &[&str]) -> Vec<u8> {
    let mut p = chat(&hermes(), extra).unwrap();
    p.stream = stream;
    p.params.n = 1;
    let mut b = ResponseBuilder::new(&p, Arc::new(tokenizer()));
    let tokens = [tok()];
    let mut out = Vec::new();
    for (i, piece) in pieces.iter().enumerate() {
        let finish = (i + 1 == pieces.len()).then_some(FinishReason::Stop);
        b.push(0, &ChoiceDelta { text: piece, tokens: &tokens, ids: &[9], finish, stop_reason: None });
        out.extend(b.take());
        if b.choice_finished(0) {
            break;
        }
    }
    out.extend(b.finish());
    out
}

const CALL: [&str; 4] =
    ["<tool_call>\n{\"name\": \"get_weather\", \"argu", "ments\": {\"city\": \"Pa", "ris\"}}\n</tool_call>", "\nmore"];

#[test]
fn a_call_is_answered_as_function_call() {
    let body: Value = serde_json::from_slice(&answer(json!({"functions": [weather()]}), false, &CALL)).unwrap();
    let choice = &body["choices"][0];
    assert_eq!(choice["finish_reason"], "function_call");
    let message = &choice["message"];
    assert_eq!(message["function_call"], json!({"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}));
    assert!(message.get("tool_calls").is_none() && message["content"].is_null(), "{message}");

    let chunks = frames(&answer(json!({"functions": [weather()]}), true, &CALL));
    let deltas: Vec<&Value> = chunks.iter().map(|c| &c["choices"][0]["delta"]).collect();
    assert!(deltas.iter().all(|d| d.get("tool_calls").is_none()));
    let calls: Vec<&Value> = deltas.iter().filter_map(|d| d.get("function_call")).collect();
    assert_eq!(calls[0], &json!({"name": "get_weather", "arguments": ""}));
    assert!(calls[1..].iter().all(|c| c.get("name").is_none()));
    let args: String = calls.iter().map(|c| c["arguments"].as_str().unwrap()).collect();
    assert_eq!(args, message["function_call"]["arguments"].as_str().unwrap());
    let finishes: Vec<&Value> =
        chunks.iter().map(|c| &c["choices"][0]["finish_reason"]).filter(|f| !f.is_null()).collect();
    assert_eq!(finishes, [&json!("function_call")]);

    // a named `function_call` finishes "stop", as a named tool_choice does
    let named = json!({"functions": [weather()], "function_call": {"name": "get_weather"}});
    let body: Value = serde_json::from_slice(&answer(named, false, &CALL[..3])).unwrap();
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
    assert_eq!(body["choices"][0]["message"]["function_call"]["name"], "get_weather");
    // and the same output under `tools` is still a tool call
    let tools = json!({"tools": [{"type": "function", "function": weather()}]});
    let body: Value = serde_json::from_slice(&answer(tools, false, &CALL)).unwrap();
    assert_eq!(body["choices"][0]["finish_reason"], "tool_calls");
    assert!(body["choices"][0]["message"].get("function_call").is_none());
}
