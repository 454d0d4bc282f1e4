//! Ignored-field reporting and strict mode, defaults resolution, ids, and the routes
//! answered at once (tokenize, detokenize, render, models).

mod protocol_fixture;

use llmserve_router::protocol::Endpoint;
use llmserve_router::router::Router;
use llmserve_router::tokenizer::Tokenizer;
use llmserve_router::tools::ToolChoice;
use protocol_fixture::*;
use serde_json::{json, Value};

/// `Router::handle`'s body.
fn handled(r: &Router, endpoint: Endpoint, body: &[u8]) -> Result<Vec<u8>, llmserve_router::error::ApiError> {
    r.handle(endpoint, body).map(|h| h.body)
}

fn body_json(bytes: Vec<u8>) -> Value {
    serde_json::from_slice(&bytes).expect("handle returns JSON")
}

#[test]
fn unknown_and_inert_fields_are_named_in_a_header() {
    let r = router();
    let p = chat(
        &r,
        json!({"foo": 1, "bar": [1], "store": true, "metadata": {"k": "v"}, "service_tier": "flex",
               "user": "alice", "echo": false}),
    )
    .unwrap();
    // `user` is logged, not ignored; chat's `echo` (vLLM's) at false asks for nothing; `store`
    // keeps the completion, with its `metadata` (unless the server stores nothing)
    assert_eq!(header(&p, "llmserve-ignored-fields"), Some("bar, foo, service_tier"));
    assert!(p.keep.is_some());
    assert_eq!(p.user.as_deref(), Some("alice"));
    let storeless = router_with(json!({"responses_store_bytes": 0}), Some(TEMPLATE));
    let p = chat(&storeless, json!({"store": true, "metadata": {"k": "v"}})).unwrap();
    assert_eq!((header(&p, "llmserve-ignored-fields"), p.keep.is_none()), (Some("metadata, store"), true));
    // OpenAI's default tier, and "default", ask for the one tier there is (also strictly).
    let strict = router_with(json!({"strict_fields": true}), Some(TEMPLATE));
    for tier in ["auto", "default"] {
        let p = chat(&strict, json!({"service_tier": tier, "store": false})).unwrap();
        assert_eq!(header(&p, "llmserve-ignored-fields"), None, "{tier}");
    }

    let p =
        completion(&r, json!({"messages": [], "stream": true, "stream_options": {"include_usage": true, "zzz": 1}}))
            .unwrap();
    assert_eq!(header(&p, "llmserve-ignored-fields"), Some("messages, stream_options.zzz"));

    // Known fields of either struct are not unknown: `logprobs` is chat's and completions'.
    let p = completion(&r, json!({"logprobs": 1, "top_k": 5, "stop": "a"})).unwrap();
    assert_eq!(header(&p, "llmserve-ignored-fields"), None);
    let p = chat(&r, json!({})).unwrap();
    assert_eq!(header(&p, "llmserve-ignored-fields"), None);
}

/// A header carries printable ASCII only, and clients refuse large ones: field names are
/// escaped as JSON escapes them, and a long list is cut at 4 KiB with a count of the rest.
/// The Prepared request keeps every name as sent.
#[test]
fn the_ignored_fields_header_stays_printable_and_bounded() {
    let r = router();
    let p = chat(&r, json!({"東京": 1, "a\r\nX-Evil: 1": 2, "back\\slash": 3})).unwrap();
    assert_eq!(header(&p, "llmserve-ignored-fields"), Some("a\\u000d\\u000aX-Evil: 1, back\\\\slash, \\u6771\\u4eac"));
    assert_eq!(p.ignored, ["a\r\nX-Evil: 1", "back\\slash", "東京"]);
    // HTTP trims a value's blank ends (h11 refuses to send them and drops the connection):
    // an item's edge spaces are escaped, an empty name is written "", inner spaces stay.
    let p = chat(&r, json!({"zz ": 1, "": 2, " a b": 3, "chat_template_kwargs": {" ": 1}})).unwrap();
    assert_eq!(
        header(&p, "llmserve-ignored-fields"),
        Some("\"\", \\u0020a b, chat_template_kwargs.\\u0020, zz\\u0020")
    );
    assert_eq!(header(&p, "llmserve-unused-template-kwargs"), Some("\\u0020"));

    let many: serde_json::Map<String, Value> = (0..5000).map(|i| (format!("field_{i:05}"), json!(1))).collect();
    let p = chat(&r, Value::Object(many)).unwrap();
    let value = header(&p, "llmserve-ignored-fields").unwrap();
    assert!(value.len() <= 4096, "{}", value.len());
    let listed = value.split(", ").filter(|s| s.starts_with("field_")).count();
    assert!(value.ends_with(&format!(", ... ({} more)", 5000 - listed)), "{}", &value[value.len() - 40..]);
    assert!(listed > 300);
    assert_eq!(p.ignored.len(), 5000);

    // one enormous name is shortened, not dropped, and never inside an escape
    let p = chat(&r, json!({"x".repeat(100_000): 1})).unwrap();
    assert_eq!(header(&p, "llmserve-ignored-fields"), Some(format!("{}...", "x".repeat(256)).as_str()));
    let p = chat(&r, json!({format!("x{}", "é".repeat(100)): 1})).unwrap();
    assert_eq!(header(&p, "llmserve-ignored-fields"), Some(format!("x{}...", "\\u00e9".repeat(42)).as_str()));
}

/// vLLM's fields that do nothing here are reported (or pass, at their defaults), but a value of
/// the wrong JSON kind is vLLM's 400 (audit K: `vllm_xargs: 5` was a 200).
#[test]
fn inert_vllm_fields_must_have_their_kind() {
    let r = router();
    let p = chat(
        &r,
        json!({"vllm_xargs": {"a": 1}, "kv_transfer_params": {}, "guided_decoding_backend": "xgrammar",
                            "spaces_between_special_tokens": false, "mm_processor_kwargs": null}),
    )
    .unwrap();
    assert_eq!(
        header(&p, "llmserve-ignored-fields"),
        Some("guided_decoding_backend, kv_transfer_params, spaces_between_special_tokens, vllm_xargs")
    );
    for (field, bad) in [
        ("spaces_between_special_tokens", json!("x")),
        ("return_token_offsets", json!(1)),
        ("vllm_xargs", json!(5)),
        ("kv_transfer_params", json!("x")),
        ("mm_processor_kwargs", json!([])),
        ("media_io_kwargs", json!(true)),
        ("guided_decoding_backend", json!(1)),
        ("guided_whitespace_pattern", json!({})),
    ] {
        let body = json!({field: bad});
        assert_eq!(shape(chat(&r, body.clone())), (400, "invalid_type", Some(field.to_string())), "{field}: {bad}");
        assert_eq!(shape(completion(&r, body)), (400, "invalid_type", Some(field.to_string())), "{field}: {bad}");
    }
}

/// OpenAI's fields that do nothing here are reported whatever their value, but a value of the
/// wrong JSON kind is a 400, as OpenAI answers it (chat's deprecated `functions` and
/// `function_call` are served, protocol_functions.rs; completions report them).
#[test]
fn inert_openai_fields_must_have_their_kind() {
    let r = router();
    let p = chat(
        &r,
        json!({"reasoning_effort": "ultra", "verbosity": "low", "modalities": ["text", "image"],
               "web_search_options": {},
               "prompt_cache_key": "k", "prompt_cache_retention": "24h", "safety_identifier": "s"}),
    )
    .unwrap();
    assert_eq!(
        header(&p, "llmserve-ignored-fields"),
        Some(
            "modalities, prompt_cache_key, prompt_cache_retention, \
             reasoning_effort, safety_identifier, verbosity, web_search_options"
        )
    );
    for (field, bad) in [
        ("reasoning_effort", json!(5)),
        ("verbosity", json!(["low"])),
        ("modalities", json!("text")),
        ("modalities[1]", json!(["text", 5])),
        ("audio", json!("x")),
        ("web_search_options", json!(true)),
        ("prompt_cache_key", json!(5)),
        ("safety_identifier", json!({})),
        ("functions", json!("f")),
        ("functions[0]", json!(["f"])),
        ("function_call", json!(5)),
        ("prompt_cache_options", json!(5)),
        ("moderation", json!("x")),
    ] {
        let mut body = json!({});
        body[field.split('[').next().unwrap()] = bad.clone();
        assert_eq!(shape(chat(&r, body.clone())), (400, "invalid_type", Some(field.to_string())), "{field}: {bad}");
        assert_eq!(shape(completion(&r, body)), (400, "invalid_type", Some(field.to_string())), "{field}: {bad}");
    }
    // audio output, which the answer would lack, is refused rather than reported
    for body in [json!({"modalities": ["text", "audio"]}), json!({"audio": {"voice": "alloy", "format": "wav"}})] {
        let field = body.as_object().unwrap().keys().next().unwrap().clone();
        assert_eq!(shape(chat(&r, body)), (400, "unsupported_parameter", Some(field)));
    }
    // the values that ask for what every request here gets pass without a word (audit 79)
    let p = chat(&r, json!({"modalities": ["text"], "reasoning_effort": "none"})).unwrap();
    assert_eq!(header(&p, "llmserve-ignored-fields"), None);
    let strict = router_with(json!({"strict_fields": true}), Some(TEMPLATE));
    chat(&strict, json!({"modalities": ["text"], "reasoning_effort": "none"})).unwrap();
    // chat's metadata has OpenAI's limits, as Responses' does
    let many: serde_json::Map<String, Value> = (0..17).map(|i| (format!("k{i}"), json!("v"))).collect();
    assert_eq!(shape(chat(&r, json!({"metadata": many}))), (400, "invalid_value", Some("metadata".into())));
    assert_eq!(shape(chat(&r, json!({"metadata": {"a": 5}}))), (400, "invalid_type", Some("metadata.a".into())));
}

