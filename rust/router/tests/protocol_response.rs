//! ResponseBuilder: golden SSE bytes (chat and completions, with usage), non-stream bodies,
//! choice indices with n > 1 and several prompts, and logprob shapes.

mod protocol_fixture;

use std::sync::Arc;

use llmserve_router::protocol::{Endpoint, Prepared, SamplingParams};
use llmserve_router::response::{ChoiceDelta, FinishReason, ResponseBuilder, StopReason, TokenOut};
use llmserve_router::tokenizer::{GgufVocab, Tokenizer};
use llmserve_router::tools::{ToolCallFormat, ToolChoice, ToolParsing};
use protocol_fixture::*;
use serde_json::{json, Value};

fn params(n: u32, logprobs: Option<u32>) -> SamplingParams {
    SamplingParams {
        n,
        temperature: 1.0,
        top_p: 1.0,
        top_k: 0,
        min_p: 0.0,
        presence_penalty: 0.0,
        frequency_penalty: 0.0,
        repetition_penalty: 1.0,
        seed: None,
        max_tokens: None,
        min_tokens: 0,
        stop: vec![],
        stop_token_ids: vec![],
        ignore_eos: false,
        include_stop_str_in_output: false,
        skip_special_tokens: true,
        logit_bias: vec![],
        bad_words: Vec::new(),
        allowed_token_ids: None,
        beam_search: None,
        logprobs,
        repetition: None,
    }
}

fn prepared(endpoint: Endpoint, prompts: Vec<Vec<u32>>, texts: &[&str], n: u32, logprobs: Option<u32>) -> Prepared {
    Prepared {
        endpoint,
        id: if endpoint == Endpoint::Chat { "chatcmpl-1".into() } else { "cmpl-1".into() },
        created: 100,
        system_fingerprint: Some("fp_test".into()),
        model: "tiny".into(),
        prompts,
        prompt_texts: texts.iter().map(|s| s.to_string()).collect(),
        params: params(n, logprobs),
        stream: false,
        include_usage: false,
        continuous_usage_stats: false,
        echo: false,
        return_token_ids: false,
        tokens_as_ids: false,
        prompt_logprobs_k: None,
        priority: 0,
        cache_salt: None,
        lora: 0,
        keep: None,
        user: None,
        headers: vec![],
        ignored: vec![],
        grammar: None,
        tools: None,
        reasoning: None,
        responses: None,
        embedding: None,
        best_of: None,
        echo_message: None,
        prediction: Vec::new(),
    }
}

fn tok(id: u32) -> TokenOut {
    TokenOut { id, logprob: -0.5, top: vec![], text_offset: 0 }
}

/// Ids for pushes whose tests do not read them (one per listed token).
static SAMPLED: [u32; 64] = [9; 64];

fn delta<'a>(text: &'a str, tokens: &'a [TokenOut], finish: Option<FinishReason>) -> ChoiceDelta<'a> {
    ChoiceDelta { text, tokens, ids: &SAMPLED[..tokens.len()], finish, stop_reason: None }
}

/// The JSON of every `data:` frame the builder has sent and sends at its finish.
fn chunks_of(b: &mut ResponseBuilder) -> Vec<Value> {
    String::from_utf8([b.take(), b.finish()].concat())
        .unwrap()
        .lines()
        .filter_map(|l| l.strip_prefix("data: ").filter(|d| *d != "[DONE]").map(|d| serde_json::from_str(d).unwrap()))
        .collect()
}

fn builder(p: &Prepared) -> ResponseBuilder {
    ResponseBuilder::new(p, Arc::new(tokenizer()))
}

#[test]
fn chat_stream_golden_bytes() {
    let mut p = prepared(Endpoint::Chat, vec![vec![0, 3, 8]], &["x"], 1, None);
    p.stream = true;
    // With include_usage, chunks before the usage chunk carry `usage: null` (OpenAI's docs).
    p.include_usage = true;
    let mut b = builder(&p);
    b.push(0, &delta("hel", &[tok(9)], None));
    b.push(0, &delta("", &[tok(10)], None)); // held-back text: no chunk
    let mut out = b.take();
    b.push(
        0,
        &ChoiceDelta {
            text: "lo",
            tokens: &[tok(1)],
            ids: &[9],
            finish: Some(FinishReason::Stop),
            stop_reason: Some(StopReason::Token(7)),
        },
    );
    assert!(b.all_finished());
    out.extend(b.take());
    out.extend(b.finish());
    let head = r#"{"id":"chatcmpl-1","object":"chat.completion.chunk","created":100,"model":"tiny","system_fingerprint":"fp_test","#;
    let expected = format!(
        "data: {head}\"choices\":[{{\"index\":0,\"delta\":{{\"role\":\"assistant\",\"content\":\"\"}},\"logprobs\":null,\"finish_reason\":null}}],\"usage\":null}}\n\n\
         data: {head}\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"hel\"}},\"logprobs\":null,\"finish_reason\":null}}],\"usage\":null}}\n\n\
         data: {head}\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"lo\"}},\"logprobs\":null,\"finish_reason\":\"stop\",\"stop_reason\":7}}],\"usage\":null}}\n\n\
         data: {head}\"choices\":[],\"usage\":{{\"prompt_tokens\":3,\"completion_tokens\":3,\"total_tokens\":6,\"prompt_tokens_details\":{{\"cached_tokens\":0}}}}}}\n\n\
         data: [DONE]\n\n"
    );
    assert_eq!(String::from_utf8(out).unwrap(), expected);
    assert!(b.finish().is_empty(), "[DONE] goes out once");
}

/// A chat choice that lists no token (a stop string trimmed all it wrote, or EOS came first)
/// has `logprobs: {"content": []}` in the body; streamed, its finish carries the same empty
/// list, so the SDK's accumulated choice has it too (audit F: it was null).
#[test]
fn a_chat_choice_without_listed_tokens_streams_empty_logprobs() {
    let mut p = prepared(Endpoint::Chat, vec![vec![0, 3]], &["x"], 1, Some(0));
    let mut b = builder(&p);
    b.push(0, &delta("", &[], Some(FinishReason::Stop)));
    let body: Value = serde_json::from_slice(&b.finish()).unwrap();
    assert_eq!(body["choices"][0]["logprobs"], json!({"content": [], "refusal": null}));
    p.stream = true;
    let mut b = builder(&p);
    b.push(0, &delta("", &[], Some(FinishReason::Stop)));
    let chunks = chunks_of(&mut b);
    let last = &chunks.last().unwrap()["choices"][0];
    assert_eq!((&last["finish_reason"], &last["logprobs"]), (&json!("stop"), &json!({"content": [], "refusal": null})));
    assert_eq!(chunks[0]["choices"][0]["logprobs"], Value::Null, "the role chunk carries none");
    // a choice that did stream a token finishes with null, as OpenAI's finishing chunk
    let mut b = builder(&p);
    b.push(0, &delta("Hi", &[tok(7)], None));
    b.push(0, &delta("", &[], Some(FinishReason::Stop)));
    let chunks = chunks_of(&mut b);
    let last = &chunks.last().unwrap()["choices"][0];
    assert_eq!((&last["finish_reason"], &last["logprobs"]), (&json!("stop"), &Value::Null));
    assert_eq!(chunks[chunks.len() - 2]["choices"][0]["logprobs"]["content"].as_array().map(Vec::len), Some(1));
}

#[test]
fn completion_stream_golden_bytes_with_echo_and_continuous_usage() {
    let mut p = prepared(Endpoint::Completion, vec![vec![0, 9]], &["hello"], 1, None);
    p.stream = true;
    p.include_usage = true;
    p.continuous_usage_stats = true;
    p.echo = true;
    let mut b = builder(&p);
    b.push(0, &delta(" world", &[tok(10)], None));
    b.push(0, &delta("", &[tok(2)], Some(FinishReason::Length)));
    let out = [b.take(), b.finish()].concat();
    let head =
        r#"{"id":"cmpl-1","object":"text_completion","created":100,"model":"tiny","system_fingerprint":"fp_test","#;
    let expected = format!(
        "data: {head}\"choices\":[{{\"index\":0,\"text\":\"hello world\",\"logprobs\":null,\"finish_reason\":null}}],\"usage\":{{\"prompt_tokens\":2,\"completion_tokens\":1,\"total_tokens\":3,\"prompt_tokens_details\":{{\"cached_tokens\":0}}}}}}\n\n\
         data: {head}\"choices\":[{{\"index\":0,\"text\":\"\",\"logprobs\":null,\"finish_reason\":\"length\",\"stop_reason\":null}}],\"usage\":{{\"prompt_tokens\":2,\"completion_tokens\":2,\"total_tokens\":4,\"prompt_tokens_details\":{{\"cached_tokens\":0}}}}}}\n\n\
         data: {head}\"choices\":[],\"usage\":{{\"prompt_tokens\":2,\"completion_tokens\":2,\"total_tokens\":4,\"prompt_tokens_details\":{{\"cached_tokens\":0}}}}}}\n\n\
         data: [DONE]\n\n"
    );
    assert_eq!(String::from_utf8(out).unwrap(), expected);
}

