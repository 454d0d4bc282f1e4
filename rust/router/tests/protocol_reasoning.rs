//! Reasoning output through the protocol layer: `prepare` picks the parser (setting or
//! template) and sees whether the prompt opened the think block; the builder splits
//! thinking into `reasoning_content`, streamed and not, with the same result.

mod protocol_fixture;

use std::sync::Arc;

use llmserve_router::reasoning::{ReasoningParser, ReasoningPlan};
use llmserve_router::response::{ChoiceDelta, FinishReason, ResponseBuilder, TokenOut};
use protocol_fixture::*;
use serde_json::{json, Value};

fn plan(opened: bool) -> Option<ReasoningPlan> {
    Some(ReasoningPlan { parser: ReasoningParser::Think, prompt_opened: opened, budget: None, hidden: false })
}

#[test]
fn prepare_detects_the_parser_and_an_opened_block() {
    let r = router_with(json!({}), Some(THINK_TEMPLATE));
    assert_eq!(chat(&r, json!({})).unwrap().reasoning, plan(true));
    // enable_thinking reaches the template: the block is closed in the prompt.
    let p = chat(&r, json!({"chat_template_kwargs": {"enable_thinking": false}})).unwrap();
    assert!(p.prompt_texts[0].ends_with("</think>\n\n"), "{:?}", p.prompt_texts[0]);
    assert_eq!(p.reasoning, plan(false));
    let off = router_with(json!({"reasoning_parser": "none"}), Some(THINK_TEMPLATE));
    assert_eq!(chat(&off, json!({})).unwrap().reasoning, None);
    // A template that knows no think block: no parser unless configured.
    assert_eq!(chat(&router(), json!({})).unwrap().reasoning, None);
    let forced = router_with(json!({"reasoning_parser": "think"}), Some(TEMPLATE));
    assert_eq!(chat(&forced, json!({})).unwrap().reasoning, plan(false));
    // Completions are never parsed.
    assert_eq!(completion(&r, json!({})).unwrap().reasoning, None);
}

/// `reasoning_effort` reaches a template that reads it; `"none"` switches off a parsed think
/// block that the template switches with `enable_thinking`; elsewhere it asks for nothing only
/// where no thinking comes (audit 79), and is reported.
#[test]
fn reasoning_effort_reaches_the_template_or_is_reported() {
    let ignored = |p: &llmserve_router::protocol::Prepared| header(p, "llmserve-ignored-fields").map(String::from);
    let r = router_with(json!({}), Some(THINK_TEMPLATE));
    let none = json!({"reasoning_effort": "none"});
    let p = chat(&r, none.clone()).unwrap();
    assert!(p.prompt_texts[0].ends_with("</think>\n\n"), "{:?}", p.prompt_texts[0]);
    assert_eq!((p.reasoning, ignored(&p)), (plan(false), None));
    // the request's own switch wins, and the thinking it asks for makes "none" unheeded
    let on = json!({"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": true}});
    let p = chat(&r, on).unwrap();
    assert_eq!((p.reasoning, ignored(&p).as_deref()), (plan(true), Some("reasoning_effort")));
    let closed = json!({"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": false}});
    assert_eq!(ignored(&chat(&r, closed).unwrap()), None);
    // over a server default that turns thinking on
    let default_on =
        router_with(json!({"default_chat_template_kwargs": {"enable_thinking": true}}), Some(THINK_TEMPLATE));
    assert_eq!(chat(&default_on, none.clone()).unwrap().reasoning, plan(false));
    // a level is no switch: the template thinks as it would, and the level is reported
    for level in ["low", "high", "minimal"] {
        let p = chat(&r, json!({"reasoning_effort": level})).unwrap();
        assert_eq!((p.reasoning, ignored(&p).as_deref()), (plan(true), Some("reasoning_effort")), "{level}");
    }
    // a think block the template cannot switch: "none" is reported
    let unswitched = "{% for m in messages %}{{ m.content }}{% endfor %}<think>\n";
    let p = chat(&router_with(json!({}), Some(unswitched)), none.clone()).unwrap();
    assert_eq!((p.reasoning, ignored(&p).as_deref()), (plan(true), Some("reasoning_effort")));
    // no thinking at all: "none" asks for what comes, a level is reported
    assert_eq!(ignored(&chat(&router(), none.clone()).unwrap()), None);
    assert_eq!(
        ignored(&chat(&router(), json!({"reasoning_effort": "low"})).unwrap()).as_deref(),
        Some("reasoning_effort")
    );
    // a template that reads it (gpt-oss's does) gets it, every level, over a kwarg of its name
    let reads = "{% for m in messages %}{{ m.content }}{% endfor %} effort={{ reasoning_effort | default('unset') }}";
    let r = router_with(json!({}), Some(reads));
    for level in ["none", "low", "high", "xhigh"] {
        let p =
            chat(&r, json!({"reasoning_effort": level, "chat_template_kwargs": {"reasoning_effort": "kw"}})).unwrap();
        assert!(p.prompt_texts[0].ends_with(&format!("effort={level}")), "{:?}", p.prompt_texts[0]);
        assert_eq!(ignored(&p), None);
    }
    let p = chat(&r, json!({"chat_template_kwargs": {"reasoning_effort": "kw"}})).unwrap();
    assert!(p.prompt_texts[0].ends_with("effort=kw"), "{:?}", p.prompt_texts[0]);
    assert!(chat(&r, json!({"reasoning_effort": null})).unwrap().prompt_texts[0].ends_with("effort=unset"));
    assert_eq!(shape(chat(&r, json!({"reasoning_effort": 5}))), (400, "invalid_type", Some("reasoning_effort".into())));
    let strict = router_with(json!({"strict_fields": true}), Some(reads));
    chat(&strict, json!({"reasoning_effort": "high"})).unwrap();
}

