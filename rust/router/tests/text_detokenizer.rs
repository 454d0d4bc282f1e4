//! Incremental detokenization and stop strings over a real byte-level vocabulary slice.

use llmserve_router::detokenizer::{ends_inside_a_char, Detokenizer, StopConfig};
use llmserve_router::tokenizer::{GgufVocab, Tokenizer};
use proptest::prelude::*;
use std::sync::{Arc, OnceLock};

fn tiny() -> Arc<Tokenizer> {
    static T: OnceLock<Arc<Tokenizer>> = OnceLock::new();
    T.get_or_init(|| {
        let vocab: GgufVocab = serde_json::from_str(include_str!("data/tiny_gguf_vocab.json")).unwrap();
        Arc::new(Tokenizer::from_gguf(&vocab).unwrap())
    })
    .clone()
}

fn config(stop: &[&str], include: bool, skip: bool) -> StopConfig {
    StopConfig {
        stop: stop.iter().map(|s| s.to_string()).collect(),
        include_stop_str_in_output: include,
        skip_special_tokens: skip,
        min_tokens: 0,
    }
}

/// Push every id; returns each step's text, the stop that matched (if any) and the flush.
fn run(t: &Arc<Tokenizer>, ids: &[u32], cfg: StopConfig) -> (Vec<String>, Option<String>, String) {
    let mut d = Detokenizer::new(t.clone(), &[], cfg);
    let mut steps = Vec::new();
    for &id in ids {
        let step = d.push(id);
        steps.push(step.text);
        if step.stop.is_some() {
            return (steps, step.stop, d.flush().text);
        }
    }
    let rest = d.flush().text;
    (steps, None, rest)
}

#[test]
fn stop_string_spanning_three_tokens_is_never_emitted() {
    let t = tiny();
    // "xyz" is three single-byte tokens, so the stop crosses two token boundaries.
    let mut ids = t.encode("Hello there ", false);
    let stop_ids: Vec<u32> = ["x", "y", "z"].iter().flat_map(|p| t.encode(p, false)).collect();
    assert_eq!(stop_ids.len(), 3);
    ids.extend(&stop_ids);
    ids.extend(t.encode(" and more text", false));
    let (steps, stop, rest) = run(&t, &ids, config(&["xyz"], false, true));
    assert_eq!(stop.as_deref(), Some("xyz"));
    for s in &steps {
        assert!(!s.contains(['x', 'y', 'z']), "step {s:?} leaks part of the stop");
    }
    assert_eq!(steps.concat(), "Hello there ");
    assert_eq!(rest, "");
}

#[test]
fn include_stop_str_in_output_sends_text_through_the_stop() {
    let t = tiny();
    let ids = t.encode("answer: 42. Done", false);
    let (steps, stop, _) = run(&t, &ids, config(&[". D"], true, true));
    assert_eq!(stop.as_deref(), Some(". D"));
    assert_eq!(steps.concat(), "answer: 42. D");
}

#[test]
fn earliest_stop_wins() {
    let t = tiny();
    let ids = t.encode("one two three", false);
    let (steps, stop, _) = run(&t, &ids, config(&["three", "two"], false, true));
    assert_eq!(stop.as_deref(), Some("two"));
    assert_eq!(steps.concat(), "one ");
}

#[test]
fn emoji_split_across_tokens_arrives_whole() {
    let t = tiny();
    let ids = t.encode("a😀b", false);
    assert!(ids.len() >= 4, "emoji should span several byte tokens: {ids:?}");
    let (steps, _, rest) = run(&t, &ids, StopConfig::default());
    for s in &steps {
        assert!(!s.contains('\u{FFFD}'), "broken UTF-8 sent: {steps:?}");
    }
    assert!(steps.contains(&"😀".to_string()) || steps.iter().any(|s| s.contains('😀')));
    assert_eq!(steps.concat() + &rest, "a😀b");
}

#[test]
fn skip_special_tokens_controls_their_text() {
    let t = tiny();
    let ids: Vec<u32> = [t.encode("hi", false), vec![2], t.encode(" there", false)].concat();
    let (steps, _, rest) = run(&t, &ids, config(&[], false, true));
    assert_eq!(steps.concat() + &rest, "hi there");
    let (steps, _, rest) = run(&t, &ids, config(&[], false, false));
    assert_eq!(steps.concat() + &rest, "hi<|im_end|> there");
}

#[test]
fn stop_on_special_token_text_when_not_skipped() {
    let t = tiny();
    let ids: Vec<u32> = [t.encode("hi", false), vec![2], t.encode(" there", false)].concat();
    let (steps, stop, _) = run(&t, &ids, config(&["<|im_end|>"], false, false));
    assert_eq!(stop.as_deref(), Some("<|im_end|>"));
    assert_eq!(steps.concat(), "hi");
}

#[test]
fn emitted_len_counts_chars() {
    let t = tiny();
    let mut d = Detokenizer::new(t.clone(), &t.encode("prompt", false), StopConfig::default());
    for id in t.encode("é😀x", false) {
        d.push(id);
    }
    d.flush();
    assert_eq!(d.emitted_len(), 3);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Without stops, what is streamed equals decoding everything at once, even for id runs
    /// that are not valid UTF-8, but for a character the output ends inside of (its U+FFFD).
    #[test]
    fn streamed_text_equals_full_decode(ids in proptest::collection::vec(0u32..2000, 0..40), skip in any::<bool>()) {
        let t = tiny();
        let (steps, stop, rest) = run(&t, &ids, config(&[], false, skip));
        prop_assert!(stop.is_none());
        let mut full = t.decode(&ids, skip);
        let bytes: Vec<u8> = ids.iter().flat_map(|&id| t.token_bytes(id)).collect();
        if full.ends_with('\u{FFFD}') && ends_inside_a_char(&bytes) {
            full.pop();
        }
        prop_assert_eq!(steps.concat() + &rest, full);
    }

    /// With stops, the streamed text is exactly the full text up to the first stop.
    #[test]
    fn streamed_text_stops_at_the_first_stop(words in proptest::collection::vec("[a-c ]{1,4}", 0..12)) {
        let t = tiny();
        let text = words.concat();
        let ids = t.encode(&text, false);
        let stop_list = ["ab c", "ca"];
        let (steps, stop, rest) = run(&t, &ids, config(&stop_list, false, true));
        let first = stop_list.iter().filter_map(|s| text.find(s).map(|at| (at, *s))).min_by_key(|(at, s)| (*at, usize::MAX - s.len()));
        match first {
            Some((at, s)) => {
                prop_assert_eq!(stop.as_deref(), Some(s));
                prop_assert_eq!(steps.concat(), &text[..at]);
            }
            None => prop_assert_eq!(steps.concat() + &rest, text),
        }
    }
}
