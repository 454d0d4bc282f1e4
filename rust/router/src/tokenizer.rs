//! The server's one tokenizer: HF `tokenizers`, built from a `tokenizer.json` or from the
//! `tokenizer.ggml.*` metadata of a GGUF file.
//!
//! Owns: text <-> ids, the bytes each token stands for (logprobs `bytes`), and which ids are
//! special. A GGUF vocabulary is turned into a `tokenizer.json` document and loaded through
//! the same path as a real one, so both sources share one code path in `tokenizers`.
//!
//! GGUF conversion follows what the model was trained with, as llama.cpp does:
//! - `gpt2`: byte-level BPE from `tokens` + `merges`; the split regex is chosen by `pre`
//!   (see [`pre_tokenizer_for`]). Tokens typed control (3) become special added tokens and
//!   user-defined (4) plain added tokens, so neither is ever cut into pieces.
//! - `llama`: sentencepiece BPE with byte fallback; merges are rebuilt from the scores, and
//!   a space is prepended to the text (`Metaspace`). Gemma's files (`arch` gemma*) differ, as
//!   transformers' GGUF loader reads them: no space is prepended (llama.cpp's
//!   `add_space_prefix` false) and spaces become "▁" in place; merges rank by the tokens'
//!   order in the file, which is the merge order where the scores are not; and the
//!   whitespace-run tokens the file spells with real spaces ("  ") are the "▁▁" pieces they
//!   stand for.
//!
//! NOTE: for `pre = "smollm"` (and the other StarCoder-family names) llama.cpp isolates every
//! digit before the GPT-2 regex, exactly as SmolLM2's own `tokenizer.json` does
//! (`Digits(individual_digits)` + `ByteLevel`). transformers 5.23's GGUF loader does not know
//! "smollm" and falls back to plain GPT-2 splitting, which differs on whitespace before
//! digits ("a  2"). We follow the model; see tests/parity/gen_text_fixtures.py.

use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::{HashMap, HashSet};

/// GGUF `tokenizer.ggml.*` metadata, passed as JSON from Python.
#[derive(Debug, Clone, Deserialize)]
pub struct GgufVocab {
    /// "gpt2" (byte-level BPE) | "llama" (sentencepiece BPE)
    pub model: String,
    /// The file's `general.architecture`: which sentencepiece variant "llama" is.
    #[serde(default)]
    pub arch: Option<String>,
    /// pre-tokenizer name, e.g. "smollm", "llama-bpe", "qwen2"
    pub pre: Option<String>,
    pub tokens: Vec<String>,
    /// "a b"
    #[serde(default)]
    pub merges: Vec<String>,
    /// 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
    #[serde(default)]
    pub token_types: Vec<i32>,
    #[serde(default)]
    pub scores: Vec<f32>,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<u32>,
    pub unk_token_id: Option<u32>,
    pub pad_token_id: Option<u32>,
    #[serde(default)]
    pub add_bos_token: bool,
    #[serde(default)]
    pub add_eos_token: bool,
}

const TOKEN_TYPE_CONTROL: i32 = 3;
const TOKEN_TYPE_USER_DEFINED: i32 = 4;

/// How a vocabulary piece spells its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Spelling {
    /// GPT-2 byte-to-unicode alphabet.
    ByteLevel,
    /// sentencepiece: "▁" for space, "<0xAB>" byte-fallback pieces.
    SentencePiece,
    /// Anything else: ask the decoder.
    Other,
}

/// Send + Sync, shared as `Arc<Tokenizer>`.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    spelling: Spelling,
    /// Added tokens (special or not): their bytes are their text, never respelled.
    added: HashMap<u32, String>,
    special: HashSet<u32>,
    /// GPT-2 alphabet char -> byte, for `token_bytes`.
    unbyte: HashMap<char, u8>,
    /// `inner` reading special tokens' text as text (for `encode_as_text`), made on first use:
    /// as at the text's start, and, for a sentencepiece pre-tokenizer that prepends "▁" only
    /// there, as further in.
    as_text: std::sync::OnceLock<(tokenizers::Tokenizer, Option<tokenizers::Tokenizer>)>,
}

