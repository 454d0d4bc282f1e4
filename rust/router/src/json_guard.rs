//! Distinct keys in the JSON objects a grammar generates.
//!
//! The grammar engine generates an object whose keys are open (`additionalProperties`,
//! `patternProperties`, a bare `{"type": "object"}`) as a repetition of key/value pairs, and a
//! context-free grammar cannot say that the keys differ: a small model writes
//! `{"x": 1, "x": 2}`, which parsers read as one key (the last value wins), so the object has
//! fewer keys than pairs and a `minProperties` the pairs met is not met. A [`KeyGuard`]
//! follows the JSON one sequence generates and takes out of each of its masks the tokens
//! that would close a key the object being written already has.
//!
//! NOTE: the guard only narrows what the grammar allows. Where every allowed token would
//! repeat a key (a key pattern such as `^(a|b)$` that cannot grow past one already written),
//! the mask is left as the grammar made it: the grammar's constraint comes first, and a mask
//! with nothing in it would end the sequence on nothing.
//!
//! Keys compare as the strings they decode to (`"a"` and `"\u0061"` are one key).

use std::collections::HashSet;
use std::sync::Arc;

use crate::tokenizer::Tokenizer;

/// The closing tag of a reasoning block, after which the JSON starts.
const THINK_END: &[u8] = b"</think>";

/// Every token's bytes, and which tokens hold a `"` (only those can close a key). Built once
/// per vocabulary, shared by every guard.
pub struct TokenBytes {
    bytes: Vec<Box<[u8]>>,
    quoted: Vec<u32>,
}

impl TokenBytes {
    pub fn of(tokenizer: &Tokenizer) -> Self {
        Self::from_words((0..tokenizer.vocab_size() as u32).map(|id| tokenizer.token_bytes(id)))
    }

    fn from_words(words: impl IntoIterator<Item = Vec<u8>>) -> Self {
        let bytes: Vec<Box<[u8]>> = words.into_iter().map(Vec::into_boxed_slice).collect();
        let quoted = (0..bytes.len() as u32).filter(|&id| bytes[id as usize].contains(&b'"')).collect();
        Self { bytes, quoted }
    }

    fn get(&self, id: u32) -> &[u8] {
        self.bytes.get(id as usize).map_or(&[], |b| b)
    }
}

/// Where the output's JSON starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JsonStart {
    /// At the output's first byte.
    Now,
    /// After the model's reasoning, closed by `</think>`: `opened` when the prompt opened the
    /// block (else the output may open it with `<think>`, or start the JSON at once).
    AfterThinking { opened: bool },
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Phase {
    /// Before the first byte, when the output may or may not open a reasoning block.
    Undecided,
    /// Inside the reasoning block: the last bytes seen, to find `</think>` across tokens.
    Thinking(Vec<u8>),
    Json,
}

/// The string the lexer is inside, if any.
#[derive(Clone, Debug, Default)]
struct Lexer {
    in_string: bool,
    /// The string is an object's key: its raw bytes (escapes undecoded) are kept.
    key: bool,
    escaped: bool,
    buf: Vec<u8>,
}

#[derive(Debug)]
struct Frame {
    object: bool,
    /// An object's next string is a key (after `{` and `,`, until the key ends).
    wants_key: bool,
    keys: HashSet<String>,
}

impl Frame {
    fn new(object: bool) -> Self {
        Self { object, wants_key: object, keys: HashSet::new() }
    }
}

/// The containers the lexer is inside, as `scan` moves through them.
trait Stack {
    fn open(&mut self, object: bool);
    fn close(&mut self);
    /// Whether the innermost container is an object whose next string is a key.
    fn wants_key(&self) -> bool;
    fn set_wants_key(&mut self, wants: bool);
    /// Record a key of the innermost object: whether the object already had it.
    fn add_key(&mut self, key: String) -> bool;
}

impl Stack for Vec<Frame> {
    fn open(&mut self, object: bool) {
        self.push(Frame::new(object));
    }

    fn close(&mut self) {
        self.pop();
    }

    fn wants_key(&self) -> bool {
        self.last().is_some_and(|f| f.object && f.wants_key)
    }

    fn set_wants_key(&mut self, wants: bool) {
        if let Some(f) = self.last_mut() {
            f.wants_key = wants;
        }
    }

