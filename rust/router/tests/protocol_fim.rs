//! Fill-in-the-middle: completions' `suffix` on a vocabulary with a FIM token set is laid out
//! `<PRE> prompt <SUF> suffix <MID>` (after the tokenizer's BOS for a text prompt), stops at
//! the vocabulary's end-of-infill tokens, and is refused where it cannot mean that.

mod protocol_fixture;

use llmserve_router::fim::Fim;
use llmserve_router::router::Router;
use llmserve_router::tokenizer::Tokenizer;
use protocol_fixture::*;
use serde_json::{json, Value};

const PRE: u32 = VOCAB as u32;
const SUF: u32 = PRE + 1;
const MID: u32 = PRE + 2;
const PAD: u32 = PRE + 3;

/// The fixture's tokenizer with StarCoder's FIM tokens added as specials (ids 20..24).
fn fim_tokenizer() -> Tokenizer {
    let mut doc: Value = serde_json::from_str(&tokenizer_json()).unwrap();
    for (i, t) in ["<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<fim_pad>"].iter().enumerate() {
        let id = VOCAB + i;
        doc["model"]["vocab"][t] = json!(id);
        doc["added_tokens"].as_array_mut().unwrap().push(json!({"id": id, "content": t, "single_word": false,
            "lstrip": false, "rstrip": false, "normalized": false, "special": true}));
    }
    Tokenizer::from_json_str(&doc.to_string()).unwrap()
}

fn fim_router(extra: Value) -> Router {
    Router::new(fim_tokenizer(), templates(Some(TEMPLATE)), config(extra))
}

#[test]
fn the_fim_set_is_found_by_its_tokens() {
    assert_eq!(Fim::detect(&tokenizer()), None);
    let fim = Fim::detect(&fim_tokenizer()).unwrap();
    assert_eq!((fim.prefix, fim.suffix, fim.middle, fim.ends), (PRE, SUF, MID, vec![PAD]));
    assert!(fim_router(json!({})).fim().is_some());
    assert!(fim_router(json!({"fim": false})).fim().is_none());
}

#[test]
fn a_suffix_lays_the_prompt_out_for_the_middle() {
    let r = fim_router(json!({}));
    // a text after the tokenizer's BOS; its text is the prompt as sent
    let p = completion(&r, json!({"suffix": "a b"})).unwrap();
    assert_eq!(p.prompts, [vec![0, PRE, 9, 10, SUF, 13, 14, MID]]);
    assert_eq!(p.prompt_texts, ["hello world"]);
    assert!(p.params.stop_token_ids.contains(&PAD));
    // token ids as sent, each prompt of a list, no BOS without special tokens; an empty suffix
    let p = completion(&r, json!({"prompt": [[9], [10, 11]], "suffix": "c"})).unwrap();
    assert_eq!(p.prompts, [vec![PRE, 9, SUF, 15, MID], vec![PRE, 10, 11, SUF, 15, MID]]);
    let p = completion(&r, json!({"suffix": "", "add_special_tokens": false})).unwrap();
    assert_eq!(p.prompts, [vec![PRE, 9, 10, SUF, MID]]);
    // the client's own stop tokens stay; `ignore_eos` ignores the end-of-infill tokens too
    let p = completion(&r, json!({"suffix": "a", "stop_token_ids": [13]})).unwrap();
    assert_eq!(p.params.stop_token_ids, [13, PAD]);
    let p = completion(&r, json!({"suffix": "a", "ignore_eos": true})).unwrap();
    assert!(p.params.stop_token_ids.is_empty());
    // null asks for nothing
    let p = completion(&r, json!({"suffix": null})).unwrap();
    assert_eq!(p.prompts, [vec![0, 9, 10]]);
}

#[test]
fn a_suffix_is_refused_where_it_cannot_mean_fill_in_the_middle() {
    let r = fim_router(json!({}));
    let err = |extra: Value| shape(completion(&r, extra));
    assert_eq!(err(json!({"suffix": 3})), (400, "invalid_type", Some("suffix".into())));
    assert_eq!(err(json!({"suffix": "a", "echo": true})), (400, "invalid_value", Some("echo".into())));
    assert_eq!(
        err(json!({"suffix": "a", "truncate_prompt_tokens": 2})),
        (400, "invalid_value", Some("truncate_prompt_tokens".into()))
    );
    // the suffix counts against the context
    let long = vec!["a"; 24].join(" ");
    assert_eq!(
        err(json!({"suffix": long, "max_tokens": 4})),
        (400, "context_length_exceeded", Some("max_tokens".into()))
    );
    // no FIM tokens, or turned off
    for router in [router(), fim_router(json!({"fim": false}))] {
        let e = completion(&router, json!({"suffix": "a"})).unwrap_err();
        assert_eq!((e.code(), e.param()), ("unsupported_parameter", Some("suffix")));
        assert!(e.message().contains("fill-in-the-middle"), "{}", e.message());
    }
}
