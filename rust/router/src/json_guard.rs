//! Guards on the JSON objects a grammar generates, beyond what its grammar can say.
//!
//! - **Distinct keys.** The grammar engine generates an object whose keys are open
//!   (`additionalProperties`, `patternProperties`, a bare `{"type": "object"}`) as a
//!   repetition of key/value pairs, and a context-free grammar cannot say that the keys differ:
//!   a small model writes `{"x": 1, "x": 2}`, which parsers read as one key (the last value
//!   wins), so the object has fewer keys than pairs and a `minProperties` the pairs met is not
//!   met.
//! - **Numbers that end.** JSON's number grammar limits neither digits nor exponent, and a
//!   small model can write `0.2976500155266768E3128138884...` until `max_tokens` cuts the JSON
//!   off. A number's integer part and its fraction get at most [`MAX_MANTISSA_DIGITS`] digits
//!   each (an IEEE double holds 17 significant digits), and its exponent at most
//!   [`MAX_EXPONENT_DIGITS`] digits and [`MAX_EXPONENT`] in value, so the number is a finite
//!   double (at most 17 integer digits times 10^290 is below 10^308).
//!
//! A [`JsonGuard`] follows the JSON one sequence generates and takes out of each of its masks
//! the tokens that would break either: close a key the object being written already has, or
//! grow a number past those lengths.
//!
//! NOTE: the guard only narrows what the grammar allows. Where every allowed token breaks a
//! rule (a key pattern such as `^(a|b)$` that cannot grow past one already written, a schema
//! whose bounds need more digits), the mask is left as the grammar made it: the grammar's
//! constraint comes first, and a mask with nothing in it would end the sequence on nothing.
//!
//! Keys compare as the strings they decode to (`"a"` and `"\u0061"` are one key).

use std::collections::HashSet;
use std::sync::Arc;

use crate::tokenizer::Tokenizer;

/// The closing tag of a reasoning block, after which the JSON starts.
const THINK_END: &[u8] = b"</think>";

/// Digits a number's integer part, and its fraction, may have.
pub const MAX_MANTISSA_DIGITS: u32 = 17;
/// Digits a number's exponent may have (leading zeros count).
pub const MAX_EXPONENT_DIGITS: u32 = 3;
/// The largest exponent a number may have, either sign.
pub const MAX_EXPONENT: u32 = 290;

/// Every token's bytes, and the tokens that can break a rule: those that hold a `"` (only they
/// can close a key), those that hold a digit (only they can lengthen a number) and those with a
/// run of more digits than the shortest limit (only they can make a number too long alone).
/// Built once per vocabulary, shared by every guard.
pub struct TokenBytes {
    bytes: Vec<Box<[u8]>>,
    quoted: Vec<u32>,
    digits: Vec<u32>,
    long_digit_runs: Vec<u32>,
}

impl TokenBytes {
    pub fn of(tokenizer: &Tokenizer) -> Self {
        Self::from_words((0..tokenizer.vocab_size() as u32).map(|id| tokenizer.token_bytes(id)))
    }

