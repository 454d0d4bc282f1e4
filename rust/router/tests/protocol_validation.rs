//! Every validation rule of the contract that is decided before generation: status, code
//! and `param` of each rejection, for chat and completions.

mod protocol_fixture;

use llmserve_router::protocol::{BestOf, Endpoint, Prepared};
use protocol_fixture::*;
use serde_json::{json, Value};

fn p(s: &str) -> Option<String> {
    Some(s.to_string())
}

fn check_chat(cases: Vec<(Value, u16, &str, Option<String>)>) {
    let r = router();
    for (extra, status, code, param) in cases {
        let got = shape(chat(&r, extra.clone()));
        assert_eq!(got, (status, code, param.clone()), "chat case {extra}");
    }
}

fn check_completion(cases: Vec<(Value, u16, &str, Option<String>)>) {
    let r = router();
    for (extra, status, code, param) in cases {
        let got = shape(completion(&r, extra.clone()));
        assert_eq!(got, (status, code, param.clone()), "completion case {extra}");
    }
}

#[test]
fn body_must_be_a_json_object() {
    let r = router();
    for ep in [Endpoint::Chat, Endpoint::Completion] {
        assert_eq!(shape(r.prepare(ep, b"{\"model\":")), (400, "invalid_json", Some("body".into())));
        assert_eq!(shape(r.prepare(ep, b"")), (400, "invalid_json", Some("body".into())));
        assert_eq!(shape(r.prepare(ep, b"\xff\xfe")), (400, "invalid_json", Some("body".into())));
        assert_eq!(shape(r.prepare(ep, b"[1]")), (400, "invalid_type", Some("body".into())));
        assert_eq!(shape(r.prepare(ep, b"null")), (400, "invalid_type", Some("body".into())));
        // a leading UTF-8 byte order mark is read past (RFC 8259 8.1), once; not one in the middle
        let bom = |s: &str| [&b"\xef\xbb\xbf"[..], s.as_bytes()].concat();
        let body = r#"{"model": "tiny", "prompt": "a", "messages": [{"role": "user", "content": "a"}]}"#;
        assert!(r.prepare(ep, &bom(body)).is_ok());
        assert_eq!(shape(r.prepare(ep, &bom(&String::from_utf8(bom(body)).unwrap()))).1, "invalid_json");
        assert_eq!(shape(r.prepare(ep, &bom("[1]"))), (400, "invalid_type", Some("body".into())));
        // a lone surrogate is named as such, not as serde's "unexpected end of hex escape"
        for body in [&br#"{"prompt": "\ud800"}"#[..], br#"{"prompt": "\udc00x"}"#] {
            let err = r.prepare(ep, body).unwrap_err();
            assert_eq!((err.status(), err.code()), (400, "invalid_json"));
            assert!(err.message().contains("lone UTF-16 surrogate"), "{}", err.message());
        }
        // valid JSON deeper than serde's 128 levels is refused as too deep, not as invalid
        // (the body object and 127 lists are 128 levels: the first refused; 127 are read)
        let nested =
            |n: usize| format!(r#"{{"model": "tiny", "prompt": "a", "x": {}{}}}"#, "[".repeat(n), "]".repeat(n));
        let err = r.prepare(ep, nested(127).as_bytes()).unwrap_err();
        assert_eq!((err.status(), err.code(), err.param()), (400, "invalid_json", Some("body")));
        assert!(err.message().starts_with("The request body nests JSON 128 levels deep or more"), "{}", err.message());
        assert!(r.prepare(ep, nested(126).as_bytes()).map_or_else(|e| e.code() != "invalid_json", |_| true));
        let shallow = format!(r#"{{"model": "tiny", "prompt": "a", "x": {}{}}}"#, "[".repeat(100), "]".repeat(100));
        if let Err(e) = r.prepare(ep, shallow.as_bytes()) {
            assert!(!e.message().contains("levels deep"), "{}", e.message());
        }
    }
}

#[test]
fn model_is_required_and_must_be_served() {
    check_chat(vec![
        (json!({"model": null}), 400, "missing_required_parameter", p("model")),
        (json!({"model": 3}), 400, "invalid_type", p("model")),
        (json!({"model": "nope"}), 404, "model_not_found", p("model")),
        // No LoRA / revision guessing from a colon.
        (json!({"model": "tiny:lora"}), 404, "model_not_found", p("model")),
    ]);
    check_completion(vec![(json!({"model": "TINY"}), 404, "model_not_found", p("model"))]);
    let r = router();
    assert_eq!(chat(&r, json!({"model": "tiny-alias"})).unwrap().model, "tiny-alias");
}

#[test]
fn messages_shape() {
    let m = |v: Value| json!({ "messages": v });
    check_chat(vec![
        (json!({"messages": null}), 400, "missing_required_parameter", p("messages")),
        (m(json!("hello")), 400, "invalid_type", p("messages")),
        (m(json!([])), 400, "invalid_value", p("messages")),
        (m(json!(["hello"])), 400, "invalid_type", p("messages[0]")),
        (m(json!([{"content": "x"}])), 400, "missing_required_parameter", p("messages[0].role")),
        (m(json!([{"role": 1, "content": "x"}])), 400, "invalid_type", p("messages[0].role")),
        // an earlier reply's thinking is text (or null)
        (
            m(
                json!([{"role": "assistant", "content": "x", "reasoning_content": true}, {"role": "user", "content": "y"}]),
            ),
            400,
            "invalid_type",
            p("messages[0].reasoning_content"),
        ),
        (
            m(json!([{"role": "user", "content": "x", "reasoning": {"a": 1}}])),
            400,
            "invalid_type",
            p("messages[0].reasoning"),
        ),
        (m(json!([{"role": "robot", "content": "x"}])), 400, "invalid_value", p("messages[0].role")),
        // OpenAI's deprecated function-result turns are served (protocol_functions.rs); their
        // `name` is required
        (m(json!([{"role": "function", "content": "42"}])), 400, "missing_required_parameter", p("messages[0].name")),
        (m(json!([{"role": "user"}])), 400, "missing_required_parameter", p("messages[0].content")),
        // sent as null: a required field of the wrong type (A84-1), as a null `role` is
        (m(json!([{"role": "user", "content": null}])), 400, "invalid_type", p("messages[0].content")),
        (m(json!([{"role": "system", "content": null}])), 400, "invalid_type", p("messages[0].content")),
        (
            m(json!([{"role": "user", "content": "a"}, {"role": "tool", "content": "42", "tool_call_id": null}])),
            400,
            "invalid_type",
            p("messages[1].tool_call_id"),
        ),
        (m(json!([{"role": "user", "content": 5}])), 400, "invalid_type", p("messages[0].content")),
        (
            m(json!([{"role": "system", "content": "a"},
                     {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}]}])),
            400,
            "unsupported_parameter",
            p("messages[1].content[1].type"),
        ),
        (
            m(json!([{"role": "user", "content": [{"type": "text"}]}])),
            400,
            "missing_required_parameter",
            p("messages[0].content[0].text"),
        ),
        (
            m(json!([{"role": "user", "content": [{"text": "a"}]}])),
            400,
            "missing_required_parameter",
            p("messages[0].content[0].type"),
        ),
        (m(json!([{"role": "user", "content": ["a"]}])), 400, "invalid_type", p("messages[0].content[0]")),
        (
            m(json!([{"role": "user", "content": "a"}, {"role": "tool", "content": "42"}])),
            400,
            "missing_required_parameter",
            p("messages[1].tool_call_id"),
        ),
        (
            m(json!([{"role": "user", "content": "a", "tool_calls": []}])),
            400,
            "invalid_value",
            p("messages[0].tool_calls"),
        ),
        (
            m(
                json!([{"role": "user", "content": "a"}, {"role": "assistant", "content": null, "tool_calls": [{"id": "1", "type": "function", "function": {"arguments": "{}"}}]}]),
            ),
            400,
            "missing_required_parameter",
            p("messages[1].tool_calls[0].function.name"),
        ),
        // refusal parts are an assistant's only
        (
            m(json!([{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}])),
            400,
            "unsupported_parameter",
            p("messages[0].content[0].type"),
        ),
        (
            m(json!([{"role": "user", "content": "a"}, {"role": "assistant", "content": [{"type": "refusal"}]}])),
            400,
            "missing_required_parameter",
            p("messages[1].content[0].refusal"),
        ),
        (
            m(
                json!([{"role": "user", "content": "a"}, {"role": "assistant", "content": null, "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f"}}]}]),
            ),
            400,
            "missing_required_parameter",
            p("messages[1].tool_calls[0].function.arguments"),
        ),
        (
            m(
                json!([{"role": "user", "content": "a"}, {"role": "assistant", "content": null, "tool_calls": [{"id": 5, "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]),
            ),
            400,
            "invalid_type",
            p("messages[1].tool_calls[0].id"),
        ),
        (
            m(json!([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "refusal": 5}])),
            400,
            "invalid_type",
            p("messages[1].refusal"),
        ),
    ]);
}

#[test]
fn valid_message_forms_are_accepted() {
    let r = router();
    let ok = json!({"messages": [
        {"role": "system", "content": "a"},
        {"role": "developer", "content": [{"type": "text", "text": "b"}]},
        {"role": "user", "content": "hello", "name": "bob"},
        {"role": "assistant", "content": null, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "x"},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
    ]});
    let p = chat(&r, ok.clone()).expect("valid conversation");
    assert!(p.prompt_texts[0].contains("No."), "{}", p.prompt_texts[0]);
    // `developer` is OpenAI's name for system instructions: a template that never names the
    // role gets `system`; one that does gets the role as sent.
    assert!(p.prompt_texts[0].contains("system : b"), "{}", p.prompt_texts[0]);
    let knows = format!("{{# developer #}}{TEMPLATE}");
    let p = chat(&router_with(json!({}), Some(&knows)), ok).expect("valid conversation");
    assert!(p.prompt_texts[0].contains("developer : b"), "{}", p.prompt_texts[0]);
}

#[test]
fn sampling_ranges() {
    let cases = vec![
        (json!({"temperature": "hot"}), 400, "invalid_type", p("temperature")),
        (json!({"temperature": 2.5}), 400, "invalid_value", p("temperature")),
        (json!({"temperature": -0.1}), 400, "invalid_value", p("temperature")),
        (json!({"top_p": 1.5}), 400, "invalid_value", p("top_p")),
        (json!({"top_p": -0.5}), 400, "invalid_value", p("top_p")),
        (json!({"min_p": -0.1}), 400, "invalid_value", p("min_p")),
        (json!({"min_p": 1.1}), 400, "invalid_value", p("min_p")),
        (json!({"presence_penalty": 3}), 400, "invalid_value", p("presence_penalty")),
        (json!({"frequency_penalty": -2.5}), 400, "invalid_value", p("frequency_penalty")),
        (json!({"repetition_penalty": 0}), 400, "invalid_value", p("repetition_penalty")),
        (json!({"repetition_penalty": -1}), 400, "invalid_value", p("repetition_penalty")),
        // applied in float32: 1e-40 would round to a denormal, 1e300 to infinity
        (json!({"repetition_penalty": 1e-40}), 400, "invalid_value", p("repetition_penalty")),
        (json!({"repetition_penalty": 1e300}), 400, "invalid_value", p("repetition_penalty")),
        (json!({"top_k": -2}), 400, "invalid_value", p("top_k")),
        (json!({"top_k": 1.5}), 400, "invalid_type", p("top_k")),
        (json!({"top_k": 3000000000u64}), 400, "invalid_value", p("top_k")),
        (json!({"n": 0}), 400, "invalid_value", p("n")),
        (json!({"n": 129}), 400, "invalid_value", p("n")),
        (json!({"n": -1}), 400, "invalid_value", p("n")),
        (json!({"n": "2"}), 400, "invalid_type", p("n")),
        (json!({"max_tokens": 0}), 400, "invalid_value", p("max_tokens")),
        (json!({"max_tokens": -1}), 400, "invalid_value", p("max_tokens")),
        (json!({"max_tokens": 1.5}), 400, "invalid_type", p("max_tokens")),
        (json!({"max_completion_tokens": 0, "max_tokens": 5}), 400, "invalid_value", p("max_completion_tokens")),
        // the one overridden is checked too, 0 as -1 is
        (json!({"max_completion_tokens": 5, "max_tokens": 0}), 400, "invalid_value", p("max_tokens")),
        (json!({"min_tokens": 6, "max_tokens": 5}), 400, "invalid_value", p("min_tokens")),
        (json!({"min_tokens": -1}), 400, "invalid_value", p("min_tokens")),
        (json!({"seed": 1.5}), 400, "invalid_type", p("seed")),
        (json!({"seed": "42"}), 400, "invalid_type", p("seed")),
        (json!({"stop": ""}), 400, "invalid_value", p("stop")),
        (json!({"stop": ["a", ""]}), 400, "invalid_value", p("stop[1]")),
        (json!({"stop": [1]}), 400, "invalid_type", p("stop[0]")),
        (json!({"stop": 5}), 400, "invalid_type", p("stop")),
        (json!({"stop_token_ids": [1, 999]}), 400, "invalid_value", p("stop_token_ids[1]")),
        (json!({"stop_token_ids": ["1"]}), 400, "invalid_type", p("stop_token_ids[0]")),
        (json!({"logit_bias": {"999": 1}}), 400, "invalid_value", p("logit_bias.999")),
        (json!({"logit_bias": {"3": 101}}), 400, "invalid_value", p("logit_bias.3")),
        (json!({"logit_bias": {"3": -100.5}}), 400, "invalid_value", p("logit_bias.3")),
        (json!({"logit_bias": {"abc": 1}}), 400, "invalid_value", p("logit_bias.abc")),
        (json!({"logit_bias": {"03": 1}}), 400, "invalid_value", p("logit_bias.03")),
        (json!({"logit_bias": {"3": "x"}}), 400, "invalid_type", p("logit_bias.3")),
        (json!({"logit_bias": [1]}), 400, "invalid_type", p("logit_bias")),
        (json!({"stream": "yes"}), 400, "invalid_type", p("stream")),
        (json!({"stream_options": {"include_usage": true}}), 400, "invalid_value", p("stream_options")),
        (
            json!({"stream": false, "stream_options": {"include_usage": true}}),
            400,
            "invalid_value",
            p("stream_options"),
        ),
        (
            json!({"stream": true, "stream_options": {"include_usage": 1}}),
            400,
            "invalid_type",
            p("stream_options.include_usage"),
        ),
        (json!({"priority": "high"}), 400, "invalid_type", p("priority")),
        (json!({"request_id": ""}), 400, "invalid_value", p("request_id")),
        (json!({"request_id": 5}), 400, "invalid_type", p("request_id")),
        (json!({"cache_salt": ""}), 400, "invalid_value", p("cache_salt")),
        (json!({"user": 5}), 400, "invalid_type", p("user")),
        (json!({"ignore_eos": "no"}), 400, "invalid_type", p("ignore_eos")),
        (json!({"skip_special_tokens": 0}), 400, "invalid_type", p("skip_special_tokens")),
        (json!({"store": "yes"}), 400, "invalid_type", p("store")),
    ];
    check_chat(cases.clone());
    check_completion(cases);
}

#[test]
fn response_format_json_modes_compile_to_grammars() {
    let schema = |s: serde_json::Value| json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}});
    let cases = vec![
        (
            schema(json!({"type": "array", "uniqueItems": true})),
            400,
            "invalid_value",
            p("response_format.json_schema.schema"),
        ),
        (schema(json!([1])), 400, "invalid_type", p("response_format.json_schema.schema")),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}),
            400,
            "missing_required_parameter",
            p("response_format.json_schema.name"),
        ),
        (
            json!({"response_format": {"type": "json_schema"}}),
            400,
            "missing_required_parameter",
            p("response_format.json_schema"),
        ),
        (
            json!({"response_format": {"type": "json_object"}, "ignore_eos": true}),
            400,
            "invalid_value",
            p("ignore_eos"),
        ),
        (json!({"response_format": {"type": "json_object"}, "min_tokens": 3}), 400, "invalid_value", p("min_tokens")),
        (json!({"response_format": {"type": "regex", "regex": "("}}), 400, "invalid_value", p("response_format.regex")),
        (
            json!({"response_format": {"type": "grammar"}}),
            400,
            "missing_required_parameter",
            p("response_format.grammar"),
        ),
        // compile but admit no text at all: refused here, not ended at once later
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}}),
            400,
            "invalid_value",
            p("response_format.json_schema.schema"),
        ),
        (
            json!({"response_format": {"type": "grammar", "grammar": "start: a\na: a"}}),
            400,
            "invalid_value",
            p("response_format.grammar"),
        ),
        (json!({"response_format": {"type": "xml"}}), 400, "invalid_value", p("response_format.type")),
        (json!({"response_format": {}}), 400, "missing_required_parameter", p("response_format.type")),
        (json!({"response_format": "text"}), 400, "invalid_type", p("response_format")),
    ];
    check_chat(cases.clone());
    check_completion(cases);
    let r = router();
    assert_eq!(chat(&r, json!({"response_format": {"type": "text"}})).unwrap().grammar, None);
    let a = chat(&r, json!({"response_format": {"type": "json_object"}})).unwrap();
    assert!(a.grammar.as_ref().unwrap().key().starts_with("json_schema:"));
    let b = chat(&r, schema(json!({"type": "object", "properties": {"a": {"enum": [1, 2]}}}))).unwrap();
    let c = chat(&r, schema(json!({"type": "object", "properties": {"a": {"enum": [1, 2]}}}))).unwrap();
    assert_eq!(b.grammar, c.grammar);
    assert_ne!(a.grammar, b.grammar);
    let e = chat(&r, schema(json!({"type": "object", "properties": {"a": {"not": {}}}}))).unwrap_err();
    assert!(e.message().contains("not"), "{}", e.message());
    let rx = chat(&r, json!({"response_format": {"type": "regex", "regex": "[a-z]+"}})).unwrap();
    assert!(rx.grammar.unwrap().key().starts_with("regex:"));
    let g = chat(&r, json!({"response_format": {"type": "grammar", "grammar": "start: \"a\" | \"b\""}})).unwrap();
    assert!(g.grammar.unwrap().key().starts_with("lark:"));
}