#[test]
fn chat_role_chunk_usage_counts_no_completion_tokens() {
    let mut p = prepared(Endpoint::Chat, vec![vec![0, 9]], &["x"], 1, None);
    p.stream = true;
    p.continuous_usage_stats = true;
    let mut b = builder(&p);
    b.push(0, &delta("a", &[tok(13)], None));
    b.push(0, &delta("b", &[tok(14)], Some(FinishReason::Stop)));
    let all = [b.take(), b.finish()].concat();
    let used: Vec<u64> = frames(&all).iter().map(|c| c["usage"]["completion_tokens"].as_u64().unwrap()).collect();
    // role chunk (before any token), "a", "b" + finish
    assert_eq!(used, [0, 1, 2]);
}

/// A `prediction`'s tokens the output holds (as a subsequence) are `accepted_prediction_tokens`,
/// the rest of it `rejected_prediction_tokens`, each choice's summed; streamed with continuous
/// usage, each chunk's counts are those of the tokens up to it (the role chunk's none).
#[test]
fn a_predictions_tokens_the_output_holds_are_counted_in_usage() {
    let mut p = prepared(Endpoint::Chat, vec![vec![0, 3]], &["x"], 2, None);
    p.prediction = vec![5, 6, 7, 8];
    let mut b = builder(&p);
    let toks = [tok(1), tok(1)];
    // choice 0 writes 5 9 7 8 (holds 5 7 8); choice 1 writes 8 (holds 8)
    b.push(0, &ChoiceDelta { text: "ab", tokens: &toks, ids: &[5, 9], finish: None, stop_reason: None });
    b.push(
        0,
        &ChoiceDelta { text: "cd", tokens: &toks, ids: &[7, 8], finish: Some(FinishReason::Stop), stop_reason: None },
    );
    b.push(
        1,
        &ChoiceDelta {
            text: "e",
            tokens: &toks[..1],
            ids: &[8],
            finish: Some(FinishReason::Length),
            stop_reason: None,
        },
    );
    let body: Value = serde_json::from_slice(&b.finish()).unwrap();
    assert_eq!(
        body["usage"]["completion_tokens_details"],
        json!({"reasoning_tokens": 0, "accepted_prediction_tokens": 4, "rejected_prediction_tokens": 4})
    );
    assert_eq!(body["usage"]["completion_tokens"], 5);

    let mut p = prepared(Endpoint::Chat, vec![vec![0, 3]], &["x"], 1, None);
    p.prediction = vec![5, 6];
    (p.stream, p.include_usage, p.continuous_usage_stats) = (true, true, true);
    let mut b = builder(&p);
    b.push(0, &ChoiceDelta { text: "ab", tokens: &toks[..1], ids: &[5], finish: None, stop_reason: None });
    b.push(
        0,
        &ChoiceDelta { text: "cd", tokens: &toks[..1], ids: &[6], finish: Some(FinishReason::Stop), stop_reason: None },
    );
    let mut out = b.take();
    out.extend(b.finish());
    let details: Vec<Value> = String::from_utf8(out)
        .unwrap()
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: ").filter(|d| *d != "[DONE]"))
        .map(|d| serde_json::from_str::<Value>(d).unwrap()["usage"]["completion_tokens_details"].clone())
        .collect();
    let counts = |a: u64, r: u64| json!({"reasoning_tokens": 0, "accepted_prediction_tokens": a, "rejected_prediction_tokens": r});
    // role chunk, "ab", "cd", the usage chunk
    assert_eq!(details, vec![counts(0, 2), counts(1, 1), counts(2, 0), counts(2, 0)]);
}

#[test]
fn stream_without_usage_ends_with_done_only() {
    let mut p = prepared(Endpoint::Chat, vec![vec![0]], &["x"], 1, None);
    p.stream = true;
    let mut b = builder(&p);
    b.push(0, &delta("a", &[tok(13)], Some(FinishReason::Stop)));
    let all = [b.take(), b.finish()].concat();
    let f = frames(&all);
    assert_eq!(f.len(), 2);
    assert!(f.iter().all(|c| c.get("usage").is_none()));
    assert_eq!(f[1]["choices"][0]["delta"], json!({"content": "a"}));
}

#[test]
fn chat_stream_n2_each_choice_starts_with_role_and_finishes_once() {
    let mut p = prepared(Endpoint::Chat, vec![vec![0, 3]], &["x"], 2, None);
    p.stream = true;
    let mut b = builder(&p);
    b.push(1, &delta("b", &[tok(14)], None));
    b.push(0, &delta("a", &[tok(13)], None));
    b.push(0, &delta("", &[tok(1)], Some(FinishReason::Stop)));
    assert!(!b.all_finished());
    b.push(0, &delta("late", &[tok(13)], None)); // after its finish: dropped
    b.push(7, &delta("nope", &[tok(13)], None)); // no such choice: dropped
    b.push(1, &delta("c", &[tok(15)], Some(FinishReason::Length)));
    assert!(b.all_finished());
    let f = frames(&[b.take(), b.finish()].concat());
    for idx in 0..2u64 {
        let mine: Vec<&Value> = f.iter().filter(|c| c["choices"][0]["index"] == idx).collect();
        assert_eq!(mine[0]["choices"][0]["delta"], json!({"role": "assistant", "content": ""}));
        let finishes = mine.iter().filter(|c| !c["choices"][0]["finish_reason"].is_null()).count();
        assert_eq!(finishes, 1);
        assert!(!mine[mine.len() - 1]["choices"][0]["finish_reason"].is_null());
    }
    let text0: String = f
        .iter()
        .filter(|c| c["choices"][0]["index"] == 0)
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text0, "a");
    assert!(f.iter().all(|c| c["id"] == "chatcmpl-1" && c["created"] == 100 && c["model"] == "tiny"));
    // Empty finishing delta is `{}`.
    let fin0 = f.iter().find(|c| c["choices"][0]["index"] == 0 && c["choices"][0]["finish_reason"] == "stop").unwrap();
    assert_eq!(fin0["choices"][0]["delta"], json!({}));
}

#[test]
fn chat_non_stream_body() {
    let p = prepared(Endpoint::Chat, vec![vec![0, 3, 8]], &["x"], 1, None);
    let mut b = builder(&p);
    b.push(0, &delta("hello", &[tok(9)], None));
    assert!(b.take().is_empty(), "nothing streams when not streaming");
    b.push(
        0,
        &ChoiceDelta {
            text: " world",
            tokens: &[tok(10), tok(19)],
            ids: &[1, 2],
            finish: Some(FinishReason::Stop),
            stop_reason: Some(StopReason::Text("z")),
        },
    );
    let v: Value = serde_json::from_slice(&b.finish()).unwrap();
    assert_eq!(
        v,
        json!({"id": "chatcmpl-1", "object": "chat.completion", "created": 100, "model": "tiny", "system_fingerprint": "fp_test",
               "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello world", "refusal": null}, "logprobs": null,
                            "finish_reason": "stop", "stop_reason": "z"}],
               "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6, "prompt_tokens_details": {"cached_tokens": 0}}})
    );
}

/// Chat's `echo`: each choice's content starts with the echoed message: in the body, and
/// streamed on the role chunk, so the deltas add up to the body's content.
#[test]
fn chat_echo_starts_each_choice() {
    for stream in [false, true] {
        let mut p = prepared(Endpoint::Chat, vec![vec![0, 3]], &["x"], 2, None);
        p.stream = stream;
        p.echo_message = Some("Once upon".into());
        let mut b = builder(&p);
        let mut out = Vec::new();
        for choice in 0..2 {
            b.push(choice, &delta(" a time", &[tok(13)], Some(FinishReason::Stop)));
            out.extend(b.take());
        }
        out.extend(b.finish());
        let contents: Vec<String> = if stream {
            let chunks = frames(&out);
            (0..2u64)
                .map(|i| {
                    let of_choice =
                        chunks.iter().flat_map(|c| c["choices"].as_array().unwrap()).filter(|c| c["index"] == i);
                    of_choice.filter_map(|c| c["delta"]["content"].as_str()).collect()
                })
                .collect()
        } else {
            let body: Value = serde_json::from_slice(&out).unwrap();
            (0..2).map(|i| body["choices"][i]["message"]["content"].as_str().unwrap().to_string()).collect()
        };
        assert_eq!(contents, ["Once upon a time", "Once upon a time"], "stream {stream}");
    }
}