impl Tokenizer {
    pub fn from_file(path: &std::path::Path) -> Result<Self, String> {
        let json = std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        Self::from_json_str(&json)
    }

    pub fn from_json_str(json: &str) -> Result<Self, String> {
        let doc: Value = serde_json::from_str(json).map_err(|e| format!("tokenizer.json is not JSON: {e}"))?;
        let spelling = spelling_of(&doc["decoder"]);
        let inner: tokenizers::Tokenizer = json.parse().map_err(|e| format!("cannot load tokenizer.json: {e}"))?;
        let decoder = inner.get_added_tokens_decoder();
        let added = decoder.iter().map(|(id, t)| (*id, t.content.clone())).collect();
        let special = decoder.iter().filter(|(_, t)| t.special).map(|(id, _)| *id).collect();
        let unbyte = byte_to_char().into_iter().map(|(b, c)| (c, b)).collect();
        Ok(Self { inner, spelling, added, special, unbyte, as_text: std::sync::OnceLock::new() })
    }

    pub fn from_gguf(vocab: &GgufVocab) -> Result<Self, String> {
        let doc = gguf_to_tokenizer_json(vocab)?;
        Self::from_json_str(&doc.to_string())
    }

    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Vec<u32> {
        // Encoding cannot fail for a BPE model with these pre-tokenizers; an error here would
        // be a broken tokenizer file, which loading already rejected.
        match self.inner.encode_fast(text, add_special_tokens) {
            Ok(enc) => enc.get_ids().to_vec(),
            Err(_) => Vec::new(),
        }
    }

    /// `text` as ids, but for the special tokens spelled at `spans` (byte ranges of `text`):
    /// each is read as the text it spells, as if the vocabulary had no such special token. The
    /// text between two other added tokens that holds one is tokenized as one piece, as
    /// `tokenizers` tokenizes the text between added tokens; the rest is `encode`'s.
    /// (A chat message's text that spells `<|im_end|>` must not end the turn: OpenAI reads
    /// message content as text.)
    pub fn encode_with_text_spans(&self, text: &str, spans: &[(usize, usize)], add_special_tokens: bool) -> Vec<u32> {
        if spans.is_empty() {
            return self.encode(text, add_special_tokens);
        }
        let Ok(enc) = self.inner.encode(text, add_special_tokens) else { return Vec::new() };
        let (ids, offsets, sequence) = (enc.get_ids(), enc.get_offsets(), enc.get_sequence_ids());
        // (a token the post-processor added, such as BOS, spells nothing of `text`)
        let in_text = |i: usize| sequence[i].is_some();
        // (the spans in order, each found by a binary search: a message may spell thousands)
        let mut spans = spans.to_vec();
        spans.sort_unstable();
        let spelled = |(start, end): (usize, usize)| {
            let k = spans.partition_point(|&(a, _)| a < start);
            spans.get(k).is_some_and(|&(_, b)| b <= end)
        };
        let as_text = |i: usize| in_text(i) && self.special.contains(&ids[i]) && spelled(offsets[i]);
        let boundary = |i: usize| !in_text(i) || (self.added.contains_key(&ids[i]) && !as_text(i));
        let mut out = Vec::with_capacity(ids.len());
        let mut i = 0;
        while i < ids.len() {
            if boundary(i) {
                out.push(ids[i]);
                i += 1;
                continue;
            }
            let start = i;
            while i < ids.len() && !boundary(i) {
                i += 1;
            }
            if !(start..i).any(as_text) {
                out.extend_from_slice(&ids[start..i]);
                continue;
            }
            let from = (0..start).rev().find(|&j| in_text(j)).map_or(0, |j| offsets[j].1);
            let to = (i..ids.len()).find(|&j| in_text(j)).map_or(text.len(), |j| offsets[j].0);
            out.extend(self.encode_as_text(&text[from..to], from == 0));
        }
        out
    }