/// vLLM's `structured_outputs` and its older `guided_*` fields ask for the same grammars as
/// `response_format`; one constraint per request, and what cannot be enforced is refused.
#[test]
fn structured_outputs_constrain_like_response_format() {
    let cases = vec![
        (json!({"structured_outputs": {"regex": "("}}), 400, "invalid_value", p("structured_outputs.regex")),
        (json!({"structured_outputs": {"regex": 5}}), 400, "invalid_type", p("structured_outputs.regex")),
        (json!({"structured_outputs": {"choice": []}}), 400, "invalid_value", p("structured_outputs.choice")),
        (json!({"structured_outputs": {"choice": ["a", 1]}}), 400, "invalid_type", p("structured_outputs.choice[1]")),
        (json!({"structured_outputs": {"choice": "a"}}), 400, "invalid_type", p("structured_outputs.choice")),
        (json!({"structured_outputs": {"json": "{not json"}}), 400, "invalid_value", p("structured_outputs.json")),
        (
            json!({"structured_outputs": {"json": {"type": "array", "uniqueItems": true}}}),
            400,
            "invalid_value",
            p("structured_outputs.json"),
        ),
        (
            json!({"structured_outputs": {"json_object": "yes"}}),
            400,
            "invalid_type",
            p("structured_outputs.json_object"),
        ),
        (
            json!({"structured_outputs": {"structural_tag": {"type": "structural_tag"}}}),
            400,
            "missing_required_parameter",
            p("structured_outputs.structural_tag.format"),
        ),
        (
            json!({"structured_outputs": {"structural_tag": "{\"format\": "}}),
            400,
            "invalid_value",
            p("structured_outputs.structural_tag"),
        ),
        (
            json!({"structured_outputs": {"structural_tag": {"type": "json", "format": {}}}}),
            400,
            "invalid_value",
            p("structured_outputs.structural_tag.type"),
        ),
        (
            json!({"response_format": {"type": "structural_tag", "format": {"type": "tag", "begin": "<a>", "end": "</a>",
                "content": {"type": "json_schema", "json_schema": {"type": "array", "uniqueItems": true}}}}}),
            400,
            "invalid_value",
            p("response_format.format.content.json_schema"),
        ),
        (
            // (a schema the grammar engine would die on, blamed where it was sent)
            json!({"response_format": {"type": "structural_tag", "format": {"type": "tag", "begin": "<a>", "end": "</a>",
                "content": {"type": "json_schema", "json_schema": {"type": "integer", "minimum": -1e19}}}}}),
            400,
            "invalid_value",
            p("response_format.format.content.json_schema"),
        ),
        (
            json!({"response_format": {"type": "structural_tag", "triggers": ["<f="],
                "structures": [{"begin": "<g=a>", "schema": {}, "end": "</g>"}]}}),
            400,
            "invalid_value",
            p("response_format.structures[0].begin"),
        ),
        (
            json!({"response_format": {"type": "structural_tag", "format": {"type": "grammar", "grammar": "root ::= \"a\" b"}}}),
            400,
            "invalid_value",
            p("response_format.format.grammar"),
        ),
        (json!({"structured_outputs": "json"}), 400, "invalid_type", p("structured_outputs")),
        (
            json!({"structured_outputs": {"regex": "[a-z]+", "choice": ["a"]}}),
            400,
            "invalid_value",
            p("structured_outputs.choice"),
        ),
        (
            json!({"structured_outputs": {"regex": "[a-z]+"}, "guided_regex": "[a-z]+"}),
            400,
            "invalid_value",
            p("guided_regex"),
        ),
        (
            json!({"structured_outputs": {"regex": "[a-z]+"}, "response_format": {"type": "json_object"}}),
            400,
            "invalid_value",
            p("structured_outputs.regex"),
        ),
        (json!({"guided_regex": "[a-z]+", "ignore_eos": true}), 400, "invalid_value", p("ignore_eos")),
        (json!({"guided_grammar": "start: a\na: a"}), 400, "invalid_value", p("guided_grammar")),
    ];
    check_chat(cases.clone());
    check_completion(cases);
    let r = router();
    let rx = chat(&r, json!({"structured_outputs": {"regex": "[a-z]+"}})).unwrap();
    let same = chat(&r, json!({"response_format": {"type": "regex", "regex": "[a-z]+"}})).unwrap();
    assert_eq!(rx.grammar, same.grammar);
    let legacy = completion(&r, json!({"guided_regex": "[a-z]+"})).unwrap();
    assert_eq!(legacy.grammar, same.grammar);
    // a schema as JSON text that does not parse says why
    let e = chat(&r, json!({"structured_outputs": {"json": "{\"type\": \"object\","}})).unwrap_err();
    assert!(e.message().contains("does not parse: EOF while parsing"), "{}", e.message());
    let e = chat(&r, json!({"guided_json": "[1]"})).unwrap_err();
    assert!(e.message().ends_with("must be a JSON Schema object, not an array."), "{}", e.message());
    let obj = chat(&r, json!({"structured_outputs": {"json_object": true}})).unwrap();
    assert_eq!(obj.grammar, chat(&r, json!({"response_format": {"type": "json_object"}})).unwrap().grammar);
    let schema = json!({"type": "object", "properties": {"a": {"enum": [1, 2]}}});
    let text = serde_json::to_string(&schema).unwrap();
    let rf =
        chat(&r, json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}));
    for so in [json!({"json": schema}), json!({"json": text})] {
        assert_eq!(chat(&r, json!({"structured_outputs": so})).unwrap().grammar, rf.as_ref().unwrap().grammar);
    }
    assert_eq!(chat(&r, json!({"guided_json": schema})).unwrap().grammar, rf.as_ref().unwrap().grammar);
    assert!(chat(&r, json!({"guided_choice": ["hello", "world"]}))
        .unwrap()
        .grammar
        .unwrap()
        .key()
        .starts_with("lark:"));
    // sent without a constraint (empty, off, tuning keys alone): 400, as vLLM
    for off in
        [json!({"json_object": false}), json!({}), json!({"regex": null}), json!({"disable_any_whitespace": true})]
    {
        let got = shape(chat(&r, json!({"structured_outputs": off.clone()})));
        assert_eq!(got, (400, "invalid_value", p("structured_outputs")), "{off}");
    }
    assert_eq!(chat(&r, json!({"structured_outputs": null})).unwrap().grammar, None);
    let beside_off = chat(&r, json!({"structured_outputs": {"regex": "[a-z]+", "json_object": false}})).unwrap();
    assert_eq!(beside_off.grammar, rx.grammar);
    let legacy_beside_off = chat(&r, json!({"structured_outputs": {"json_object": false}, "guided_regex": "[a-z]+"}));
    assert_eq!(legacy_beside_off.unwrap().grammar, rx.grammar);
    // a ref that leads only through refs back to itself: a 400 now, not a dead end mid-way
    let cycle =
        json!({"type": "object", "$defs": {"A": {"$ref": "#/$defs/A"}}, "properties": {"x": {"$ref": "#/$defs/A"}}});
    for (body, param) in [
        (json!({"structured_outputs": {"json": cycle}}), "structured_outputs.json"),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": cycle}}}),
            "response_format.json_schema.schema",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": cycle}}]}),
            "tools[0].function.parameters",
        ),
    ] {
        let e = chat(&r, body).unwrap_err();
        assert_eq!((e.code(), e.param()), ("invalid_value", Some(param)));
        assert!(e.message().contains("back to itself"), "{}", e.message());
    }
    // a regex syntax error says what is wrong, and where in the client's regex
    let e = chat(&r, json!({"structured_outputs": {"regex": "(((a"}})).unwrap_err();
    assert!(e.message().ends_with("unclosed group (at character 3 of the regex)"), "{}", e.message());
    for n in [2000, 20000] {
        let many: Vec<String> = (0..n).map(|i| format!("c{i}")).collect();
        assert!(chat(&r, json!({"guided_choice": many})).is_ok(), "{n}");
    }
    let many: Vec<String> = (0..20001).map(|i| format!("c{i}")).collect();
    assert_eq!(shape(chat(&r, json!({"guided_choice": many}))), (400, "invalid_value", p("guided_choice")));
    let tuned = chat(
        &r,
        json!({"structured_outputs": {"regex": "[a-z]+", "disable_any_whitespace": true},
               "guided_decoding_backend": "xgrammar"}),
    )
    .unwrap();
    assert_eq!(
        header(&tuned, "llmserve-ignored-fields"),
        Some("guided_decoding_backend, structured_outputs.disable_any_whitespace")
    );
    // vLLM's StructuredOutputsParams passed whole: its tuning keys at their defaults ask nothing
    // (audit T2: each call warned of them)
    let whole = chat(
        &r,
        json!({"structured_outputs": {"choice": ["a", "b"], "disable_fallback": false, "disable_any_whitespace": false,
               "disable_additional_properties": false, "whitespace_pattern": null, "_backend": null,
               "_backend_was_auto": false, "regex": null}}),
    )
    .unwrap();
    assert_eq!(header(&whole, "llmserve-ignored-fields"), None);
    // a constraint at false is still no constraint's value
    let (status, _, param) = shape(chat(&r, json!({"structured_outputs": {"regex": false}})));
    assert_eq!((status, param.as_deref()), (400, Some("structured_outputs.regex")));
}