#[test]
fn completion_choices_are_prompt_major_and_usage_counts_each_prompt_once() {
    let mut p = prepared(Endpoint::Completion, vec![vec![0, 9], vec![0, 10, 10]], &["hello", "world world"], 2, None);
    p.echo = true;
    let mut b = builder(&p);
    // each prompt's first token reports its cached prompt tokens: the request sums them
    b.add_cached_prompt_tokens(2);
    b.add_cached_prompt_tokens(1);
    // choice = prompt_index * n + j
    for (choice, text) in [(3u32, "d"), (0, "a"), (2, "c"), (1, "b")] {
        b.push(choice, &delta(text, &[tok(13), tok(14)], Some(FinishReason::Length)));
    }
    let v: Value = serde_json::from_slice(&b.finish()).unwrap();
    assert_eq!(v["object"], "text_completion");
    let choices = v["choices"].as_array().unwrap();
    let got: Vec<(u64, &str)> =
        choices.iter().map(|c| (c["index"].as_u64().unwrap(), c["text"].as_str().unwrap())).collect();
    assert_eq!(got, vec![(0, "helloa"), (1, "hellob"), (2, "world worldc"), (3, "world worldd")]);
    assert_eq!(
        v["usage"],
        json!({"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13, "prompt_tokens_details": {"cached_tokens": 3}})
    );
    assert!(choices.iter().all(|c| c["logprobs"].is_null() && c["finish_reason"] == "length"));
}

/// `best_of` above `n`: each prompt's `n` choices with the highest mean logprob per sampled
/// token come back, indexed anew; `usage` counts every choice generated.
#[test]
fn best_of_returns_each_prompts_best_choices() {
    use llmserve_router::protocol::BestOf;
    // two prompts, best 1 of 3 each; logprobs computed only to rank
    let mut p = prepared(Endpoint::Completion, vec![vec![0, 9], vec![0, 10]], &["P", "Q"], 3, Some(0));
    p.echo = true;
    p.best_of = Some(BestOf { n: 1, logprobs: false });
    let mut b = builder(&p);
    // (choice, text, the logprobs of the tokens it sampled)
    let runs: [(u32, &str, &[f32]); 6] = [
        (0, "a", &[-1.0, -1.0]),
        (1, "b", &[-0.25, -0.75]),
        (2, "c", &[-0.5]),
        (3, "d", &[-2.0]),
        // sampled nothing shown, yet its one token (say eos) counts
        (4, "", &[-0.0625]),
        (5, "f", &[-0.5, -0.5, -0.5]),
    ];
    for (choice, text, lps) in runs {
        for &lp in lps {
            b.score(choice, lp);
        }
        let tokens: Vec<TokenOut> = lps.iter().map(|&logprob| TokenOut { logprob, ..tok(13) }).collect();
        b.push(choice, &delta(text, &tokens, Some(FinishReason::Stop)));
    }
    let v: Value = serde_json::from_slice(&b.finish()).unwrap();
    let got: Vec<(u64, &str)> = v["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (c["index"].as_u64().unwrap(), c["text"].as_str().unwrap()))
        .collect();
    // prompt P: b (mean -0.5) beats c (-0.5, later) and a (-1); Q: the empty one (-0.0625)
    assert_eq!(got, vec![(0, "Pb"), (1, "Q")]);
    assert!(v["choices"].as_array().unwrap().iter().all(|c| c["logprobs"].is_null()), "not asked for");
    assert_eq!(v["usage"]["completion_tokens"], 10);

    // n = 2 of 3, with logprobs asked: the two best, best first, with theirs
    let mut p = prepared(Endpoint::Completion, vec![vec![0, 9]], &["P"], 3, Some(1));
    p.best_of = Some(BestOf { n: 2, logprobs: true });
    let mut b = builder(&p);
    for (choice, lp) in [(0u32, -3.0f32), (1, -1.0), (2, -2.0)] {
        b.score(choice, lp);
        b.push(
            choice,
            &delta(&format!("t{choice}"), &[TokenOut { logprob: lp, ..tok(13) }], Some(FinishReason::Length)),
        );
    }
    let v: Value = serde_json::from_slice(&b.finish()).unwrap();
    let choices = v["choices"].as_array().unwrap();
    let got: Vec<(u64, &str, f64)> = choices
        .iter()
        .map(|c| {
            (
                c["index"].as_u64().unwrap(),
                c["text"].as_str().unwrap(),
                c["logprobs"]["token_logprobs"][0].as_f64().unwrap(),
            )
        })
        .collect();
    assert_eq!(got, vec![(0, "t1", -1.0), (1, "t2", -2.0)]);
}

#[test]
fn chat_logprobs_shape() {
    let t = tokenizer();
    let p = prepared(Endpoint::Chat, vec![vec![0]], &["x"], 1, Some(2));
    let mut b = builder(&p);
    let toks = [
        TokenOut { id: 9, logprob: -0.25, top: vec![(9, -0.25), (10, -1.5)], text_offset: 0 },
        TokenOut { id: 10, logprob: f32::NEG_INFINITY, top: vec![(13, -0.1), (10, f32::NEG_INFINITY)], text_offset: 5 },
    ];
    b.push(
        0,
        &ChoiceDelta {
            text: "hello world",
            tokens: &toks,
            ids: &toks.iter().map(|t| t.id).collect::<Vec<_>>(),
            finish: Some(FinishReason::Stop),
            stop_reason: None,
        },
    );
    let v: Value = serde_json::from_slice(&b.finish()).unwrap();
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 2);
    // OpenAI's `refusal` beside `content`, null
    assert_eq!(v["choices"][0]["logprobs"].as_object().unwrap().get("refusal"), Some(&Value::Null));
    let bytes = |id: u32| json!(t.token_bytes(id));
    assert_eq!(
        content[0],
        json!({"token": t.token_str(9), "logprob": -0.25, "bytes": bytes(9),
               "top_logprobs": [{"token": t.token_str(9), "logprob": -0.25, "bytes": bytes(9)},
                                {"token": t.token_str(10), "logprob": -1.5, "bytes": bytes(10)}]})
    );
    assert_eq!(content[1]["logprob"], -9999.0);
    assert_eq!(content[1]["top_logprobs"][1]["logprob"], -9999.0);
    // f32 logprobs keep their short form on the wire.
    assert!(String::from_utf8(b.finish()).unwrap().contains("\"logprob\":-0.25,"));
}

#[test]
fn chat_stream_logprobs_ride_on_empty_deltas() {
    let mut p = prepared(Endpoint::Chat, vec![vec![0]], &["x"], 1, Some(0));
    p.stream = true;
    let mut b = builder(&p);
    b.push(0, &delta("", &[TokenOut { id: 9, logprob: -1.0, top: vec![], text_offset: 0 }], None));
    let f = frames(&[b.take(), b.finish()].concat());
    assert_eq!(f.len(), 2, "role chunk, then the logprobs chunk");
    assert_eq!(f[1]["choices"][0]["delta"], json!({}));
    assert_eq!(f[1]["choices"][0]["logprobs"]["content"][0]["top_logprobs"], json!([]));
    assert_eq!(f[1]["choices"][0]["logprobs"].as_object().unwrap().get("refusal"), Some(&Value::Null));
}

#[test]
fn completion_top_logprobs_always_hold_the_token() {
    // `logprobs: 0` gives the token alone; with k alternatives that miss it, k + 1 entries
    let t = tokenizer();
    let p = prepared(Endpoint::Completion, vec![vec![0, 9]], &["hello"], 1, Some(0));
    let mut b = builder(&p);
    let toks = [
        TokenOut { id: 10, logprob: -0.5, top: vec![], text_offset: 0 },
        TokenOut { id: 9, logprob: -2.5, top: vec![(10, -0.1)], text_offset: 6 },
    ];
    b.push(
        0,
        &ChoiceDelta {
            text: " world hello",
            tokens: &toks,
            ids: &[1, 2],
            finish: Some(FinishReason::Length),
            stop_reason: None,
        },
    );
    let v: Value = serde_json::from_slice(&b.finish()).unwrap();
    let tops = &v["choices"][0]["logprobs"]["top_logprobs"];
    assert_eq!(tops[0], json!({t.token_str(10): -0.5}));
    assert_eq!(tops[1], json!({t.token_str(10): -0.1, t.token_str(9): -2.5}));
}

/// Two ids that show as one text (partial UTF-8 bytes, both U+FFFD): the token's own text
/// holds its own logprob, not its likelier look-alike's.
#[test]
fn completion_top_logprobs_keep_the_tokens_own_value_under_its_text() {
    let vocab: GgufVocab = serde_json::from_str(include_str!("data/tiny_gguf_vocab.json")).unwrap();
    let t = Arc::new(Tokenizer::from_gguf(&vocab).unwrap());
    let alike: Vec<u32> = (0..t.vocab_size() as u32).filter(|&id| t.token_str(id) == "\u{FFFD}").take(2).collect();
    assert_eq!(alike.len(), 2, "the fixture has partial-UTF-8 byte tokens");
    let (likelier, own) = (alike[0], alike[1]);
    for top in [vec![(likelier, -0.3), (10, -1.0)], vec![(likelier, -0.3), (own, -3.5), (10, -4.0)]] {
        let p = prepared(Endpoint::Completion, vec![vec![0, 9]], &["hello"], 1, Some(top.len() as u32));
        let mut b = ResponseBuilder::new(&p, t.clone());
        let toks = [TokenOut { id: own, logprob: -3.5, top: top.clone(), text_offset: 0 }];
        let d =
            ChoiceDelta { text: "x", tokens: &toks, ids: &[9], finish: Some(FinishReason::Length), stop_reason: None };
        b.push(0, &d);
        let v: Value = serde_json::from_slice(&b.finish()).unwrap();
        let lp = &v["choices"][0]["logprobs"];
        assert_eq!(lp["tokens"][0], "\u{FFFD}");
        assert_eq!(lp["top_logprobs"][0]["\u{FFFD}"], lp["token_logprobs"][0], "{top:?}: {lp}");
        assert_eq!(lp["top_logprobs"][0][t.token_str(10)], top.iter().find(|e| e.0 == 10).unwrap().1);
    }
}

#[test]
fn completion_logprobs_shape_with_echo_offsets() {
    let t = tokenizer();
    let mut p = prepared(Endpoint::Completion, vec![vec![0, 9]], &["hello"], 1, Some(2));
    p.echo = true;
    let mut b = builder(&p);
    // The prompt's second token, given the first (its text_offset is the builder's to count).
    b.push_prompt_logprobs(0, &[TokenOut { id: 9, logprob: -1.5, top: vec![(10, -0.25)], text_offset: 99 }], &[]);
    let toks = [
        TokenOut { id: 10, logprob: -0.5, top: vec![(10, -0.5), (9, -2.0)], text_offset: 0 },
        TokenOut { id: 9, logprob: -0.75, top: vec![(9, -0.75), (9, -3.0)], text_offset: 6 },
    ];
    b.push(
        0,
        &ChoiceDelta {
            text: " world hello",
            tokens: &toks,
            ids: &toks.iter().map(|t| t.id).collect::<Vec<_>>(),
            finish: Some(FinishReason::Length),
            stop_reason: None,
        },
    );
    let v: Value = serde_json::from_slice(&b.finish()).unwrap();
    let lp = &v["choices"][0]["logprobs"];
    assert_eq!(v["choices"][0]["text"], "hello world hello");
    // The prompt's tokens come first; the first has no logprob (nothing precedes it).
    assert_eq!(lp["tokens"], json!([t.token_str(0), t.token_str(9), t.token_str(10), t.token_str(9)]));
    assert_eq!(lp["token_logprobs"], json!([null, -1.5, -0.5, -0.75]));
    assert_eq!(lp["top_logprobs"][0], Value::Null);
    // the token itself joins its alternatives when they lack it (OpenAI: up to logprobs + 1)
    assert_eq!(lp["top_logprobs"][1], json!({t.token_str(10): -0.25, t.token_str(9): -1.5}));
    let mut top0 = serde_json::Map::new();
    top0.insert(t.token_str(10), json!(-0.5));
    top0.insert(t.token_str(9), json!(-2.0));
    assert_eq!(lp["top_logprobs"][2], Value::Object(top0));
    // Two alternatives with one text keep the likelier.
    assert_eq!(lp["top_logprobs"][3], json!({t.token_str(9): -0.75}));
    // Offsets count from the start of the returned text: prompt tokens by their texts, then
    // the completion's after the echoed prompt ("hello"). The BOS the tokenizer added (<s>,
    // id 0) is not in that text: it takes no width.
    assert_eq!(lp["text_offset"], json!([0, 0, 5, 11]));
}

#[test]
fn echo_offsets_give_a_special_token_its_width_where_the_text_holds_it() {
    // a prompt sent as ids echoes its specials: "<s>" is the text's first 3 chars
    let t = tokenizer();
    let text = t.decode(&[0, 9], false);
    assert!(text.starts_with("<s>"), "{text}");
    let mut p = prepared(Endpoint::Completion, vec![vec![0, 9]], &[&text], 1, Some(0));
    p.echo = true;
    let mut b = builder(&p);
    b.push_prompt_logprobs(0, &[TokenOut { id: 9, logprob: -1.5, top: vec![], text_offset: 0 }], &[]);
    let tok = [TokenOut { id: 10, logprob: -0.5, top: vec![], text_offset: 0 }];
    let ids = [10];
    b.push(
        0,
        &ChoiceDelta { text: " world", tokens: &tok, ids: &ids, finish: Some(FinishReason::Length), stop_reason: None },
    );
    let v: Value = serde_json::from_slice(&b.finish()).unwrap();
    let offsets = &v["choices"][0]["logprobs"]["text_offset"];
    let chars = text.chars().count();
    assert_eq!(offsets, &json!([0, 3, chars]), "{text:?}");
}

#[test]
fn completion_stream_sends_prompt_logprobs_with_the_echo() {
    let t = tokenizer();
    let mut p = prepared(Endpoint::Completion, vec![vec![0, 9]], &["hello"], 2, Some(1));
    p.echo = true;
    p.stream = true;
    let mut b = builder(&p);
    b.push_prompt_logprobs(0, &[TokenOut { id: 9, logprob: -1.5, top: vec![(10, -0.25)], text_offset: 0 }], &[]);
    let tok = [TokenOut { id: 10, logprob: -0.5, top: vec![(10, -0.5)], text_offset: 0 }];
    for choice in 0..2 {
        b.push(
            choice,
            &ChoiceDelta {
                text: " world",
                tokens: &tok,
                ids: &tok.iter().map(|t| t.id).collect::<Vec<_>>(),
                finish: None,
                stop_reason: None,
            },
        );
        b.push(
            choice,
            &ChoiceDelta {
                text: "!",
                tokens: &tok,
                ids: &tok.iter().map(|t| t.id).collect::<Vec<_>>(),
                finish: Some(FinishReason::Length),
                stop_reason: None,
            },
        );
    }
    let f = frames(&[b.take(), b.finish()].concat());
    assert_eq!(f.len(), 4);
    for first in [&f[0], &f[2]] {
        let c = &first["choices"][0];
        assert_eq!(c["text"], "hello world");
        assert_eq!(c["logprobs"]["tokens"], json!([t.token_str(0), t.token_str(9), t.token_str(10)]));
        assert_eq!(c["logprobs"]["token_logprobs"], json!([null, -1.5, -0.5]));
    }
    assert_eq!(f[1]["choices"][0]["logprobs"]["token_logprobs"], json!([-0.5]), "the prompt goes out once");
}

#[test]
fn a_completion_chunk_without_tokens_has_empty_logprobs() {
    // A stop string's tokens send no text: the finishing chunk has no tokens, and its
    // logprobs are empty lists (as a non-streamed answer's), not null.
    let mut p = prepared(Endpoint::Completion, vec![vec![0, 9]], &["hello"], 1, Some(1));
    p.stream = true;
    let mut b = builder(&p);
    b.push(0, &ChoiceDelta { text: "", tokens: &[], ids: &[], finish: Some(FinishReason::Stop), stop_reason: None });
    let f = frames(&[b.take(), b.finish()].concat());
    let c = &f[0]["choices"][0];
    assert_eq!(c["finish_reason"], "stop");
    assert_eq!(c["logprobs"], json!({"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}));
}

#[test]
fn builder_round_trips_a_prepared_request() {
    // The Prepared a real request produces drives the builder end to end.
    let r = router();
    let p = completion(
        &r,
        json!({"prompt": ["hello", "world"], "n": 2, "stream": true,
                                  "stream_options": {"include_usage": true}}),
    )
    .unwrap();
    let mut b = ResponseBuilder::new(&p, r.tokenizer().clone());
    for c in 0..4 {
        b.push(c, &delta("a", &[tok(13)], Some(FinishReason::Stop)));
    }
    let f = frames(&[b.take(), b.finish()].concat());
    assert_eq!(f.len(), 5);
    assert_eq!(
        f[4]["usage"],
        json!({"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8, "prompt_tokens_details": {"cached_tokens": 0}})
    );
    assert!(f.iter().all(|c| c["id"] == p.id.as_str()));
}

/// A builder for a chat with one tool in the Hermes format (`tool_choice: auto`).
fn hermes_chat(stream: bool, parallel: bool) -> ResponseBuilder {
    let mut p = prepared(Endpoint::Chat, vec![vec![0, 3]], &["x"], 1, None);
    p.stream = stream;
    let f = json!({"name": "get", "parameters": {"type": "object"}});
    p.tools = Some(ToolParsing::new(ToolCallFormat::Hermes, parallel, &[&f]));
    builder(&p)
}

const TWO_CALLS: [&str; 6] = [
    "Checking. <tool_call>\n{\"name\": \"get\", \"argu",
    "ments\": {\"city\": \"Pa",
    "ris\"}}\n</tool_call>\n",
    "<tool_call>\n{\"name\": \"get\", \"arguments\": {\"city\": \"Rome\"}}\n</tool_call>",
    " bye",
    "",
];

fn push_all(b: &mut ResponseBuilder) -> Vec<u8> {
    let mut out = Vec::new();
    for (i, piece) in TWO_CALLS.iter().enumerate() {
        let finish = (i + 1 == TWO_CALLS.len()).then_some(FinishReason::Stop);
        b.push(0, &delta(piece, &[tok(9)], finish));
        out.extend(b.take());
    }
    out.extend(b.finish());
    out
}

#[test]
fn streamed_tool_calls_equal_the_body_and_arguments_arrive_in_pieces() {
    let body: Value = serde_json::from_slice(&push_all(&mut hermes_chat(false, true))).unwrap();
    let msg = &body["choices"][0]["message"];
    // Whitespace around calls belongs to the markup: the text on either side is joined as is.
    assert_eq!(msg["content"], "Checking.bye");
    assert_eq!(body["choices"][0]["finish_reason"], "tool_calls");
    let calls = msg["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 2);
    assert_eq!(calls[0]["function"]["arguments"], "{\"city\": \"Paris\"}");

    let chunks = frames(&push_all(&mut hermes_chat(true, true)));
    let mut content = String::new();
    let mut args = vec![String::new(); 2];
    let mut pieces = [0; 2];
    for c in &chunks {
        let d = &c["choices"][0]["delta"];
        content.push_str(d["content"].as_str().unwrap_or_default());
        for t in d["tool_calls"].as_array().into_iter().flatten() {
            let i = t["index"].as_u64().unwrap() as usize;
            if let Some(id) = t["id"].as_str() {
                assert!(id.starts_with("call_") && t["type"] == "function", "{t}");
                assert_eq!(t["function"]["name"], "get");
            } else {
                pieces[i] += 1;
            }
            args[i].push_str(t["function"]["arguments"].as_str().unwrap());
        }
    }
    assert_eq!(content, "Checking.bye");
    assert_eq!(args[0], calls[0]["function"]["arguments"].as_str().unwrap());
    assert_eq!(args[1], calls[1]["function"]["arguments"].as_str().unwrap());
    assert_eq!(pieces[0], 2, "the first call's arguments came in the 2 pushes after its name");
    assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "tool_calls");
}

/// Under "auto" the output may turn out to be calls: the role chunk starts no content, so a
/// client that sums the deltas of a calls-only answer ends with `content` null, as the body
/// has it; an answer with neither text nor calls gets its `""` on the finishing chunk. Tokens
/// that are only call markup carry their logprobs on the call piece they send.
#[test]
fn auto_stream_content_sums_as_the_body_and_logprobs_ride_on_call_pieces() {
    let auto = |stream: bool, logprobs: bool| {
        let mut p = prepared(Endpoint::Chat, vec![vec![0, 3]], &["x"], 1, logprobs.then_some(0));
        p.stream = stream;
        let f = json!({"name": "get", "parameters": {"type": "object"}});
        p.tools = Some(ToolParsing::new(ToolCallFormat::Hermes, true, &[&f]));
        builder(&p)
    };
    let call = ["<tool_call>\n{\"name\": \"get\", \"argu", "ments\": {\"a\": 1}}\n</tool_call>", ""];
    let body: Value = serde_json::from_slice(&push_pieces(&mut auto(false, false), &call, FinishReason::Stop)).unwrap();
    assert!(body["choices"][0]["message"]["content"].is_null());
    let chunks = frames(&push_pieces(&mut auto(true, true), &call, FinishReason::Stop));
    assert!(chunks.iter().all(|c| c["choices"][0]["delta"].get("content").is_none_or(Value::is_null)), "{chunks:?}");
    let (_, calls, finish) = streamed(&chunks);
    assert_eq!((calls.len(), finish), (1, json!("tool_calls")));
    // every token's logprobs went out once, each on a chunk that carries a call piece or the
    // finish (the last token here is the end's, with no text)
    let mut entries = 0;
    for c in &chunks {
        let ch = &c["choices"][0];
        if let Some(lp) = ch["logprobs"]["content"].as_array() {
            let carries = ch["delta"]["tool_calls"].is_array() || !ch["finish_reason"].is_null();
            assert!(carries, "logprobs on a chunk without a piece: {c}\n{chunks:#?}");
            entries += lp.len();
        }
    }
    assert_eq!(entries, 3);

    let empty = [""];
    let body: Value =
        serde_json::from_slice(&push_pieces(&mut auto(false, false), &empty, FinishReason::Stop)).unwrap();
    assert_eq!(body["choices"][0]["message"]["content"], "");
    let chunks = frames(&push_pieces(&mut auto(true, false), &empty, FinishReason::Stop));
    let contents: Vec<&Value> = chunks.iter().filter_map(|c| c["choices"][0]["delta"].get("content")).collect();
    assert_eq!(contents, [&json!("")], "the finishing chunk holds the empty answer");
    // text answers stream as before
    let text = ["Hello", " there", ""];
    let (content, calls, _) = streamed(&frames(&push_pieces(&mut auto(true, false), &text, FinishReason::Stop)));
    assert_eq!((content.as_str(), calls.len()), ("Hello there", 0));
}

/// Under "auto", a complete call whose arguments are not a JSON object (clients `json.loads`
/// them) makes the non-streamed choice answer its text as content, as vLLM's parsers do; a
/// call cut off by the output's end keeps what it had.
#[test]
fn a_call_with_broken_arguments_is_content_unless_cut_off() {
    let broken = ["Sure. <tool_call>\n{\"name\": \"get\", \"arguments\": {\"a\": 1,}}\n</tool_call>", ""];
    let mut b = hermes_chat(false, true);
    b.push(0, &delta(broken[0], &[tok(9)], None));
    b.push(0, &delta(broken[1], &[tok(9)], Some(FinishReason::Stop)));
    let body: Value = serde_json::from_slice(&b.finish()).unwrap();
    let choice = &body["choices"][0];
    assert_eq!(choice["message"]["content"], broken[0]);
    assert!(choice["message"].get("tool_calls").is_none_or(|c| c.as_array().is_some_and(Vec::is_empty)), "{choice}");
    assert_eq!(choice["finish_reason"], "stop");
    // cut off by EOS inside the arguments: content too
    let mut b = hermes_chat(false, true);
    let cut = "<tool_call>\n{\"name\": \"get\", \"arguments\": {\"a\": 1";
    b.push(0, &delta(cut, &[tok(9)], Some(FinishReason::Stop)));
    let body: Value = serde_json::from_slice(&b.finish()).unwrap();
    assert_eq!(body["choices"][0]["message"]["content"], cut);
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
    // cut off by a stop string: the call stays with what was generated, the finish names
    // the stop, as the stream (which has sent the call) ends
    for stream in [false, true] {
        let mut b = hermes_chat(stream, true);
        let tokens = [tok(9)];
        let d = ChoiceDelta {
            stop_reason: Some(StopReason::Text("Paris")),
            ..delta(cut, &tokens, Some(FinishReason::Stop))
        };
        b.push(0, &d);
        let mut out = b.take();
        out.extend(b.finish());
        let (content, calls, finish, stop) = if stream {
            let chunks = frames(&out);
            let choices = chunks.iter().flat_map(|c| c["choices"].as_array().unwrap().iter());
            let deltas: Vec<&Value> = choices.clone().map(|c| &c["delta"]).collect();
            let content: String = deltas.iter().filter_map(|d| d["content"].as_str()).collect();
            let args: String = deltas
                .iter()
                .filter_map(|d| d["tool_calls"].as_array())
                .flatten()
                .filter_map(|t| t["function"]["arguments"].as_str())
                .collect();
            let last = choices.last().unwrap();
            (content, args, last["finish_reason"].clone(), last["stop_reason"].clone())
        } else {
            let body: Value = serde_json::from_slice(&out).unwrap();
            let c = &body["choices"][0];
            let content = c["message"]["content"].as_str().unwrap_or_default().to_string();
            let args = c["message"]["tool_calls"][0]["function"]["arguments"].as_str().unwrap().to_string();
            (content, args, c["finish_reason"].clone(), c["stop_reason"].clone())
        };
        assert_eq!((content.as_str(), calls.as_str()), ("", "{\"a\": 1"), "stream {stream}");
        assert_eq!((finish, stop), (json!("stop"), json!("Paris")), "stream {stream}");
    }
    // cut off by max_tokens inside the arguments: the call stays, with what was generated
    let mut b = hermes_chat(false, true);
    b.push(
        0,
        &delta("<tool_call>\n{\"name\": \"get\", \"arguments\": {\"a\": ", &[tok(9)], Some(FinishReason::Length)),
    );
    let body: Value = serde_json::from_slice(&b.finish()).unwrap();
    let choice = &body["choices"][0];
    assert_eq!(choice["message"]["tool_calls"][0]["function"]["arguments"], "{\"a\": ");
    assert_eq!(choice["finish_reason"], "length");
}

#[test]
fn without_parallel_calls_the_choice_ends_with_its_first_call() {
    let mut b = hermes_chat(true, false);
    let mut out = Vec::new();
    for piece in &TWO_CALLS[..3] {
        assert!(!b.choice_finished(0));
        b.push(0, &delta(piece, &[tok(9)], None));
        out.extend(b.take());
    }
    assert!(b.choice_finished(0), "the engine stops the sequence here");
    b.push(0, &delta(TWO_CALLS[3], &[tok(9)], Some(FinishReason::Stop))); // dropped
    out.extend(b.finish());
    let chunks = frames(&out);
    let indices: Vec<u64> = chunks
        .iter()
        .flat_map(|c| c["choices"][0]["delta"]["tool_calls"].as_array().cloned().unwrap_or_default())
        .map(|t| t["index"].as_u64().unwrap())
        .collect();
    assert!(indices.iter().all(|&i| i == 0), "{indices:?}");
    let finishes: Vec<&Value> =
        chunks.iter().map(|c| &c["choices"][0]["finish_reason"]).filter(|f| !f.is_null()).collect();
    assert_eq!(finishes, vec![&json!("tool_calls")]);
}

/// A chat whose `tool_choice` forces calls to `f0`..`f19` (same `parameters`), read in
/// `format`; named: only `f1`, exactly once.
fn forced_chat(format: ToolCallFormat, choice: ToolChoice, stream: bool, parallel: bool) -> ResponseBuilder {
    let mut p = prepared(Endpoint::Chat, vec![vec![0, 3]], &["x"], 1, None);
    p.stream = stream;
    let fns: Vec<Value> = (0..20)
        .map(|i| json!({"name": format!("f{i}"), "parameters": {"type": "object", "properties": {"a": {"type": "string"}}}}))
        .filter(|f| choice != ToolChoice::Named || f["name"] == "f1")
        .collect();
    let fns: Vec<&Value> = fns.iter().collect();
    p.tools = Some(ToolParsing::new(format, parallel, &fns).with_choice(choice));
    builder(&p)
}

/// Pushes `pieces` (the last one finishing with `finish`); the body or the SSE bytes.
fn push_pieces(b: &mut ResponseBuilder, pieces: &[&str], finish: FinishReason) -> Vec<u8> {
    let mut out = Vec::new();
    for (i, piece) in pieces.iter().enumerate() {
        let f = (i + 1 == pieces.len()).then_some(finish);
        b.push(0, &delta(piece, &[tok(9)], f));
        out.extend(b.take());
    }
    out.extend(b.finish());
    out
}

/// (content, [(id, name, arguments)], finish_reason) from the streamed chunks.
fn streamed(chunks: &[Value]) -> (String, Vec<(String, String, String)>, Value) {
    let mut content = String::new();
    let mut calls: Vec<(String, String, String)> = Vec::new();
    let mut finish = Value::Null;
    for c in chunks {
        let ch = &c["choices"][0];
        content.push_str(ch["delta"]["content"].as_str().unwrap_or_default());
        for t in ch["delta"]["tool_calls"].as_array().into_iter().flatten() {
            let i = t["index"].as_u64().unwrap() as usize;
            if let Some(id) = t["id"].as_str() {
                assert_eq!(i, calls.len());
                calls.push((id.into(), t["function"]["name"].as_str().unwrap().into(), String::new()));
            }
            calls[i].2.push_str(t["function"]["arguments"].as_str().unwrap());
        }
        if !ch["finish_reason"].is_null() {
            assert!(finish.is_null(), "one finishing chunk");
            finish = ch["finish_reason"].clone();
        }
    }
    (content, calls, finish)
}

/// A forced call cut off by max_tokens right after its name keeps the call (arguments so
/// far, here none) instead of returning its JSON as content; streamed, the name goes out
/// as soon as it is complete.
#[test]
fn forced_call_cut_off_after_its_name_is_a_call() {
    let cases = [
        (ToolChoice::Required, true, vec!["[{\"name\": \"f", "2\"", ", \"arguments"], "f2", ""),
        // a named call in the json format is its arguments alone
        (ToolChoice::Named, false, vec!["{\"a\": ", "\"x"], "f1", "{\"a\": \"x"),
        (ToolChoice::Named, false, vec![""], "f1", ""),
        (ToolChoice::Required, false, vec!["{\"name\": \"f7\", \"arguments\": {\"a\": ", "\"xy"], "f7", "{\"a\": \"xy"),
    ];
    for (choice, parallel, pieces, name, args) in cases {
        let body =
            push_pieces(&mut forced_chat(ToolCallFormat::Json, choice, false, parallel), &pieces, FinishReason::Length);
        let body: Value = serde_json::from_slice(&body).unwrap();
        let choice0 = &body["choices"][0];
        assert_eq!(choice0["finish_reason"], "length", "{body}");
        assert_eq!(choice0["message"]["content"], Value::Null, "{body}");
        let calls = choice0["message"]["tool_calls"].as_array().expect("a call");
        assert_eq!(calls.len(), 1, "{body}");
        assert_eq!(calls[0]["function"], json!({"name": name, "arguments": args}));

        let mut b = forced_chat(ToolCallFormat::Json, choice, true, parallel);
        let chunks = frames(&push_pieces(&mut b, &pieces, FinishReason::Length));
        let (content, calls, finish) = streamed(&chunks);
        assert_eq!((content.as_str(), finish), ("", json!("length")));
        assert_eq!(calls.len(), 1);
        assert_eq!((calls[0].1.as_str(), calls[0].2.as_str()), (name, args));
    }
    // Streamed, the id and name go out with the push that completes the name.
    let mut b = forced_chat(ToolCallFormat::Json, ToolChoice::Required, true, true);
    b.push(0, &delta("[{\"name\": \"f", &[tok(9)], None));
    assert!(!String::from_utf8(b.take()).unwrap().contains("tool_calls"));
    b.push(0, &delta("12\"", &[tok(9)], None));
    let sent = String::from_utf8(b.take()).unwrap();
    assert!(sent.contains("\"name\":\"f12\"") && sent.contains("\"id\":\"call_"), "{sent}");
}

/// Hermes, required, parallel: a second call cut off before its name is complete is
/// dropped: no `<tool_call>` in content and no empty call.
#[test]
fn forced_second_call_cut_off_before_its_name_is_dropped() {
    let first = "<tool_call>\n{\"name\": \"f3\", \"arguments\": {\"a\": \"b\"}}\n</tool_call>";
    for tail in ["\n<tool_call>", "\n<tool_call>\n{\"na", "\n<tool_call>\n{\"name\": \"f1"] {
        let pieces = [first, tail];
        let body = push_pieces(
            &mut forced_chat(ToolCallFormat::Hermes, ToolChoice::Required, false, true),
            &pieces,
            FinishReason::Length,
        );
        let body: Value = serde_json::from_slice(&body).unwrap();
        let choice0 = &body["choices"][0];
        assert_eq!(choice0["finish_reason"], "length");
        assert_eq!(choice0["message"]["content"], Value::Null, "{tail:?}: {body}");
        assert_eq!(choice0["message"]["tool_calls"].as_array().unwrap().len(), 1, "{tail:?}");

        let mut b = forced_chat(ToolCallFormat::Hermes, ToolChoice::Required, true, true);
        let (content, calls, finish) = streamed(&frames(&push_pieces(&mut b, &pieces, FinishReason::Length)));
        assert_eq!((content.as_str(), calls.len(), finish), ("", 1, json!("length")), "{tail:?}");
        assert_eq!(calls[0].2, "{\"a\": \"b\"}");
    }
}

/// A named tool_choice that produced its call finishes "stop" (OpenAI's behaviour when a
/// specific function is forced); required and auto calls finish "tool_calls".
#[test]
fn named_tool_choice_finishes_stop() {
    let call = ["{\"name\": \"f1\", \"arguments\": {\"a\": \"x\"}}"];
    // (a named call in the json format is its arguments alone)
    let args = ["{\"a\": \"x\"}"];
    for (choice, parallel, want) in [
        (ToolChoice::Named, false, "stop"),
        (ToolChoice::Required, false, "tool_calls"),
        (ToolChoice::Required, true, "tool_calls"),
    ] {
        let pieces = if choice == ToolChoice::Named { &args } else { &call };
        let body =
            push_pieces(&mut forced_chat(ToolCallFormat::Json, choice, false, parallel), pieces, FinishReason::Stop);
        let body: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(body["choices"][0]["finish_reason"], want, "{choice:?}");
        let function = &body["choices"][0]["message"]["tool_calls"][0]["function"];
        assert_eq!((&function["name"], &function["arguments"]), (&json!("f1"), &json!("{\"a\": \"x\"}")));
        let mut b = forced_chat(ToolCallFormat::Json, choice, true, parallel);
        let (_, calls, finish) = streamed(&frames(&push_pieces(&mut b, pieces, FinishReason::Stop)));
        assert_eq!((calls.len(), finish), (1, json!(want)), "{choice:?}");
        assert_eq!(calls[0].2, "{\"a\": \"x\"}");
    }
    // Hermes named: the builder ends the choice at the call's end (no parallel calls).
    let mut b = forced_chat(ToolCallFormat::Hermes, ToolChoice::Named, true, false);
    b.push(0, &delta("<tool_call>\n{\"name\": \"f1\", \"arguments\": {}}\n</tool_call>", &[tok(9)], None));
    assert!(b.choice_finished(0));
    assert_eq!(b.finish_reason(0), Some(FinishReason::Stop));
    // Cut off, it is still "length".
    let body = push_pieces(
        &mut forced_chat(ToolCallFormat::Json, ToolChoice::Named, false, false),
        &["{\"a\""],
        FinishReason::Length,
    );
    let body: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(body["choices"][0]["finish_reason"], "length");
}

/// A stop string that cuts a forced call short is reported as the stop it was: the
/// arguments are not whole, so the choice does not claim to end in its calls. A stop string
/// after a complete call still finishes "tool_calls" (an agent's "Observation:"), naming it.
#[test]
fn a_stop_string_that_cuts_a_call_short_is_named() {
    let stop = |text: &'static str, b: &mut ResponseBuilder, pieces: &[&str]| -> Vec<u8> {
        let mut out = Vec::new();
        for (i, piece) in pieces.iter().enumerate() {
            let last = i + 1 == pieces.len();
            let d = ChoiceDelta {
                text: piece,
                tokens: &[],
                ids: &[9],
                finish: last.then_some(FinishReason::Stop),
                stop_reason: last.then_some(StopReason::Text(text)),
            };
            b.push(0, &d);
            out.extend(b.take());
        }
        out.extend(b.finish());
        out
    };
    for (choice, parallel) in [(ToolChoice::Required, true), (ToolChoice::Named, false)] {
        // (a named call in the json format is its arguments alone)
        let cut = if parallel { "[{\"name\": \"f1\", \"arguments\": {\"a\": \"" } else { "{\"a\": \"" };
        let body = stop("Paris", &mut forced_chat(ToolCallFormat::Json, choice, false, parallel), &[cut]);
        let body: Value = serde_json::from_slice(&body).unwrap();
        let c = &body["choices"][0];
        assert_eq!((&c["finish_reason"], &c["stop_reason"]), (&json!("stop"), &json!("Paris")), "{body}");
        assert_eq!(c["message"]["tool_calls"][0]["function"]["arguments"], "{\"a\": \"");
        let chunks = frames(&stop("Paris", &mut forced_chat(ToolCallFormat::Json, choice, true, parallel), &[cut]));
        let (_, calls, finish) = streamed(&chunks);
        assert_eq!((calls.len(), finish), (1, json!("stop")), "{choice:?}");
        assert!(chunks.iter().any(|c| c["choices"][0]["stop_reason"] == "Paris"));
    }
    let mut b = hermes_chat(false, true);
    let whole = "<tool_call>\n{\"name\": \"get\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n";
    let body: Value = serde_json::from_slice(&stop("Observation:", &mut b, &[whole])).unwrap();
    let c = &body["choices"][0];
    assert_eq!((&c["finish_reason"], &c["stop_reason"]), (&json!("tool_calls"), &json!("Observation:")), "{body}");
}

/// Pushes for `return_token_ids` tests: text, listed tokens, sampled ids and finish. The
/// second push's text is held back (a possible stop string); the last ends on a stop token
/// whose text is not shown (its id is sampled but not listed).
type Push = (&'static str, &'static [u32], &'static [u32], Option<FinishReason>);

const SAMPLED_PUSHES: [Push; 4] = [
    ("he", &[5], &[5], None),
    ("", &[], &[6], None),
    ("llo", &[6, 7], &[7], None),
    ("", &[], &[2], Some(FinishReason::Stop)),
];

fn push_sampled(b: &mut ResponseBuilder, choices: u32) -> Vec<u8> {
    let mut out = Vec::new();
    for (text, listed, ids, finish) in SAMPLED_PUSHES {
        let tokens: Vec<TokenOut> = listed.iter().map(|&id| tok(id)).collect();
        for c in 0..choices {
            b.push(c, &ChoiceDelta { text, tokens: &tokens, ids, finish, stop_reason: None });
        }
        out.extend(b.take());
    }
    out.extend(b.finish());
    out
}

/// Every streamed chunk's `token_ids` of choice `index`, joined in order, and how many chunks
/// carried the prompt's ids.
fn streamed_ids(chunks: &[Value], index: u64) -> (Vec<u64>, usize) {
    let mut ids = Vec::new();
    for c in chunks.iter().filter(|c| c["choices"][0]["index"] == index) {
        for id in c["choices"][0]["token_ids"].as_array().into_iter().flatten() {
            ids.push(id.as_u64().unwrap());
        }
    }
    let prompts = chunks.iter().filter(|c| c.get("prompt_token_ids").is_some()).count();
    (ids, prompts)
}

/// vLLM's `return_token_ids`: chat puts the prompt's ids at the top (on the first chunk when
/// streaming) and each choice's sampled ids on it, every one of them (the stop token and held
/// text included), so they count as `completion_tokens`; streamed, the chunks' ids join to the
/// body's. Without the field, neither key appears.
#[test]
fn chat_returns_prompt_and_sampled_token_ids() {
    let mut p = prepared(Endpoint::Chat, vec![vec![0, 3, 8]], &["x"], 1, Some(0));
    p.return_token_ids = true;
    let body: Value = serde_json::from_slice(&push_sampled(&mut builder(&p), 1)).unwrap();
    assert_eq!(body["prompt_token_ids"], json!([0, 3, 8]));
    let choice = &body["choices"][0];
    assert_eq!(choice["token_ids"], json!([5, 6, 7, 2]));
    assert_eq!(choice["message"]["content"], "hello");
    assert_eq!(choice["logprobs"]["content"].as_array().unwrap().len(), 3, "the stop token is not listed");
    assert_eq!(body["usage"]["completion_tokens"], 4);

    p.stream = true;
    let chunks = frames(&push_sampled(&mut builder(&p), 1));
    assert_eq!(chunks[0]["prompt_token_ids"], json!([0, 3, 8]));
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(chunks[0]["choices"][0].get("token_ids").is_none(), "the role chunk comes before any token");
    assert_eq!(streamed_ids(&chunks, 0), (vec![5, 6, 7, 2], 1));
    // the held-back id goes out with the text it made
    assert_eq!(chunks[2]["choices"][0]["token_ids"], json!([6, 7]));
    assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "stop");

    for stream in [false, true] {
        let mut p = prepared(Endpoint::Chat, vec![vec![0, 3, 8]], &["x"], 1, None);
        p.stream = stream;
        let out = String::from_utf8(push_sampled(&mut builder(&p), 1)).unwrap();
        assert!(!out.contains("token_ids"), "{out}");
    }
}

/// Completions give each choice its prompt's ids and its own sampled ids, the generated ones
/// alone also with `echo` (as vLLM's: `prompt_token_ids` holds the rest).
#[test]
fn completion_returns_token_ids_per_choice() {
    let mut p = prepared(Endpoint::Completion, vec![vec![0, 9], vec![3]], &["hello", "a"], 2, None);
    p.return_token_ids = true;
    for echo in [false, true] {
        p.echo = echo;
        let body: Value = serde_json::from_slice(&push_sampled(&mut builder(&p), 4)).unwrap();
        assert!(body.get("prompt_token_ids").is_none());
        for (i, choice) in body["choices"].as_array().unwrap().iter().enumerate() {
            let prompt = if i < 2 { json!([0, 9]) } else { json!([3]) };
            assert_eq!(choice["prompt_token_ids"], prompt, "{choice}");
            assert_eq!(choice["token_ids"], json!([5, 6, 7, 2]), "{choice}");
        }
        assert_eq!(body["choices"][0]["text"], if echo { "hellohello" } else { "hello" });
        assert_eq!(body["usage"]["completion_tokens"], 16);
    }

    p.stream = true;
    let chunks = frames(&push_sampled(&mut builder(&p), 4));
    for index in 0..4 {
        let mine: Vec<&Value> = chunks.iter().filter(|c| c["choices"][0]["index"] == index).collect();
        let prompt = if index < 2 { json!([0, 9]) } else { json!([3]) };
        assert_eq!(mine[0]["choices"][0]["prompt_token_ids"], prompt);
        assert!(mine[1..].iter().all(|c| c["choices"][0].get("prompt_token_ids").is_none()));
        assert_eq!(streamed_ids(&chunks, index).0, vec![5, 6, 7, 2]);
    }
}

/// Ids of tokens that are only call markup ride on the call pieces (with their logprobs), and
/// a stream's ids still join to the body's.
#[test]
fn token_ids_of_tool_calls_join_to_the_body() {
    let run = |stream: bool| {
        let mut b = {
            let mut p = prepared(Endpoint::Chat, vec![vec![0, 3]], &["x"], 1, None);
            p.stream = stream;
            p.return_token_ids = true;
            let f = json!({"name": "get", "parameters": {"type": "object"}});
            p.tools = Some(ToolParsing::new(ToolCallFormat::Hermes, true, &[&f]));
            builder(&p)
        };
        let mut out = Vec::new();
        for (i, piece) in TWO_CALLS.iter().enumerate() {
            let finish = (i + 1 == TWO_CALLS.len()).then_some(FinishReason::Stop);
            b.push(0, &ChoiceDelta { text: piece, tokens: &[], ids: &[100 + i as u32], finish, stop_reason: None });
            out.extend(b.take());
        }
        out.extend(b.finish());
        out
    };
    let body: Value = serde_json::from_slice(&run(false)).unwrap();
    assert_eq!(body["choices"][0]["token_ids"], json!([100, 101, 102, 103, 104, 105]));
    assert_eq!(body["choices"][0]["message"]["tool_calls"].as_array().unwrap().len(), 2);
    let chunks = frames(&run(true));
    assert_eq!(streamed_ids(&chunks, 0), (vec![100, 101, 102, 103, 104, 105], 1));
    // the second push is only argument text: its id is on its call piece
    let piece = chunks.iter().find(|c| c["choices"][0]["token_ids"] == json!([101])).expect("a chunk with id 101");
    assert!(piece["choices"][0]["delta"]["tool_calls"].is_array(), "{piece}");
}

/// vLLM's `return_tokens_as_token_ids`: every token logprobs name (sampled, alternatives,
/// echoed prompt) is `token_id:<id>`, chat's `bytes` those of the name, as vLLM's.
#[test]
fn logprobs_name_tokens_by_id_on_request() {
    let top = vec![(6, -0.2), (5, -0.5)];
    let toks = [TokenOut { id: 5, logprob: -0.5, top: top.clone(), text_offset: 0 }];
    let mut p = prepared(Endpoint::Chat, vec![vec![0, 3]], &["x"], 1, Some(2));
    p.tokens_as_ids = true;
    let mut b = builder(&p);
    b.push(
        0,
        &ChoiceDelta { text: "he", tokens: &toks, ids: &[5], finish: Some(FinishReason::Length), stop_reason: None },
    );
    let body: Value = serde_json::from_slice(&b.finish()).unwrap();
    let lp = &body["choices"][0]["logprobs"]["content"][0];
    assert_eq!(lp["token"], "token_id:5");
    assert_eq!(lp["bytes"], json!(b"token_id:5".to_vec()));
    assert_eq!(lp["top_logprobs"][0]["token"], "token_id:6");
    assert_eq!(body["choices"][0]["message"]["content"], "he", "the text is the text");

    let mut p = prepared(Endpoint::Completion, vec![vec![0, 9]], &["hello"], 1, Some(2));
    p.tokens_as_ids = true;
    p.echo = true;
    let mut b = builder(&p);
    b.push_prompt_logprobs(0, &[TokenOut { id: 9, logprob: -1.0, top: vec![(9, -1.0)], text_offset: 0 }], &[]);
    b.push(
        0,
        &ChoiceDelta { text: "he", tokens: &toks, ids: &[5], finish: Some(FinishReason::Length), stop_reason: None },
    );
    let body: Value = serde_json::from_slice(&b.finish()).unwrap();
    let lp = &body["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"], json!(["token_id:0", "token_id:9", "token_id:5"]));
    assert_eq!(lp["top_logprobs"][2], json!({"token_id:6": -0.2, "token_id:5": -0.5}));
}

/// vLLM's `prompt_logprobs`: null for the first prompt token, then per token a map of id ->
/// `{logprob, rank, decoded_token}`, the token first with the rank the runner computed, then
/// its k alternatives ranked 1..k (the token once). Chat puts the list at the top of the body;
/// completions on each choice. With `echo` and `logprobs` too, each takes its own k.
#[test]
fn prompt_logprobs_list_each_prompt_token_as_vllm() {
    let entries = [
        TokenOut { id: 3, logprob: -0.7, top: vec![(5, -0.1), (3, -0.7), (8, -3.0)], text_offset: 0 },
        TokenOut { id: 8, logprob: -0.2, top: vec![(8, -0.2), (5, -1.0), (3, -4.0)], text_offset: 0 },
    ];
    let mut p = prepared(Endpoint::Chat, vec![vec![0, 3, 8]], &["x"], 1, None);
    p.prompt_logprobs_k = Some(1);
    p.tokens_as_ids = true; // (the key is the id; `decoded_token` stays text, as vLLM's)
    let mut b = builder(&p);
    b.push_prompt_logprobs(0, &entries, &[2, 1]);
    b.push(0, &delta("he", &[tok(5)], Some(FinishReason::Length)));
    let body: Value = serde_json::from_slice(&b.finish()).unwrap();
    assert_eq!(
        body["prompt_logprobs"],
        json!([
            null,
            {"3": {"logprob": -0.7, "rank": 2, "decoded_token": "user"},
             "5": {"logprob": -0.1, "rank": 1, "decoded_token": "system"}},
            {"8": {"logprob": -0.2, "rank": 1, "decoded_token": ":"}},
        ])
    );
    let text = serde_json::to_string(&body["prompt_logprobs"][1]).unwrap();
    assert!(text.find("\"3\"").unwrap() < text.find("\"5\"").unwrap(), "the prompt token comes first: {text}");
    assert!(body["choices"][0].get("prompt_logprobs").is_none());

    // completions, 2 choices, echo with logprobs 1 beside prompt_logprobs 2
    let mut p = prepared(Endpoint::Completion, vec![vec![0, 3, 8]], &["x"], 2, Some(1));
    p.prompt_logprobs_k = Some(2);
    p.echo = true;
    assert_eq!(p.prompt_logprobs(), Some(2), "the scheduler computes the larger k");
    let mut b = builder(&p);
    b.push_prompt_logprobs(0, &entries, &[]);
    for c in 0..2 {
        b.push(c, &delta("he", &[tok(5)], Some(FinishReason::Length)));
    }
    let body: Value = serde_json::from_slice(&b.finish()).unwrap();
    assert!(body.get("prompt_logprobs").is_none());
    for choice in body["choices"].as_array().unwrap() {
        let entries = &choice["prompt_logprobs"];
        assert_eq!(entries[0], Value::Null);
        assert_eq!(entries[1]["3"], json!({"logprob": -0.7, "rank": null, "decoded_token": "user"}));
        assert_eq!(entries[1].as_object().unwrap().len(), 2, "k 2 holds the token itself: {entries}");
        assert_eq!(entries[2].as_object().unwrap().len(), 2);
        // the echoed logprobs keep their k of 1 (+ the token itself)
        assert_eq!(choice["logprobs"]["top_logprobs"][1], json!({"system": -0.1, "user": -0.7}));
        assert_eq!(choice["logprobs"]["top_logprobs"][2], json!({":": -0.2}));
    }
    // echo with logprobs alone: no prompt_logprobs key
    let p = prepared(Endpoint::Completion, vec![vec![0, 3, 8]], &["x"], 1, Some(1));
    let mut b = builder(&p);
    b.push_prompt_logprobs(0, &entries, &[]);
    b.push(0, &delta("he", &[tok(5)], Some(FinishReason::Length)));
    assert!(!String::from_utf8(b.finish()).unwrap().contains("prompt_logprobs"));
}
