//! Tokenizer behaviour on a real byte-level vocabulary slice (the first 2,000 SmolLM2 tokens
//! and the merges inside them; tests/data/tiny_gguf_vocab.json, written by
//! tests/parity/gen_text_fixtures.py --tiny-vocab).

use llmserve_router::tokenizer::{GgufVocab, Tokenizer};
use proptest::prelude::*;
use std::sync::OnceLock;

fn tiny() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| {
        let vocab: GgufVocab = serde_json::from_str(include_str!("data/tiny_gguf_vocab.json")).unwrap();
        Tokenizer::from_gguf(&vocab).unwrap()
    })
}

#[test]
fn loads_and_knows_its_specials() {
    let t = tiny();
    assert_eq!(t.vocab_size(), 2000);
    assert_eq!(t.token_to_id("<|im_start|>"), Some(1));
    assert!(t.is_special(2) && !t.is_special(100));
    assert_eq!(t.id_to_token(2).as_deref(), Some("<|im_end|>"));
}

#[test]
fn chat_markup_stays_whole() {
    let t = tiny();
    let ids = t.encode("<|im_start|>user\nhi<|im_end|>\n", false);
    assert_eq!(ids.first(), Some(&1));
    assert!(ids.contains(&2));
    assert_eq!(t.decode(&ids, false), "<|im_start|>user\nhi<|im_end|>\n");
    assert_eq!(t.decode(&ids, true), "user\nhi\n");
}

#[test]
fn digits_are_isolated_as_smollm_does() {
    let t = tiny();
    let ids = t.encode("a  2024", false);
    let pieces: Vec<String> = ids.iter().map(|&i| t.id_to_token(i).unwrap()).collect();
    // "  " stays one whitespace run (not " " + " 2"); each digit is its own token.
    assert_eq!(pieces.iter().filter(|p| p.chars().all(|c| c.is_ascii_digit())).count(), 4);
    assert_eq!(t.decode(&ids, false), "a  2024");
}

#[test]
fn token_bytes_concatenate_to_the_text() {
    let t = tiny();
    let text = "Zürich 😀 — ok";
    let bytes: Vec<u8> = t.encode(text, false).iter().flat_map(|&i| t.token_bytes(i)).collect();
    assert_eq!(bytes, text.as_bytes());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]
    #[test]
    fn byte_level_round_trips_any_text(s in "\\PC{0,40}") {
        let t = tiny();
        let ids = t.encode(&s, false);
        prop_assert_eq!(t.decode(&ids, false), s);
    }
}