#[test]
fn chat_logprobs() {
    check_chat(vec![
        (json!({"logprobs": true, "top_logprobs": 21}), 400, "invalid_value", p("top_logprobs")),
        (json!({"top_logprobs": 2}), 400, "invalid_value", p("top_logprobs")),
        (json!({"logprobs": false, "top_logprobs": 0}), 400, "invalid_value", p("top_logprobs")),
        (json!({"logprobs": "yes"}), 400, "invalid_type", p("logprobs")),
        (json!({"logprobs": 3}), 400, "invalid_type", p("logprobs")),
    ]);
    let r = router();
    assert_eq!(chat(&r, json!({})).unwrap().params.logprobs, None);
    assert_eq!(chat(&r, json!({"logprobs": false})).unwrap().params.logprobs, None);
    assert_eq!(chat(&r, json!({"logprobs": true})).unwrap().params.logprobs, Some(0));
    assert_eq!(chat(&r, json!({"logprobs": true, "top_logprobs": 20})).unwrap().params.logprobs, Some(20));
    let r5 = router_with(json!({"max_logprobs": 5}), Some(TEMPLATE));
    assert_eq!(shape(chat(&r5, json!({"logprobs": true, "top_logprobs": 6}))).2, p("top_logprobs"));
}

#[test]
fn tools_and_tool_choice() {
    let tool = json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}});
    let object_enum = json!({"type": "function", "function": {"name": "f", "parameters": {"enum": [{"a": 1}]}}});
    assert!(chat(&router(), json!({"tools": [object_enum]})).is_ok(), "an enum of objects admits arguments");
    // a keyword the engine cannot enforce is placed within the tool's own `parameters`, under
    // "required" (whose grammar wraps every tool's call) as under a named choice
    let tagged = json!({"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": true}}});
    let tags = json!({"type": "function", "function": {"name": "t", "parameters": tagged}});
    for choice in [json!("required"), json!({"type": "function", "function": {"name": "t"}})] {
        let err = chat(&router(), json!({"tools": [tool, tags], "tool_choice": choice})).unwrap_err();
        assert_eq!(err.param(), Some("tools[1].function.parameters"));
        assert!(err.message().ends_with("(`uniqueItems` at /properties/tags)"), "{}", err.message());
    }
    let named = |name: &str| json!({"type": "function", "function": {"name": name}});
    let allowed = |mode: Value, tools: Value| json!({"tools": [tool], "tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": tools}}});
    let at = |rest: &str| p(&format!("tool_choice.allowed_tools{rest}"));
    check_chat(vec![
        (json!({"tools": []}), 400, "invalid_value", p("tools")),
        (json!({"tools": {}}), 400, "invalid_type", p("tools")),
        // arguments are an object: a schema that admits none is refused by name, typed or not
        (
            json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}),
            400,
            "invalid_value",
            p("tools[0].function.parameters"),
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"enum": ["a", "b"]}}}]}),
            400,
            "invalid_value",
            p("tools[0].function.parameters"),
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"enum": []}}}]}),
            400,
            "invalid_value",
            p("tools[0].function.parameters"),
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"const": 3}}}]}),
            400,
            "invalid_value",
            p("tools[0].function.parameters"),
        ),
        (json!({"tool_choice": "auto"}), 400, "invalid_value", p("tool_choice")),
        (json!({"tool_choice": "none"}), 400, "invalid_value", p("tool_choice")),
        (json!({"tools": [tool], "tool_choice": "sometimes"}), 400, "invalid_value", p("tool_choice")),
        (json!({"tools": [tool], "tool_choice": 1}), 400, "invalid_type", p("tool_choice")),
        (
            json!({"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
            400,
            "invalid_value",
            p("tool_choice.function.name"),
        ),
        // beside a forced call a response_format has no effect (reported), but is still checked
        (
            json!({"tools": [tool], "tool_choice": "required", "response_format": {"type": "json_schema"}}),
            400,
            "missing_required_parameter",
            p("response_format.json_schema"),
        ),
        (
            json!({"tools": [tool], "tool_choice": "required",
                   "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}}),
            400,
            "invalid_value",
            p("response_format.json_schema.schema"),
        ),
        (
            json!({"tools": [{"type": "function", "function": {}}]}),
            400,
            "missing_required_parameter",
            p("tools[0].function.name"),
        ),
        (json!({"tools": [{"type": "function"}]}), 400, "missing_required_parameter", p("tools[0].function")),
        (json!({"tools": [tool, {"function": {"name": "b"}}]}), 400, "missing_required_parameter", p("tools[1].type")),
        (
            json!({"tools": [{"type": "retrieval", "function": {"name": "b"}}]}),
            400,
            "invalid_value",
            p("tools[0].type"),
        ),
        (
            json!({"tools": [{"type": "custom", "custom": {"name": "code"}}]}),
            400,
            "unsupported_parameter",
            p("tools[0].type"),
        ),
        // (allowed_tools is served: protocol_fields.rs; its shape is checked)
        (allowed(json!("required"), json!([named("nope")])), 400, "invalid_value", at(".tools[0].function.name")),
        (allowed(json!("sometimes"), json!([named("get_weather")])), 400, "invalid_value", at(".mode")),
        (allowed(json!("auto"), json!([])), 400, "invalid_value", at(".tools")),
        (
            allowed(json!("auto"), json!([{"type": "custom", "custom": {"name": "f"}}])),
            400,
            "invalid_value",
            at(".tools[0].type"),
        ),
        (json!({"tools": [tool], "tool_choice": {"type": "allowed_tools"}}), 400, "missing_required_parameter", at("")),
        (json!({"tools": [tool], "tool_choice": {"type": "bogus"}}), 400, "invalid_value", p("tool_choice.type")),
        (
            json!({"tools": [{"type": "function", "function": {"name": "b", "parameters": "x"}}]}),
            400,
            "invalid_type",
            p("tools[0].function.parameters"),
        ),
        (json!({"tools": [tool], "parallel_tool_calls": "no"}), 400, "invalid_type", p("parallel_tool_calls")),
        // OpenAI's function names: ^[a-zA-Z0-9_-]{1,64}$
        (
            json!({"tools": [{"type": "function", "function": {"name": "a b"}}]}),
            400,
            "invalid_value",
            p("tools[0].function.name"),
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "x".repeat(65)}}]}),
            400,
            "invalid_value",
            p("tools[0].function.name"),
        ),
        // arguments are a JSON object: another root type cannot be honoured
        (
            json!({"tools": [{"type": "function", "function": {"name": "b", "parameters": {"type": "array"}}}]}),
            400,
            "invalid_value",
            p("tools[0].function.parameters"),
        ),
        // two definitions of one name would leave a named tool_choice, and the calls, ambiguous
        (json!({"tools": [tool, tool]}), 400, "invalid_value", p("tools[1].function.name")),
        // a malformed schema is refused even when nothing compiles it (tool_choice auto)
        (
            json!({"tools": [tool, {"type": "function", "function": {"name": "b", "parameters": {"type": "objekt"}}}]}),
            400,
            "invalid_value",
            p("tools[1].function.parameters"),
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "b",
                    "parameters": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}],
                   "tool_choice": "none"}),
            400,
            "invalid_value",
            p("tools[0].function.parameters"),
        ),
    ]);
    let r = router();
    // auto (the default with tools) renders them; none does not.
    let auto = chat(&r, json!({"tools": [tool], "parallel_tool_calls": false})).unwrap();
    assert!(auto.prompt_texts[0].contains("tools : get_weather"), "{}", auto.prompt_texts[0]);
    assert_eq!(header(&auto, "llmserve-ignored-fields"), None);
    let none = chat(&r, json!({"tools": [tool], "tool_choice": "none"})).unwrap();
    assert!(!none.prompt_texts[0].contains("tools"), "{}", none.prompt_texts[0]);
    // so under "none" the tools have no effect: reported, even by a template that reads them
    assert_eq!(header(&none, "llmserve-ignored-fields"), Some("tools"));
    assert_eq!((none.grammar.is_some(), none.tools), (false, None));
    // This template knows no tool format: "auto" is text, forced calls use the json format.
    assert_eq!(auto.tools, None);
    let required = chat(&r, json!({"tools": [tool], "tool_choice": "required"})).unwrap();
    assert!(required.grammar.is_some());
    let t = required.tools.unwrap();
    assert_eq!((t.format.name(), t.parallel), ("json", true));
    let named =
        chat(&r, json!({"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}))
            .unwrap();
    assert!(!named.tools.unwrap().parallel);
    let bad = json!({"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}});
    let e = chat(&r, json!({"tools": [bad], "tool_choice": "required"})).unwrap_err();
    assert_eq!(e.param(), Some("tools[0].function.parameters"));
    // the tool that fails is named, also among others
    let e = chat(&r, json!({"tools": [tool, bad], "tool_choice": "required"})).unwrap_err();
    assert_eq!((e.code(), e.param()), ("invalid_value", Some("tools[1].function.parameters")));
    assert!(e.message().contains("not"), "{}", e.message());
    // a malformed pattern is placed in the client's `parameters`, not in the call object the
    // grammar wraps them in
    let bad = json!({"type": "function", "function": {"name": "f", "parameters": {"type": "object",
        "properties": {"a": {"type": "string", "pattern": "(["}}, "required": ["a"]}}});
    for choice in [json!("required"), json!({"type": "function", "function": {"name": "f"}})] {
        let e = chat(&r, json!({"tools": [tool, bad], "tool_choice": choice})).unwrap_err();
        assert_eq!(e.param(), Some("tools[1].function.parameters"));
        assert!(e.message().contains("`pattern` at /properties/a:"), "{}", e.message());
    }
}

/// A template that never shows `tools` and knows no tool-call format (SmolLM2's): under
/// "auto" the tools do nothing, so neither does `parallel_tool_calls`; forced calls use the
/// names and parameters (grammar), but the descriptions never reach the model.
#[test]
fn tools_a_template_never_shows_are_reported() {
    let plain = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}";
    let r = router_with(json!({}), Some(plain));
    let tool = |name: &str, description: Option<&str>| {
        let mut f = json!({"name": name, "parameters": {"type": "object"}});
        if let Some(d) = description {
            f["description"] = json!(d);
        }
        json!({"type": "function", "function": f})
    };
    let tools = json!([tool("a", Some("weather")), tool("b", None), tool("c", Some("news"))]);
    let auto = chat(&r, json!({"tools": tools, "parallel_tool_calls": false})).unwrap();
    assert_eq!(header(&auto, "llmserve-ignored-fields"), Some("parallel_tool_calls, tools"));
    let required = chat(&r, json!({"tools": tools, "tool_choice": "required"})).unwrap();
    assert!(required.grammar.is_some());
    assert_eq!(
        header(&required, "llmserve-ignored-fields"),
        Some("tools[0].function.description, tools[2].function.description")
    );
    // under a named function the other tools do nothing at all
    let named =
        chat(&r, json!({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "b"}}})).unwrap();
    assert_eq!(header(&named, "llmserve-ignored-fields"), Some("tools[0], tools[2]"));
    let named =
        chat(&r, json!({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "c"}}})).unwrap();
    assert_eq!(header(&named, "llmserve-ignored-fields"), Some("tools[0], tools[1], tools[2].function.description"));
    // a template that shows the tools passes their descriptions on
    let shown = chat(&router(), json!({"tools": tools, "tool_choice": "required"})).unwrap();
    assert_eq!(header(&shown, "llmserve-ignored-fields"), None);
}