/// vLLM's fields that llmserve does not implement: at the value that asks for nothing they
/// pass silently (also under `--strict-fields`; clients send vLLM's whole default set), any
/// other value is refused, as it would change vLLM's output. (Chat's `echo` and beam search
/// are served.)
#[test]
fn vllm_fields_pass_at_their_default_and_are_refused_otherwise() {
    let strict = router_with(json!({"strict_fields": true}), Some(TEMPLATE));
    let defaults = json!({"use_beam_search": false, "length_penalty": 1.0, "bad_words": [], "logits_processors": [],
                          "return_tokens_as_token_ids": false, "return_token_ids": false, "allowed_token_ids": null,
                          "prompt_logprobs": null});
    assert_eq!(header(&chat(&strict, defaults.clone()).unwrap(), "llmserve-ignored-fields"), None);
    assert_eq!(header(&completion(&strict, defaults).unwrap(), "llmserve-ignored-fields"), None);
    chat(&strict, json!({"echo": false})).unwrap();
    let r = router();
    for got in [
        shape(chat(&r, json!({"logits_processors": ["m.P"]}))),
        shape(completion(&r, json!({"logits_processors": ["m.P"]}))),
    ] {
        assert_eq!(got, (400, "unsupported_parameter", Some("logits_processors".to_string())));
    }
    // a prompt as embeddings (vLLM too refuses it unless started with --enable-prompt-embeds)
    for embeds in [json!("AAAA"), json!(["AAAA"])] {
        let got = shape(completion(&r, json!({"prompt_embeds": embeds})));
        assert_eq!(got, (400, "unsupported_parameter", Some("prompt_embeds".to_string())));
        // (without a prompt too: what is refused is what was sent)
        let alone = json!({"model": "tiny", "prompt_embeds": embeds}).to_string();
        let got = shape(r.prepare(llmserve_router::protocol::Endpoint::Completion, alone.as_bytes()));
        assert_eq!(got, (400, "unsupported_parameter", Some("prompt_embeds".to_string())));
    }
}

/// vLLM's beam search: `n` beams, `length_penalty` read; fields that reshape the distribution
/// the beams are ranked by are refused, those it has no use for reported (as is
/// `length_penalty` without beam search).
#[test]
fn beam_search_is_checked_against_what_it_cannot_honour() {
    let r = router();
    let beam = |extra: Value| {
        let mut body = json!({"use_beam_search": true, "n": 3, "length_penalty": 0.5});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        body
    };
    for prepare in [chat, completion] {
        let p = prepare(&r, beam(json!({}))).unwrap();
        assert_eq!(p.params.beam_search.map(|b| b.length_penalty), Some(0.5));
        assert_eq!(p.params.seqs_per_prompt(), 3, "every beam runs");
        assert_eq!(header(&p, "llmserve-ignored-fields"), None);
        let p = prepare(&r, beam(json!({"temperature": 0.7, "seed": 3, "top_p": 0.9}))).unwrap();
        assert_eq!(header(&p, "llmserve-ignored-fields"), Some("seed, temperature, top_p"));
        // the values that ask for nothing, OpenAI's default temperature among them, pass quietly
        let p =
            prepare(&r, beam(json!({"temperature": 1, "top_p": 1, "top_k": -1, "min_p": 0, "seed": null}))).unwrap();
        assert_eq!(header(&p, "llmserve-ignored-fields"), None);
        let p = prepare(&r, json!({"length_penalty": 0.5})).unwrap();
        assert_eq!(p.params.beam_search, None);
        assert_eq!(header(&p, "llmserve-ignored-fields"), Some("length_penalty"));
        for (field, value) in [
            ("logit_bias", json!({"5": 1})),
            ("bad_words", json!(["x"])),
            ("allowed_token_ids", json!([5, 6])),
            ("presence_penalty", json!(0.5)),
            ("frequency_penalty", json!(0.5)),
            ("repetition_penalty", json!(1.2)),
        ] {
            let got = shape(prepare(&r, beam(json!({field: value}))));
            assert_eq!(got, (400, "unsupported_parameter", Some(field.to_string())), "{field}");
        }
        let got = shape(prepare(&r, beam(json!({"response_format": {"type": "json_object"}}))));
        assert_eq!(got, (400, "unsupported_parameter", Some("use_beam_search".to_string())));
        let got = shape(prepare(&r, beam(json!({"length_penalty": "x"}))));
        assert_eq!(got.0, 400);
        // a field of the wrong type is its own error, not a conflict
        let got = shape(prepare(&r, beam(json!({"bad_words": "x"}))));
        assert_eq!(got, (400, "invalid_type", Some("bad_words".to_string())));
    }
    let got = shape(completion(&r, beam(json!({"best_of": 4}))));
    assert_eq!(got, (400, "unsupported_parameter", Some("best_of".to_string())));
    completion(&r, beam(json!({"best_of": 3}))).unwrap();
    let tools = json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]);
    let hermes = router_with(json!({"tool_call_format": "hermes"}), Some(TEMPLATE));
    let got = shape(chat(&hermes, beam(json!({"tools": tools, "tool_choice": "required"}))));
    assert_eq!(got, (400, "unsupported_parameter", Some("use_beam_search".to_string())));
}