    /// `piece` with special tokens read as text, as the piece of a longer text that starts at
    /// that text's start or not (`first`).
    fn encode_as_text(&self, piece: &str, first: bool) -> Vec<u32> {
        let (at_start, further) = self.as_text.get_or_init(|| {
            let mut at_start = self.inner.clone();
            at_start.set_encode_special_tokens(true);
            // (Metaspace's `prepend_scheme: "first"` prepends "▁" to the text's first piece only)
            let further = at_start.get_pre_tokenizer().and_then(|pre| {
                let json = serde_json::to_string(pre).expect("a pre-tokenizer serializes");
                let never = json.replace("\"prepend_scheme\":\"first\"", "\"prepend_scheme\":\"never\"");
                let pre =
                    serde_json::from_str::<tokenizers::PreTokenizerWrapper>(&never).ok().filter(|_| never != json)?;
                let mut further = at_start.clone();
                further.with_pre_tokenizer(Some(pre));
                Some(further)
            });
            (at_start, further)
        });
        let tokenizer = if first { at_start } else { further.as_ref().unwrap_or(at_start) };
        tokenizer.encode_fast(piece, false).map(|e| e.get_ids().to_vec()).unwrap_or_default()
    }

    /// The text of every special token (what `encode_with_text_spans` can read as text),
    /// longest first.
    pub fn special_texts(&self) -> Vec<String> {
        let mut texts: Vec<String> = self.special.iter().filter_map(|id| self.added.get(id).cloned()).collect();
        texts.sort_by(|a, b| b.len().cmp(&a.len()).then_with(|| a.cmp(b)));
        texts.dedup();
        texts
    }

    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> String {
        // Ids outside the vocabulary decode to nothing (tokenizers skips unknown ids).
        self.inner.decode(ids, skip_special_tokens).unwrap_or_default()
    }

    /// Including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The model's own vocabulary, without the tokens added to it (transformers' `vocab_size`).
    pub fn base_vocab_size(&self) -> usize {
        self.inner.get_vocab_size(false)
    }

    /// Every raw piece and its id, the added tokens included.
    pub fn vocab(&self) -> HashMap<String, u32> {
        self.inner.get_vocab(true)
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The raw vocabulary piece ("Ġthe", "▁the", "<|im_end|>").
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The bytes the token stands for (logprobs `bytes`). Empty for an unknown id.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        if let Some(text) = self.added.get(&id) {
            return text.as_bytes().to_vec();
        }
        let Some(piece) = self.inner.id_to_token(id) else { return Vec::new() };
        match self.spelling {
            Spelling::ByteLevel => {
                let bytes: Option<Vec<u8>> = piece.chars().map(|c| self.unbyte.get(&c).copied()).collect();
                // A piece outside the alphabet is a mislabelled added token: its text is its bytes.
                bytes.unwrap_or_else(|| piece.into_bytes())
            }
            Spelling::SentencePiece => match byte_fallback_piece(&piece) {
                Some(b) => vec![b],
                None => piece.replace('\u{2581}', " ").into_bytes(),
            },
            Spelling::Other => self.decode(&[id], false).into_bytes(),
        }
    }

    /// `token_bytes` as text, lossy (logprobs `token`).
    pub fn token_str(&self, id: u32) -> String {
        String::from_utf8_lossy(&self.token_bytes(id)).into_owned()
    }

    pub fn is_special(&self, id: u32) -> bool {
        self.special.contains(&id)
    }
}

/// GPT-2's byte -> printable char table: printable Latin-1 bytes stand for themselves, the
/// rest are moved to U+0100.. in byte order.
fn byte_to_char() -> Vec<(u8, char)> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut next = 256u32;
    (0..=255u8)
        .map(|b| {
            if printable(b) {
                (b, b as char)
            } else {
                let c = char::from_u32(next).expect("U+0100..U+0143 are chars");
                next += 1;
                (b, c)
            }
        })
        .collect()
}

/// "<0xAB>" -> 0xAB
fn byte_fallback_piece(piece: &str) -> Option<u8> {
    let hex = piece.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

/// Which spelling a tokenizer.json decoder implies.
fn spelling_of(decoder: &Value) -> Spelling {
    match decoder["type"].as_str() {
        Some("ByteLevel") => Spelling::ByteLevel,
        Some("ByteFallback") | Some("Metaspace") => Spelling::SentencePiece,
        Some("Sequence") => {
            let parts: Vec<Spelling> =
                decoder["decoders"].as_array().map(|a| a.iter().map(spelling_of).collect()).unwrap_or_default();
            if parts.contains(&Spelling::ByteLevel) {
                Spelling::ByteLevel
            } else if parts.contains(&Spelling::SentencePiece) {
                Spelling::SentencePiece
            } else {
                Spelling::Other
            }
        }
        _ => Spelling::Other,
    }
}

const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_SPLIT: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

fn byte_level(use_regex: bool) -> Value {
    json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex})
}