#[test]
fn chat_extensions() {
    check_chat(vec![
        (json!({"chat_template": "{{ messages }}"}), 400, "unsupported_parameter", p("chat_template")),
        (
            json!({"add_generation_prompt": true, "continue_final_message": true}),
            400,
            "invalid_value",
            p("continue_final_message"),
        ),
        (json!({"chat_template_kwargs": "x"}), 400, "invalid_type", p("chat_template_kwargs")),
        (
            json!({"chat_template_kwargs": {"add_generation_prompt": false}}),
            400,
            "invalid_value",
            p("chat_template_kwargs.add_generation_prompt"),
        ),
        (json!({"documents": {}}), 400, "invalid_type", p("documents")),
        (json!({"documents": [{"text": "a"}, "b"]}), 400, "invalid_type", p("documents[1]")),
        (json!({"documents": [null]}), 400, "invalid_type", p("documents[0]")),
        (json!({"add_generation_prompt": "yes"}), 400, "invalid_type", p("add_generation_prompt")),
    ]);
    let r = router();
    let e = chat(&r, json!({"chat_template": "x"})).unwrap_err();
    assert!(e.message().contains("--chat-template"));
    // continue_final_message alone turns the generation prompt off rather than failing.
    let body = json!({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                      "continue_final_message": true});
    let p = chat(&r, body).unwrap();
    assert!(!p.prompt_texts[0].ends_with("assistant :"), "{}", p.prompt_texts[0]);
    let p = chat(&r, json!({"add_generation_prompt": false})).unwrap();
    assert!(!p.prompt_texts[0].contains("assistant"));
}

