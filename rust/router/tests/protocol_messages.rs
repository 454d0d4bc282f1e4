//! Anthropic's Messages API: a request prepares exactly the chat request it means (same prompt
//! ids, same parameters), its errors and ignored fields are named in its own terms, and its
//! answer is a `message` object or Anthropic's event sequence, which add up to the same thing.

mod protocol_fixture;

use llmserve_router::error::ApiError;
use llmserve_router::protocol::{Endpoint, Prepared};
use llmserve_router::response::{ChoiceDelta, FinishReason, ResponseBuilder, StopReason};
use llmserve_router::router::Router;
use protocol_fixture::*;
use serde_json::{json, Value};

/// `body` (with the served model and `max_tokens: 4` unless it says otherwise) prepared as a
/// Messages request.
fn messages(r: &Router, body: Value) -> Result<Prepared, ApiError> {
    let mut b = json!({"model": "tiny", "max_tokens": 4});
    merge(&mut b, body);
    r.prepare(Endpoint::Messages, &serde_json::to_vec(&b).unwrap())
}

fn chat_of(r: &Router, body: Value) -> Prepared {
    let mut b = json!({"model": "tiny"});
    merge(&mut b, body);
    r.prepare(Endpoint::Chat, &serde_json::to_vec(&b).unwrap()).expect("the chat equivalent prepares")
}

fn hermes() -> Router {
    router_with(json!({"tool_call_format": "hermes"}), Some(TEMPLATE))
}

const WEATHER: &str = r#"{"name": "get_weather", "description": "x", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}"#;

fn weather() -> Value {
    serde_json::from_str(WEATHER).unwrap()
}

#[test]
fn a_request_prepares_its_chat_equivalent() {
    let r = hermes();
    let p = messages(
        &r,
        json!({
            "system": [{"type": "text", "text": "a"}, {"type": "text", "text": "b", "cache_control": {"type": "ephemeral"}}],
            "messages": [
                {"role": "user", "content": "hello"},
                {"role": "user", "content": [{"type": "text", "text": "world"}]},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "x", "signature": "sig"},
                    {"type": "text", "text": "y"},
                    {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "c"}},
                ]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "z"}]},
                    {"type": "text", "text": "a"},
                ]},
            ],
            "tools": [weather()],
            "tool_choice": {"type": "auto", "disable_parallel_tool_use": true},
            "max_tokens": 3,
            "stop_sequences": ["c"],
            "temperature": 0.5,
            "top_k": 3,
            "metadata": {"user_id": "u1"},
        }),
    )
    .unwrap();
    let c = chat_of(
        &r,
        json!({
            "messages": [
                {"role": "system", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "y"}], "reasoning_content": "x",
                 "tool_calls": [{"id": "t1", "type": "function",
                                 "function": {"name": "get_weather", "arguments": "{\"city\":\"c\"}"}}]},
                {"role": "tool", "tool_call_id": "t1", "name": "get_weather", "content": [{"type": "text", "text": "z"}]},
                {"role": "user", "content": [{"type": "text", "text": "a"}]},
            ],
            "tools": [{"type": "function", "function": {"name": "get_weather", "description": "x",
                       "parameters": weather()["input_schema"]}}],
            "tool_choice": "auto",
            "parallel_tool_calls": false,
            "max_completion_tokens": 3,
            "stop": ["c"],
            "temperature": 0.5,
            "top_k": 3,
            "user": "u1",
        }),
    );
    assert_eq!(p.prompts, c.prompts);
    assert_eq!(p.params, c.params);
    assert_eq!(p.tools, c.tools);
    assert_eq!(p.user.as_deref(), Some("u1"));
    assert_eq!(p.endpoint, Endpoint::Messages);
    assert!(p.id.starts_with("msg_"), "{}", p.id);
    // a client's request id names it
    let named = messages(&r, json!({"messages": [{"role": "user", "content": "hello"}], "request_id": "abc"})).unwrap();
    assert_eq!(named.id, "msg_abc");
}