/// vLLM's chat `echo`: the reply's content starts with the last message's when that one is
/// the assistant's (a continued final message, read whole); its parts joined with newlines;
/// nothing otherwise (`echo` reported). Beside a tool-call or reasoning parser, whose content is what they leave
/// of the output, a 400.
#[test]
fn chat_echo_starts_the_content_with_the_last_assistant_message() {
    let r = router();
    let cont = |content: Value| {
        json!({"echo": true, "continue_final_message": true, "messages": [
            {"role": "user", "content": "hello"}, {"role": "assistant", "content": content}]})
    };
    assert_eq!(chat(&r, cont(json!("hello world"))).unwrap().echo_message.as_deref(), Some("hello world"));
    let parts = json!([{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]);
    assert_eq!(chat(&r, cont(parts)).unwrap().echo_message.as_deref(), Some("hello\nworld"));
    let user_last = chat(&r, json!({"echo": true})).unwrap();
    assert_eq!(user_last.echo_message, None, "the last message is the user's");
    assert_eq!(header(&user_last, "llmserve-ignored-fields"), Some("echo"), "nothing to start the reply with");
    assert_eq!(chat(&r, json!({"echo": false})).unwrap().echo_message, None);
    let p = chat(&r, cont(json!("hello world"))).unwrap();
    assert_eq!(header(&p, "llmserve-ignored-fields"), None);
    let hermes = router_with(json!({"tool_call_format": "hermes"}), Some(TEMPLATE));
    let tools = json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]);
    let mut body = cont(json!("hello"));
    body["tools"] = tools;
    assert_eq!(shape(chat(&hermes, body)), (400, "unsupported_parameter", Some("echo".into())));
    let think = router_with(json!({}), Some(THINK_TEMPLATE));
    let body = json!({"echo": true, "messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]});
    assert_eq!(shape(chat(&think, body)).2.as_deref(), Some("echo"));
}

/// vLLM's `bad_words` (served on both routes): each word's tokens as the tokenizer makes them
/// (its leading whitespace dropped; again after a space only where that makes other tokens of
/// the same count, which a whitespace-split vocabulary never does); each must hold text.
#[test]
fn bad_words_are_tokenized_as_vllm_does() {
    let r = router();
    let id = |w: &str| WORDS.iter().position(|x| *x == w).unwrap() as u32;
    let p = chat(&r, json!({"bad_words": ["  hello world", "user"]})).unwrap();
    assert_eq!(p.params.bad_words, vec![vec![id("hello"), id("world")], vec![id("user")]]);
    let p = completion(&r, json!({"bad_words": ["user"]})).unwrap();
    assert_eq!(p.params.bad_words, vec![vec![id("user")]]);
    // each word, stop string and stop token once: every prompt and sequence holds the lists,
    // and checks them at every step (a million copies of one were seconds a step)
    let p = completion(
        &r,
        json!({"bad_words": ["user", "user", " user"], "stop": ["a", "b", "a"],
                                  "stop_token_ids": [3, 1, 3, 3]}),
    )
    .unwrap();
    assert_eq!(p.params.bad_words, vec![vec![id("user")]]);
    assert_eq!(
        (p.params.stop.as_slice(), p.params.stop_token_ids.as_slice()),
        (&["a".to_string(), "b".into()][..], &[3, 1][..])
    );
    assert!(chat(&r, json!({"bad_words": []})).unwrap().params.bad_words.is_empty());
    for (bad, code, param) in [
        (json!("x"), "invalid_type", "bad_words"),
        (json!(["a", 3]), "invalid_type", "bad_words[1]"),
        (json!(["hello", "  "]), "invalid_value", "bad_words[1]"),
    ] {
        assert_eq!(shape(chat(&r, json!({"bad_words": bad}))), (400, code, Some(param.to_string())));
    }
}

/// vLLM's `allowed_token_ids` (served on both routes): the ids, each in the vocabulary, at
/// least one; not beside a grammar, which decides the tokens itself.
#[test]
fn allowed_token_ids_are_checked_and_kept_sorted() {
    let r = router();
    let p = chat(&r, json!({"allowed_token_ids": [7, 3, 7]})).unwrap();
    assert_eq!(p.params.allowed_token_ids, Some(vec![3, 7]));
    assert_eq!(completion(&r, json!({"allowed_token_ids": [5]})).unwrap().params.allowed_token_ids, Some(vec![5]));
    assert_eq!(chat(&r, json!({})).unwrap().params.allowed_token_ids, None);
    for (body, code, param) in [
        (json!({"allowed_token_ids": []}), "invalid_value", "allowed_token_ids"),
        (json!({"allowed_token_ids": [3, 999]}), "invalid_value", "allowed_token_ids[1]"),
        (
            json!({"allowed_token_ids": [3], "response_format": {"type": "json_object"}}),
            "unsupported_parameter",
            "allowed_token_ids",
        ),
    ] {
        assert_eq!(shape(chat(&r, body.clone())), (400, code, Some(param.to_string())), "{body}");
    }
    assert_eq!(shape(chat(&r, json!({"allowed_token_ids": "3"}))).0, 400);

    // bans of the request's own that leave no allowed token: a one-token bad word always, the
    // eos (1 here) and stop_token_ids before min_tokens
    let words = chat(&r, json!({"bad_words": ["hello"]})).unwrap().params.bad_words;
    let word = words.iter().find(|w| w.len() == 1).expect("a one-token word")[0];
    let refused = |body: Value| shape(completion(&r, body));
    let nothing = (400, "invalid_value", Some("allowed_token_ids".to_string()));
    assert_eq!(refused(json!({"allowed_token_ids": [word], "bad_words": ["hello"]})), nothing);
    let early = (400, "invalid_value", Some("min_tokens".to_string()));
    assert_eq!(refused(json!({"allowed_token_ids": [1], "min_tokens": 2})), early);
    assert_eq!(refused(json!({"allowed_token_ids": [1, 5], "stop_token_ids": [5], "min_tokens": 1})), early);
    assert_eq!(refused(json!({"allowed_token_ids": [1, word], "bad_words": ["hello"], "min_tokens": 1})), early);
    for fine in [
        json!({"allowed_token_ids": [1], "min_tokens": 2, "ignore_eos": true}),
        json!({"allowed_token_ids": [1, 5], "min_tokens": 2}),
        json!({"allowed_token_ids": [1], "stop_token_ids": [1]}),
    ] {
        assert!(completion(&r, fine.clone()).is_ok(), "{fine}");
    }
}

/// vLLM's `return_token_ids` and `return_tokens_as_token_ids` are implemented
/// (protocol_response.rs has their shapes): true is taken on both routes, under
/// `--strict-fields` too, and each must be a boolean. `return_tokens_as_token_ids` names the
/// tokens of logprobs: without logprobs it does nothing, and is reported.
#[test]
fn token_id_fields_are_booleans_both_routes_take() {
    let strict = router_with(json!({"strict_fields": true}), Some(TEMPLATE));
    for value in [json!(true), json!(false), Value::Null] {
        let on = value == json!(true);
        let body = json!({"return_token_ids": value, "return_tokens_as_token_ids": value});
        let (mut chat_body, mut completion_body) = (body.clone(), body);
        merge(&mut chat_body, json!({"logprobs": true}));
        merge(&mut completion_body, json!({"logprobs": 1}));
        for p in [chat(&strict, chat_body).unwrap(), completion(&strict, completion_body).unwrap()] {
            assert_eq!((p.return_token_ids, p.tokens_as_ids), (on, on));
        }
    }
    let r = router();
    let body = json!({"return_tokens_as_token_ids": true});
    for p in [chat(&r, body.clone()).unwrap(), completion(&r, body.clone()).unwrap()] {
        assert_eq!(header(&p, "llmserve-ignored-fields"), Some("return_tokens_as_token_ids"));
    }
    assert_eq!(shape(chat(&strict, body)), (400, "unsupported_parameter", Some("return_tokens_as_token_ids".into())));
    let r = router();
    for field in ["return_token_ids", "return_tokens_as_token_ids"] {
        let body = json!({field: "yes"});
        assert_eq!(shape(chat(&r, body.clone())), (400, "invalid_type", Some(field.into())));
        assert_eq!(shape(completion(&r, body)), (400, "invalid_type", Some(field.into())));
    }
}

/// vLLM's server flags `--return-tokens-as-token-ids` (the request field's default: a request
/// may still say false) and `--enable-force-include-usage` (every stream ends with its usage).
#[test]
fn server_flags_set_the_token_id_and_usage_defaults() {
    let r = router_with(json!({"return_tokens_as_token_ids": true, "force_include_usage": true}), Some(TEMPLATE));
    let plain = router();
    for (body, ids, usage) in [
        (json!({}), true, false),
        (json!({"return_tokens_as_token_ids": false}), false, false),
        (json!({"stream": true}), true, true),
        (json!({"stream": true, "stream_options": {"include_usage": false}}), true, true),
        (json!({"stream": true, "stream_options": {"continuous_usage_stats": true}}), true, true),
    ] {
        for p in [chat(&r, body.clone()).unwrap(), completion(&r, body.clone()).unwrap()] {
            assert_eq!((p.tokens_as_ids, p.include_usage), (ids, usage), "{body}");
        }
        // without the flags: the request's own fields alone
        let p = chat(&plain, body.clone()).unwrap();
        assert!(!p.tokens_as_ids && !p.include_usage, "{body}");
    }
}

/// vLLM's `add_special_tokens` and `truncate_prompt_tokens` are honoured on both routes.
#[test]
fn add_special_tokens_and_truncate_prompt_tokens() {
    let r = router();
    let plain = completion(&r, json!({"prompt": "hello world"})).unwrap();
    let bare = completion(&r, json!({"prompt": "hello world", "add_special_tokens": false})).unwrap();
    assert_eq!(plain.prompts[0], vec![0, 9, 10]);
    assert_eq!(bare.prompts[0], vec![9, 10]);
    let chat_plain = chat(&r, json!({})).unwrap();
    let chat_special = chat(&r, json!({"add_special_tokens": true})).unwrap();
    assert_eq!(chat_special.prompts[0].len(), chat_plain.prompts[0].len() + 1);
    // a text keeps its BOS (counted in the k), as a tokenizer's left truncation does (vLLM's)
    let cut = completion(&r, json!({"prompt": "hello world", "truncate_prompt_tokens": 2, "echo": true})).unwrap();
    // (its echo: the text the kept text tokens spell, without the BOS, as a whole prompt's)
    assert_eq!((cut.prompts[0].clone(), cut.prompt_texts[0].as_str()), (vec![0, 10], "world"));
    assert_eq!(plain.prompt_texts[0], "hello world");
    let cut = completion(&r, json!({"prompt": "hello world", "truncate_prompt_tokens": 1})).unwrap();
    assert_eq!(cut.prompts[0], vec![10], "no room for the text beside the BOS: the last token");
    let cut =
        completion(&r, json!({"prompt": "hello world", "truncate_prompt_tokens": 1, "add_special_tokens": false}));
    assert_eq!(cut.unwrap().prompts[0], vec![10]);
    // token ids are cut as they are
    let cut = completion(&r, json!({"prompt": [0, 9, 10], "truncate_prompt_tokens": 2})).unwrap();
    assert_eq!(cut.prompts[0], vec![9, 10]);
    let cut = chat(&r, json!({"truncate_prompt_tokens": 3})).unwrap();
    assert_eq!(cut.prompts[0], chat_plain.prompts[0][chat_plain.prompts[0].len() - 3..].to_vec());
    let whole = completion(&r, json!({"prompt": "hello world", "truncate_prompt_tokens": -1})).unwrap();
    assert_eq!(whole.prompts[0], plain.prompts[0]);
    for bad in [0, -2, 33] {
        let got = shape(completion(&r, json!({"prompt": "x", "truncate_prompt_tokens": bad})));
        assert_eq!(got, (400, "invalid_value", Some("truncate_prompt_tokens".into())));
    }
}

#[test]
fn strict_fields_turn_ignored_fields_into_400() {
    let r = router_with(json!({"strict_fields": true}), Some(TEMPLATE));
    let got = shape(chat(&r, json!({"zeta": 1, "beta": 2})));
    assert_eq!(got, (400, "unsupported_parameter", Some("beta".to_string())));
    let storeless = router_with(json!({"strict_fields": true, "responses_store_bytes": 0}), Some(TEMPLATE));
    assert_eq!(shape(chat(&storeless, json!({"store": true}))).2.as_deref(), Some("store"));
    chat(&r, json!({"store": true, "metadata": {"k": "v"}})).unwrap();
    assert_eq!(shape(completion(&r, json!({"metadata": {}}))).2.as_deref(), Some("metadata"));
    // `user` and known extensions stay fine.
    chat(&r, json!({"user": "u", "top_k": 3, "priority": -1, "cache_salt": "s"})).unwrap();
    // a template kwarg the template never reads has no effect either
    let got = shape(chat(&r, json!({"chat_template_kwargs": {"zzz": 1}})));
    assert_eq!(got, (400, "unsupported_parameter", Some("chat_template_kwargs.zzz".to_string())));
}

/// Chat's `prediction` (OpenAI's Predicted Outputs) is read: its text, tokenized as output,
/// drafts the answer (the scheduler's), and usage counts what the answer holds of it. Its
/// shape is checked as OpenAI documents it; other keys are reported.
#[test]
fn a_prediction_is_read_and_checked() {
    let r = router();
    let ids = |text: &str| r.tokenizer().encode(text, false);
    let p = chat(&r, json!({"prediction": {"type": "content", "content": "def f():\n    return 1"}})).unwrap();
    assert_eq!(p.prediction, ids("def f():\n    return 1"));
    assert_eq!(header(&p, "llmserve-ignored-fields"), None);
    let parts = json!([{"type": "text", "text": "def f():"}, {"type": "text", "text": "\n    return 1", "x": 1}]);
    let p = chat(&r, json!({"prediction": {"type": "content", "content": parts, "zzz": true}})).unwrap();
    assert_eq!(p.prediction, ids("def f():\n    return 1"));
    assert_eq!(header(&p, "llmserve-ignored-fields"), Some("prediction.content[1].x, prediction.zzz"));
    assert!(chat(&r, json!({"prediction": null})).unwrap().prediction.is_empty());
    assert!(chat(&r, json!({})).unwrap().prediction.is_empty());
    for (bad, want) in [
        (json!("x"), ("invalid_type", "prediction")),
        (json!({"content": "a"}), ("missing_required_parameter", "prediction.type")),
        (json!({"type": "text", "content": "a"}), ("invalid_value", "prediction.type")),
        (json!({"type": "content"}), ("missing_required_parameter", "prediction.content")),
        (json!({"type": "content", "content": 5}), ("invalid_type", "prediction.content")),
        (
            json!({"type": "content", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}]}),
            ("invalid_value", "prediction.content[1]"),
        ),
        (json!({"type": "content", "content": ["a"]}), ("invalid_type", "prediction.content[0]")),
    ] {
        let got = shape(chat(&r, json!({"prediction": bad.clone()})));
        assert_eq!(got, (400, want.0, Some(want.1.to_string())), "{bad}");
    }
    // longer than the context: no answer could hold it
    let long = "word ".repeat(r.config().max_model_len as usize + 1);
    let got = shape(chat(&r, json!({"prediction": {"type": "content", "content": long}})));
    assert_eq!(got, (400, "invalid_value", Some("prediction.content".to_string())));
    // completions have no `prediction` (OpenAI's is chat's): reported
    let p = completion(&r, json!({"prediction": {"type": "content", "content": "a"}})).unwrap();
    assert_eq!(header(&p, "llmserve-ignored-fields"), Some("prediction"));
    assert!(p.prediction.is_empty());
}