#[test]
fn thinking_token_budget_bounds_the_thinking_of_a_parsed_model() {
    let r = router_with(json!({}), Some(THINK_TEMPLATE));
    let budget = |p: &llmserve_router::protocol::Prepared| p.reasoning.and_then(|r| r.budget);
    let p = chat(&r, json!({"thinking_token_budget": 7})).unwrap();
    assert_eq!((budget(&p), header(&p, "llmserve-ignored-fields")), (Some(7), None));
    assert_eq!(budget(&chat(&r, json!({"thinking_token_budget": 0})).unwrap()), Some(0));
    assert_eq!(budget(&chat(&r, json!({"thinking_token_budget": null})).unwrap()), None);
    // -1 is vLLM's "no bound": as if not sent (below it, a 400: below)
    assert_eq!(budget(&chat(&r, json!({"thinking_token_budget": -1})).unwrap()), None);
    // (the prompt closed the block, but the model may open one: still bounded)
    let closed = json!({"thinking_token_budget": 3, "chat_template_kwargs": {"enable_thinking": false}});
    assert_eq!(budget(&chat(&r, closed).unwrap()), Some(3));
    for bad in [json!(-2), json!(1.5), json!("4")] {
        let (status, _, param) = shape(chat(&r, json!({"thinking_token_budget": bad})));
        assert_eq!((status, param.as_deref()), (400, Some("thinking_token_budget")), "{bad}");
    }
    let beams = json!({"thinking_token_budget": 3, "use_beam_search": true, "n": 2, "temperature": 0});
    assert_eq!(shape(chat(&r, beams)), (400, "unsupported_parameter", Some("thinking_token_budget".into())));
    // no reasoning parser: nothing knows a think block, so the field is reported
    let p = chat(&router(), json!({"thinking_token_budget": 3})).unwrap();
    assert_eq!((p.reasoning, header(&p, "llmserve-ignored-fields")), (None, Some("thinking_token_budget")));
    let strict = router_with(json!({"strict_fields": true}), Some(TEMPLATE));
    assert_eq!(shape(chat(&strict, json!({"thinking_token_budget": 3}))).0, 400);
    // completions have no parser either
    let p = completion(&r, json!({"thinking_token_budget": 3})).unwrap();
    assert_eq!(header(&p, "llmserve-ignored-fields"), Some("thinking_token_budget"));
}