#[test]
fn a_last_assistant_message_is_continued() {
    let r = router();
    let p = messages(
        &r,
        json!({"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world a"}]}),
    )
    .unwrap();
    let c = chat_of(
        &r,
        json!({"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world a"}],
               "continue_final_message": true, "add_generation_prompt": false}),
    );
    assert_eq!(p.prompts, c.prompts);
    assert!(!p.prompt_texts[0].ends_with("assistant :"), "{:?}", p.prompt_texts[0]);
    // a last user message gets the generation prompt
    let p = messages(&r, json!({"messages": [{"role": "user", "content": "hello"}]})).unwrap();
    assert!(p.prompt_texts[0].ends_with("assistant :"), "{:?}", p.prompt_texts[0]);
    // a prefill cannot be continued under a forced tool call: named as the prefill
    let forced = messages(
        &hermes(),
        json!({"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "a"}],
               "tools": [weather()], "tool_choice": {"type": "any"}}),
    )
    .unwrap_err();
    assert_eq!(forced.param(), Some("messages[1]"), "{forced:?}");
    assert!(!forced.message().contains("continue_final_message"), "{}", forced.message());
    // and so is a template's refusal to continue it
    let roles_only = router_with(json!({}), Some("{% for m in messages %}{{ m.role }} {% endfor %}"));
    let unread = messages(
        &roles_only,
        json!({"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "a"}]}),
    )
    .unwrap_err();
    assert!(
        unread.message().starts_with("the final assistant message (a prefill) is continued, but"),
        "{}",
        unread.message()
    );
}

#[test]
fn errors_are_named_in_the_messages_terms() {
    let r = hermes();
    let user = json!([{"role": "user", "content": "hello"}]);
    let err = |body: Value| {
        let mut b = json!({"model": "tiny", "max_tokens": 4, "messages": user.clone()});
        merge(&mut b, body);
        shape(r.prepare(Endpoint::Messages, &serde_json::to_vec(&b).unwrap()))
    };
    let bad = |code: &'static str, param: &str| (400, code, Some(param.to_string()));
    // (merge drops a null: these send no `max_tokens` / `messages`; null ones are below)
    assert_eq!(err(json!({"max_tokens": null})), bad("missing_required_parameter", "max_tokens"));
    assert_eq!(err(json!({"max_tokens": 100})), bad("context_length_exceeded", "max_tokens"));
    assert_eq!(err(json!({"messages": null})), bad("missing_required_parameter", "messages"));
    assert_eq!(err(json!({"messages": []})), bad("invalid_value", "messages"));
    assert_eq!(err(json!({"temperature": 9})), bad("invalid_value", "temperature"));
    assert_eq!(err(json!({"stop_sequences": "c"})), bad("invalid_type", "stop_sequences"));
    assert_eq!(err(json!({"stop_sequences": ["c", 3]})), bad("invalid_type", "stop_sequences[1]"));
    assert_eq!(
        err(json!({"messages": [{"role": "developer", "content": "a"}]})),
        bad("invalid_value", "messages[0].role")
    );
    // (a system message is a turn of the conversation, but not one to answer alone)
    assert_eq!(err(json!({"messages": [{"role": "system", "content": "a"}]})), bad("invalid_value", "messages"));
    let tool_use = json!({"type": "tool_use", "id": "t", "name": "get_weather", "input": {}});
    assert_eq!(
        err(json!({"messages": [{"role": "system", "content": [tool_use]}, {"role": "user", "content": "a"}]})),
        bad("invalid_value", "messages[0].content[0].type")
    );
    assert_eq!(
        err(json!({"messages": [{"role": "user", "content": [{"type": "text"}]}]})),
        bad("missing_required_parameter", "messages[0].content[0].text")
    );
    assert_eq!(
        err(json!({"messages": [{"role": "user", "content": "a"},
                                 {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": "{}"}]}]})),
        bad("invalid_type", "messages[1].content[0].input")
    );
    assert_eq!(
        err(
            json!({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]})
        ),
        bad("invalid_value", "messages[0].content[0].type")
    );
    assert_eq!(
        err(json!({"tools": [{"name": "f", "input_schema": {"type": 3}}]})),
        bad("invalid_value", "tools[0].input_schema")
    );
    assert_eq!(err(json!({"tools": [{"name": "f"}]})), bad("missing_required_parameter", "tools[0].input_schema"));
    assert_eq!(
        err(json!({"tools": [weather()], "tool_choice": {"type": "tool", "name": "g"}})),
        bad("invalid_value", "tool_choice.name")
    );
    assert_eq!(err(json!({"tool_choice": {"type": "any"}})), bad("invalid_value", "tool_choice"));
    assert_eq!(
        err(json!({"output_config": {"format": {"type": "json_schema", "schema": {"type": 3}}}})),
        bad("invalid_value", "output_config.format.schema")
    );
    for (body, param) in [
        (json!({"stop": ["c"]}), "stop"),
        (json!({"max_completion_tokens": 3}), "max_completion_tokens"),
        (json!({"n": 2}), "n"),
        (json!({"logprobs": true}), "logprobs"),
        (json!({"mcp_servers": [{"type": "url"}]}), "mcp_servers"),
        (json!({"container": []}), "container"),
        (json!({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}), "tools[0].type"),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}),
            "messages[0].content[0].type",
        ),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                               "content": [{"type": "image"}]}]}]}),
            "messages[0].content[0].content[0].type",
        ),
    ] {
        assert_eq!(err(body.clone()), bad("unsupported_parameter", param), "{body}");
    }
    // the message quotes the field the client sent
    let e = messages(&r, json!({"messages": user, "max_tokens": 100})).unwrap_err();
    assert!(e.message().contains("`max_tokens`") && !e.message().contains("max_completion_tokens"), "{}", e.message());
    // the model is checked as on every route
    assert_eq!(
        shape(messages(&r, json!({"model": "nope", "messages": user}))),
        (404, "model_not_found", Some("model".into()))
    );
}

