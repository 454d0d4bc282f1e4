//! vLLM's `/score` and `/rerank` on an embedding model: every distinct text is one prompt that
//! samples nothing, the pairs to score follow the request's shape, and the answer holds the
//! cosine similarities of the pooled vectors.

mod protocol_fixture;

use llmserve_router::error::ApiError;
use llmserve_router::protocol::embeddings::MAX_INPUTS;
use llmserve_router::protocol::score::Scoring;
use llmserve_router::protocol::{Endpoint, Prepared};
use llmserve_router::response::{ChoiceDelta, FinishReason, ResponseBuilder};
use llmserve_router::router::Router;
use protocol_fixture::*;
use serde_json::{json, Value};

fn r() -> Router {
    router_with(json!({"embeddings": {"pooling": "mean", "normalize": true, "hidden_size": 4}}), Some(TEMPLATE))
}

fn prepare(r: &Router, endpoint: Endpoint, body: Value) -> Result<Prepared, ApiError> {
    let mut b = json!({"model": "tiny"});
    merge(&mut b, body);
    r.prepare(endpoint, &serde_json::to_vec(&b).unwrap())
}

fn scoring(p: &Prepared) -> Scoring {
    p.embedding.as_ref().unwrap().scoring.as_deref().unwrap().clone()
}

#[test]
fn score_pairs_one_text_with_each_or_two_lists_pair_by_pair() {
    let r = r();
    let tok = r.tokenizer().clone();
    let p = prepare(&r, Endpoint::Score, json!({"text_1": "hello", "text_2": ["a b", "foo", "bar"]})).unwrap();
    assert_eq!(p.endpoint, Endpoint::Score);
    assert!(p.id.starts_with("score-"));
    // the one `text_1` runs once
    assert_eq!(p.prompts.len(), 4);
    assert_eq!(p.prompts[0], tok.encode("hello", true));
    assert_eq!((p.params.n, p.params.max_tokens), (1, Some(0)));
    assert_eq!(scoring(&p), Scoring::Pairs(vec![(0, 1), (0, 2), (0, 3)]));
    let p = prepare(&r, Endpoint::Score, json!({"text_1": ["a", "b"], "text_2": ["c", "d"]})).unwrap();
    assert_eq!(scoring(&p), Scoring::Pairs(vec![(0, 2), (1, 3)]));
    let p =
        prepare(&r, Endpoint::Score, json!({"text_1": "a", "text_2": "b", "request_id": "x", "priority": 2})).unwrap();
    assert_eq!((p.id.as_str(), p.priority, scoring(&p)), ("score-x", 2, Scoring::Pairs(vec![(0, 1)])));
    // newer vLLM's names for the pair mean the same
    let want = prepare(&r, Endpoint::Score, json!({"text_1": "hello", "text_2": ["a b", "foo"]})).unwrap();
    for body in [
        json!({"queries": "hello", "documents": ["a b", "foo"]}),
        json!({"queries": "hello", "items": ["a b", "foo"]}),
        json!({"data_1": "hello", "data_2": ["a b", "foo"]}),
    ] {
        let p = prepare(&r, Endpoint::Score, body.clone()).unwrap();
        assert_eq!((&p.prompts, scoring(&p)), (&want.prompts, scoring(&want)), "{body}");
        assert!(p.ignored.is_empty(), "{body}: {:?}", p.ignored);
    }
}

#[test]
fn rerank_puts_the_query_first_and_keeps_what_to_return() {
    let r = r();
    let p = prepare(
        &r,
        Endpoint::Rerank,
        json!({"query": "q", "documents": ["a", {"text": "b"}, "c"], "top_n": 2, "truncate_prompt_tokens": 1}),
    )
    .unwrap();
    assert!(p.id.starts_with("rerank-"));
    assert_eq!(p.prompts.len(), 4);
    assert!(p.prompts.iter().all(|ids| ids.len() == 1), "truncated to one token each");
    assert_eq!(scoring(&p), Scoring::Rerank { top_n: 2, documents: Some(vec!["a".into(), "b".into(), "c".into()]) });
    let p =
        prepare(&r, Endpoint::Rerank, json!({"query": "q", "documents": ["a"], "return_documents": false})).unwrap();
    assert_eq!(scoring(&p), Scoring::Rerank { top_n: 0, documents: None });
    // a cross-encoder's switch changes nothing in a cosine: reported
    let p = prepare(&r, Endpoint::Rerank, json!({"query": "q", "documents": ["a"], "use_activation": true})).unwrap();
    assert_eq!(p.ignored, vec!["use_activation".to_string()]);
    // a Cohere document's other keys are neither ranked nor echoed: reported
    let docs = json!({"query": "q", "documents": ["a", {"text": "b", "title": "T", "id": null}]});
    assert_eq!(prepare(&r, Endpoint::Rerank, docs).unwrap().ignored, vec!["documents[1].title".to_string()]);
}