#[test]
fn default_chat_template_kwargs_render_under_the_requests_own() {
    let off = json!({"default_chat_template_kwargs": {"enable_thinking": false, "unknown": 1}});
    let r = router_with(off, Some(THINK_TEMPLATE));
    // the server's default turns thinking off; keys no template reads are the start's to warn
    // of, never a request's report
    let p = chat(&r, json!({})).unwrap();
    assert!(p.prompt_texts[0].ends_with("</think>\n\n"), "{:?}", p.prompt_texts[0]);
    assert_eq!(p.reasoning, plan(false));
    assert_eq!((header(&p, "llmserve-ignored-fields"), header(&p, "llmserve-unused-template-kwargs")), (None, None));
    assert_eq!(r.unread_default_kwargs(), Ok(vec!["unknown".to_string()]));
    // the request's own key wins; its unread keys are reported as before
    let p = chat(&r, json!({"chat_template_kwargs": {"enable_thinking": true, "mine": 2}})).unwrap();
    assert!(p.prompt_texts[0].ends_with("<think>\n"), "{:?}", p.prompt_texts[0]);
    assert_eq!(header(&p, "llmserve-unused-template-kwargs"), Some("mine"));
    // /tokenize renders the same prompt (the closed block's, longer than the open one's)
    let count = |r: &llmserve_router::router::Router| {
        let body =
            serde_json::to_vec(&json!({"model": "tiny", "messages": [{"role": "user", "content": "hello world"}]}));
        let out = r.handle(llmserve_router::protocol::Endpoint::Tokenize, &body.unwrap()).unwrap();
        serde_json::from_slice::<Value>(&out.body).unwrap()["count"].as_u64().unwrap() as usize
    };
    assert_eq!(count(&r), chat(&r, json!({})).unwrap().prompts[0].len());
    assert!(count(&r) > count(&router_with(json!({}), Some(THINK_TEMPLATE))));
    // a field the template takes from the request cannot be a default
    let bad = router_with(json!({"default_chat_template_kwargs": {"tools": []}}), Some(THINK_TEMPLATE));
    assert!(bad.unread_default_kwargs().unwrap_err().contains("may not set `tools`"));
}

#[test]
fn grammars_start_after_the_thinking_unless_the_prompt_closed_it() {
    let r = router_with(json!({}), Some(THINK_TEMPLATE));
    let json_object = json!({"response_format": {"type": "json_object"}});
    let key = |p: &llmserve_router::protocol::Prepared| p.grammar.as_ref().unwrap().key().to_string();
    let thinking = chat(&r, json_object.clone()).unwrap();
    assert!(key(&thinking).starts_with("after_thinking:"), "{}", key(&thinking));
    let mut closed = json_object.clone();
    closed["chat_template_kwargs"] = json!({"enable_thinking": false});
    assert!(key(&chat(&r, closed).unwrap()).starts_with("json_schema:"));
    // No reasoning parser: the grammar starts at the first token.
    assert!(key(&chat(&router(), json_object).unwrap()).starts_with("json_schema:"));
}

fn tok(id: u32) -> TokenOut {
    TokenOut { id, logprob: -0.5, top: vec![], text_offset: 0 }
}

/// Runs `pieces` (one token each; the last finishes) through a builder for a request.
fn run(stream: bool, opened: bool, pieces: &[&str]) -> Vec<u8> {
    let r = router_with(json!({"reasoning_parser": "think"}), Some(TEMPLATE));
    let mut p = chat(
        &r,
        json!({"stream": stream, "stream_options": if stream { json!({"include_usage": true}) } else { Value::Null }}),
    )
    .unwrap();
    p.reasoning = plan(opened);
    let mut b = ResponseBuilder::new(&p, Arc::new(tokenizer()));
    let mut out = Vec::new();
    for (i, piece) in pieces.iter().enumerate() {
        let finish = (i + 1 == pieces.len()).then_some(FinishReason::Stop);
        b.push(0, &ChoiceDelta { text: piece, tokens: &[tok(9)], ids: &[9], finish, stop_reason: None });
        out.extend(b.take());
    }
    out.extend(b.finish());
    out
}

/// (reasoning, content, completion_tokens) of a streamed response, with its chunks.
fn streamed(bytes: &[u8]) -> (String, String, u64, Vec<Value>) {
    let chunks = frames(bytes);
    let (mut reasoning, mut content, mut tokens) = (String::new(), String::new(), 0);
    for c in &chunks {
        for ch in c["choices"].as_array().unwrap() {
            // (vLLM's current name and DeepSeek's, always the same text)
            assert_eq!(ch["delta"].get("reasoning"), ch["delta"].get("reasoning_content"), "{c}");
            reasoning.push_str(ch["delta"]["reasoning_content"].as_str().unwrap_or(""));
            content.push_str(ch["delta"]["content"].as_str().unwrap_or(""));
        }
        if let Some(n) = c["usage"]["completion_tokens"].as_u64() {
            tokens = n;
        }
    }
    (reasoning, content, tokens, chunks)
}