    fn add_key(&mut self, key: String) -> bool {
        self.last_mut().is_some_and(|f| !f.keys.insert(key))
    }
}

/// A what-if view of a guard's frames for one token: the frames it opens are its own, and
/// those it reaches below are read, never changed.
struct Overlay<'a> {
    below: &'a [Frame],
    /// How many of `below` the token has not closed.
    depth: usize,
    /// The innermost of `below`'s `wants_key` as the token changed it, and the keys the
    /// token gave it.
    top_wants_key: Option<bool>,
    top_keys: Vec<String>,
    opened: Vec<Frame>,
}

impl Stack for Overlay<'_> {
    fn open(&mut self, object: bool) {
        self.opened.push(Frame::new(object));
    }

    fn close(&mut self) {
        if self.opened.pop().is_none() && self.depth > 0 {
            self.depth -= 1;
            self.top_wants_key = None;
            self.top_keys.clear();
        }
    }

    fn wants_key(&self) -> bool {
        match (self.opened.last(), self.depth) {
            (Some(f), _) => f.object && f.wants_key,
            (None, 0) => false,
            (None, d) => self.below[d - 1].object && self.top_wants_key.unwrap_or(self.below[d - 1].wants_key),
        }
    }

    fn set_wants_key(&mut self, wants: bool) {
        match self.opened.last_mut() {
            Some(f) => f.wants_key = wants,
            None => self.top_wants_key = Some(wants),
        }
    }

    fn add_key(&mut self, key: String) -> bool {
        if let Some(f) = self.opened.last_mut() {
            return !f.keys.insert(key);
        }
        if self.depth == 0 {
            return false;
        }
        let repeated = self.below[self.depth - 1].keys.contains(&key) || self.top_keys.contains(&key);
        self.top_keys.push(key);
        repeated
    }
}

/// Moves the lexer through `bytes` over `stack`; stops at, and answers true for, a key that
/// its object already had.
fn scan(lexer: &mut Lexer, stack: &mut impl Stack, bytes: &[u8]) -> bool {
    for &b in bytes {
        if lexer.in_string {
            if lexer.escaped {
                lexer.escaped = false;
            } else if b == b'\\' {
                lexer.escaped = true;
            } else if b == b'"' {
                lexer.in_string = false;
                if lexer.key {
                    stack.set_wants_key(false);
                    if stack.add_key(decode(&lexer.buf)) {
                        return true;
                    }
                }
                continue;
            }
            if lexer.key {
                lexer.buf.push(b);
            }
            continue;
        }
        match b {
            b'"' => {
                lexer.in_string = true;
                lexer.key = stack.wants_key();
                lexer.buf.clear();
            }
            b'{' => stack.open(true),
            b'[' => stack.open(false),
            b'}' | b']' => stack.close(),
            b',' => stack.set_wants_key(true),
            b':' => stack.set_wants_key(false),
            _ => {}
        }
    }
    false
}

/// The string a key's raw bytes (between its quotes) stand for.
fn decode(raw: &[u8]) -> String {
    let mut quoted = Vec::with_capacity(raw.len() + 2);
    quoted.push(b'"');
    quoted.extend_from_slice(raw);
    quoted.push(b'"');
    serde_json::from_slice(&quoted).unwrap_or_else(|_| String::from_utf8_lossy(raw).into_owned())
}

/// One sequence's view of the JSON it has generated so far (see the module note).
pub struct KeyGuard {
    tokens: Arc<TokenBytes>,
    phase: Phase,
    lexer: Lexer,
    frames: Vec<Frame>,
}

impl KeyGuard {
    pub fn new(tokens: Arc<TokenBytes>, start: JsonStart) -> Self {
        let phase = match start {
            JsonStart::Now => Phase::Json,
            JsonStart::AfterThinking { opened: true } => Phase::Thinking(Vec::new()),
            JsonStart::AfterThinking { opened: false } => Phase::Undecided,
        };
        Self { tokens, phase, lexer: Lexer::default(), frames: Vec::new() }
    }