#[test]
fn completion_prompts() {
    check_completion(vec![
        (json!({"prompt": null}), 400, "missing_required_parameter", p("prompt")),
        (json!({"prompt": ""}), 400, "invalid_value", p("prompt")),
        (json!({"prompt": []}), 400, "invalid_value", p("prompt")),
        (json!({"prompt": ["a", ""]}), 400, "invalid_value", p("prompt[1]")),
        (json!({"prompt": [[]]}), 400, "invalid_value", p("prompt[0]")),
        (json!({"prompt": [1, 999]}), 400, "invalid_value", p("prompt[1]")),
        (json!({"prompt": [1, 20]}), 400, "invalid_value", p("prompt[1]")),
        (json!({"prompt": [[1], [2, 999]]}), 400, "invalid_value", p("prompt[1][1]")),
        (json!({"prompt": [1.5]}), 400, "invalid_type", p("prompt[0]")),
        (json!({"prompt": [-1]}), 400, "invalid_value", p("prompt[0]")),
        (json!({"prompt": [5.0]}), 400, "invalid_type", p("prompt[0]")),
        // whole numbers past 64 bits arrive as floats: still a range error
        (json!({"prompt": [18446744073709551616.0f64]}), 400, "invalid_value", p("prompt[0]")),
        (json!({"prompt": [-1e30]}), 400, "invalid_value", p("prompt[0]")),
        (json!({"prompt": [1, "a"]}), 400, "invalid_type", p("prompt[1]")),
        (json!({"prompt": ["a", 1]}), 400, "invalid_type", p("prompt[1]")),
        (json!({"prompt": ["a", [1, 2]]}), 400, "invalid_type", p("prompt[1]")),
        (json!({"prompt": [[1, 2], "a"]}), 400, "invalid_type", p("prompt[1]")),
        (json!({"prompt": [["a"]]}), 400, "invalid_type", p("prompt[0][0]")),
        (json!({"prompt": {"a": 1}}), 400, "invalid_type", p("prompt")),
        (json!({"prompt": 5}), 400, "invalid_type", p("prompt")),
        (json!({"suffix": "x"}), 400, "unsupported_parameter", p("suffix")),
        (json!({"best_of": 0}), 400, "invalid_value", p("best_of")),
        (json!({"best_of": 1, "n": 2}), 400, "invalid_value", p("best_of")),
        (json!({"best_of": 129}), 400, "invalid_value", p("best_of")),
        (json!({"best_of": 2, "stream": true}), 400, "invalid_value", p("best_of")),
        (json!({"best_of": 2, "stream": true, "temperature": 0}), 400, "invalid_value", p("best_of")),
        (json!({"logprobs": 21}), 400, "invalid_value", p("logprobs")),
        (json!({"logprobs": true}), 400, "invalid_type", p("logprobs")),
        (json!({"logprobs": -1}), 400, "invalid_value", p("logprobs")),
        (json!({"echo": "yes"}), 400, "invalid_type", p("echo")),
    ]);
    let r = router();
    completion(&r, json!({"best_of": 2, "n": 2})).unwrap();
    // best_of above n: that many run, ranked by their tokens' logprobs (computed, not shown)
    let best = completion(&r, json!({"best_of": 3, "n": 2})).unwrap();
    assert_eq!((best.params.n, best.params.logprobs), (3, Some(0)));
    assert_eq!(best.best_of, Some(BestOf { n: 2, logprobs: false }));
    assert_eq!(best.shown_logprobs(), None);
    let shown = completion(&r, json!({"best_of": 3, "logprobs": 2, "echo": true})).unwrap();
    assert_eq!((shown.params.n, shown.shown_logprobs(), shown.prompt_logprobs()), (3, Some(2), Some(2)));
    let hidden = completion(&r, json!({"best_of": 3, "echo": true})).unwrap();
    assert_eq!(hidden.prompt_logprobs(), None, "no prompt logprobs were asked for");
    // greedy choices are all the same: computed once (one sequence), each counted as billed
    let greedy = completion(&r, json!({"best_of": 3, "temperature": 0})).unwrap();
    assert_eq!((greedy.params.n, greedy.best_of), (3, Some(BestOf { n: 1, logprobs: false })));
    assert_eq!((greedy.params.seqs_per_prompt(), greedy.params.logprobs), (1, None), "nothing to rank them by");
    completion(&r, json!({"best_of": null, "suffix": null})).unwrap();
    assert_eq!(completion(&r, json!({"logprobs": 3})).unwrap().params.logprobs, Some(3));
    assert_eq!(completion(&r, json!({"logprobs": null})).unwrap().params.logprobs, None);
}