#[test]
fn thinking_goes_to_reasoning_content_streamed_or_not() {
    let pieces = ["<th", "ink>let me", " see</", "think>", "\n\nIt is 4."];
    let body: Value = serde_json::from_slice(&run(false, false, &pieces)).unwrap();
    let msg = &body["choices"][0]["message"];
    assert_eq!(msg["reasoning_content"], "let me see");
    assert_eq!(msg["reasoning"], "let me see");
    assert_eq!(msg["content"], "\n\nIt is 4.");
    assert_eq!(body["usage"]["completion_tokens"], 5);
    let (reasoning, content, tokens, chunks) = streamed(&run(true, false, &pieces));
    assert_eq!((reasoning.as_str(), content.as_str(), tokens), ("let me see", "\n\nIt is 4.", 5));
    // The first chunk carries the role; no chunk carries any piece of a marker.
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    for c in &chunks {
        assert!(!c.to_string().contains("think"), "{c}");
    }
}

#[test]
fn an_opened_prompt_makes_output_reasoning_until_the_close() {
    let pieces = ["hmm", "</think>", "ok"];
    let body: Value = serde_json::from_slice(&run(false, true, &pieces)).unwrap();
    assert_eq!(body["choices"][0]["message"]["reasoning_content"], "hmm");
    assert_eq!(body["choices"][0]["message"]["content"], "ok");
    // Unterminated: everything is reasoning; there is no content (null, as vLLM), and no
    // streamed chunk carries any, not even the first one's "".
    let body: Value = serde_json::from_slice(&run(false, true, &["still", " going"])).unwrap();
    assert_eq!(body["choices"][0]["message"]["reasoning_content"], "still going");
    assert_eq!(body["choices"][0]["message"]["content"], Value::Null);
    // no thinking: both names are there, null
    let body: Value = serde_json::from_slice(&run(false, true, &["</think>", "ok"])).unwrap();
    let msg = body["choices"][0]["message"].as_object().unwrap();
    assert_eq!((msg.get("reasoning"), msg.get("reasoning_content")), (Some(&Value::Null), Some(&Value::Null)));
    let (reasoning, content, _, chunks) = streamed(&run(true, true, &["still", " going"]));
    assert_eq!((reasoning.as_str(), content.as_str()), ("still going", ""));
    assert!(chunks.iter().all(|c| c["choices"][0]["delta"].get("content").is_none()), "{chunks:?}");
}

#[test]
fn without_a_parser_the_message_has_no_reasoning_field() {
    let r = router();
    let p = chat(&r, json!({})).unwrap();
    let mut b = ResponseBuilder::new(&p, Arc::new(tokenizer()));
    b.push(
        0,
        &ChoiceDelta {
            text: "<think>a</think>b",
            tokens: &[tok(9)],
            ids: &[9],
            finish: Some(FinishReason::Stop),
            stop_reason: None,
        },
    );
    let body: Value = serde_json::from_slice(&b.finish()).unwrap();
    assert!(body["choices"][0]["message"].get("reasoning_content").is_none());
    assert!(body["choices"][0]["message"].get("reasoning").is_none());
    assert_eq!(body["choices"][0]["message"]["content"], "<think>a</think>b");
}

/// Runs `pieces` (one token each, with their offsets; the last finishes) through the builder
/// of a chat request with `extra` on the think template (the prompt opens the block).
fn run_request(extra: Value, pieces: &[&str]) -> Vec<u8> {
    let r = router_with(json!({}), Some(THINK_TEMPLATE));
    let p = chat(&r, extra).unwrap();
    let mut b = ResponseBuilder::new(&p, Arc::new(tokenizer()));
    let (mut out, mut offset) = (Vec::new(), 0);
    for (i, piece) in pieces.iter().enumerate() {
        let finish = (i + 1 == pieces.len()).then_some(FinishReason::Length);
        let token = TokenOut { id: i as u32, logprob: -0.5, top: vec![], text_offset: offset };
        b.push(0, &ChoiceDelta { text: piece, tokens: &[token], ids: &[i as u32], finish, stop_reason: None });
        offset += piece.chars().count();
        out.extend(b.take());
    }
    out.extend(b.finish());
    out
}