#[test]
fn anthropics_conversation_rules_are_400s() {
    let r = hermes();
    let ask = json!({"role": "user", "content": "Weather?"});
    let call = |id: &str| json!({"type": "tool_use", "id": id, "name": "get_weather", "input": {"city": "Paris"}});
    let result = |id: &str| json!({"type": "tool_result", "tool_use_id": id, "content": "ok"});
    // (built whole: the fixture's merge drops null values)
    let err = |body: Value| shape(r.prepare(Endpoint::Messages, &serde_json::to_vec(&body).unwrap()));
    let with = |messages: Value| json!({"model": "tiny", "max_tokens": 1, "tools": [weather()], "messages": messages});
    let bad = |code: &'static str, param: &str| (400, code, Some(param.to_string()));
    for (messages, param) in [
        // a final assistant message ending in a call is no prefill: the call has no result
        (
            json!([ask, {"role": "assistant", "content": [{"type": "text", "text": "Checking."}, call("t1")]}]),
            "messages[1].content[1]",
        ),
        (
            json!([ask, {"role": "assistant", "content": [call("t1")]}, {"role": "user", "content": "thanks"}]),
            "messages[1].content[0]",
        ),
        (
            json!([ask, {"role": "assistant", "content": [call("t1"), call("t2")]}, {"role": "user", "content": [result("t2")]}]),
            "messages[1].content[0]",
        ),
        // text before the results
        (
            json!([ask, {"role": "assistant", "content": [call("t1")]},
                {"role": "user", "content": [{"type": "text", "text": "here"}, result("t1")]}]),
            "messages[1].content[0]",
        ),
        (json!([{"role": "user", "content": [result("nope")]}]), "messages[0].content[0].tool_use_id"),
        (
            json!([ask, {"role": "assistant", "content": [call("t1")]}, {"role": "user", "content": [result("t2")]}]),
            "messages[2].content[0].tool_use_id",
        ),
        (
            json!([ask, {"role": "assistant", "content": [call("t1")]}, {"role": "user", "content": [result("t1"), result("t1")]}]),
            "messages[2].content[1].tool_use_id",
        ),
        (json!([ask, {"role": "assistant", "content": [call("t1"), call("t1")]}]), "messages[1].content[1].id"),
        (json!([{"role": "user", "content": ""}]), "messages[0].content"),
        (json!([{"role": "user", "content": [{"type": "text", "text": ""}]}]), "messages[0].content[0].text"),
        (json!([{"role": "user", "content": [{"type": "text", "text": " \n"}]}]), "messages[0].content[0].text"),
        (json!([{"role": "user", "content": "\t"}]), "messages[0].content"),
        (json!([ask, {"role": "assistant", "content": [{"type": "text", "text": ""}]}]), "messages[1].content[0].text"),
        (json!([ask, {"role": "assistant", "content": " "}]), "messages[1].content"),
        (
            json!([ask, {"role": "assistant", "content": ""}, {"role": "user", "content": "and?"}]),
            "messages[1].content",
        ),
        (json!([ask, {"role": "assistant", "content": "It is "}]), "messages[1].content"),
        (json!([ask, {"role": "assistant", "content": [{"type": "text", "text": "It is\n"}]}]), "messages[1].content"),
    ] {
        assert_eq!(err(with(messages.clone())), bad("invalid_value", param), "{messages}");
    }
    let mut no_tools =
        with(json!([ask, {"role": "assistant", "content": [call("t1")]}, {"role": "user", "content": [result("t1")]}]));
    no_tools.as_object_mut().unwrap().remove("tools");
    assert_eq!(err(no_tools), bad("invalid_value", "tools"));
    let mut system = with(json!([ask]));
    system["system"] = json!([{"type": "text", "text": ""}]);
    assert_eq!(err(system.clone()), bad("invalid_value", "system[0].text"));
    system["system"] = json!([{"type": "text", "text": "a"}, {"type": "text", "text": "  "}]);
    assert_eq!(err(system.clone()), bad("invalid_value", "system[1].text"));
    // (a string is one block: blank, refused as one; "" is no system prompt)
    system["system"] = json!(" \n");
    assert_eq!(err(system.clone()), bad("invalid_value", "system"));
    system["system"] = json!("");
    r.prepare(Endpoint::Messages, &serde_json::to_vec(&system).unwrap()).unwrap();
    let blank =
        r.prepare(Endpoint::Messages, &serde_json::to_vec(&with(json!([{"role": "user", "content": " "}]))).unwrap());
    assert!(blank.unwrap_err().message().contains("non-whitespace text"));
    // a valid loop, and an empty final assistant message (a prefill of nothing), pass
    let looped = json!([ask, {"role": "assistant", "content": [call("t1"), call("t2")]},
                        {"role": "user", "content": [result("t2"), result("t1"), {"type": "text", "text": "?"}]}]);
    r.prepare(Endpoint::Messages, &serde_json::to_vec(&with(looped)).unwrap()).unwrap();
    // a result with no content blocks is an empty result, as one without `content` or with ""
    for content in [json!([]), json!(""), Value::Null] {
        let empty = json!({"type": "tool_result", "tool_use_id": "t1", "content": content});
        let turn = json!([ask, {"role": "assistant", "content": [call("t1")]}, {"role": "user", "content": [empty]}]);
        r.prepare(Endpoint::Messages, &serde_json::to_vec(&with(turn)).unwrap()).unwrap();
    }
    // a negative max_tokens is told its bound, without chat's words about completions' `echo`
    let mut negative = with(json!([ask]));
    negative["max_tokens"] = json!(-1);
    let e = r.prepare(Endpoint::Messages, &serde_json::to_vec(&negative).unwrap()).unwrap_err();
    // (its bound is 0, which warms the prompt cache: audit M found chat's "at least 1")
    assert_eq!((e.param(), e.message().as_str()), (Some("max_tokens"), "`max_tokens` must be at least 0, got -1."));
    assert!(r
        .prepare(
            Endpoint::Messages,
            &serde_json::to_vec(&with(json!([ask, {"role": "assistant", "content": ""}]))).unwrap()
        )
        .is_ok());

    // required fields sent as null are the wrong type, as on the chat route
    for (key, param) in [("messages", "messages"), ("max_tokens", "max_tokens")] {
        let mut body = with(json!([ask]));
        body[key] = Value::Null;
        assert_eq!(err(body), bad("invalid_type", param));
    }
    assert_eq!(err(with(json!([{"role": "user", "content": null}]))), bad("invalid_type", "messages[0].content"));
    let mut thinking = with(json!([ask]));
    thinking["thinking"] = json!({"type": "enabled"});
    assert_eq!(err(thinking.clone()), bad("missing_required_parameter", "thinking.budget_tokens"));
    thinking["thinking"] = json!({"type": "enabled", "budget_tokens": null});
    assert_eq!(err(thinking.clone()), bad("invalid_type", "thinking.budget_tokens"));
    thinking["thinking"] = json!({"type": "adaptive", "budget_tokens": null}); // (none asked for)
    assert!(r.prepare(Endpoint::Messages, &serde_json::to_vec(&thinking).unwrap()).is_ok());
    // a budget of the wrong kind is refused on a model without thinking too
    for budget in [json!("x"), json!(-5), json!(1.5), json!(true)] {
        thinking["thinking"] = json!({"type": "enabled", "budget_tokens": budget});
        assert_eq!(err(thinking.clone()), bad("invalid_type", "thinking.budget_tokens"));
    }
    // chat's messages quote the Messages fields
    let mut schema = with(json!([ask]));
    schema["tools"] = json!([{"name": "f", "input_schema": "x"}]);
    let e = r.prepare(Endpoint::Messages, &serde_json::to_vec(&schema).unwrap()).unwrap_err();
    assert!(e.message().contains("`input_schema`") && !e.message().contains("parameters"), "{}", e.message());
    let mut name = with(json!([ask]));
    name["tools"] = json!([{"name": "bad name!", "input_schema": {"type": "object"}}]);
    let e = r.prepare(Endpoint::Messages, &serde_json::to_vec(&name).unwrap()).unwrap_err();
    assert!(e.message().starts_with("Tool names") && !e.message().contains("OpenAI"), "{}", e.message());
}