fn split_then_bytes(regex: &str) -> Value {
    json!({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false},
        byte_level(false),
    ]})
}

/// The pre-tokenizer a byte-level GGUF vocabulary was trained with, by `tokenizer.ggml.pre`
/// (llama.cpp's names). Unknown names get plain GPT-2 splitting, as llama.cpp's default.
fn pre_tokenizer_for(pre: Option<&str>) -> Value {
    match pre.unwrap_or("default") {
        // llama.cpp: "\p{N}" isolated, then the GPT-2 regex.
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva" => {
            json!({"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true},
                byte_level(true),
            ]})
        }
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "pixtral" | "dbrx" | "smaug-bpe" | "lfm2" => {
            split_then_bytes(LLAMA3_SPLIT)
        }
        "qwen2" | "deepseek-r1-qwen" | "megrez" => split_then_bytes(QWEN2_SPLIT),
        // "gpt2", "mpt", "olmo", "jais", "default" and anything unknown: ByteLevel's own
        // regex is the GPT-2 one.
        _ => byte_level(true),
    }
}

fn added_token(id: usize, content: &str, special: bool) -> Value {
    json!({"id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false,
           "normalized": false, "special": special})
}

/// BOS/EOS wrapping as the GGUF flags ask, written as a TemplateProcessing post-processor.
fn post_processor(vocab: &GgufVocab) -> Result<Value, String> {
    let mut single = Vec::new();
    let mut pair = Vec::new();
    let mut specials = serde_json::Map::new();
    let mut piece = |id: Option<u32>, what: &str| -> Result<Value, String> {
        let id = id.ok_or_else(|| format!("GGUF asks to add {what} but has no {what} id"))?;
        let tok = vocab.tokens.get(id as usize).ok_or_else(|| format!("{what} id {id} is outside the vocabulary"))?;
        specials.insert(tok.clone(), json!({"id": tok, "ids": [id], "tokens": [tok]}));
        Ok(json!({"SpecialToken": {"id": tok, "type_id": 0}}))
    };
    let bos = if vocab.add_bos_token { Some(piece(vocab.bos_token_id, "bos")?) } else { None };
    let eos = if vocab.add_eos_token { Some(piece(vocab.eos_token_id, "eos")?) } else { None };
    let wrap = |seq: &mut Vec<Value>, name: &str, type_id: u32| {
        seq.extend(bos.clone());
        seq.push(json!({"Sequence": {"id": name, "type_id": type_id}}));
        seq.extend(eos.clone());
    };
    wrap(&mut single, "A", 0);
    wrap(&mut pair, "A", 0);
    wrap(&mut pair, "B", 1);
    Ok(json!({"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": specials}))
}