    /// Follow the sequence's next token.
    pub fn push(&mut self, id: u32) {
        let tokens = Arc::clone(&self.tokens);
        let mut bytes = tokens.get(id);
        if self.phase == Phase::Undecided && !bytes.is_empty() {
            // (JSON never starts with `<`: this opens the reasoning block)
            self.phase = if bytes[0] == b'<' { Phase::Thinking(Vec::new()) } else { Phase::Json };
        }
        if let Phase::Thinking(seen) = &mut self.phase {
            seen.extend_from_slice(bytes);
            match seen.windows(THINK_END.len()).position(|w| w == THINK_END) {
                Some(at) => {
                    let after = seen.len() - at - THINK_END.len();
                    bytes = &bytes[bytes.len() - after.min(bytes.len())..];
                    self.phase = Phase::Json;
                }
                None => {
                    let keep = seen.len().saturating_sub(THINK_END.len() - 1);
                    seen.drain(..keep);
                    return;
                }
            }
        }
        if self.phase == Phase::Json {
            scan(&mut self.lexer, &mut self.frames, bytes);
        }
    }

    /// Whether token `id` would close a key its object already has.
    fn repeats_a_key(&self, id: u32) -> bool {
        let mut lexer = self.lexer.clone();
        let mut view = Overlay {
            below: &self.frames,
            depth: self.frames.len(),
            top_wants_key: None,
            top_keys: Vec::new(),
            opened: Vec::new(),
        };
        scan(&mut lexer, &mut view, self.tokens.get(id))
    }

    /// Clear from `mask` (bit `t % 32` of word `t / 32` set when token `t` is allowed) the
    /// tokens that would repeat a key, unless that would clear every bit.
    pub fn restrict(&self, mask: &mut [i32]) {
        if self.phase != Phase::Json || self.frames.iter().all(|f| f.keys.is_empty()) {
            return;
        }
        let bit = |id: u32| (id as usize / 32, 1i32 << (id % 32));
        let cleared: Vec<u32> = self
            .tokens
            .quoted
            .iter()
            .copied()
            .filter(|&id| {
                let (word, b) = bit(id);
                mask.get(word).is_some_and(|w| w & b != 0) && self.repeats_a_key(id)
            })
            .collect();
        for &id in &cleared {
            let (word, b) = bit(id);
            mask[word] &= !b;
        }
        if !cleared.is_empty() && mask.iter().all(|&w| w == 0) {
            for &id in &cleared {
                let (word, b) = bit(id);
                mask[word] |= b;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A vocabulary of the given words, token ids in order.
    fn vocab(words: &[&str]) -> Arc<TokenBytes> {
        Arc::new(TokenBytes::from_words(words.iter().map(|w| w.as_bytes().to_vec())))
    }

    fn guard(words: &[&str], start: JsonStart, text: &[&str]) -> KeyGuard {
        let tokens = vocab(words);
        let mut g = KeyGuard::new(tokens, start);
        for piece in text {
            let id = words.iter().position(|w| w == piece).expect("a word of the vocabulary");
            g.push(id as u32);
        }
        g
    }

    /// The words `restrict` leaves allowed when all were.
    fn allowed<'a>(g: &KeyGuard, words: &[&'a str]) -> Vec<&'a str> {
        let mut mask = vec![0i32; words.len().div_ceil(32)];
        for id in 0..words.len() {
            mask[id / 32] |= 1 << (id % 32);
        }
        g.restrict(&mut mask);
        (0..words.len()).filter(|&id| mask[id / 32] & (1 << (id % 32)) != 0).map(|id| words[id]).collect()
    }

    const WORDS: [&str; 16] = [
        "{",
        "}",
        "[",
        "]",
        "\"",
        "x",
        "y",
        "\":",
        ": ",
        "1",
        ", ",
        ", \"x\"",
        "\"x\": 1",
        "\\u0078",
        "xy",
        "\", \"x\"",
    ];

    #[test]
    fn a_key_the_object_has_cannot_close_again() {
        let g = guard(&WORDS, JsonStart::Now, &["{", "\"", "x", "\":", "1", ", ", "\"", "x"]);
        let left = allowed(&g, &WORDS);
        // closing "x" again is out, however the quote comes; growing it to "xy" is not
        assert!(!left.contains(&"\"") && !left.contains(&"\":"), "{left:?}");
        assert!(left.contains(&"y") && left.contains(&"xy") && left.contains(&"}"), "{left:?}");
        // one token may open and close the key: `, "x"` after the first pair
        let g = guard(&WORDS, JsonStart::Now, &["{", "\"", "x", "\":", "1"]);
        let left = allowed(&g, &WORDS);
        assert!(!left.contains(&", \"x\"") && left.contains(&", "), "{left:?}");
    }