#[test]
fn fields_without_effect_are_reported_in_the_messages_terms() {
    let r = hermes();
    let p = messages(
        &r,
        json!({
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "hello", "cache_control": {"type": "ephemeral"}, "foo": 1}]},
                {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"},
                                                  {"type": "tool_use", "id": "t", "name": "get_weather", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "a", "is_error": true}]},
            ],
            "tools": [weather()],
            "metadata": {"user_id": "u", "tier": "x"},
            "thinking": {"type": "enabled", "budget_tokens": 2048},
            "service_tier": "priority",
            "cache_control": {"type": "ephemeral"},
        }),
    )
    .unwrap();
    // (the fixture's template shows no reasoning, so the model cannot think; nor does it
    // render tool calls or tool results' ids)
    assert_eq!(
        header(&p, "llmserve-ignored-fields"),
        Some(
            "messages[0].content[0].foo, messages[1].content[0], messages[1].content[1], \
             messages[2].content[0].is_error, messages[2].content[0].tool_use_id, metadata.tier, service_tier, thinking"
        )
    );
    // vLLM's chat switch for the thinking: a message returns it as its blocks
    let think = router_with(json!({}), Some(THINK_TEMPLATE));
    let hello = json!([{"role": "user", "content": "hello"}]);
    let p = messages(&think, json!({"messages": hello, "include_reasoning": false})).unwrap();
    assert_eq!(header(&p, "llmserve-ignored-fields"), Some("include_reasoning"));
    assert!(!p.reasoning.unwrap().hidden);
    let p = messages(&think, json!({"messages": hello, "include_reasoning": true})).unwrap();
    assert_eq!(header(&p, "llmserve-ignored-fields"), None);
    // what asks for nothing is not reported
    let p = messages(
        &r,
        json!({"messages": [{"role": "user", "content": "hello"}], "thinking": {"type": "disabled"},
               "tools": [], "tool_choice": {"type": "auto"}}),
    )
    .unwrap();
    assert_eq!(header(&p, "llmserve-ignored-fields"), None);
    // a model that thinks: `thinking` and its budget are honoured (the budget bounds each
    // think block, as chat's `thinking_token_budget`)
    let thinks = router_with(json!({"reasoning_parser": "think"}), Some(TEMPLATE));
    let p = messages(
        &thinks,
        json!({"messages": [{"role": "user", "content": "hello"}], "thinking": {"type": "enabled", "budget_tokens": 1024}}),
    )
    .unwrap();
    assert_eq!(header(&p, "llmserve-ignored-fields"), None);
    assert_eq!(p.reasoning.and_then(|r| r.budget), Some(1024));
    let huge = json!({"messages": [{"role": "user", "content": "hi"}], "thinking": {"type": "adaptive", "budget_tokens": 1u64 << 40}});
    assert_eq!(messages(&thinks, huge).unwrap().reasoning.and_then(|r| r.budget), Some(u32::MAX));
    let off =
        json!({"messages": [{"role": "user", "content": "hi"}], "thinking": {"type": "disabled", "budget_tokens": 5}});
    assert_eq!(messages(&thinks, off).unwrap().reasoning.and_then(|r| r.budget), None);
    let beams = json!({"messages": [{"role": "user", "content": "hi"}], "use_beam_search": true,
                       "thinking": {"type": "enabled", "budget_tokens": 5}});
    assert_eq!(shape(messages(&thinks, beams)), (400, "unsupported_parameter", Some("thinking.budget_tokens".into())));
    // asked for, but without effect here: `store` (no message is stored), citations in
    // `system`, a disabled thinking's budget, a `user` that `metadata.user_id` replaces
    let hi = json!([{"role": "user", "content": "hi"}]);
    let cite = json!([{"type": "char_location", "cited_text": "x", "document_index": 0, "start_char_index": 0,
                       "end_char_index": 1}]);
    let p = messages(
        &r,
        json!({"messages": hi, "store": true, "system": [{"type": "text", "text": "Be nice.", "citations": cite}],
               "thinking": {"type": "disabled", "budget_tokens": 2048}, "metadata": {"user_id": "a"}, "user": "b"}),
    )
    .unwrap();
    assert_eq!(header(&p, "llmserve-ignored-fields"), Some("store, system[0].citations, thinking.budget_tokens, user"));
    assert_eq!(
        header(&messages(&r, json!({"messages": hi, "store": false})).unwrap(), "llmserve-ignored-fields"),
        None
    );
    // strict field checking refuses them, by their Messages name
    let strict = router_with(json!({"strict_fields": true}), Some(TEMPLATE));
    // (in its words too: `disable_parallel_tool_use` is the field sent, `parallel_tool_calls` chat's)
    let serial = json!({"messages": hi, "tool_choice": {"type": "none", "disable_parallel_tool_use": true}});
    let err = messages(&strict, serial).expect_err("strict");
    assert_eq!(err.param(), Some("tool_choice.disable_parallel_tool_use"));
    assert!(!err.message().contains("parallel_tool_calls"), "{}", err.message());
    assert_eq!(
        shape(messages(&strict, json!({"messages": [{"role": "user", "content": "hello"}], "metadata": {"a": "b"}}))),
        (400, "unsupported_parameter", Some("metadata.a".into()))
    );
}