#[test]
fn bad_fields_are_refused_with_their_path() {
    let r = r();
    let many: Vec<Value> = (0..=MAX_INPUTS).map(|_| json!("a")).collect();
    let cases = [
        (Endpoint::Score, json!({"text_1": "a"}), "text_2", "missing_required_parameter"),
        // (newer vLLM's names for the pair: errors name the fields as sent; one pair only)
        (Endpoint::Score, json!({"queries": "a"}), "documents", "missing_required_parameter"),
        (Endpoint::Score, json!({"data_1": "a", "text_2": "b"}), "data_2", "missing_required_parameter"),
        (Endpoint::Score, json!({"queries": "a", "items": [""]}), "items[0]", "invalid_value"),
        (Endpoint::Score, json!({"queries": ["a", "b"], "documents": ["c", "d", "e"]}), "documents", "invalid_value"),
        (Endpoint::Score, json!({"queries": "a", "documents": ["b"], "items": ["c"]}), "items", "invalid_value"),
        (Endpoint::Score, json!({"text_1": "a", "text_2": "b", "queries": "c"}), "queries", "invalid_value"),
        (Endpoint::Score, json!({"text_1": "", "text_2": "b"}), "text_1", "invalid_value"),
        (Endpoint::Score, json!({"text_1": "a", "text_2": []}), "text_2", "invalid_value"),
        (Endpoint::Score, json!({"text_1": "a", "text_2": ["b", 5]}), "text_2[1]", "invalid_type"),
        (Endpoint::Score, json!({"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}), "text_2", "invalid_value"),
        (Endpoint::Score, json!({"text_1": 5, "text_2": "b"}), "text_1", "invalid_type"),
        (Endpoint::Score, json!({"text_1": "a", "text_2": many.clone()}), "text_2", "invalid_value"),
        (
            Endpoint::Score,
            json!({"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 0}),
            "truncate_prompt_tokens",
            "invalid_value",
        ),
        (Endpoint::Rerank, json!({"documents": ["a"]}), "query", "missing_required_parameter"),
        (Endpoint::Rerank, json!({"query": "", "documents": ["a"]}), "query", "invalid_value"),
        (Endpoint::Rerank, json!({"query": ["q"], "documents": ["a"]}), "query", "invalid_type"),
        (Endpoint::Rerank, json!({"query": "q", "documents": []}), "documents", "invalid_value"),
        (Endpoint::Rerank, json!({"query": "q", "documents": "a"}), "documents", "invalid_type"),
        (Endpoint::Rerank, json!({"query": "q", "documents": ["a", ""]}), "documents[1]", "invalid_value"),
        (Endpoint::Rerank, json!({"query": "q", "documents": [{"txt": "a"}]}), "documents[0].text", "invalid_type"),
        (Endpoint::Rerank, json!({"query": "q", "documents": ["a"], "top_n": -1}), "top_n", "invalid_value"),
        (
            Endpoint::Rerank,
            json!({"query": "q", "documents": ["a"], "return_documents": "no"}),
            "return_documents",
            "invalid_type",
        ),
        (Endpoint::Rerank, json!({"query": "q", "documents": many}), "documents", "invalid_value"),
    ];
    for (endpoint, body, param, code) in cases {
        let e = prepare(&r, endpoint, body.clone()).expect_err("the request is refused");
        assert_eq!((e.status(), e.param(), e.code()), (400, Some(param), code), "{body}");
    }
    let e = prepare(&r, Endpoint::Rerank, json!({"model": "other", "query": "q", "documents": ["a"]})).unwrap_err();
    assert_eq!((e.status(), e.code()), (404, "model_not_found"));
    // a server that does not embed does not score either
    let e = router().prepare(Endpoint::Score, br#"{"model": "tiny", "text_1": "a", "text_2": "b"}"#).unwrap_err();
    assert_eq!((e.status(), e.param()), (400, Some("model")));
}

#[test]
fn a_text_over_the_context_is_refused_unless_truncated() {
    let r = r();
    let long = "a ".repeat(MAX_LEN as usize + 5);
    let e = prepare(&r, Endpoint::Rerank, json!({"query": "q", "documents": ["b", long]})).unwrap_err();
    assert_eq!((e.code(), e.param()), ("context_length_exceeded", Some("documents[1]")));
    let p =
        prepare(&r, Endpoint::Rerank, json!({"query": "q", "documents": ["b", long], "truncate_prompt_tokens": -1}));
    assert_eq!(p.unwrap().prompts[2].len(), MAX_LEN as usize);
}

#[test]
fn the_rerank_body_ranks_the_documents_by_cosine() {
    let r = r();
    let p = prepare(&r, Endpoint::Rerank, json!({"query": "q", "documents": ["a", "b", "c"], "top_n": 2})).unwrap();
    let mut b = ResponseBuilder::new(&p, r.tokenizer().clone());
    let rows: [[f32; 4]; 4] = [[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0], [-1.0, 0.0, 0.0, 0.0]];
    for (input, row) in rows.iter().enumerate() {
        b.add_pooled(input as u32, row);
        let delta =
            ChoiceDelta { text: "", tokens: &[], ids: &[], finish: Some(FinishReason::Stop), stop_reason: None };
        b.push(input as u32, &delta);
    }
    assert!(b.all_finished());
    let body: Value = serde_json::from_slice(&b.finish()).unwrap();
    let tokens: u64 = p.prompts.iter().map(|ids| ids.len() as u64).sum();
    assert_eq!(body["id"], json!(p.id));
    assert_eq!(body["usage"], json!({"prompt_tokens": tokens, "total_tokens": tokens}));
    let results = body["results"].as_array().unwrap();
    assert_eq!(results.len(), 2);
    assert_eq!((results[0]["index"].as_u64(), &results[0]["document"]), (Some(1), &json!({"text": "b"})));
    assert!((results[0]["relevance_score"].as_f64().unwrap() - 0.5f64.sqrt()).abs() < 1e-9);
    assert_eq!((results[1]["index"].as_u64(), results[1]["relevance_score"].as_f64()), (Some(0), Some(0.0)));
}