    fn from_words(words: impl IntoIterator<Item = Vec<u8>>) -> Self {
        let bytes: Vec<Box<[u8]>> = words.into_iter().map(Vec::into_boxed_slice).collect();
        let ids =
            |keep: &dyn Fn(&[u8]) -> bool| (0..bytes.len() as u32).filter(|&id| keep(&bytes[id as usize])).collect();
        let quoted = ids(&|b| b.contains(&b'"'));
        let digits = ids(&|b| b.iter().any(u8::is_ascii_digit));
        let long_digit_runs =
            ids(&|b| b.split(|c| !c.is_ascii_digit()).any(|run| run.len() as u32 > MAX_EXPONENT_DIGITS));
        Self { bytes, quoted, digits, long_digit_runs }
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

/// The part of a number the lexer is inside, and how many digits it has so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Number {
    #[default]
    Outside,
    Integer(u32),
    Fraction(u32),
    /// Its digits and their value.
    Exponent(u32, u32),
}

/// The string or number the lexer is inside, if any.
#[derive(Clone, Debug)]
struct Lexer {
    in_string: bool,
    /// The string is an object's key: its raw bytes (escapes undecoded) are kept.
    key: bool,
    escaped: bool,
    buf: Vec<u8>,
    number: Number,
    /// A value may start here (at the start, and after `:`, `,` or `[` and any whitespace):
    /// only there do `-` and digits open a number (a tool's markup may hold digits).
    value_next: bool,
}

impl Default for Lexer {
    fn default() -> Self {
        Self {
            in_string: false,
            key: false,
            escaped: false,
            buf: Vec::new(),
            number: Number::Outside,
            value_next: true,
        }
    }
}

#[derive(Clone, Debug)]
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

/// Moves the lexer through `bytes` over `stack`: whether they break a rule (repeat a key of
/// their object, make a number too long). With `bail`, it stops at the first break (a what-if
/// scan); else it goes on to the end (a token the sequence took).
fn scan(lexer: &mut Lexer, stack: &mut impl Stack, bytes: &[u8], bail: bool) -> bool {
    let mut broke = false;
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
                        if bail {
                            return true;
                        }
                        broke = true;
                    }
                }
                continue;
            }
            if lexer.key {
                lexer.buf.push(b);
            }
            continue;
        }
        if lexer.number != Number::Outside {
            // (saturating: a sequence may have taken digits past a limit, see the module's NOTE)
            let next = match (lexer.number, b) {
                (Number::Integer(n), b'0'..=b'9') => Number::Integer(n.saturating_add(1)),
                (Number::Fraction(n), b'0'..=b'9') => Number::Fraction(n.saturating_add(1)),
                (Number::Exponent(n, v), b'0'..=b'9') => {
                    Number::Exponent(n.saturating_add(1), v.saturating_mul(10).saturating_add(u32::from(b - b'0')))
                }
                (Number::Integer(_), b'.') => Number::Fraction(0),
                (Number::Integer(_) | Number::Fraction(_), b'e' | b'E') => Number::Exponent(0, 0),
                (Number::Exponent(0, 0), b'+' | b'-') => Number::Exponent(0, 0),
                _ => Number::Outside,
            };
            lexer.number = next;
            let too_long = match next {
                Number::Outside => None, // the number ended: `b` is read below
                Number::Integer(n) | Number::Fraction(n) => Some(n > MAX_MANTISSA_DIGITS),
                Number::Exponent(n, v) => Some(n > MAX_EXPONENT_DIGITS || v > MAX_EXPONENT),
            };
            if let Some(too_long) = too_long {
                if too_long {
                    if bail {
                        return true;
                    }
                    broke = true;
                }
                continue;
            }
        }
        let value_next = lexer.value_next;
        lexer.value_next = false;
        match b {
            b'"' => {
                lexer.in_string = true;
                lexer.key = stack.wants_key();
                lexer.buf.clear();
            }
            b'{' => stack.open(true),
            b'[' => {
                stack.open(false);
                lexer.value_next = true;
            }
            b'}' | b']' => stack.close(),
            b',' => {
                stack.set_wants_key(true);
                lexer.value_next = true;
            }
            b':' => {
                stack.set_wants_key(false);
                lexer.value_next = true;
            }
            b' ' | b'\t' | b'\r' | b'\n' => lexer.value_next = value_next,
            b'-' if value_next => lexer.number = Number::Integer(0),
            b'0'..=b'9' if value_next => lexer.number = Number::Integer(1),
            _ => {}
        }
    }
    broke
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
#[derive(Clone)]
pub struct JsonGuard {
    tokens: Arc<TokenBytes>,
    phase: Phase,
    lexer: Lexer,
    frames: Vec<Frame>,
}