#[test]
fn thinking_switches_a_template_that_reads_enable_thinking() {
    let r = router_with(json!({}), Some(THINK_TEMPLATE));
    let ask = json!([{"role": "user", "content": "hello"}]);
    let off = messages(&r, json!({"messages": ask, "thinking": {"type": "disabled"}})).unwrap();
    assert!(off.prompt_texts[0].ends_with("</think>\n\n"), "{:?}", off.prompt_texts[0]);
    assert_eq!(header(&off, "llmserve-ignored-fields"), None);
    let c = chat_of(&r, json!({"messages": ask, "chat_template_kwargs": {"enable_thinking": false}, "max_tokens": 4}));
    assert_eq!((off.prompts.clone(), off.reasoning), (c.prompts, c.reasoning));
    let on = messages(&r, json!({"messages": ask, "thinking": {"type": "enabled", "budget_tokens": 2048}})).unwrap();
    assert!(on.prompt_texts[0].ends_with("<think>\n"), "{:?}", on.prompt_texts[0]);
    assert_eq!(header(&on, "llmserve-ignored-fields"), None);
    assert_eq!(on.reasoning.and_then(|r| r.budget), Some(2048));
    // the request's own kwarg wins, and then `thinking` asks for what is not done
    let kwarg = messages(
        &r,
        json!({"messages": ask, "thinking": {"type": "disabled"}, "chat_template_kwargs": {"enable_thinking": true}}),
    )
    .unwrap();
    assert!(kwarg.prompt_texts[0].ends_with("<think>\n"), "{:?}", kwarg.prompt_texts[0]);
    assert_eq!(header(&kwarg, "llmserve-ignored-fields"), Some("thinking"));
    // a template without the switch: nothing is added (no unused kwarg is reported)
    let p = messages(&router(), json!({"messages": ask, "thinking": {"type": "disabled"}})).unwrap();
    assert_eq!((header(&p, "llmserve-ignored-fields"), header(&p, "llmserve-unused-template-kwargs")), (None, None));
    // count_tokens counts the prompt the switch renders
    let body = json!({"model": "tiny", "messages": ask, "thinking": {"type": "disabled"}});
    let counted: Value = serde_json::from_slice(
        &r.handle(Endpoint::MessagesCountTokens, &serde_json::to_vec(&body).unwrap()).unwrap().body,
    )
    .unwrap();
    assert_eq!(counted["input_tokens"], off.prompts[0].len());
}

/// What a client sums a stream's events up to (as the Anthropic SDK does): the message of
/// `message_start` with each block's deltas applied and `message_delta`'s stop and usage.
fn accumulate(evs: &[(String, Value)]) -> Value {
    let mut message = evs[0].1["message"].clone();
    let mut json_bufs: Vec<String> = Vec::new();
    for (kind, e) in evs {
        match kind.as_str() {
            "content_block_start" => {
                assert_eq!(e["index"], message["content"].as_array().unwrap().len());
                message["content"].as_array_mut().unwrap().push(e["content_block"].clone());
                json_bufs.push(String::new());
            }
            "content_block_delta" => {
                let i = e["index"].as_u64().unwrap() as usize;
                let block = &mut message["content"][i];
                let d = &e["delta"];
                match d["type"].as_str().unwrap() {
                    "text_delta" => {
                        block["text"] =
                            json!(format!("{}{}", block["text"].as_str().unwrap(), d["text"].as_str().unwrap()))
                    }
                    "thinking_delta" => {
                        block["thinking"] =
                            json!(format!("{}{}", block["thinking"].as_str().unwrap(), d["thinking"].as_str().unwrap()))
                    }
                    "input_json_delta" => {
                        json_bufs[i].push_str(d["partial_json"].as_str().unwrap());
                        block["input"] = serde_json::from_str(&json_bufs[i]).unwrap_or(block["input"].clone());
                    }
                    other => panic!("unknown delta {other}"),
                }
            }
            "message_delta" => {
                message["stop_reason"] = e["delta"]["stop_reason"].clone();
                message["stop_sequence"] = e["delta"]["stop_sequence"].clone();
                message["usage"] = e["usage"].clone();
            }
            _ => {}
        }
    }
    message
}