#[test]
fn completion_prompt_shapes_tokenize() {
    let r = router();
    // Strings get the tokenizer's post-processor (BOS); ids go through as sent.
    let s = completion(&r, json!({"prompt": "hello world"})).unwrap();
    assert_eq!(s.prompts, vec![vec![0, 9, 10]]);
    assert_eq!(s.prompt_texts, vec!["hello world".to_string()]);
    let l = completion(&r, json!({"prompt": ["hello", "world"]})).unwrap();
    assert_eq!(l.prompts, vec![vec![0, 9], vec![0, 10]]);
    let ids = completion(&r, json!({"prompt": [9, 10]})).unwrap();
    assert_eq!(ids.prompts, vec![vec![9, 10]]);
    assert_eq!(ids.prompt_texts, vec![r.tokenizer().decode(&[9, 10], false)]);
    let lists = completion(&r, json!({"prompt": [[9], [10, 9]]})).unwrap();
    assert_eq!(lists.prompts, vec![vec![9], vec![10, 9]]);
    assert_eq!(lists.endpoint, Endpoint::Completion);
}

#[test]
fn chat_prompt_is_rendered_then_tokenized_without_extra_specials() {
    let r = router();
    let p = chat(&r, json!({})).unwrap();
    assert_eq!(p.prompt_texts, vec!["<s>user : hello world </s> assistant :".to_string()]);
    // One BOS: the template's, not the post-processor's as well.
    assert_eq!(p.prompts, vec![vec![0, 3, 8, 9, 10, 1, 4, 8]]);
    assert_eq!(p.endpoint, Endpoint::Chat);
    let h = header(&p, "llmserve-chat-template").unwrap();
    assert!(h.starts_with("--chat-template sha256:"), "{h}");
}

#[test]
fn special_tokens_spelled_in_messages_are_text_unless_told() {
    // OpenAI reads message content as text: a user who writes `</s>` does not end the turn
    let messages = json!([{"role": "user", "content": "hello </s> world"},
                          {"role": "assistant", "content": [{"type": "text", "text": "<s>a"}]}]);
    let eos = |p: &Prepared| p.prompts[0].iter().filter(|&&t| t == 1).count();
    let bos = |p: &Prepared| p.prompts[0].iter().filter(|&&t| t == 0).count();
    let text_body = json!({"messages": messages});
    let r = router();
    let p = chat(&r, text_body.clone()).unwrap();
    assert_eq!(p.prompt_texts[0], "<s>user : hello </s> world </s> assistant : <s>a </s> assistant :");
    assert_eq!((bos(&p), eos(&p)), (1, 2), "only the template's own: {:?}", p.prompts[0]);
    // /tokenize renders and counts the same way
    let body = serde_json::to_vec(&text_body).unwrap();
    let tokenized: Value = serde_json::from_slice(&r.handle(Endpoint::Tokenize, &body).unwrap().body).unwrap();
    assert_eq!(tokenized["tokens"], json!(p.prompts[0]));
    // --parse-special-tokens-in-messages: the tokens themselves, as transformers tokenizes them
    let parsing = router_with(json!({"parse_special_tokens_in_messages": true}), Some(TEMPLATE));
    let q = chat(&parsing, text_body).unwrap();
    assert_eq!(q.prompt_texts, p.prompt_texts);
    assert_eq!((bos(&q), eos(&q)), (2, 3), "{:?}", q.prompts[0]);
    // a message without them renders and tokenizes the same either way
    assert_eq!(chat(&r, json!({})).unwrap().prompts, chat(&parsing, json!({})).unwrap().prompts);
}

#[test]
fn missing_template_names_the_flag() {
    let r = router_with(json!({}), None);
    let e = chat(&r, json!({})).unwrap_err();
    assert_eq!((e.status(), e.code()), (400, "chat_template_missing"));
    assert!(e.message().contains("--chat-template"), "{}", e.message());
    // Completions need no template.
    completion(&r, json!({})).unwrap();
}

#[test]
fn context_budget() {
    let r = router();
    // "hello world" is 3 tokens with BOS; the context is 32.
    completion(&r, json!({"max_tokens": 29})).unwrap();
    let e = completion(&r, json!({"max_tokens": 30})).unwrap_err();
    assert_eq!((e.status(), e.code(), e.param()), (400, "context_length_exceeded", Some("max_tokens")));
    let m = e.message();
    assert!(m.contains("is 32 tokens") && m.contains("33 tokens") && m.contains("(3 in the prompt"), "{m}");
    assert!(m.contains("30 in the completion via `max_tokens`"), "{m}");
    let e = completion(&r, json!({"max_completion_tokens": 30, "max_tokens": 1})).unwrap_err();
    assert_eq!(e.param(), Some("max_completion_tokens"));

    let long = vec!["hello"; 31].join(" "); // 31 + BOS = 32 tokens: no room left
    let e = completion(&r, json!({"prompt": long})).unwrap_err();
    assert_eq!((e.code(), e.param()), ("context_length_exceeded", Some("prompt")));
    let e = completion(&r, json!({"prompt": ["hello", long]})).unwrap_err();
    assert_eq!(e.param(), Some("prompt[1]"));
    let just_fits = vec!["hello"; 30].join(" ");
    completion(&r, json!({"prompt": just_fits})).unwrap();
    // Every prompt of a list is checked against max_tokens.
    let e = completion(&r, json!({"prompt": ["hello", vec!["hello"; 20].join(" ")], "max_tokens": 12})).unwrap_err();
    assert_eq!(e.param(), Some("max_tokens"));

    // min_tokens must fit the room the prompt leaves (32 - 3).
    completion(&r, json!({"min_tokens": 29})).unwrap();
    let e = completion(&r, json!({"min_tokens": 30})).unwrap_err();
    assert_eq!((e.code(), e.param()), ("context_length_exceeded", Some("min_tokens")));
    assert!(e.message().contains("the prompt (3 tokens) leaves room for 29 tokens"), "{}", e.message());

    // Chat: 8 prompt tokens.
    chat(&r, json!({"max_tokens": 24})).unwrap();
    let e = chat(&r, json!({"max_tokens": 25})).unwrap_err();
    assert_eq!((e.code(), e.param()), ("context_length_exceeded", Some("max_tokens")));
    let e = chat(&r, json!({"messages": [{"role": "user", "content": vec!["hello"; 30].join(" ")}]})).unwrap_err();
    assert_eq!((e.code(), e.param()), ("context_length_exceeded", Some("messages")));
}