#[test]
fn null_and_what_every_request_gets_are_not_reported() {
    // OpenAI reads null as "not set"; clients that serialize every optional field send them.
    let r = router_with(json!({"strict_fields": true}), Some(TEMPLATE));
    let nulls = json!({"reasoning_effort": null, "functions": null, "function_call": null, "modalities": null,
                       "audio": null, "prediction": null, "verbosity": null, "echo": null, "store": null,
                       "metadata": null, "service_tier": null, "web_search_options": null});
    let p = chat(&r, nulls.clone()).unwrap();
    assert_eq!(header(&p, "llmserve-ignored-fields"), None);
    let mut body = nulls;
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true, "include_obfuscation": false, "zzz": null});
    body["store"] = json!(false); // nothing is ever stored
    completion(&r, body).unwrap();
    let got = shape(chat(&r, json!({"stream": true, "stream_options": {"include_obfuscation": true}})));
    assert_eq!(got, (400, "unsupported_parameter", Some("stream_options.include_obfuscation".to_string())));
    assert_eq!(shape(chat(&r, json!({"reasoning_effort": "low"}))).2.as_deref(), Some("reasoning_effort"));
    // tokenize's unknown keys too
    let ok = handled(&r, Endpoint::Tokenize, br#"{"prompt": "a", "foo": null}"#).unwrap();
    assert!(body_json(ok).get("ignored_fields").is_none());
}

#[test]
fn unused_template_kwargs_are_reported() {
    let r = router();
    let p = chat(&r, json!({"chat_template_kwargs": {"enable_thinking": true, "foo": 1}})).unwrap();
    assert!(p.prompt_texts[0].ends_with("assistant : think"), "{}", p.prompt_texts[0]);
    assert_eq!(header(&p, "llmserve-unused-template-kwargs"), Some("foo"));
    // an accepted field with no effect, so `llmserve-ignored-fields` names it too (CONTRACT)
    assert_eq!(header(&p, "llmserve-ignored-fields"), Some("chat_template_kwargs.foo"));
    let p = chat(&r, json!({"chat_template_kwargs": {"enable_thinking": false}})).unwrap();
    assert_eq!(header(&p, "llmserve-unused-template-kwargs"), None);
    assert_eq!(header(&p, "llmserve-ignored-fields"), None);
    // /tokenize's `messages` form renders the same way, and says the same (audit 44, A44-1)
    let body = br#"{"messages": [{"role": "user", "content": "a"}], "chat_template_kwargs": {"enable_thinking": true, "foo": 1}}"#;
    let h = r.handle(Endpoint::Tokenize, body).unwrap();
    let names: Vec<&str> = h.headers.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(names, ["llmserve-ignored-fields", "llmserve-chat-template", "llmserve-unused-template-kwargs"]);
    let value = |name: &str| h.headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str());
    assert_eq!(value("llmserve-ignored-fields"), Some("chat_template_kwargs.foo"));
    assert_eq!(value("llmserve-unused-template-kwargs"), Some("foo"));
    assert_eq!(value("llmserve-chat-template"), header(&p, "llmserve-chat-template"));
    // ...and under --strict-fields both refuse the key
    let strict = router_with(json!({"strict_fields": true}), Some(TEMPLATE));
    let refused = shape(chat(&strict, json!({"chat_template_kwargs": {"foo": 1}})));
    assert_eq!(refused, (400, "unsupported_parameter", Some("chat_template_kwargs.foo".to_string())));
    assert_eq!(shape(handled(&strict, Endpoint::Tokenize, body)), refused);
}

#[test]
fn openai_defaults() {
    let r = router();
    let p = chat(&r, json!({})).unwrap();
    let s = &p.params;
    assert_eq!((s.n, s.temperature, s.top_p, s.top_k, s.min_p), (1, 1.0, 1.0, 0, 0.0));
    assert_eq!((s.presence_penalty, s.frequency_penalty, s.repetition_penalty), (0.0, 0.0, 1.0));
    assert_eq!((s.seed, s.max_tokens, s.min_tokens), (None, None, 0));
    assert!(s.stop.is_empty() && s.stop_token_ids.is_empty() && s.logit_bias.is_empty());
    assert!(!s.ignore_eos && !s.include_stop_str_in_output && s.skip_special_tokens);
    assert!(!p.stream && !p.include_usage && !p.continuous_usage_stats && !p.echo);
    assert_eq!((p.priority, p.cache_salt.clone(), p.user.clone()), (0, None, None));
}

#[test]
fn generation_config_sits_between_request_and_openai_defaults() {
    let r = router_with(
        json!({"generation_defaults": {"temperature": 0.6, "top_p": 0.9, "top_k": 50, "min_p": 0.05,
                                        "repetition_penalty": 1.1, "max_tokens": 7}}),
        Some(TEMPLATE),
    );
    let s = chat(&r, json!({})).unwrap().params;
    assert_eq!((s.temperature, s.top_p, s.top_k, s.min_p, s.repetition_penalty), (0.6, 0.9, 50, 0.05, 1.1));
    assert_eq!(s.max_tokens, Some(7));
    // The request wins, including temperature 0 (greedy) and top_k -1 (off).
    let s = chat(&r, json!({"temperature": 0, "top_k": -1, "top_p": 1, "max_tokens": 3})).unwrap().params;
    assert_eq!((s.temperature, s.top_k, s.top_p, s.max_tokens), (0.0, 0, 1.0, Some(3)));
    // A default max_tokens is not the client's request: no context error for it; it shrinks
    // to the room the longest prompt leaves (32 - 27 = 5 here), so a Some always fits.
    let long = vec!["hello"; 26].join(" ");
    let p = completion(&r, json!({"prompt": ["hello", long]})).unwrap();
    assert_eq!(p.params.max_tokens, Some(5));
    assert_eq!(completion(&r, json!({"prompt": "hello"})).unwrap().params.max_tokens, Some(7));
    // An explicit value is checked instead (3 + 29 = 32 fits).
    assert_eq!(completion(&r, json!({"max_tokens": 29})).unwrap().params.max_tokens, Some(29));
}

#[test]
fn request_values_are_resolved() {
    let r = router();
    let p = completion(
        &r,
        json!({"n": 3, "temperature": 0.5, "top_k": 0, "seed": -1, "stop": "a", "stop_token_ids": [1, 19],
               "max_tokens": 5, "max_completion_tokens": 9, "min_tokens": 2, "logit_bias": {"10": -100, "9": 5.5, "13": 100},
               "ignore_eos": true, "include_stop_str_in_output": true, "skip_special_tokens": false,
               "stream": true, "stream_options": {"include_usage": true, "continuous_usage_stats": true},
               "echo": true, "priority": -3, "cache_salt": "salt", "request_id": "req-1"}),
    )
    .unwrap();
    let s = &p.params;
    assert_eq!((s.n, s.temperature, s.top_k), (3, 0.5, 0));
    assert_eq!(s.seed, Some(u64::MAX));
    assert_eq!(s.stop, vec!["a".to_string()]);
    assert_eq!(s.stop_token_ids, vec![1, 19]);
    assert_eq!((s.max_tokens, s.min_tokens), (Some(9), 2));
    // max_completion_tokens won: the other value did nothing, and the client is told
    assert!(p.ignored.contains(&"max_tokens".to_string()), "{:?}", p.ignored);
    let same = completion(&r, json!({"max_tokens": 9, "max_completion_tokens": 9})).unwrap();
    assert!(same.ignored.is_empty(), "{:?}", same.ignored);
    assert_eq!(s.logit_bias, vec![(9, 5.5), (10, -100.0), (13, 100.0)]);
    assert!(s.ignore_eos && s.include_stop_str_in_output && !s.skip_special_tokens);
    assert!(p.stream && p.include_usage && p.continuous_usage_stats && p.echo);
    assert_eq!((p.priority, p.cache_salt.as_deref(), p.id.as_str()), (-3, Some("salt"), "cmpl-req-1"));
    let big = completion(&r, json!({"seed": 18446744073709551615u64, "stop": ["a", "b", "c", "d", "e"]})).unwrap();
    assert_eq!(big.params.seed, Some(u64::MAX));
    assert_eq!(big.params.stop.len(), 5);
    assert_eq!(completion(&r, json!({"top_k": 7})).unwrap().params.top_k, 7);
}

#[test]
fn ids_and_created() {
    let r = router();
    let a = chat(&r, json!({})).unwrap();
    let b = chat(&r, json!({})).unwrap();
    let hex = |s: &str| s.len() == 32 && s.chars().all(|c| c.is_ascii_hexdigit());
    assert!(a.id.starts_with("chatcmpl-") && hex(&a.id["chatcmpl-".len()..]), "{}", a.id);
    assert_ne!(a.id, b.id);
    let c = completion(&r, json!({})).unwrap();
    assert!(c.id.starts_with("cmpl-") && hex(&c.id["cmpl-".len()..]), "{}", c.id);
    assert!(a.created > 1_700_000_000);
    // vLLM's ids for a request_id; the header carries the id either way.
    let mine = chat(&r, json!({"request_id": "mine"})).unwrap();
    assert_eq!(mine.id, "chatcmpl-mine");
    assert_eq!(header(&mine, "x-request-id"), Some("chatcmpl-mine"));
    assert_eq!(completion(&r, json!({"request_id": "mine"})).unwrap().id, "cmpl-mine");
    assert_eq!(header(&a, "x-request-id"), Some(a.id.as_str()));
    // An X-Request-Id header names it when the body does not (vLLM); the body wins.
    let named = |body: Value, hdr: Option<&str>| r.prepare_as(Endpoint::Chat, &chat_body(body), hdr).unwrap().id;
    assert_eq!(named(json!({}), Some("trace-7")), "chatcmpl-trace-7");
    assert_eq!(named(json!({"request_id": "mine"}), Some("trace-7")), "chatcmpl-mine");
    assert!(named(json!({}), Some("")).len() > "chatcmpl-".len() + 30, "an empty header names nothing");
    // Ids travel back in a header: what a header cannot carry as it is is refused (body) or
    // ignored (header).
    for bad in ["a\r\nX-Evil: 1", "smile \u{1F600}", "tab\there", &"x".repeat(257), "", "abc ", " "] {
        let err = chat(&r, json!({"request_id": bad})).unwrap_err();
        assert_eq!((err.status(), err.param()), (400, Some("request_id")), "{bad:?}");
        assert!(!named(json!({}), Some(bad)).contains(bad) || bad.is_empty(), "{bad:?}");
    }
    assert_eq!(chat(&r, json!({"request_id": "a b~!"})).unwrap().id, "chatcmpl-a b~!");
    assert_eq!(chat(&r, json!({"request_id": "x".repeat(256)})).unwrap().id.len(), 9 + 256);
}