/// The answer to `body` when the model generates `pieces` (the last one finishing with
/// `finish`, a stop string `stopped` naming what matched), streamed or not.
fn answer(
    r: &Router,
    body: Value,
    pieces: &[&str],
    finish: FinishReason,
    stopped: Option<&str>,
    stream: bool,
) -> Vec<u8> {
    let mut body = body;
    merge(&mut body, json!({"stream": stream}));
    let p = messages(r, body).unwrap();
    let mut b = ResponseBuilder::new(&p, r.tokenizer().clone());
    let mut out = b.take();
    for (i, piece) in pieces.iter().enumerate() {
        let last = i + 1 == pieces.len();
        let stop_reason = stopped.filter(|_| last).map(StopReason::Text);
        b.push(0, &ChoiceDelta { text: piece, tokens: &[], ids: &[9], finish: last.then_some(finish), stop_reason });
        out.extend(b.take());
    }
    out.extend(b.finish());
    out
}

#[test]
fn a_streamed_answer_is_anthropics_event_sequence_and_adds_up_to_the_body() {
    let r = router();
    let body = json!({"messages": [{"role": "user", "content": "hello"}]});
    let run = |stream| answer(&r, body.clone(), &["a", " b"], FinishReason::Length, None, stream);
    let evs = sse_events(&run(true));
    let kinds: Vec<&str> = evs.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        kinds,
        [
            "message_start",
            "content_block_start",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ]
    );
    let start = &evs[0].1["message"];
    assert_eq!((start["content"].clone(), start["stop_reason"].clone()), (json!([]), Value::Null));
    assert_eq!(evs[1].1["content_block"], json!({"type": "text", "text": ""}));
    let body: Value = serde_json::from_slice(&run(false)).unwrap();
    let mut streamed = accumulate(&evs);
    // (two requests: two ids)
    assert!(streamed["id"].as_str().unwrap().starts_with("msg_"));
    streamed["id"] = body["id"].clone();
    assert_eq!(streamed, body);
    assert_eq!(body["type"], "message");
    assert_eq!(body["role"], "assistant");
    assert!(body["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(body["content"], json!([{"type": "text", "text": "a b"}]));
    assert_eq!((body["stop_reason"].clone(), body["stop_sequence"].clone()), (json!("max_tokens"), Value::Null));
    // the prompt is "<s> user : hello </s> assistant :"
    assert_eq!(
        body["usage"],
        json!({"input_tokens": 7, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0, "output_tokens": 2})
    );
}

#[test]
fn stop_reasons_and_cached_tokens() {
    let r = router();
    let body = json!({"messages": [{"role": "user", "content": "hello"}], "stop_sequences": ["c"]});
    for stream in [false, true] {
        let out = answer(&r, body.clone(), &["a"], FinishReason::Stop, Some("c"), stream);
        let m = if stream { accumulate(&sse_events(&out)) } else { serde_json::from_slice(&out).unwrap() };
        assert_eq!((m["stop_reason"].clone(), m["stop_sequence"].clone()), (json!("stop_sequence"), json!("c")));
        let out = answer(&r, body.clone(), &["a", ""], FinishReason::Stop, None, stream);
        let m = if stream { accumulate(&sse_events(&out)) } else { serde_json::from_slice(&out).unwrap() };
        assert_eq!((m["stop_reason"].clone(), m["stop_sequence"].clone()), (json!("end_turn"), Value::Null));
        assert_eq!(m["content"], json!([{"type": "text", "text": "a"}]));
        // an empty answer has no blocks
        let out = answer(&r, body.clone(), &[""], FinishReason::Stop, None, stream);
        let m = if stream { accumulate(&sse_events(&out)) } else { serde_json::from_slice(&out).unwrap() };
        assert_eq!(m["content"], json!([]));
    }
    // the prefix cache's tokens are read from the cache, not input
    let p = messages(&r, body.clone()).unwrap();
    let mut b = ResponseBuilder::new(&p, r.tokenizer().clone());
    b.add_cached_prompt_tokens(4);
    b.push(0, &ChoiceDelta { text: "a", tokens: &[], ids: &[9], finish: Some(FinishReason::Stop), stop_reason: None });
    let m: Value = serde_json::from_slice(&b.finish()).unwrap();
    assert_eq!(
        (m["usage"]["input_tokens"].clone(), m["usage"]["cache_read_input_tokens"].clone()),
        (json!(3), json!(4))
    );
}

#[test]
fn tools_render_as_their_chat_equivalent_where_a_template_writes_them_as_json() {
    // (Hermes, Qwen and Llama 3.1 templates write each tool with `tojson`: its keys in chat's
    // order, name, description, parameters; audit M found parameters before description)
    let r = router_with(
        json!({"max_model_len": 4096}),
        Some("{{ tools | tojson }}{% for m in messages %}{{ m.content }}{% endfor %}"),
    );
    let ask = json!([{"role": "user", "content": "hello"}]);
    let tool = serde_json::from_str::<Value>(WEATHER).unwrap();
    let p = messages(&r, json!({"messages": ask, "tools": [tool]})).unwrap();
    let c = chat_of(
        &r,
        json!({"messages": ask, "max_completion_tokens": 4, "tools": [{"type": "function", "function": {
            "name": "get_weather", "description": "x", "parameters": tool["input_schema"]}}]}),
    );
    assert_eq!(p.prompt_texts, c.prompt_texts);
    assert!(p.prompt_texts[0].contains(r#"{"name": "get_weather", "description": "x", "parameters""#));
}

#[test]
fn tool_calls_are_tool_use_blocks_streamed_or_not() {
    let r = hermes();
    let body = json!({"messages": [{"role": "user", "content": "hello"}], "tools": [weather()], "max_tokens": 20});
    let pieces = [
        "Checking. <tool_call>\n{\"name\": \"get_weather\", \"argu",
        "ments\": {\"city\": \"Pa",
        "ris\"}}\n</tool_call>",
        "",
    ];
    let body_out: Value =
        serde_json::from_slice(&answer(&r, body.clone(), &pieces, FinishReason::Stop, None, false)).unwrap();
    let evs = sse_events(&answer(&r, body, &pieces, FinishReason::Stop, None, true));
    let streamed = accumulate(&evs);
    assert_eq!(body_out["stop_reason"], "tool_use");
    let content = body_out["content"].as_array().unwrap();
    assert_eq!(content[0], json!({"type": "text", "text": "Checking."}));
    assert_eq!(content[1]["type"], "tool_use");
    assert_eq!(content[1]["name"], "get_weather");
    assert_eq!(content[1]["input"], json!({"city": "Paris"}));
    // the stream's ids are its own draw; the rest adds up to the body
    let id = |m: &Value| m["content"][1]["id"].as_str().unwrap().to_string();
    let (mut a, mut b) = (streamed.clone(), body_out.clone());
    assert!(!id(&a).is_empty() && !id(&b).is_empty());
    a["content"][1]["id"] = json!("");
    b["content"][1]["id"] = json!("");
    a["id"] = json!("");
    b["id"] = json!("");
    assert_eq!(a, b);
    // the arguments came as pieces of JSON
    let pieces = evs.iter().filter(|(_, e)| e["delta"]["type"] == "input_json_delta").count();
    assert!(pieces >= 2, "{evs:?}");
}

#[test]
fn a_system_message_is_a_system_turn_where_it_stands() {
    // (the anthropic SDK's `SystemMessageParam`)
    let r = hermes();
    let sent = messages(
        &r,
        json!({"system": "s", "messages": [{"role": "system", "content": [{"type": "text", "text": "t"}]},
                                           {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                           {"role": "system", "content": "c"}, {"role": "user", "content": "d"}]}),
    )
    .unwrap();
    let chat = chat_of(
        &r,
        json!({"max_completion_tokens": 4, "messages": [
            {"role": "system", "content": [{"type": "text", "text": "s"}, {"type": "text", "text": "t"}]},
            {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"role": "system", "content": "c"}, {"role": "user", "content": "d"}]}),
    );
    assert_eq!(sent.prompt_texts, chat.prompt_texts);
    assert_eq!(sent.prompts, chat.prompts);
}

#[test]
fn an_empty_system_is_none() {
    let r = router();
    let prompt = |system: Option<Value>| {
        let mut body = json!({"max_tokens": 4, "messages": [{"role": "user", "content": "hello"}]});
        if let Some(system) = system {
            body["system"] = system;
        }
        messages(&r, body).unwrap().prompts[0].clone()
    };
    assert_eq!(prompt(Some(json!(""))), prompt(None));
    assert_eq!(prompt(Some(json!([]))), prompt(None));
    assert_ne!(prompt(Some(json!("a"))), prompt(None));
}

#[test]
fn a_stop_sequence_that_cuts_a_call_is_the_stop_not_tool_use() {
    // `tool_use` tells a client its calls are whole (an agent loop runs them): a call a stop
    // sequence cut is `stop_sequence`, naming it; one after whole calls is still `tool_use`.
    let r = hermes();
    let body = json!({"messages": [{"role": "user", "content": "hello"}], "tools": [weather()], "max_tokens": 20,
                      "stop_sequences": ["Paris", "Obs"]});
    let cut = ["<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \""];
    let whole = ["<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n</tool_call>\n"];
    for stream in [false, true] {
        let out = answer(&r, body.clone(), &cut, FinishReason::Stop, Some("Paris"), stream);
        let m = if stream { accumulate(&sse_events(&out)) } else { serde_json::from_slice(&out).unwrap() };
        assert_eq!((m["stop_reason"].clone(), m["stop_sequence"].clone()), (json!("stop_sequence"), json!("Paris")));
        assert_eq!(m["content"][0]["type"], "tool_use", "{m}");
        let out = answer(&r, body.clone(), &whole, FinishReason::Stop, Some("Obs"), stream);
        let m = if stream { accumulate(&sse_events(&out)) } else { serde_json::from_slice(&out).unwrap() };
        assert_eq!((m["stop_reason"].clone(), m["stop_sequence"].clone()), (json!("tool_use"), Value::Null));
        assert_eq!(m["content"][0]["input"], json!({"city": "Rome"}));
    }
}

#[test]
fn count_tokens_counts_the_prompt_the_request_renders() {
    let r = hermes();
    let body = json!({"model": "tiny", "system": "a", "messages": [{"role": "user", "content": "hello"}], "tools": [weather()]});
    let handled = r.handle(Endpoint::MessagesCountTokens, &serde_json::to_vec(&body).unwrap()).unwrap();
    let counted: Value = serde_json::from_slice(&handled.body).unwrap();
    let mut with_max = body.clone();
    merge(&mut with_max, json!({"max_tokens": 1}));
    let p = messages(&r, with_max.clone()).unwrap();
    assert_eq!(counted, json!({"input_tokens": p.prompts[0].len()}));
    assert!(handled.headers.is_empty(), "{:?}", handled.headers);
    // a `max_tokens` copied along asks for nothing here
    let handled = r.handle(Endpoint::MessagesCountTokens, &serde_json::to_vec(&with_max).unwrap()).unwrap();
    assert_eq!(handled.headers, [("llmserve-ignored-fields".to_string(), "max_tokens".to_string())]);
    // (`max_tokens` is not needed to count; the same errors are named the same way)
    let bad = json!({"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image"}]}]});
    let e = r.handle(Endpoint::MessagesCountTokens, &serde_json::to_vec(&bad).unwrap()).unwrap_err();
    assert_eq!(e.param(), Some("messages[0].content[0].type"));
}