#[test]
fn prepare_and_handle_refuse_the_other_kind_of_route() {
    let r = router();
    for ep in [Endpoint::Tokenize, Endpoint::Detokenize, Endpoint::ChatRender, Endpoint::CompletionRender] {
        assert_eq!(r.prepare(ep, &chat_body(json!({}))).unwrap_err().status(), 500);
    }
    for ep in [Endpoint::Chat, Endpoint::Completion] {
        assert_eq!(r.handle(ep, &chat_body(json!({}))).unwrap_err().status(), 500);
    }
}

#[test]
fn endpoint_names_round_trip() {
    for ep in [
        Endpoint::Chat,
        Endpoint::Completion,
        Endpoint::Responses,
        Endpoint::Messages,
        Endpoint::MessagesCountTokens,
        Endpoint::Embeddings,
        Endpoint::Tokenize,
        Endpoint::Detokenize,
        Endpoint::ChatRender,
        Endpoint::CompletionRender,
    ] {
        assert_eq!(Endpoint::from_name(ep.name()), Some(ep));
    }
    assert_eq!(Endpoint::from_name("anthropic"), None);
}

#[test]
fn echo_with_logprobs_is_accepted() {
    // Prompt-token logprobs are computed, so echo + logprobs is answered in full.
    let r = router();
    let both = completion(&r, json!({"echo": true, "logprobs": 1})).unwrap();
    assert!(both.echo);
    assert_eq!(both.params.logprobs, Some(1));
    assert!(completion(&r, json!({"echo": true, "logprobs": 0})).is_ok());
    assert!(completion(&r, json!({"echo": true})).is_ok());
    assert!(completion(&r, json!({"echo": false, "logprobs": 2})).is_ok());
}

/// A template that concatenates `content` as a string, as SmolLM2's does.
const CONCAT: &str = "{% for m in messages %}{{ m.role + ' : ' + m['content'] + ' </s> ' }}{% endfor %}\
                      {% if add_generation_prompt %}assistant :{% endif %}";

#[test]
fn tool_round_trip_with_null_content_renders_on_string_templates() {
    let r = router_with(json!({}), Some(CONCAT));
    let msgs = json!([
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": null, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": "z"},
        {"role": "assistant", "tool_calls": []}
    ]);
    let p = chat(&r, json!({"messages": msgs})).expect("null content renders as an empty string");
    assert_eq!(p.prompt_texts[0], "user : x </s> assistant :  </s> tool : z </s> assistant :  </s> assistant :");
    // A template that walks parts sees an empty list.
    let walks =
        "{% for m in messages %}{{ m.role }}:{% for part in m.content %}{{ part.text }}{% endfor %};{% endfor %}";
    let r = router_with(json!({}), Some(walks));
    let user = json!({"role": "user", "content": [{"type": "text", "text": "x"}]});
    let p = chat(
        &r,
        json!({"messages": [user, {"role": "assistant", "content": null}],
                            "add_generation_prompt": false}),
    )
    .unwrap();
    assert_eq!(p.prompt_texts[0], "user:x;assistant:;");
}

/// String content reaches a parts template as a string when the template shows it (as
/// transformers renders it), and as one text part when the template only walks parts.
#[test]
fn string_content_renders_through_parts_templates() {
    let messages = json!([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]);
    let body = json!({"messages": messages, "add_generation_prompt": false});
    let walks_only =
        "{% for m in messages %}{{ m.role }}:{% for part in m.content %}{{ part.text }}{% endfor %};{% endfor %}";
    let wrapped = chat(&router_with(json!({}), Some(walks_only)), body.clone()).unwrap();
    assert_eq!(wrapped.prompt_texts[0], "system:be brief;user:hello world;");
    // Mistral-Small-3.1's shape: the system prompt concatenated, user turns walked unless strings
    let mixed = "{{ messages[0]['content'] + '|' }}{% for m in messages[1:] %}{% if m.content is string %}\
                 S:{{ m.content }}{% else %}{% for b in m.content %}P:{{ b.text }}{% endfor %}{% endif %};{% endfor %}";
    let r = router_with(json!({}), Some(mixed));
    assert_eq!(chat(&r, body.clone()).unwrap().prompt_texts[0], "be brief|S:hello world;");
    let parts = json!([{"role": "system", "content": "be brief"},
                       {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]}]);
    let walked = chat(&r, json!({"messages": parts, "add_generation_prompt": false})).unwrap();
    assert_eq!(walked.prompt_texts[0], "be brief|P:helloP:world;");
    // templates that reach the parts where detection does not look (an alias, a macro's
    // parameter, a filter) show string and part content alike
    let parts_body = json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "hello"},
                                                                      {"type": "text", "text": "world"}]}],
                            "add_generation_prompt": false});
    for indirect in [
        "{% for m in messages %}{% set ps = m.content %}{% for p in ps %}{{ p.text }}{% endfor %};{% endfor %}",
        "{% macro show(c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}{% for m in messages %}{{ show(m.content) }};{% endfor %}",
        "{% for m in messages %}{{ m.content | map(attribute='text') | join('') }};{% endfor %}",
    ] {
        let r = router_with(json!({}), Some(indirect));
        assert_eq!(chat(&r, body.clone()).unwrap().prompt_texts[0], "be brief;hello world;", "{indirect}");
        assert_eq!(chat(&r, parts_body.clone()).unwrap().prompt_texts[0], "helloworld;", "{indirect}");
    }
    // a string template that drops some text on purpose (earlier reasoning) and prints
    // content with `~`: the retry would print the parts' repr, which is not kept
    let drops = "{% for m in messages %}{% set c = m.content %}{% if c is string and '</think>' in c %}\
                 {% set c = c.split('</think>')[-1] %}{% endif %}{{ m.role ~ ': ' ~ c | trim }};{% endfor %}";
    let r = router_with(json!({}), Some(drops));
    let reasoned = json!({"messages": [{"role": "user", "content": "Hi"},
                                       {"role": "assistant", "content": "<think>greet back</think>Hello!"},
                                       {"role": "user", "content": "Bye"}], "add_generation_prompt": false});
    assert_eq!(chat(&r, reasoned).unwrap().prompt_texts[0], "user: Hi;assistant: Hello!;user: Bye;");
    // a template that refuses some content with `raise_exception` is answered with its refusal:
    // the other shape, which it does not refuse, is not tried in its place
    let refuses = "{% for m in messages %}{% if m.content is string and m.content == 'RAISE' %}\
                   {{ raise_exception('content RAISE not allowed') }}{% endif %}{{ m.role }}:\
                   {% for part in m.content %}{{ part.text }}{% endfor %};{% endfor %}";
    let r = router_with(json!({}), Some(refuses));
    let e = chat(&r, json!({"messages": [{"role": "user", "content": "RAISE"}]})).unwrap_err();
    assert_eq!(
        (e.code(), e.param(), e.message().as_str()),
        ("invalid_value", Some("messages"), "content RAISE not allowed")
    );
    assert_eq!(chat(&r, body.clone()).unwrap().prompt_texts[0], "system:be brief;user:hello world;");
    // told that the template walks parts, every content is parts
    let told = router_with(json!({"chat_template_content_format": "openai"}), Some(mixed));
    assert_eq!(shape(chat(&told, body)), (400, "template_error", p("messages")));
}

#[test]
fn template_failures_name_messages() {
    let r = router_with(json!({}), Some("{{ messages[0].content + 1 }}"));
    assert_eq!(shape(chat(&r, json!({}))), (400, "template_error", p("messages")));
}