    #[test]
    fn keys_compare_decoded_and_per_object() {
        // "\u0078" is "x"
        let g = guard(&WORDS, JsonStart::Now, &["{", "\"", "x", "\":", "1", ", ", "\"", "\\u0078"]);
        assert!(!allowed(&g, &WORDS).contains(&"\""));
        // a nested object has keys of its own; back in the outer one, its keys count again
        let inner = ["{", "\"", "x", "\":", "{", "\"", "x"];
        let g = guard(&WORDS, JsonStart::Now, &inner);
        assert!(allowed(&g, &WORDS).contains(&"\""));
        let mut back = inner.to_vec();
        back.extend(["\":", "1", "}", ", ", "\"", "x"]);
        let g = guard(&WORDS, JsonStart::Now, &back);
        assert!(!allowed(&g, &WORDS).contains(&"\""));
        // a token that closes the inner object and opens a key of the outer one
        let words = ["{", "\"", "x", "\":", "1", "}, \"x\"", "}, \"y\""];
        let g = guard(&words, JsonStart::Now, &["{", "\"", "x", "\":", "{", "\"", "x", "\":", "1"]);
        assert_eq!(allowed(&g, &words), ["{", "\"", "x", "\":", "1", "}, \"y\""]);
    }

    #[test]
    fn strings_that_are_values_or_array_items_are_not_keys() {
        // {"x": "x", "y": ["x", "x"]}: no key repeats
        let g = guard(&WORDS, JsonStart::Now, &["{", "\"", "x", "\":", "\"", "x"]);
        assert!(allowed(&g, &WORDS).contains(&"\""));
        let g = guard(
            &WORDS,
            JsonStart::Now,
            &["{", "\"", "x", "\":", "\"", "x", "\"", ", ", "\"", "y", "\":", "[", "\"", "x", "\"", ", ", "\"", "x"],
        );
        assert!(allowed(&g, &WORDS).contains(&"\""));
        // braces, quotes and commas inside a value string are text
        let words = ["{", "\"", "x", "\":", "\"{\\\", \\\"x", "\"", ", ", "}"];
        let g = guard(&words, JsonStart::Now, &["{", "\"", "x", "\":", "\"{\\\", \\\"x"]);
        assert_eq!(allowed(&g, &words), words);
    }

    #[test]
    fn a_mask_it_would_empty_is_left_as_it_was() {
        let g = guard(&WORDS, JsonStart::Now, &["{", "\"", "x", "\":", "1", ", ", "\"", "x"]);
        let quote = WORDS.iter().position(|w| *w == "\"").unwrap();
        let mut mask = vec![0i32; 1];
        mask[0] |= 1 << quote;
        g.restrict(&mut mask);
        assert_eq!(mask[0], 1 << quote);
    }

    #[test]
    fn the_json_after_the_thinking_is_guarded_not_the_thinking() {
        let words = ["<think>", "{\"x\": 1, \"", "x", "\"", "</think>", "</th", "ink>{", "\":", "1", ", "];
        let thought = ["{\"x\": 1, \"", "x"];
        for start in [JsonStart::AfterThinking { opened: true }, JsonStart::AfterThinking { opened: false }] {
            let mut text = if start == (JsonStart::AfterThinking { opened: false }) { vec!["<think>"] } else { vec![] };
            text.extend(thought);
            let g = guard(&words, start, &text);
            assert!(allowed(&g, &words).contains(&"\""), "{start:?}");
            // `</think>` split over two tokens, the JSON starting in the second
            text.extend(["</th", "ink>{", "\"", "x", "\":", "1", ", ", "\"", "x"]);
            let g = guard(&words, start, &text);
            assert!(!allowed(&g, &words).contains(&"\""), "{start:?}");
        }
        // a model that does not think starts the JSON at once
        let g = guard(&words, JsonStart::AfterThinking { opened: false }, &["{\"x\": 1, \"", "x"]);
        assert!(!allowed(&g, &words).contains(&"\""));
    }
}