/// Build the tokenizer.json document a GGUF vocabulary describes.
fn gguf_to_tokenizer_json(vocab: &GgufVocab) -> Result<Value, String> {
    if vocab.tokens.is_empty() {
        return Err("GGUF vocabulary has no tokens".into());
    }
    let types = |i: usize| vocab.token_types.get(i).copied().unwrap_or(1);
    let (model, pre_tokenizer, decoder, normalizer, alphabet) = match vocab.model.as_str() {
        "gpt2" => {
            let alphabet: HashSet<char> = byte_to_char().into_iter().map(|(_, c)| c).collect();
            let merges: Vec<Value> = vocab.merges.iter().map(|m| merge_pair(m)).collect::<Result<_, _>>()?;
            let model = json!({"type": "BPE", "dropout": null, "unk_token": null,
                "continuing_subword_prefix": "", "end_of_word_suffix": "", "fuse_unk": false,
                "byte_fallback": false, "ignore_merges": false,
                "vocab": byte_level_vocab(&vocab.tokens, &alphabet), "merges": merges});
            let decoder =
                json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true});
            (model, pre_tokenizer_for(vocab.pre.as_deref()), decoder, Value::Null, Some(alphabet))
        }
        "llama" => {
            let gemma = vocab.arch.as_deref().is_some_and(|a| a.starts_with("gemma"));
            let tokens: Vec<String> = if gemma {
                vocab.tokens.iter().map(|t| respelled_spaces(t).unwrap_or_else(|| t.clone())).collect()
            } else {
                vocab.tokens.clone()
            };
            let unk = vocab.unk_token_id.and_then(|i| tokens.get(i as usize)).cloned();
            let mut index = serde_json::Map::new();
            for (i, t) in tokens.iter().enumerate() {
                index.insert(t.clone(), json!(i));
            }
            let rank: Vec<f32> =
                if gemma { (0..tokens.len()).map(|i| -(i as f32)).collect() } else { vocab.scores.clone() };
            let model = json!({"type": "BPE", "dropout": null, "unk_token": unk,
                "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": true,
                "byte_fallback": true, "ignore_merges": false,
                "vocab": index, "merges": sentencepiece_merges(&tokens, &rank)});
            let mut decoders = vec![
                json!({"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "}),
                json!({"type": "ByteFallback"}),
                json!({"type": "Fuse"}),
            ];
            let (pre, normalizer) = if gemma {
                (Value::Null, json!({"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"}))
            } else {
                decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
                let pre = json!({"type": "Metaspace", "replacement": "\u{2581}", "prepend_scheme": "first",
                                 "split": false});
                (pre, Value::Null)
            };
            (model, pre, json!({"type": "Sequence", "decoders": decoders}), normalizer, None)
        }
        other => return Err(format!("unsupported GGUF tokenizer model {other:?} (supported: gpt2, llama)")),
    };
    let mut added = Vec::new();
    for (i, tok) in vocab.tokens.iter().enumerate() {
        match types(i) {
            // A byte-level "control" token spelled outside the byte alphabet is a llama.cpp
            // mislabel; transformers skips it too, so both agree on the vocabulary.
            TOKEN_TYPE_CONTROL if !alphabet.as_ref().is_some_and(|a| tok.chars().any(|c| !a.contains(&c))) => {
                added.push(added_token(i, tok, true))
            }
            // (a Gemma whitespace run, respelled as the piece it stands for, is no added token)
            TOKEN_TYPE_USER_DEFINED if !(vocab.model == "llama" && gemma_spaces(vocab, tok)) => {
                added.push(added_token(i, tok, false))
            }
            _ => {}
        }
    }
    Ok(json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": added, "normalizer": normalizer, "pre_tokenizer": pre_tokenizer,
        "post_processor": post_processor(vocab)?, "decoder": decoder, "model": model,
    }))
}

fn merge_pair(m: &str) -> Result<Value, String> {
    let (a, b) = m.split_once(' ').ok_or_else(|| format!("malformed GGUF merge {m:?}"))?;
    Ok(json!([a, b]))
}

/// Byte-level vocabulary; a token written outside the byte alphabet (a raw added token) is
/// respelled through it, as transformers does, so the merges find it. Later duplicates win,
/// as in a Python dict.
fn byte_level_vocab(tokens: &[String], alphabet: &HashSet<char>) -> Value {
    let table: HashMap<u8, char> = byte_to_char().into_iter().collect();
    let mut out = serde_json::Map::new();
    for (i, t) in tokens.iter().enumerate() {
        let key =
            if t.chars().all(|c| alphabet.contains(&c)) { t.clone() } else { t.bytes().map(|b| table[&b]).collect() };
        out.insert(key, json!(i));
    }
    Value::Object(out)
}

/// A token of nothing but spaces, as Gemma's files spell its whitespace runs: the "▁" piece it
/// stands for.
fn respelled_spaces(token: &str) -> Option<String> {
    (!token.is_empty() && token.chars().all(|c| c == ' ')).then(|| "\u{2581}".repeat(token.chars().count()))
}