#[test]
fn empty_content_parts_are_rejected_except_on_assistant_turns() {
    check_chat(vec![
        (json!({"messages": [{"role": "user", "content": []}]}), 400, "invalid_value", p("messages[0].content")),
        (
            json!({"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": []}]}),
            400,
            "invalid_value",
            p("messages[1].content"),
        ),
    ]);
    let r = router();
    chat(&r, json!({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": []}]})).unwrap();
}

#[test]
fn out_of_range_integers_say_so() {
    let r = router();
    let raw = |extra: &str| {
        let body = format!(r#"{{"model": "tiny", "messages": [{{"role": "user", "content": "a"}}], {extra}}}"#);
        r.prepare(Endpoint::Chat, body.as_bytes()).unwrap_err()
    };
    let e = raw(r#""seed": 1180591620717411303424"#);
    assert_eq!((e.code(), e.param()), ("invalid_value", Some("seed")));
    assert!(e.message().contains("fit in 64 bits"), "{}", e.message());
    // The accepted range: -2^63 ..= 2^64 - 1.
    for seed in ["18446744073709551615", "-9223372036854775808", "0"] {
        let body = format!(r#"{{"model": "tiny", "messages": [{{"role": "user", "content": "a"}}], "seed": {seed}}}"#);
        r.prepare(Endpoint::Chat, body.as_bytes()).unwrap();
    }
    assert_eq!(raw(r#""seed": -9223372036854775809"#).code(), "invalid_value");
    for decimal in ["2.0", "1e19"] {
        let e = raw(&format!(r#""seed": {decimal}"#));
        assert_eq!((e.code(), e.param()), ("invalid_type", Some("seed")), "{decimal}");
        assert!(e.message().contains("not a decimal number"), "{}", e.message());
    }
    let e = raw(r#""max_tokens": 1000000000000000000000000000000"#);
    assert_eq!((e.code(), e.param()), ("invalid_value", Some("max_tokens")));
    assert!(e.message().contains("must be an integer that fits in 32 bits"), "{}", e.message());
    assert!(!e.message().contains("floating point"), "{}", e.message());
    let e = raw(r#""n": 5000000000"#);
    assert_eq!((e.code(), e.param()), ("invalid_value", Some("n")));
    assert_eq!(e.message(), "`n` must be an integer that fits in 32 bits, got 5000000000.");
    // A fraction is still the wrong type, and so is a whole number written as a decimal
    // (OpenAI rejects it too), without naming a range it is inside of.
    assert_eq!(raw(r#""max_tokens": 1.5"#).code(), "invalid_type");
    let e = raw(r#""n": 2.0"#);
    assert_eq!((e.code(), e.param()), ("invalid_type", Some("n")));
    assert_eq!(e.message(), "`n` must be an integer, not a decimal number, got 2.0.");
    assert_eq!(raw(r#""max_tokens": 1e3"#).code(), "invalid_type");
    // Just past a 64-bit field's bounds the float lands on them (-2^63 - 1 is -2^63 as a
    // float): out of range, not a decimal number; inside them a float is still a decimal.
    for past in ["-9223372036854775809", "9223372036854775808"] {
        let e = raw(&format!(r#""top_k": {past}"#));
        assert_eq!((e.code(), e.param()), ("invalid_value", Some("top_k")), "{past}");
        assert!(e.message().contains("between -9223372036854775808 and 9223372036854775807"), "{}", e.message());
    }
    assert_eq!(raw(r#""top_k": -4.0"#).code(), "invalid_type");
    assert_eq!(raw(r#""top_k": 0.0"#).code(), "invalid_type");
    // A negative count names the field's own range (n is 1..=128, not 0..2^32), as 0 is told.
    let e = raw(r#""n": -1"#);
    assert_eq!((e.code(), e.param()), ("invalid_value", Some("n")));
    assert_eq!(e.message(), "`n` must be between 1 and 128, got -1.");
    for field in ["max_tokens", "max_completion_tokens"] {
        let e = raw(&format!(r#""{field}": -1"#));
        assert_eq!((e.code(), e.param()), ("invalid_value", Some(field)));
        assert_eq!(e.message(), format!("`{field}` must be at least 1, got -1."));
    }
    // 0 is told where `echo` would take it: on completions, not on chat
    let r = router();
    let message = |e: llmserve_router::ApiError| e.message();
    assert_eq!(
        message(completion(&r, json!({"max_tokens": 0})).err().unwrap()),
        "`max_tokens` must be at least 1 (0 with `echo`: the prompt alone), got 0."
    );
    assert!(completion(&r, json!({"max_tokens": 0, "echo": true})).is_ok());
    assert_eq!(message(chat(&r, json!({"max_tokens": 0})).err().unwrap()), "`max_tokens` must be at least 1, got 0.");
    // (a field that takes 0 is told it must not be negative)
    assert_eq!(raw(r#""min_tokens": -1"#).message(), "`min_tokens` must be a non-negative integer, got -1.");
}

#[test]
fn a_non_object_is_named_with_its_kind() {
    let r = router();
    let tool = json!({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}});
    let call = json!({"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}});
    let cases = vec![
        (json!({"messages": [3]}), "messages[0]", "Each message must be an object, not a number."),
        (
            json!({"messages": [{"role": "assistant", "tool_calls": ["x"]}]}),
            "messages[0].tool_calls[0]",
            "A tool call must be an object, not a string.",
        ),
        (
            json!({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": []}]}]}),
            "messages[0].tool_calls[0].function",
            "`function` must be an object, not an array.",
        ),
        (json!({"tools": [true]}), "tools[0]", "Each tool must be an object, not a boolean."),
        (
            json!({"tools": [tool], "tool_choice": {"type": "function", "function": "f"}}),
            "tool_choice.function",
            "`tool_choice.function` must be an object, not a string.",
        ),
        (json!({"response_format": "json"}), "response_format", "`response_format` must be an object, not a string."),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": 1}}),
            "response_format.json_schema",
            "`response_format.json_schema` must be an object, not a number.",
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": [1]}}}),
            "response_format.json_schema.schema",
            "`schema` must be an object, not an array.",
        ),
        (
            json!({"structured_outputs": "x"}),
            "structured_outputs",
            "`structured_outputs` must be an object, not a string.",
        ),
    ];
    for (extra, param, message) in cases {
        let e = chat(&r, extra.clone()).expect_err("expected an error");
        assert_eq!(
            (e.status(), e.code(), e.param(), e.message().as_str()),
            (400, "invalid_type", Some(param), message),
            "{extra}"
        );
    }
    // a valid assistant tool call passes the same checks
    assert!(chat(
        &r,
        json!({"messages": [{"role": "assistant", "tool_calls": [call]}, {"role": "tool", "tool_call_id": "c", "content": "r"}]})
    )
    .is_ok());
}

#[test]
fn tool_results_answer_the_calls_right_before_them() {
    let r = router();
    let call = |id: Value| json!({"id": id, "type": "function", "function": {"name": "f", "arguments": "{}"}});
    let asked = |calls: Vec<Value>| json!({"role": "assistant", "content": null, "tool_calls": calls});
    let result = |id: &str| json!({"role": "tool", "tool_call_id": id, "content": "r"});
    let user = json!({"role": "user", "content": "u"});
    let with = |msgs: Vec<Value>| chat(&r, json!({"messages": msgs}));
    // answered, in any order; a call without an id by any one result
    assert!(with(vec![user.clone(), asked(vec![call(json!("a")), call(json!("b"))]), result("b"), result("a")]).is_ok());
    assert!(with(vec![user.clone(), asked(vec![call(Value::Null)]), result("whatever"), user.clone()]).is_ok());
    let cases = [
        // a result of no call
        (vec![user.clone(), result("a")], "messages[1].role"),
        (vec![user.clone(), asked(vec![call(json!("a"))]), result("a"), user.clone(), result("a")], "messages[4].role"),
        // a result naming a call that is not waiting for one
        (vec![user.clone(), asked(vec![call(json!("a"))]), result("x")], "messages[2].tool_call_id"),
        (
            vec![user.clone(), asked(vec![call(json!("a")), call(json!("b"))]), result("a"), result("a")],
            "messages[3].tool_call_id",
        ),
        // a call with no result: before the next message, or at the end
        (vec![user.clone(), asked(vec![call(json!("a"))]), user.clone()], "messages[1].tool_calls[0]"),
        (vec![user.clone(), asked(vec![call(json!("a")), call(json!("b"))]), result("a")], "messages[1].tool_calls[1]"),
        (
            vec![user.clone(), asked(vec![call(json!("a"))]), asked(vec![call(json!("b"))]), result("a")],
            "messages[1].tool_calls[0]",
        ),
    ];
    for (msgs, param) in cases {
        let e = with(msgs.clone()).expect_err("expected an error");
        assert_eq!((e.status(), e.code(), e.param()), (400, "invalid_value", Some(param)), "{msgs:?}");
        // the same conversation tokenizes as it renders: refused alike
        let body = serde_json::to_vec(&json!({"messages": msgs})).unwrap();
        assert_eq!(r.handle(Endpoint::Tokenize, &body).unwrap_err().param(), Some(param));
    }
    // OpenAI's deprecated function messages are matched to their calls by name instead
    let legacy = json!([user, {"role": "assistant", "content": null, "function_call": {"name": "f", "arguments": "{}"}},
                        {"role": "function", "name": "f", "content": "r"}]);
    assert!(with(legacy.as_array().unwrap().clone()).is_ok());
}