impl JsonGuard {
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
            scan(&mut self.lexer, &mut self.frames, bytes, false);
        }
    }

    /// Whether token `id` would break a rule: close a key its object already has, or make a
    /// number too long.
    fn breaks_a_rule(&self, id: u32) -> bool {
        let mut lexer = self.lexer.clone();
        let mut view = Overlay {
            below: &self.frames,
            depth: self.frames.len(),
            top_wants_key: None,
            top_keys: Vec::new(),
            opened: Vec::new(),
        };
        scan(&mut lexer, &mut view, self.tokens.get(id), true)
    }

    /// Clear from `mask` (bit `t % 32` of word `t / 32` set when token `t` is allowed) the
    /// tokens that would break a rule, unless that would clear every bit.
    pub fn restrict(&self, mask: &mut [i32]) {
        if self.phase != Phase::Json {
            return;
        }
        // Only a token with a quote can close a key, once an object has one; only a token with
        // a digit can lengthen the number being written, and outside one only a token with a
        // long run of digits can write a number too long by itself.
        let keys: &[u32] = if self.frames.iter().any(|f| !f.keys.is_empty()) { &self.tokens.quoted } else { &[] };
        let numbers: &[u32] =
            if self.lexer.number == Number::Outside { &self.tokens.long_digit_runs } else { &self.tokens.digits };
        let bit = |id: u32| (id as usize / 32, 1i32 << (id % 32));
        let mut cleared = Vec::new();
        for &id in keys.iter().chain(numbers) {
            let (word, b) = bit(id);
            // (a token in both lists is cleared once: its bit is then off)
            if mask.get(word).is_some_and(|w| w & b != 0) && self.breaks_a_rule(id) {
                mask[word] &= !b;
                cleared.push(id);
            }
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

    fn guard(words: &[&str], start: JsonStart, text: &[&str]) -> JsonGuard {
        let tokens = vocab(words);
        let mut g = JsonGuard::new(tokens, start);
        for piece in text {
            let id = words
                .iter()
                .position(|w| w == piece)
                .unwrap_or_else(|| panic!("{piece:?} is not a word of the vocabulary"));
            g.push(id as u32);
        }
        g
    }

    /// The words `restrict` leaves allowed when all were.
    fn allowed<'a>(g: &JsonGuard, words: &[&'a str]) -> Vec<&'a str> {
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

    /// The words of `words` that `restrict` clears from an all-allowed mask.
    fn cleared<'a>(g: &JsonGuard, words: &[&'a str]) -> Vec<&'a str> {
        let left = allowed(g, words);
        words.iter().copied().filter(|w| !left.contains(w)).collect()
    }

    const NUMBER_WORDS: [&str; 17] =
        ["{", "}", "[", "\"", "x", "\":", " ", ", ", "0", "1", "12", "2", "9", "-", ".", "e", "+"];

    /// `text` spelled in NUMBER_WORDS: each char a word, but "12" taken whole where it stands.
    fn number_guard(text: &str) -> JsonGuard {
        let mut pieces = Vec::new();
        let mut rest = text;
        while !rest.is_empty() {
            let piece = ["\":", ", ", "12"].into_iter().find(|p| rest.starts_with(p)).unwrap_or(&rest[..1]);
            pieces.push(piece);
            rest = &rest[piece.len()..];
        }
        guard(&NUMBER_WORDS, JsonStart::Now, &pieces)
    }

    #[test]
    fn a_number_part_ends_at_its_limit() {
        let digits = ["0", "1", "12", "2", "9"];
        // the integer part: 16 digits leave room for one more, 17 for none
        let g = number_guard(&format!("{{\"x\": -1{}", "0".repeat(15)));
        assert_eq!(cleared(&g, &NUMBER_WORDS), ["12"], "a two-digit token would make 18");
        let g = number_guard(&format!("{{\"x\": 1{}", "0".repeat(16)));
        assert_eq!(cleared(&g, &NUMBER_WORDS), digits);
        // the fraction counts on its own
        let g = number_guard(&format!("{{\"x\": 1{}.{}", "0".repeat(16), "0".repeat(16)));
        assert_eq!(cleared(&g, &NUMBER_WORDS), ["12"]);
        let g = number_guard(&format!("{{\"x\": 0.{}", "0".repeat(17)));
        assert_eq!(cleared(&g, &NUMBER_WORDS), digits, "`e`, `,` and `}}` stay");
        // the exponent, after its sign, three digits
        for text in ["{\"x\": 0.1e+112", "{\"x\": 1E-112", "{\"x\": 1e112"] {
            let g = number_guard(&text.replace('E', "e"));
            assert_eq!(cleared(&g, &NUMBER_WORDS), digits, "{text}");
        }
        let g = number_guard("{\"x\": 1e11");
        assert_eq!(cleared(&g, &NUMBER_WORDS), ["12"]);
        // ... and at most 290, so the number is a finite double; leading zeros count as digits
        for text in ["{\"x\": 1e29", "{\"x\": 1e-29", "{\"x\": 1e+29"] {
            assert_eq!(cleared(&number_guard(text), &NUMBER_WORDS), ["1", "12", "2", "9"], "{text}");
        }
        assert_eq!(cleared(&number_guard("{\"x\": 1e00"), &NUMBER_WORDS), ["12"]);
        // a number that ended leaves the next one its own count
        let g = number_guard(&format!("[1{}, ", "0".repeat(16)));
        assert!(cleared(&g, &NUMBER_WORDS).is_empty());
        let g = number_guard(&format!("[1{}, 0.1e112", "0".repeat(16)));
        assert_eq!(cleared(&g, &NUMBER_WORDS), digits);
    }

    #[test]
    fn digits_in_strings_and_markup_are_not_numbers() {
        let words = ["{", "\"", "x", "1", "\": ", "<tool_call>", "a", "12345678901234567890"];
        let long = "12345678901234567890";
        // a key's or a string value's digits count for nothing
        let g = guard(&words, JsonStart::Now, &["{", "\"", "1", "1", "1"]);
        assert!(allowed(&g, &words).contains(&long));
        // markup such as a tool's name holds digits outside JSON values
        let mut text = vec!["<tool_call>", "a"];
        text.extend(["1"; 20]);
        let g = guard(&words, JsonStart::Now, &text);
        assert!(allowed(&g, &words).contains(&"1"));
        // a token with more digits than a number may have cannot start one
        let g = guard(&words, JsonStart::Now, &["{", "\"", "x", "\": "]);
        assert_eq!(cleared(&g, &words), [long]);
    }

    #[test]
    fn a_mask_of_only_digits_past_the_limit_is_left_as_it_was() {
        // (bounds that need more digits: the grammar allows nothing else)
        let g = number_guard(&format!("{{\"x\": 1{}", "0".repeat(16)));
        let zero = NUMBER_WORDS.iter().position(|w| *w == "0").unwrap();
        let mut mask = vec![1i32 << zero];
        g.restrict(&mut mask);
        assert_eq!(mask[0], 1 << zero);
    }

    #[test]
    fn a_token_taken_against_a_rule_is_still_followed_to_its_end() {
        // The mask fell back to the grammar and the sequence repeated "x", opening an object in
        // the same token: the guard is inside that new object, whose keys are its own.
        let words = ["{", "\"", "x", "y", "\":", "1", ", ", ", \"x\": {"];
        let text = ["{", "\"", "x", "\":", "1", ", \"x\": {", "\"", "y", "\":", "1", ", ", "\"", "x"];
        let g = guard(&words, JsonStart::Now, &text);
        assert!(allowed(&g, &words).contains(&"\""));
    }
}