#[test]
fn tokenize_route() {
    let r = router();
    let v = body_json(handled(&r, Endpoint::Tokenize, br#"{"prompt": "hello world"}"#).unwrap());
    assert_eq!(v, json!({"tokens": [0, 9, 10], "count": 3, "max_model_len": 32}));
    let v = body_json(
        handled(&r, Endpoint::Tokenize, br#"{"model": "tiny-alias", "prompt": "hello", "add_special_tokens": false}"#)
            .unwrap(),
    );
    assert_eq!(v["tokens"], json!([9]));
    let v = body_json(
        handled(&r, Endpoint::Tokenize, br#"{"messages": [{"role": "user", "content": "hello world"}]}"#).unwrap(),
    );
    assert_eq!(v["tokens"], json!([0, 3, 8, 9, 10, 1, 4, 8]));
    let v = body_json(
        handled(
            &r,
            Endpoint::Tokenize,
            br#"{"messages": [{"role": "user", "content": "a"}], "add_generation_prompt": false}"#,
        )
        .unwrap(),
    );
    assert_eq!(v["tokens"], json!([0, 3, 8, 13, 1]));

    let t = |b: &[u8]| shape(handled(&r, Endpoint::Tokenize, b));
    assert_eq!(t(br#"{"model": "x", "prompt": "a"}"#), (404, "model_not_found", Some("model".into())));
    assert_eq!(t(br#"{}"#), (400, "missing_required_parameter", Some("prompt".into())));
    assert_eq!(t(br#"{"prompt": "a", "messages": []}"#).0, 400);
    assert_eq!(t(br#"{"prompt": 5}"#), (400, "invalid_type", Some("prompt".into())));
    assert_eq!(t(br#"{"messages": []}"#), (400, "invalid_value", Some("messages".into())));
    assert_eq!(
        t(br#"{"messages": [{"role": "user", "content": "a"}], "tools": []}"#),
        (400, "invalid_value", Some("tools".into()))
    );
    assert_eq!(t(b"{"), (400, "invalid_json", Some("body".into())));
    // a per-request template is refused as on the chat route, not rendered past
    assert_eq!(
        t(br#"{"messages": [{"role": "user", "content": "a"}], "chat_template": "{{ messages }}"}"#),
        (400, "unsupported_parameter", Some("chat_template".into()))
    );
    handled(&r, Endpoint::Tokenize, br#"{"messages": [{"role": "user", "content": "a"}], "chat_template": null}"#)
        .unwrap();
    assert_eq!(
        t(br#"{"messages": [{"role": "user", "content": "a"}], "documents": [1]}"#),
        (400, "invalid_type", Some("documents[0]".into()))
    );
    // The chat-only fields do nothing to a prompt: reported (null means unset).
    let v = body_json(
        handled(
            &r,
            Endpoint::Tokenize,
            br#"{"prompt": "hello", "tools": [null], "continue_final_message": true, "documents": null}"#,
        )
        .unwrap(),
    );
    assert_eq!(v["ignored_fields"], json!(["continue_final_message", "tools"]));
}

#[test]
fn detokenize_route() {
    let r = router();
    let v = body_json(handled(&r, Endpoint::Detokenize, br#"{"model": "tiny", "tokens": [9, 10]}"#).unwrap());
    assert_eq!(v, json!({"prompt": r.tokenizer().decode(&[9, 10], false)}));
    let d = |b: &[u8]| shape(handled(&r, Endpoint::Detokenize, b));
    assert_eq!(d(br#"{"tokens": [9, 20]}"#), (400, "invalid_value", Some("tokens[1]".into())));
    assert_eq!(d(br#"{"tokens": [-1]}"#), (400, "invalid_value", Some("tokens[0]".into())));
    assert_eq!(d(br#"{"tokens": ["a"]}"#), (400, "invalid_type", Some("tokens[0]".into())));
    assert_eq!(d(br#"{}"#), (400, "missing_required_parameter", Some("tokens".into())));
    assert_eq!(d(br#"{"model": "no", "tokens": []}"#).0, 404);
}

#[test]
fn chat_render_route() {
    let r = router();
    let body = chat_body(json!({"chat_template_kwargs": {"foo": 1}, "weird": true}));
    let v = body_json(handled(&r, Endpoint::ChatRender, &body).unwrap());
    assert_eq!(v["prompt"], "<s>user : hello world </s> assistant :");
    assert_eq!(v["prompt_token_ids"], json!([0, 3, 8, 9, 10, 1, 4, 8]));
    assert_eq!(v["template"]["origin"], "--chat-template");
    assert!(v["template"]["hash"].as_str().unwrap().starts_with("sha256:"));
    assert_eq!(v["unused_template_kwargs"], json!(["foo"]));
    assert_eq!(v["ignored_fields"], json!(["chat_template_kwargs.foo", "weird"]));
    // The headers a generation of the same request gets, but no response id.
    let headers = r.handle(Endpoint::ChatRender, &body).unwrap().headers;
    let get = |name: &str| headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone());
    assert_eq!(get("llmserve-ignored-fields").as_deref(), Some("chat_template_kwargs.foo, weird"));
    assert_eq!(get("llmserve-unused-template-kwargs").as_deref(), Some("foo"));
    assert!(get("llmserve-chat-template").unwrap().starts_with("--chat-template sha256:"));
    assert_eq!(get("x-request-id"), None);
    // Validated as a generation request would be.
    assert_eq!(shape(handled(&r, Endpoint::ChatRender, &chat_body(json!({"n": 0})))).2.as_deref(), Some("n"));
    assert_eq!(shape(handled(&r, Endpoint::ChatRender, &chat_body(json!({"model": "z"})))).0, 404);
}

#[test]
fn completion_render_route() {
    let r = router();
    let v = body_json(
        handled(&r, Endpoint::CompletionRender, &completion_body(json!({"prompt": ["hello", "hello"]}))).unwrap(),
    );
    let hello = json!({"prompt": "hello", "prompt_token_ids": [0, 9]});
    assert_eq!(v, json!({"prompts": [hello, hello], "ignored_fields": []}));
    let v = body_json(
        handled(&r, Endpoint::CompletionRender, &completion_body(json!({"prompt": [[0, 9], [10, 9]]}))).unwrap(),
    );
    let (bos_hello, d) = (r.tokenizer().decode(&[0, 9], false), r.tokenizer().decode(&[10, 9], false));
    assert_eq!(
        v,
        json!({"prompts": [{"prompt": bos_hello, "prompt_token_ids": [0, 9]}, {"prompt": d, "prompt_token_ids": [10, 9]}],
               "ignored_fields": []})
    );
    assert_eq!(
        shape(handled(&r, Endpoint::CompletionRender, &completion_body(json!({"prompt": ""})))).2.as_deref(),
        Some("prompt")
    );
}

#[test]
fn models_routes() {
    let r = router();
    let v = body_json(r.models());
    assert_eq!(v["object"], "list");
    let data = v["data"].as_array().unwrap();
    assert_eq!(data.len(), 2);
    for (m, id) in data.iter().zip(["tiny", "tiny-alias"]) {
        assert_eq!(m["id"], id);
        assert_eq!(m["object"], "model");
        assert_eq!(m["owned_by"], "llmserve");
        assert_eq!(m["root"], "tiny");
        assert_eq!(m["parent"], Value::Null);
        assert_eq!(m["permission"][0]["object"], "model_permission");
        assert_eq!(m["permission"][0]["allow_sampling"], true);
        assert_eq!(m["max_model_len"], 32);
        assert!(m["created"].as_u64().unwrap() > 1_700_000_000);
        // Anthropic's keys: its SDK lists the same page
        assert_eq!((m["type"].as_str(), m["display_name"].as_str()), (Some("model"), Some(id)));
        assert_eq!(m["lifecycle"], "active");
        let at = m["created_at"].as_str().unwrap();
        assert!(at.len() == 20 && at.ends_with('Z') && at.as_bytes()[10] == b'T', "{at}");
        assert_eq!((m["max_input_tokens"].clone(), m["max_tokens"].clone()), (json!(32), json!(32)));
    }
    assert_eq!(
        (v["has_more"].clone(), v["first_id"].clone(), v["last_id"].clone()),
        (json!(false), json!("tiny"), json!("tiny-alias"))
    );
    let one = body_json(r.model("tiny-alias").unwrap());
    assert_eq!(one, data[1]);
    let e = r.model("tiny:latest").unwrap_err();
    assert_eq!((e.status(), e.code()), (404, "model_not_found"));
}

/// A LoRA adapter is a model of its own name: listed after the base model's names with its
/// path as `root` and the base model as `parent`, and a request naming it runs through it
/// (`Prepared::lora`: its place plus one) on every generating route.
#[test]
fn lora_adapters_are_models_of_their_own_names() {
    let adapters = json!({"system_fingerprint": "fp_base", "lora_adapters": [
        {"name": "sql", "path": "/a/sql", "system_fingerprint": "fp_sql"},
        {"name": "chat", "path": "org/chat-lora", "parent": "org/base"},
    ]});
    let r = router_with(adapters, Some(TEMPLATE));
    let v = body_json(r.models());
    let ids: Vec<&str> = v["data"].as_array().unwrap().iter().map(|m| m["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["tiny", "tiny-alias", "sql", "chat"]);
    let sql = body_json(r.model("sql").unwrap());
    assert_eq!((sql["root"].clone(), sql["parent"].clone()), (json!("/a/sql"), json!("tiny")));
    assert_eq!(body_json(r.model("tiny").unwrap())["parent"], Value::Null);
    // vLLM's `base_model_name` names the parent; each adapter's requests carry its fingerprint
    let chat_model = body_json(r.model("chat").unwrap());
    assert_eq!((chat_model["root"].clone(), chat_model["parent"].clone()), (json!("org/chat-lora"), json!("org/base")));
    let fingerprint = |model: &str| chat(&r, json!({"model": model})).unwrap().system_fingerprint;
    assert_eq!(
        (fingerprint("sql"), fingerprint("chat"), fingerprint("tiny")),
        (Some("fp_sql".into()), Some("fp_base".into()), Some("fp_base".into()))
    );
    assert_eq!(chat(&r, json!({"model": "chat"})).unwrap().lora, 2);
    assert_eq!(completion(&r, json!({"model": "sql"})).unwrap().lora, 1);
    assert_eq!(chat(&r, json!({"model": "tiny-alias"})).unwrap().lora, 0);
    let e = chat(&r, json!({"model": "sql:latest"})).unwrap_err();
    assert_eq!((e.status(), e.code()), (404, "model_not_found"));
    assert!(e.message().ends_with("This server serves `tiny`, `tiny-alias`, `sql`, `chat`."), "{}", e.message());
}

#[test]
fn tokenize_takes_vllms_fields_and_reports_unknown_ones() {
    let r = router();
    let v =
        body_json(handled(&r, Endpoint::Tokenize, br#"{"prompt": "hello world", "return_token_strs": true}"#).unwrap());
    assert_eq!(
        v,
        json!({"tokens": [0, 9, 10], "count": 3, "max_model_len": 32, "token_strs": ["<s>", "hello", "world"]})
    );
    let v =
        body_json(handled(&r, Endpoint::Tokenize, br#"{"prompt": "a", "add_special_tokens": false, "x": 1}"#).unwrap());
    assert_eq!(v, json!({"tokens": [13], "count": 1, "max_model_len": 32, "ignored_fields": ["x"]}));
    // ...and in the header the generation routes send
    let h = r.handle(Endpoint::Tokenize, br#"{"prompt": "a", "x": 1}"#).unwrap();
    assert_eq!(h.headers, vec![("llmserve-ignored-fields".to_string(), "x".to_string())]);
    assert!(r.handle(Endpoint::Tokenize, br#"{"prompt": "a"}"#).unwrap().headers.is_empty());
    let v = body_json(
        handled(&r, Endpoint::Tokenize, br#"{"messages": [{"role": "user", "content": "a", "weird": 1}]}"#).unwrap(),
    );
    assert_eq!(v["ignored_fields"], json!(["messages[0].weird"]));

    let v =
        body_json(handled(&r, Endpoint::Detokenize, br#"{"tokens": [0, 9], "skip_special_tokens": true}"#).unwrap());
    assert_eq!(v, json!({"prompt": r.tokenizer().decode(&[9], false)}));
    let v =
        body_json(handled(&r, Endpoint::Detokenize, br#"{"tokens": [0, 9], "skip_special_tokens": false}"#).unwrap());
    assert_eq!(v, json!({"prompt": r.tokenizer().decode(&[0, 9], false)}));
    let v = body_json(handled(&r, Endpoint::Detokenize, br#"{"tokens": [], "x": 1}"#).unwrap());
    assert_eq!(v["ignored_fields"], json!(["x"]));

    let strict = router_with(json!({"strict_fields": true}), Some(TEMPLATE));
    let t = |ep, b: &[u8]| shape(strict.handle(ep, b));
    assert_eq!(t(Endpoint::Tokenize, br#"{"prompt": "a", "x": 1}"#), (400, "unsupported_parameter", Some("x".into())));
    assert_eq!(
        t(Endpoint::Tokenize, br#"{"messages": [{"role": "user", "content": "a", "w": 1}]}"#),
        (400, "unsupported_parameter", Some("messages[0].w".into()))
    );
    assert_eq!(t(Endpoint::Detokenize, br#"{"tokens": [], "y": 1}"#), (400, "unsupported_parameter", Some("y".into())));
    strict
        .handle(Endpoint::Tokenize, br#"{"prompt": "a", "return_token_strs": false, "add_special_tokens": true}"#)
        .unwrap();
}

#[test]
fn unread_message_keys_are_reported() {
    let r = router();
    let msgs = json!([
        {"role": "system", "content": "a", "name": "n", "refusal": null},
        {"role": "user", "content": "b", "weird": 1},
        {"role": "assistant", "content": "c", "reasoning_content": "x", "refusal": "no",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "d"}
    ]);
    let p = chat(&r, json!({"messages": msgs, "store": true})).unwrap();
    // (this template names `.name` only on tools: a message's name is dropped, as are an
    // assistant's calls and a tool result's id)
    assert_eq!(
        header(&p, "llmserve-ignored-fields"),
        Some("messages[0].name, messages[1].weird, messages[2].refusal, messages[2].tool_calls, messages[3].tool_call_id")
    );
    // Nested keys with no meaning: in content parts, tools and response_format (vLLM-style
    // `schema` beside `json_object` would be dropped silently otherwise); unread documents.
    let p = chat(
        &r,
        json!({
            "messages": [{"role": "user", "content": [{"type": "text", "text": "a", "foo": 1}]}],
            "tools": [{"type": "function", "bar": 2,
                       "function": {"name": "f", "strict": true, "baz": 3, "parameters": {"type": "object"}}}],
            "tool_choice": "required",
            "documents": [{"title": "t", "text": "x"}],
        }),
    )
    .unwrap();
    assert_eq!(
        header(&p, "llmserve-ignored-fields"),
        Some("documents, messages[0].content[0].foo, tools[0].bar, tools[0].function.baz")
    );
    // A named tool_choice reads `type` and `function.name`; anything beside them is reported
    // (OpenAI's tool_choice has no `strict`: a tool's own `strict` is in `tools`).
    let tools = json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]);
    let named = |tc: Value| json!({"messages": [{"role": "user", "content": "a"}], "tools": tools, "tool_choice": tc});
    let p = chat(&r, named(json!({"type": "function", "function": {"name": "f", "strict": true}, "zz": 1}))).unwrap();
    assert_eq!(header(&p, "llmserve-ignored-fields"), Some("tool_choice.function.strict, tool_choice.zz"));
    assert_eq!(
        shape(chat(&r, named(json!({"type": "function", "function": "f"})))),
        (400, "invalid_type", Some("tool_choice.function".into()))
    );
    assert_eq!(
        shape(chat(&r, named(json!({"type": "function", "function": {}})))),
        (400, "missing_required_parameter", Some("tool_choice.function.name".into()))
    );
    let p =
        chat(&r, json!({"messages": msgs, "response_format": {"type": "json_object", "schema": {"type": "object"}}}))
            .unwrap();
    assert!(header(&p, "llmserve-ignored-fields").unwrap().ends_with("response_format.schema"));
    let p = chat(
        &r,
        json!({"messages": [{"role": "user", "content": "a"}],
               "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "extra": 1}}}),
    )
    .unwrap();
    assert_eq!(header(&p, "llmserve-ignored-fields"), Some("response_format.json_schema.extra"));
    // A json_schema's description is for the model, which never sees it here: reported, and
    // a 400 under --strict-fields; an empty one says nothing and passes; a number is a type error.
    let described = |d: Value| {
        json!({"messages": [{"role": "user", "content": "a"}],
               "response_format": {"type": "json_schema", "json_schema": {"name": "x", "description": d, "schema": {}}}})
    };
    let p = chat(&r, described(json!("Answer in French."))).unwrap();
    assert_eq!(header(&p, "llmserve-ignored-fields"), Some("response_format.json_schema.description"));
    for quiet in [json!(""), Value::Null] {
        assert_eq!(header(&chat(&r, described(quiet)).unwrap(), "llmserve-ignored-fields"), None);
    }
    let (status, code, param) = shape(chat(&r, described(json!(3))));
    assert_eq!(
        (status, code, param.as_deref()),
        (400, "invalid_type", Some("response_format.json_schema.description"))
    );
    let strict_r = router_with(json!({"strict_fields": true}), Some(TEMPLATE));
    let e = chat(&strict_r, described(json!("Answer in French."))).unwrap_err();
    assert_eq!(
        (e.status(), e.code(), e.param()),
        (400, "unsupported_parameter", Some("response_format.json_schema.description"))
    );
    // the refusal says what is true of every such field: it does nothing here (a field may
    // work on another request, as tools do with a template that shows them)
    assert_eq!(
        e.message(),
        "`response_format.json_schema.description` would have no effect on this request (strict field checking is on)."
    );
    // The extensions' own keys are read, not reported; another type's key is.
    let msgs = json!([{"role": "user", "content": "a"}]);
    for rf in [json!({"type": "regex", "regex": "[0-9]+"}), json!({"type": "grammar", "grammar": "start: \"a\""})] {
        let p = chat(&r, json!({"messages": msgs, "response_format": rf})).unwrap();
        assert_eq!(header(&p, "llmserve-ignored-fields"), None, "{rf}");
    }
    let p =
        chat(&r, json!({"messages": msgs, "response_format": {"type": "json_object", "json_schema": {"name": "x"}}}))
            .unwrap();
    assert_eq!(header(&p, "llmserve-ignored-fields"), Some("response_format.json_schema"));
    let strict = router_with(json!({"strict_fields": true}), Some(TEMPLATE));
    assert!(chat(&strict, json!({"messages": msgs, "response_format": {"type": "regex", "regex": "a+"}})).is_ok());
    // A key the template names is read.
    let t = "{% for m in messages %}{{ m.content }}{{ m.weird }}{% endfor %}";
    let r2 = router_with(json!({}), Some(t));
    let p = chat(&r2, json!({"messages": [{"role": "user", "content": "a", "weird": "b"}]})).unwrap();
    assert_eq!(header(&p, "llmserve-ignored-fields"), None);
    let strict = router_with(json!({"strict_fields": true}), Some(TEMPLATE));
    let got = shape(chat(&strict, json!({"messages": [{"role": "user", "content": "a", "weird": 1}]})));
    assert_eq!(got, (400, "unsupported_parameter", Some("messages[0].weird".to_string())));
    // The render route reports them in its body.
    let body = chat_body(json!({"messages": [{"role": "user", "content": "a", "weird": 1}]}));
    let v = body_json(handled(&r, Endpoint::ChatRender, &body).unwrap());
    assert_eq!(v["ignored_fields"], json!(["messages[0].weird"]));
}

/// A forced call under the XML format whose `parameters` its grammar cannot enforce is a 400
/// naming the keyword's place in the tool that has it.
#[test]
fn xml_forced_calls_name_what_they_cannot_enforce() {
    let plain = "{% for m in messages %}{{ m.role }} : {{ m.content }} </s> {% endfor %}";
    let r = router_with(json!({"tool_call_format": "qwen3_xml"}), Some(plain));
    let tool =
        |name: &str, params: Value| json!({"type": "function", "function": {"name": name, "parameters": params}});
    let tools = json!([
        tool("ok", json!({"type": "object"})),
        tool("zip", json!({"type": "object", "properties": {"code": {"type": "string", "pattern": "^[0-9]{5}$"}}})),
    ]);
    for choice in [json!("required"), json!({"type": "function", "function": {"name": "zip"}})] {
        let err = chat(&r, json!({"tools": tools, "tool_choice": choice})).unwrap_err();
        let at = "tools[1].function.parameters.properties.code.pattern";
        assert_eq!((err.status(), err.code(), err.param()), (400, "invalid_value", Some(at)));
        assert!(err.message().contains("qwen3_xml") && err.message().contains("`pattern`"), "{}", err.message());
    }
    // not forced: nothing is enforced, so nothing is refused
    chat(&r, json!({"tools": tools, "tool_choice": "auto"})).unwrap();
}

/// `tool_choice: {"type": "allowed_tools"}`: every tool is shown, only the listed ones may be
/// called: "required" forces a call among them (any format), "auto" in the Hermes format is
/// the grammar of an answer or calls to them; other formats cannot say that and report it.
#[test]
fn allowed_tools_restrict_the_calls_not_the_prompt() {
    let tool = |name: &str| json!({"type": "function", "function": {"name": name, "parameters": {"type": "object"}}});
    let tools = json!([tool("get_weather"), tool("get_time"), tool("get_news")]);
    let allowed = |mode: &str, names: &[&str]| {
        let list: Vec<Value> = names.iter().map(|n| json!({"type": "function", "function": {"name": n}})).collect();
        json!({"tools": tools, "tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": list}}})
    };
    let callable = |p: &llmserve_router::protocol::Prepared| {
        let mut names: Vec<String> = p.tools.as_ref().unwrap().parameters.keys().cloned().collect();
        names.sort();
        names
    };
    let hermes = router_with(json!({"tool_call_format": "hermes", "strict_fields": true}), Some(TEMPLATE));
    let all = chat(&hermes, json!({"tools": tools})).unwrap();
    for mode in ["required", "auto"] {
        let p = chat(&hermes, allowed(mode, &["get_time", "get_news"])).unwrap();
        assert_eq!(p.prompts, all.prompts, "every tool is still shown");
        assert_eq!(callable(&p), ["get_news", "get_time"]);
        assert!(p.grammar.is_some(), "{mode}: enforced");
        let choice = p.tools.as_ref().unwrap().choice;
        assert_eq!(choice, if mode == "required" { ToolChoice::Required } else { ToolChoice::Auto });
    }
    // the same request through Responses' flat shape
    let flat =
        json!({"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "get_time"}]});
    let flat_tools: Vec<Value> = ["get_weather", "get_time"]
        .iter()
        .map(|n| json!({"type": "function", "name": n, "parameters": {"type": "object"}}))
        .collect();
    let body = json!({"model": "tiny", "input": "hi", "tools": flat_tools, "tool_choice": flat});
    let r = hermes.prepare(Endpoint::Responses, &serde_json::to_vec(&body).unwrap()).unwrap();
    assert_eq!(callable(&r), ["get_time"]);
    let mut bad = body.clone();
    bad["tool_choice"]["tools"][0]["name"] = json!("nope");
    let err = hermes.prepare(Endpoint::Responses, &serde_json::to_vec(&bad).unwrap()).unwrap_err();
    assert_eq!(err.param(), Some("tool_choice.tools[0].name"));

    // Qwen3's XML has one too: enforced
    let xml = router_with(json!({"tool_call_format": "qwen3_xml", "strict_fields": true}), Some(TEMPLATE));
    let p = chat(&xml, allowed("auto", &["get_time"])).unwrap();
    assert_eq!((callable(&p), p.grammar.is_some()), (vec!["get_time".to_string()], true));
    // and llama3's, and Mistral's
    let llama = router_with(json!({"tool_call_format": "llama3_json"}), Some(TEMPLATE));
    let p = chat(&llama, allowed("auto", &["get_time"])).unwrap();
    assert_eq!((header(&p, "llmserve-ignored-fields"), p.grammar.is_some()), (None, true));
    let mistral = router_with(json!({"tool_call_format": "mistral"}), Some(TEMPLATE));
    let p = chat(&mistral, allowed("auto", &["get_time"])).unwrap();
    assert_eq!((header(&p, "llmserve-ignored-fields"), p.grammar.is_some()), (None, true));
    // a format without an "answer or calls" grammar: the restriction reported
    let json_format = router_with(json!({"tool_call_format": "json"}), Some(TEMPLATE));
    let p = chat(&json_format, allowed("auto", &["get_time"])).unwrap();
    assert_eq!(header(&p, "llmserve-ignored-fields"), Some("tool_choice.allowed_tools"));
    assert!(p.grammar.is_none());
    let p = chat(&llama, allowed("required", &["get_time"])).unwrap();
    assert_eq!((callable(&p), header(&p, "llmserve-ignored-fields")), (vec!["get_time".to_string()], None));
    // keys that mean nothing are named where they are
    let mut extra = allowed("required", &["get_time"]);
    extra["tool_choice"]["allowed_tools"]["tools"][0]["function"]["strict"] = json!(true);
    let p = chat(&llama, extra).unwrap();
    assert_eq!(header(&p, "llmserve-ignored-fields"), Some("tool_choice.allowed_tools.tools[0].function.strict"));
}

/// Under `tool_choice: "auto"`, a strict tool's arguments must follow its schema and a
/// `response_format` beside tools shapes the answer when no tool is called: in the Hermes
/// format one grammar says both (a call, or the answer); other formats report what they
/// cannot enforce.
#[test]
fn auto_calls_follow_strict_schemas_and_answers_the_response_format() {
    let plain = "{% for m in messages %}{{ m.role }} : {{ m.content }} </s> {% endfor %}";
    let tools = |strict: bool| {
        json!([{"type": "function", "function": {"name": "get_weather", "strict": strict, "parameters":
            {"type": "object", "properties": {"city": {"enum": ["London", "Rome"]}}, "required": ["city"]}}}])
    };
    let kind = |p: &llmserve_router::protocol::Prepared| {
        p.grammar.as_ref().map(|g| g.key().split(':').next().unwrap().to_string())
    };
    let json_object = json!({"type": "json_object"});

    let hermes = router_with(json!({"tool_call_format": "hermes", "strict_fields": true}), Some(plain));
    let free = chat(&hermes, json!({"tools": tools(false)})).unwrap();
    assert_eq!(kind(&free), None);
    for body in [json!({"tools": tools(true)}), json!({"tools": tools(false), "response_format": json_object})] {
        let p = chat(&hermes, body.clone()).unwrap();
        assert_eq!(kind(&p).as_deref(), Some("lark"), "{body}");
        assert_eq!(header(&p, "llmserve-ignored-fields"), None, "{body}");
        assert!(p.tools.is_some(), "{body}");
    }
    let alone = chat(&hermes, json!({"response_format": json_object})).unwrap();
    assert_eq!(kind(&alone).as_deref(), Some("json_schema"));
    // The response_format's own errors still name it; a grammar decides where output ends.
    let bad = json!({"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object",
        "properties": {"a": {"type": "string", "pattern": "("}}}}});
    let (status, _, param) = shape(chat(&hermes, json!({"tools": tools(false), "response_format": bad})));
    assert_eq!((status, param.as_deref().map(|p| p.starts_with("response_format"))), (400, Some(true)));
    let (status, _, param) = shape(chat(&hermes, json!({"tools": tools(true), "ignore_eos": true})));
    assert_eq!((status, param.as_deref()), (400, Some("ignore_eos")));
    // A regex leaves no way to write a call: the tools are reported and not read for calls.
    let lenient = router_with(json!({"tool_call_format": "hermes"}), Some(plain));
    let p = chat(
        &lenient,
        json!({"tools": tools(true), "structured_outputs": {"regex": "a+"},
                                 "parallel_tool_calls": false, "tool_choice": "auto"}),
    )
    .unwrap();
    assert_eq!(header(&p, "llmserve-ignored-fields"), Some("parallel_tool_calls, tool_choice, tools"));
    assert!(p.tools.is_none());
    // A structural tag spells the calls itself: they are read from its output, and the strict
    // schema it alone decides is reported.
    let call = json!({"type": "object", "properties": {"city": {"type": "string"}}});
    let tag = json!({"type": "structural_tag", "triggers": ["<tool_call>"], "structures": [
        {"begin": "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": ", "schema": call, "end": "}\n</tool_call>"}]});
    let p = chat(&lenient, json!({"tools": tools(true), "response_format": tag})).unwrap();
    assert_eq!(kind(&p).as_deref(), Some("structural_tag"));
    assert_eq!(header(&p, "llmserve-ignored-fields"), Some("tools[0].function.strict"));
    assert!(p.tools.is_some());

    // `strict` is a boolean; a strict tool's schema the engine refuses is named; more tools
    // than the engine can choose between are not enforced (reported), never a 500 later.
    let mut bad = tools(true);
    bad[0]["function"]["strict"] = json!("true");
    let (status, code, param) = shape(chat(&hermes, json!({"tools": bad})));
    assert_eq!((status, code, param.as_deref()), (400, "invalid_type", Some("tools[0].function.strict")));
    let mut refused = tools(true);
    refused[0]["function"]["parameters"]["properties"]["city"] = json!({"type": "string", "pattern": "(?<=a)b"});
    let (status, _, param) = shape(chat(&hermes, json!({"tools": refused})));
    assert_eq!((status, param.as_deref()), (400, Some("tools[0].function.parameters")));
    // (a vocabulary that spells the calls, so the probe reaches the choice between names)
    let chars: serde_json::Map<String, Value> = std::iter::once("\n".to_string())
        .chain((32u8..127).map(|c| (c as char).to_string()))
        .enumerate()
        .map(|(i, c)| (c, json!(i + 2)))
        .chain([("<s>".to_string(), json!(0)), ("</s>".to_string(), json!(1))])
        .collect();
    let special = |id: u32, content: &str| {
        json!({"id": id, "content": content, "special": true, "single_word": false, "lstrip": false,
               "rstrip": false, "normalized": false})
    };
    let tokenizer = json!({"version": "1.0", "model": {"type": "WordLevel", "vocab": chars, "unk_token": "</s>"},
        "added_tokens": [special(0, "<s>"), special(1, "</s>")],
        "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "[\\s\\S]"}, "behavior": "Isolated", "invert": false}});
    let spelled = Router::new(
        Tokenizer::from_json_str(&tokenizer.to_string()).unwrap(),
        templates(Some(plain)),
        config(json!({"tool_call_format": "hermes", "max_model_len": 4096})),
    );
    let many: Vec<Value> =
        (0..2100).map(|i| json!({"type": "function", "function": {"name": format!("f{i}"), "strict": true}})).collect();
    let p = chat(&spelled, json!({"tools": many})).unwrap();
    assert_eq!(kind(&p), None);
    assert!(header(&p, "llmserve-ignored-fields").unwrap().starts_with("tools[0].function.strict, "));
    let p = chat(&spelled, json!({"tools": many[..3], "response_format": json_object})).unwrap();
    assert_eq!(kind(&p).as_deref(), Some("lark"));
    let p = chat(&spelled, json!({"tools": many, "response_format": json_object})).unwrap();
    assert_eq!((kind(&p).as_deref(), header(&p, "llmserve-ignored-fields")), (Some("json_schema"), Some("tools")));

    // A grammar constrains what is generated, not the final message it would continue.
    let continued = json!({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                           "continue_final_message": true, "add_generation_prompt": false});
    let mut with_format = continued.clone();
    with_format["response_format"] = json_object.clone();
    let (status, code, param) = shape(chat(&hermes, with_format));
    assert_eq!((status, code, param.as_deref()), (400, "unsupported_parameter", Some("continue_final_message")));
    let mut with_strict = continued.clone();
    with_strict["tools"] = tools(true);
    assert_eq!(shape(chat(&hermes, with_strict)).2.as_deref(), Some("continue_final_message"));
    chat(&hermes, continued).unwrap();

    // llama3's and Mistral's calls have one too.
    for format in ["llama3_json", "mistral"] {
        let r = router_with(json!({ "tool_call_format": format }), Some(plain));
        let p = chat(&r, json!({"tools": tools(true)})).unwrap();
        assert_eq!((header(&p, "llmserve-ignored-fields"), kind(&p).as_deref()), (None, Some("lark")), "{format}");
        let p = chat(&r, json!({"tools": tools(false), "response_format": json_object})).unwrap();
        assert_eq!((header(&p, "llmserve-ignored-fields"), kind(&p).as_deref()), (None, Some("lark")), "{format}");
        assert!(p.tools.is_some());
    }
    // The json format has none: its calls are any JSON the output starts with.
    let llama = router_with(json!({"tool_call_format": "json"}), Some(plain));
    let p = chat(&llama, json!({"tools": tools(true)})).unwrap();
    assert_eq!(header(&p, "llmserve-ignored-fields"), Some("tools[0].function.strict"));
    assert_eq!(kind(&p), None);
    let p = chat(&llama, json!({"tools": tools(false), "response_format": json_object})).unwrap();
    assert_eq!(header(&p, "llmserve-ignored-fields"), Some("tools"));
    assert!(p.tools.is_none());
    assert_eq!(kind(&p).as_deref(), Some("json_schema"));
    // Forced calls follow every schema anyway: `strict` is never reported there.
    let p = chat(&llama, json!({"tools": tools(true), "tool_choice": "required"})).unwrap();
    assert_eq!(header(&p, "llmserve-ignored-fields"), None);

    // Qwen3's XML calls open with the same marker as Hermes': the same "answer or calls" grammar.
    let xml = router_with(json!({"tool_call_format": "qwen3_xml", "strict_fields": true}), Some(plain));
    assert_eq!(kind(&chat(&xml, json!({"tools": tools(false)})).unwrap()), None);
    for body in [json!({"tools": tools(true)}), json!({"tools": tools(false), "response_format": json_object})] {
        let p = chat(&xml, body.clone()).unwrap();
        assert_eq!(kind(&p).as_deref(), Some("lark"), "{body}");
        assert_eq!(header(&p, "llmserve-ignored-fields"), None, "{body}");
    }
    // a schema the XML grammar cannot follow: reported, as in formats without a grammar
    let mut union = tools(true);
    union[0]["function"]["parameters"] = json!({"type": "object", "anyOf": [{"required": ["a"]}]});
    let lenient = router_with(json!({"tool_call_format": "qwen3_xml"}), Some(plain));
    let p = chat(&lenient, json!({"tools": union})).unwrap();
    assert_eq!((kind(&p), header(&p, "llmserve-ignored-fields")), (None, Some("tools[0].function.strict")));
}

#[test]
fn tools_a_template_never_reads_are_reported_unless_forced() {
    // No `tools` in the template, no tool-call format to parse with.
    let plain = "{% for m in messages %}{{ m.role }} : {{ m.content }} </s> {% endfor %}";
    let r = router_with(json!({}), Some(plain));
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]);
    // (an `"auto"` sent chooses between calls and an answer: with no calls, it chooses nothing)
    for (choice, reported) in [(json!(null), "tools"), (json!("auto"), "tool_choice, tools"), (json!("none"), "tools")]
    {
        let p = chat(&r, json!({"tools": tools, "tool_choice": choice})).unwrap();
        assert_eq!(header(&p, "llmserve-ignored-fields"), Some(reported), "tool_choice {choice}");
    }
    // Forced calls use the tools (in a grammar): never reported. NOTE: the fixture's word
    // vocabulary may not spell JSON, so the forced grammar itself may be refused, but not as
    // an ignored field.
    let strict = router_with(json!({"strict_fields": true}), Some(plain));
    for choice in [json!("required"), json!({"type": "function", "function": {"name": "get_weather"}})] {
        match chat(&strict, json!({"tools": tools, "tool_choice": choice.clone()})) {
            Ok(p) => assert_eq!(header(&p, "llmserve-ignored-fields"), None, "tool_choice {choice}"),
            Err(e) => assert_ne!(e.code(), "unsupported_parameter", "tool_choice {choice}: {e:?}"),
        }
    }
    // A configured format parses `auto` calls from the text: the tools are used.
    let parsing = router_with(json!({"tool_call_format": "hermes"}), Some(plain));
    let p = chat(&parsing, json!({"tools": tools})).unwrap();
    assert_eq!(header(&p, "llmserve-ignored-fields"), None);
    // A template that renders them.
    let p = chat(&router(), json!({"tools": tools})).unwrap();
    assert_eq!(header(&p, "llmserve-ignored-fields"), None);
    assert_eq!(shape(chat(&strict, json!({"tools": tools}))), (400, "unsupported_parameter", Some("tools".into())));
}

/// vLLM's `prompt_logprobs`: 0..=max_logprobs on both routes (the scheduler then computes the
/// prompt's logprobs, also without `echo`); refused on streams and out of range, as vLLM does.
#[test]
fn prompt_logprobs_are_bounded_and_not_streamed() {
    let r = router();
    for k in [0, 5, 20] {
        assert_eq!(chat(&r, json!({"prompt_logprobs": k})).unwrap().prompt_logprobs(), Some(k));
        assert_eq!(completion(&r, json!({"prompt_logprobs": k})).unwrap().prompt_logprobs(), Some(k));
    }
    assert_eq!(completion(&r, json!({"prompt_logprobs": null})).unwrap().prompt_logprobs(), None);
    for (body, code) in [
        (json!({"prompt_logprobs": 21}), "invalid_value"),
        (json!({"prompt_logprobs": -1}), "invalid_value"),
        (json!({"prompt_logprobs": 1, "stream": true}), "invalid_value"),
        (json!({"prompt_logprobs": "1"}), "invalid_type"),
    ] {
        assert_eq!(shape(chat(&r, body.clone())), (400, code, Some("prompt_logprobs".into())), "{body}");
        assert_eq!(shape(completion(&r, body.clone())), (400, code, Some("prompt_logprobs".into())), "{body}");
    }
    // k = 0 on a stream: vLLM takes it and shows it nowhere; here it is reported
    let zero = json!({"prompt_logprobs": 0, "stream": true});
    for p in [chat(&r, zero.clone()).unwrap(), completion(&r, zero).unwrap()] {
        assert_eq!((p.prompt_logprobs(), header(&p, "llmserve-ignored-fields")), (None, Some("prompt_logprobs")));
    }
}

/// vLLM's defaults, which clients that send its whole default set send, ask for nothing here:
/// they pass without a word, also under `--strict-fields`; other values are reported, and a
/// right-side truncation, which would cut the prompt's other end, is refused.
#[test]
fn vllms_default_values_ask_for_nothing() {
    let strict = router_with(json!({"strict_fields": true}), Some(TEMPLATE));
    let defaults = json!({"spaces_between_special_tokens": true, "return_token_offsets": false,
                          "return_mm_kwargs": true, "routed_experts_prompt_start": 0, "watermarking": false,
                          "truncation_side": "left"});
    for p in [chat(&strict, defaults.clone()).unwrap(), completion(&strict, defaults).unwrap()] {
        assert_eq!(header(&p, "llmserve-ignored-fields"), None);
    }
    let r = router();
    let p = chat(&r, json!({"spaces_between_special_tokens": false, "watermarking": true})).unwrap();
    assert_eq!(header(&p, "llmserve-ignored-fields"), Some("spaces_between_special_tokens, watermarking"));
    let right = json!({"truncation_side": "right", "truncate_prompt_tokens": 2});
    for result in [chat(&r, right.clone()), completion(&r, right)] {
        assert_eq!(shape(result), (400, "unsupported_parameter", Some("truncation_side".into())));
    }
}

/// minijinja panics on a reversed slice of an empty string or list (`''[::-1]`; Python gives
/// `''`): the request gets a template error that says so, and no other shape of the messages
/// is tried, since that render would be another prompt (it rendered `P:hi;P:;` here, as if
/// every message had parts).
#[test]
fn a_render_the_engine_fails_in_is_an_error_not_another_prompt() {
    let template = "{% for m in messages %}{% if m.content is string %}S:{{ m.content[::-1] }}{% else %}P:\
                    {% for p in m.content %}{{ p.text }}{% endfor %}{% endif %};{% endfor %}";
    let r = router_with(json!({}), Some(template));
    let two = json!({"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": ""}]});
    let e = chat(&r, two).unwrap_err();
    assert_eq!((e.code(), e.param()), ("template_error", Some("messages")));
    assert!(e.message().contains("`[::-1]`"), "{}", e.message());
    // (a string that is not empty reverses as Python's does)
    assert!(chat(&r, json!({})).is_ok());
}