/// A message thread (`thread`, whose later turns send only their new messages) is refused with
/// Anthropic's `error.details`, from which its SDK's tool runner recovers by sending the whole
/// history (audit 78); `thread: false` asks for nothing.
#[test]
fn a_thread_is_refused_with_the_details_the_sdk_reads() {
    let r = router();
    for thread in [json!({"type": "create"}), json!({"type": "continue", "previous_message_id": "msg_1"})] {
        let e = messages(
            &r,
            json!({"max_tokens": 4, "messages": [{"role": "user", "content": "hello"}], "thread": thread}),
        )
        .unwrap_err();
        assert_eq!((e.status(), e.code(), e.param()), (400, "thread_unsupported_request", Some("thread")));
        let body: Value = serde_json::from_slice(&e.to_anthropic_json()).unwrap();
        assert_eq!(body["error"]["type"], "invalid_request_error");
        assert_eq!(
            body["error"]["details"],
            json!({"error_code": "thread_unsupported_request", "unsupported": ["thread"]})
        );
    }
    messages(&r, json!({"max_tokens": 4, "messages": [{"role": "user", "content": "hello"}], "thread": false}))
        .unwrap();
    messages(&r, json!({"max_tokens": 4, "messages": [{"role": "user", "content": "hello"}], "thread": null})).unwrap();
    // other errors carry no details
    let e =
        messages(&r, json!({"max_tokens": 4, "messages": [{"role": "user", "content": "hello"}], "container": "c"}))
            .unwrap_err();
    let body: Value = serde_json::from_slice(&e.to_anthropic_json()).unwrap();
    assert!(body["error"].get("details").is_none());
}