/// Whether `token` is one of a Gemma file's whitespace runs (respelled by the conversion).
fn gemma_spaces(vocab: &GgufVocab, token: &str) -> bool {
    vocab.arch.as_deref().is_some_and(|a| a.starts_with("gemma")) && respelled_spaces(token).is_some()
}

/// Sentencepiece files carry scores, not merges: every split of a token into two known
/// pieces is a merge, ranked by the merged token's `rank` (its score; best first).
fn sentencepiece_merges<'a>(tokens: &'a [String], rank: &[f32]) -> Vec<Value> {
    let ids: HashMap<&str, usize> = tokens.iter().enumerate().map(|(i, t)| (t.as_str(), i)).collect();
    let mut merges: Vec<(f32, usize, usize, usize, usize, &'a str, &'a str)> = Vec::new();
    for (i, tok) in tokens.iter().enumerate() {
        let score = rank.get(i).copied().unwrap_or(0.0);
        let mut local = Vec::new();
        for (cut, _) in tok.char_indices().skip(1) {
            let (l, r) = tok.split_at(cut);
            if let (Some(&li), Some(&ri)) = (ids.get(l), ids.get(r)) {
                local.push((score, l.chars().count(), r.chars().count(), li, ri, l, r));
            }
        }
        local.sort_by_key(|m| (m.3, m.4));
        merges.extend(local);
    }
    // Stable sort, descending on (score, len(left), len(right)), as transformers' generate_merges.
    merges.sort_by(|a, b| b.0.total_cmp(&a.0).then(b.1.cmp(&a.1)).then(b.2.cmp(&a.2)));
    merges.into_iter().map(|m| json!([m.5, m.6])).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> Tokenizer {
        let mut tokens: Vec<String> = vec!["<|endoftext|>".into(), "<|im_start|>".into(), "<think>".into()];
        tokens.extend(byte_to_char().into_iter().map(|(_, c)| c.to_string()));
        for t in ["he", "ll", "llo", "hello", "Ġw", "Ġwor", "Ġworld", "Ġ1"] {
            tokens.push(t.into());
        }
        let merges = ["h e", "l l", "ll o", "he llo", "Ġ w", "Ġw o", "Ġwo r", "Ġwor l", "Ġworl d", "Ġ 1"];
        // Build the missing intermediate tokens the merges produce.
        for m in merges {
            let t = m.replace(' ', "");
            if !tokens.contains(&t) {
                tokens.push(t);
            }
        }
        let mut types = vec![3, 3, 4];
        types.resize(tokens.len(), 1);
        let v = GgufVocab {
            model: "gpt2".into(),
            arch: None,
            pre: Some("smollm".into()),
            tokens,
            merges: merges.iter().map(|s| s.to_string()).collect(),
            token_types: types,
            scores: vec![],
            bos_token_id: Some(1),
            eos_token_id: Some(0),
            unk_token_id: None,
            pad_token_id: None,
            add_bos_token: false,
            add_eos_token: false,
        };
        Tokenizer::from_gguf(&v).unwrap()
    }

    #[test]
    fn byte_table_is_a_bijection() {
        let t = byte_to_char();
        let chars: HashSet<char> = t.iter().map(|(_, c)| *c).collect();
        assert_eq!(chars.len(), 256);
        assert_eq!(t[b' ' as usize].1, 'Ġ');
        assert_eq!(t[b'\n' as usize].1, 'Ċ');
        assert_eq!(t[b'a' as usize].1, 'a');
    }

    #[test]
    fn encodes_with_merges_and_keeps_special_tokens_whole() {
        let t = tiny();
        let ids = t.encode("hello world<|endoftext|>", false);
        let pieces: Vec<String> = ids.iter().map(|&i| t.id_to_token(i).unwrap()).collect();
        assert_eq!(pieces, ["hello", "Ġworld", "<|endoftext|>"]);
        assert!(t.is_special(0) && t.is_special(1) && !t.is_special(2));
        assert_eq!(t.decode(&ids, false), "hello world<|endoftext|>");
        assert_eq!(t.decode(&ids, true), "hello world");
        // user-defined tokens are matched whole too
        assert_eq!(t.encode("<think>", false), vec![2]);
    }

    #[test]
    fn special_tokens_at_text_spans_are_read_as_text() {
        let t = tiny();
        let text = "<|im_start|>hello<|endoftext|> world<|endoftext|>";
        let normal = t.encode(text, false);
        assert_eq!(normal, vec![1, t.encode("hello", false)[0], 0, t.encode(" world", false)[0], 0]);
        // no span: encode's; a span on no special token: encode's
        assert_eq!(t.encode_with_text_spans(text, &[], false), normal);
        assert_eq!(t.encode_with_text_spans(text, &[(12, 17)], false), normal);
        // the first <|endoftext|> (bytes 17..30) is text: it and the text around it up to the
        // next added token are one piece; the template's tokens stay
        let ids = t.encode_with_text_spans(text, &[(17, 30)], false);
        assert_eq!(ids[0], 1);
        assert_eq!(ids[ids.len() - 1], 0);
        assert!(!ids[1..ids.len() - 1].contains(&0), "{ids:?}");
        assert_eq!(t.decode(&ids, false), text);
        let mut piece = t.inner.clone();
        piece.set_encode_special_tokens(true);
        let middle = piece.encode_fast("hello<|endoftext|> world", false).unwrap().get_ids().to_vec();
        assert_eq!(&ids[1..ids.len() - 1], &middle[..]);
        // a non-special added token is no special token's text: it stays whole
        assert_eq!(t.encode_with_text_spans("<think><|endoftext|>", &[(7, 20)], false)[0], 2);
        assert_eq!(t.special_texts(), ["<|endoftext|>", "<|im_start|>"]);
    }

    #[test]
    fn smollm_isolates_digits() {
        let t = tiny();
        // "Ġ1" exists as a merge, but digits are split off before the GPT-2 regex sees them.
        let ids = t.encode(" 1", false);
        let pieces: Vec<String> = ids.iter().map(|&i| t.id_to_token(i).unwrap()).collect();
        assert_eq!(pieces, ["Ġ", "1"]);
    }

    #[test]
    fn vocab_lists_every_piece_and_counts_added_tokens_apart() {
        let t = tiny();
        let vocab = t.vocab();
        assert_eq!(vocab.len(), t.vocab_size());
        for (piece, &id) in &vocab {
            assert_eq!(t.id_to_token(id).as_deref(), Some(piece.as_str()));
        }
        assert_eq!(vocab["Ġworld"], t.token_to_id("Ġworld").unwrap());
        assert!(t.base_vocab_size() <= t.vocab_size());
    }

    #[test]
    fn token_bytes_undo_the_byte_alphabet() {
        let t = tiny();
        let world = t.token_to_id("Ġworld").unwrap();
        assert_eq!(t.token_bytes(world), b" world");
        assert_eq!(t.token_str(world), " world");
        // "é" is two byte tokens; each alone is half a character.
        let ids = t.encode("é", false);
        assert_eq!(ids.len(), 2);
        assert_eq!(t.token_bytes(ids[0]), vec![0xC3]);
        assert_eq!(t.token_str(ids[0]), "\u{FFFD}");
        assert_eq!(t.token_bytes(0), b"<|endoftext|>");
        assert!(t.token_bytes(999_999).is_empty());
    }

    #[test]
    fn bos_eos_from_flags() {
        let mut v: GgufVocab = serde_json::from_value(json!({
            "model": "gpt2", "pre": "gpt2", "tokens": ["<s>", "</s>", "a", "b"], "token_types": [3, 3, 1, 1],
            "bos_token_id": 0, "eos_token_id": 1, "add_bos_token": true, "add_eos_token": true
        }))
        .unwrap();
        let t = Tokenizer::from_gguf(&v).unwrap();
        assert_eq!(t.encode("ab", true), vec![0, 2, 3, 1]);
        assert_eq!(t.encode("ab", false), vec![2, 3]);
        v.bos_token_id = None;
        assert!(Tokenizer::from_gguf(&v).is_err());
    }

    #[test]
    fn sentencepiece_vocab() {
        let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
        tokens.extend((0..=255u8).map(|b| format!("<0x{b:02X}>")));
        for t in ["▁", "h", "i", "▁h", "▁hi", "hi"] {
            tokens.push(t.into());
        }
        let n = tokens.len();
        let mut types = vec![2, 3, 3];
        types.extend([6; 256]);
        types.resize(n, 1);
        let scores: Vec<f32> = (0..n).map(|i| -(i as f32)).collect();
        let v = GgufVocab {
            model: "llama".into(),
            arch: None,
            pre: None,
            tokens,
            merges: vec![],
            token_types: types,
            scores,
            bos_token_id: Some(1),
            eos_token_id: Some(2),
            unk_token_id: Some(0),
            pad_token_id: None,
            add_bos_token: true,
            add_eos_token: false,
        };
        let t = Tokenizer::from_gguf(&v).unwrap();
        let ids = t.encode("hi hi\n", true);
        let pieces: Vec<String> = ids.iter().map(|&i| t.id_to_token(i).unwrap()).collect();
        assert_eq!(pieces, ["<s>", "▁hi", "▁hi", "<0x0A>"]);
        assert_eq!(t.decode(&ids, true), "hi hi\n");
        assert_eq!(t.token_bytes(ids[1]), b" hi");
        assert_eq!(t.token_bytes(ids[3]), b"\n");
        // a special token's text read as text, after a special token: "▁" is prepended to the
        // text's first piece only, as `encode` does
        let text = "<s>hi</s>hi";
        let normal = t.encode(text, false);
        let ids = t.encode_with_text_spans(text, &[(5, 9)], false);
        assert_eq!((ids[0], ids[1]), (normal[0], normal[1]), "{ids:?} {normal:?}");
        assert!(!ids.contains(&2), "{ids:?}");
        assert_eq!(t.decode(&ids, false), "<s>hi</s>hi");
        // and at the text's start, prepended as `encode` does
        let ids = t.encode_with_text_spans("</s>hi", &[(0, 4)], false);
        assert_eq!(t.id_to_token(ids[0]).unwrap(), "▁", "{ids:?}");
    }

    #[test]
    fn gemma_sentencepiece_prepends_nothing_and_reads_its_space_runs() {
        let mut tokens: Vec<String> = vec!["<pad>".into(), "<eos>".into(), "<bos>".into(), "<unk>".into()];
        tokens.extend((0..=255u8).map(|b| format!("<0x{b:02X}>")));
        for t in ["▁", "h", "i", "hi", "▁hi", "  "] {
            tokens.push(t.into());
        }
        let n = tokens.len();
        let mut types = vec![3, 3, 3, 2];
        types.extend([6; 256]);
        types.resize(n - 1, 1);
        types.push(4);
        let vocab = |arch: Option<&str>| GgufVocab {
            model: "llama".into(),
            arch: arch.map(str::to_string),
            pre: None,
            tokens: tokens.clone(),
            merges: vec![],
            token_types: types.clone(),
            scores: (0..n).map(|i| -(i as f32)).collect(),
            bos_token_id: Some(2),
            eos_token_id: Some(1),
            unk_token_id: Some(3),
            pad_token_id: None,
            add_bos_token: true,
            add_eos_token: false,
        };
        let t = Tokenizer::from_gguf(&vocab(Some("gemma3"))).unwrap();
        let pieces = |ids: Vec<u32>| ids.iter().map(|&i| t.id_to_token(i).unwrap()).collect::<Vec<_>>();
        assert_eq!(pieces(t.encode("hi  hi", true)), ["<bos>", "hi", "▁", "▁hi"]); // (merges in file order)
        assert_eq!(pieces(t.encode("hi  ", false)), ["hi", "▁▁"]);
        assert_eq!(pieces(t.encode(" hi", false)), ["▁hi"]);
        assert_eq!(t.decode(&t.encode(" hi  hi", true), true), " hi  hi");
        assert_eq!(t.token_bytes(n as u32 - 1), b"  ");
        // Llama's sentencepiece prepends a space, and strips it again when decoding
        let llama = Tokenizer::from_gguf(&vocab(Some("llama"))).unwrap();
        assert_eq!(llama.encode("hi", false), vec![n as u32 - 2]);
        assert_eq!(llama.decode(&llama.encode("hi", false), true), "hi");
    }
}