#[test]
fn include_reasoning_false_counts_the_thinking_and_returns_none_of_it() {
    let pieces = ["let me", " see", "</think>", "\n\nIt", " is 4."];
    let hidden = json!({"include_reasoning": false, "logprobs": true});
    let p = chat(&router_with(json!({}), Some(THINK_TEMPLATE)), hidden.clone()).unwrap();
    assert_eq!((p.reasoning.map(|r| r.hidden), header(&p, "llmserve-ignored-fields")), (Some(true), None));
    let body: Value = serde_json::from_slice(&run_request(hidden.clone(), &pieces)).unwrap();
    let choice = &body["choices"][0];
    assert_eq!(
        (&choice["message"]["reasoning"], &choice["message"]["reasoning_content"]),
        (&Value::Null, &Value::Null)
    );
    assert_eq!(choice["message"]["content"], "\n\nIt is 4.");
    // the thinking's tokens (and the close) are counted, not listed
    assert_eq!(body["usage"]["completion_tokens"], 5);
    assert_eq!(body["usage"]["completion_tokens_details"]["reasoning_tokens"], 2);
    assert_eq!(choice["logprobs"]["content"].as_array().unwrap().len(), 2, "{}", choice["logprobs"]);
    // shown, the same request lists every token
    let shown: Value = serde_json::from_slice(&run_request(json!({"logprobs": true}), &pieces)).unwrap();
    assert_eq!(shown["choices"][0]["message"]["reasoning"], "let me see");
    assert_eq!(shown["choices"][0]["logprobs"]["content"].as_array().unwrap().len(), 5);
    // streamed: no chunk holds thinking, the role comes with the first content, usage alike
    let stream = json!({"include_reasoning": false, "stream": true, "stream_options": {"include_usage": true}});
    let (reasoning, content, tokens, chunks) = streamed(&run_request(stream, &pieces));
    assert_eq!((reasoning.as_str(), content.as_str(), tokens), ("", "\n\nIt is 4.", 5));
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let mut deltas = chunks.iter().flat_map(|c| c["choices"].as_array().unwrap().iter().map(|ch| &ch["delta"]));
    assert!(deltas.all(|d| d.get("reasoning").is_none() && d.get("reasoning_content").is_none()), "{chunks:?}");
    // the thinking's ids go out with the answer's first chunk (every sampled id is listed)
    let ids = json!({"include_reasoning": false, "stream": true, "return_token_ids": true});
    let chunks = frames(&run_request(ids, &pieces));
    let listed: Vec<u64> = chunks
        .iter()
        .flat_map(|c| c["choices"].as_array().unwrap().iter())
        .flat_map(|ch| ch["token_ids"].as_array().into_iter().flatten().map(|t| t.as_u64().unwrap()))
        .collect();
    assert_eq!(listed, [0, 1, 2, 3, 4], "{chunks:?}");
    // ... or with the finish, when the answer never came
    let ids = json!({"include_reasoning": false, "stream": true, "return_token_ids": true});
    let chunks = frames(&run_request(ids, &["let me", " see"]));
    let last = chunks.last().unwrap()["choices"][0].clone();
    assert_eq!((&last["finish_reason"], &last["token_ids"]), (&json!("length"), &json!([0, 1])), "{chunks:?}");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    // and no delta holds content, so a client summing them ends with null, as the body (audit F)
    let mut deltas = chunks.iter().flat_map(|c| c["choices"].as_array().unwrap().iter().map(|ch| &ch["delta"]));
    assert!(deltas.all(|d| d.get("content").is_none()), "{chunks:?}");
    // cut off while thinking: nothing to say, content null as when the thinking is shown
    let body: Value = serde_json::from_slice(&run_request(hidden, &["let me", " see"])).unwrap();
    assert_eq!(body["choices"][0]["message"]["content"], Value::Null);
    // true asks for what happens; false with no parser to split the thinking off does nothing
    // (thinking the model writes stays in the content), so it is reported
    assert_eq!(header(&chat(&router(), json!({"include_reasoning": true})).unwrap(), "llmserve-ignored-fields"), None);
    assert!(
        !chat(&router_with(json!({}), Some(THINK_TEMPLATE)), json!({"include_reasoning": true}))
            .unwrap()
            .reasoning
            .unwrap()
            .hidden
    );
    let p = chat(&router(), json!({"include_reasoning": false})).unwrap();
    assert_eq!((p.reasoning, header(&p, "llmserve-ignored-fields")), (None, Some("include_reasoning")));
    let (status, _, param) = shape(chat(&router(), json!({"include_reasoning": "no"})));
    assert_eq!((status, param.as_deref()), (400, Some("include_reasoning")));
}
