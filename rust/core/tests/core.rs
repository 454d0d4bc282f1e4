//! `Core` without Python: requests prepared by the router fixture's tiny router, stepped by
//! hand (a "model" that samples fixed tokens), their wire bytes read back.

#[path = "../../router/tests/protocol_fixture/mod.rs"]
mod protocol_fixture;

use std::sync::Arc;

use llmserve_core::{Core, Output};
use protocol_fixture::{chat, completion, router, WORDS};
use serde_json::{json, Value};

const CONFIG: &str = r#"{"num_blocks": 16, "block_size": 4, "max_num_seqs": 8, "max_num_batched_tokens": 64,
                         "max_model_len": 32}"#;

fn core() -> Core {
    Core::new(Arc::new(router()), CONFIG).expect("core config")
}

/// Runs `core` to the end, sampling `word`'s id on every row; every output, in order.
fn run(core: &mut Core, word: &str) -> Vec<Output> {
    let id = WORDS.iter().position(|w| *w == word).unwrap() as u32;
    let mut out = Vec::new();
    while let Some((plan, _masks)) = core.schedule() {
        let rows = plan.num_rows;
        out.extend(
            core.commit(&vec![id; rows], &vec![-0.5; rows], &vec![-1; rows], &vec![0.0; rows], 1, None, None).unwrap(),
        );
    }
    out
}

fn body(outputs: &[Output], handle: u64) -> Value {
    let bytes: Vec<u8> = outputs.iter().filter(|o| o.0 == handle).flat_map(|o| o.1.clone()).collect();
    serde_json::from_slice(&bytes).expect("a JSON body")
}

#[test]
fn a_completion_runs_to_its_max_tokens_and_frees_its_blocks() {
    let mut core = core();
    let handle = core.add(completion(core.router(), json!({"max_tokens": 3, "ignore_eos": true})).unwrap()).unwrap();
    let out = run(&mut core, "z");
    let last = out.last().unwrap();
    assert_eq!((last.0, last.2, last.3, &last.5), (handle, Some("length"), false, &vec![("length", 3)]));
    let body = body(&out, handle);
    assert_eq!(body["choices"][0]["text"], " z z z");
    assert_eq!((&body["usage"]["prompt_tokens"], &body["usage"]["completion_tokens"]), (&json!(3), &json!(3)));
    assert_eq!((core.num_requests(), core.scheduler().stats().used_blocks), (0, 0));
}

#[test]
fn a_streamed_chat_ends_at_eos_with_done() {
    let mut core = core();
    let handle = core.add(chat(core.router(), json!({"stream": true, "max_tokens": 5})).unwrap()).unwrap();
    let out = run(&mut core, "</s>");
    let text: String = out.iter().filter(|o| o.0 == handle).map(|o| String::from_utf8(o.1.clone()).unwrap()).collect();
    assert!(text.starts_with("data: {") && text.ends_with("data: [DONE]\n\n"), "{text}");
    assert!(text.contains(r#""finish_reason":"stop""#) && !text.contains("</s>"), "{text}");
    assert_eq!(out.last().unwrap().2, Some("stop"));
}

#[test]
fn an_aborted_request_gives_back_its_blocks_and_no_output() {
    let mut core = core();
    let handle = core.add(completion(core.router(), json!({"max_tokens": 8})).unwrap()).unwrap();
    let (plan, _) = core.schedule().unwrap();
    assert!(core.scheduler().stats().used_blocks > 0);
    assert!(core.abort(handle) && !core.abort(handle));
    assert_eq!((core.num_requests(), core.scheduler().stats().used_blocks), (0, 0));
    let out = core.commit(&vec![9; plan.num_rows], &vec![0.0; plan.num_rows], &[], &[], 0, None, None).unwrap();
    assert!(out.is_empty(), "{out:?}");
    assert!(core.schedule().is_none());
    // (no plan awaits: tokens are refused, none is an empty commit)
    assert!(core.commit(&[9], &[0.0], &[], &[], 0, None, None).unwrap_err().contains("has 0 rows"));
    assert!(core.commit(&[], &[], &[], &[], 0, None, None).unwrap().is_empty());
}

#[test]
fn a_commit_whose_sizes_do_not_match_is_refused_and_applies_nothing() {
    let mut core = core();
    let handle = core.add(completion(core.router(), json!({"max_tokens": 1})).unwrap()).unwrap();
    let (plan, _) = core.schedule().unwrap();
    let rows = plan.num_rows;
    let err = core.commit(&vec![9; rows], &vec![0.0; rows + 1], &[], &[], 0, None, None).unwrap_err();
    assert!(err.contains("logprobs"), "{err}");
    let err = core.commit(&vec![9; rows], &vec![0.0; rows], &[], &[], 0, None, Some((&[0.5; 4], 2))).unwrap_err();
    assert!(err.contains("listed 0 pooling entries"), "{err}");
    // (a token short, or one too many: refused before the scheduler, which would panic)
    for n in [rows - 1, rows + 1] {
        let err = core.commit(&vec![9; n], &vec![0.0; n], &[], &[], 0, None, None).unwrap_err();
        assert!(err.contains(&format!("has {rows} rows; got {n} tokens")), "{err}");
    }
    // (the plan still awaits its commit)
    let out = core.commit(&vec![9; rows], &vec![0.0; rows], &[], &[], 0, None, None).unwrap();
    assert_eq!(out.last().map(|o| (o.0, o.2)), Some((handle, Some("length"))));
}

#[test]
fn a_config_that_cannot_hold_one_sequence_is_refused() {
    let small = CONFIG.replace(r#""num_blocks": 16"#, r#""num_blocks": 4"#);
    let err = Core::new(Arc::new(router()), &small).err().expect("refused");
    assert!(err.contains("cannot hold one sequence of max_model_len 32"), "{err}");
    let bad = CONFIG.replace("}", r#", "policy": "lifo"}"#);
    assert!(Core::new(Arc::new(router()), &bad).err().unwrap().contains("lifo"));
}