/// Audit 79: `compaction` is refused (it asks for a summary block in place of an answer);
/// `cache_control` is Anthropic's shape (a 1h ttl, which the prefix cache does not promise, is
/// reported); the values that ask for what this server does pass without a word.
#[test]
fn compaction_cache_control_and_no_op_values() {
    let r = router();
    let user = json!([{"role": "user", "content": "hello"}]);
    let req = |extra: Value| {
        let mut b = json!({"max_tokens": 4, "messages": user.clone()});
        merge(&mut b, extra);
        messages(&r, b)
    };
    assert_eq!(
        shape(req(json!({"compaction": {"type": "summarize"}}))),
        (400, "unsupported_parameter", Some("compaction".into()))
    );
    // cache_control: the breakpoint alone asks for nothing
    let block = |cc: Value| json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "hello", "cache_control": cc}]}]});
    let p = req(block(json!({"type": "ephemeral"}))).unwrap();
    assert_eq!(header(&p, "llmserve-ignored-fields"), None);
    let p = req(block(json!({"type": "ephemeral", "ttl": "1h"}))).unwrap();
    assert_eq!(header(&p, "llmserve-ignored-fields"), Some("messages[0].content[0].cache_control.ttl"));
    let p = req(json!({"cache_control": {"type": "ephemeral", "ttl": "5m"}})).unwrap();
    assert_eq!(header(&p, "llmserve-ignored-fields"), None);
    for (cc, param) in [
        (json!({"type": "bogus"}), "messages[0].content[0].cache_control.type"),
        (json!({"type": "ephemeral", "ttl": "2h"}), "messages[0].content[0].cache_control.ttl"),
        (json!("yes"), "messages[0].content[0].cache_control"),
    ] {
        assert_eq!(shape(req(block(cc.clone()))).2, Some(param.to_string()), "{cc}");
    }
    assert_eq!(shape(req(json!({"cache_control": {"type": "persistent"}}))).2, Some("cache_control.type".into()));
    // no-op values pass, also under strict field checking
    let strict = router_with(json!({"strict_fields": true}), Some(TEMPLATE));
    let no_ops = json!({"speed": "standard", "service_tier": "standard_only", "thread": false, "fallbacks": "default",
                        "context_management": {"edits": []}, "billing_policy": {"type": "billing_policy", "bill_to": "self"}});
    let p = req(no_ops.clone()).unwrap();
    assert_eq!(header(&p, "llmserve-ignored-fields"), None);
    let mut b = json!({"max_tokens": 4, "messages": user.clone()});
    merge(&mut b, no_ops);
    messages(&strict, b).unwrap();
    let p = req(json!({"speed": "fast"})).unwrap();
    assert_eq!(header(&p, "llmserve-ignored-fields"), Some("speed"));
}
