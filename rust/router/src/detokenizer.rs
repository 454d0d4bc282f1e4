//! Incremental detokenization and stop strings: the one place generated ids become text.
//!
//! Invariants of what [`Detokenizer::push`] returns:
//! - never broken UTF-8: a byte-level piece that ends mid-character is held back until the
//!   character completes (the prefix-offset / read-offset window: decode a window of recent
//!   ids and send the new suffix only once it does not end in U+FFFD);
//! - never text a stop string could still claim: the longest suffix of pending text that is a
//!   prefix of some stop string is withheld until it is resolved;
//! - nothing after a matched stop string, ever; the stop string itself only with
//!   `include_stop_str_in_output`;
//! - with `min_tokens`, a stop string counts only when it ends in the text of a token after
//!   the first `min_tokens` (as vLLM: eos and stop ids are banned that long, stop strings are
//!   not looked for). Earlier text is still held back while it may begin a stop string that
//!   ends later, and released once it cannot.
//!
//! Without stop strings, the concatenation of every `push` and the final `flush` equals
//! `tokenizer.decode(generated ids)` (checked by a property test).

use crate::tokenizer::Tokenizer;
use std::sync::Arc;

/// How many prompt ids are kept as decoding context (sentencepiece decoders strip a leading
/// space at the start of a decode; with context before it, the space survives).
const PROMPT_CONTEXT: usize = 5;

#[derive(Debug, Clone, Default)]
pub struct StopConfig {
    pub stop: Vec<String>,
    pub include_stop_str_in_output: bool,
    pub skip_special_tokens: bool,
    /// Stop strings are not matched in the text of the first `min_tokens` generated tokens.
    pub min_tokens: u32,
}

/// One sequence's decoder. Holds `Arc<Tokenizer>`.
pub struct Detokenizer {
    tokenizer: Arc<Tokenizer>,
    config: StopConfig,
    /// The ids the window still reads; older ones are dropped as it moves.
    ids: Vec<u32>,
    /// `ids[..read]` is text already produced; `ids[..prefix]` is the window's context.
    prefix: usize,
    read: usize,
    /// Decoded but not yet sent: may still be the start of a stop string.
    pending: String,
    emitted_chars: usize,
    stopped: bool,
    longest_stop: usize,
    /// Tokens pushed so far.
    generated: u32,
    /// Byte offset in `pending` where text that may end a stop string begins (text of the
    /// first `min_tokens` tokens lies before it).
    armed_from: usize,
}

/// Text now safe to send, and the stop string that matched (then generation must end).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct DetokStep {
    pub text: String,
    pub stop: Option<String>,
}

impl Detokenizer {
    pub fn new(tokenizer: Arc<Tokenizer>, prompt: &[u32], config: StopConfig) -> Self {
        let ids = prompt[prompt.len().saturating_sub(PROMPT_CONTEXT)..].to_vec();
        let mut config = config;
        // An empty stop string would match everywhere; the protocol layer rejects it, and
        // here it must not end every generation at its first token.
        config.stop.retain(|s| !s.is_empty());
        let longest_stop = config.stop.iter().map(|s| s.len()).max().unwrap_or(0);
        let read = ids.len();
        Self {
            tokenizer,
            config,
            ids,
            prefix: 0,
            read,
            pending: String::new(),
            emitted_chars: 0,
            stopped: false,
            longest_stop,
            generated: 0,
            armed_from: 0,
        }
    }

    /// Feed one generated token: text now safe to send (never broken UTF-8, never a prefix
    /// of a stop string that may still complete) and whether a stop string matched.
    pub fn push(&mut self, id: u32) -> DetokStep {
        if self.stopped {
            return DetokStep::default();
        }
        self.ids.push(id);
        self.generated = self.generated.saturating_add(1);
        let new = self.decode_new(false);
        self.append(&new);
        self.release(false)
    }

    /// Generation ended (no stop string matched yet): the held-back text, and a stop string
    /// only it holds (text held back as half a character was not searched; the generation
    /// then ends by that stop string, whatever ended it).
    pub fn flush(&mut self) -> DetokStep {
        if self.stopped {
            return DetokStep::default();
        }
        let rest = self.decode_new(true);
        self.append(&rest);
        let step = self.release(true);
        self.stopped = true;
        step
    }

    /// Generation ended on a token id (eos or a `stop_token_ids` entry): the held-back text,
    /// and with `include_stop_str_in_output` the token's own text too (none for a special
    /// token under `skip_special_tokens`), as vLLM's detokenizer keeps it.
    pub fn finish_on_token(&mut self, id: u32) -> String {
        if self.stopped {
            return String::new();
        }
        let mut text = String::new();
        if self.config.include_stop_str_in_output {
            let step = self.push(id);
            text = step.text;
            if step.stop.is_some() {
                return text;
            }
        }
        text.push_str(&self.flush().text);
        text
    }

    /// Appends decoded text to `pending`; within the first `min_tokens` tokens it cannot end
    /// a stop string.
    fn append(&mut self, text: &str) {
        self.pending.push_str(text);
        if self.generated <= self.config.min_tokens {
            self.armed_from = self.pending.len();
        }
    }

    /// Chars sent so far.
    pub fn emitted_len(&self) -> usize {
        self.emitted_chars
    }

    /// Whether the last tokens pushed have no text yet: they end inside a character (or show
    /// nothing alone), and their text comes with a later token's.
    pub fn awaits_text(&self) -> bool {
        self.read < self.ids.len()
    }

    /// Chars decoded so far, sent or held back for a possible stop string: where the next
    /// token's text starts in the untrimmed output (completions `text_offset`, counted as
    /// vLLM counts it, so a trimmed stop string's tokens point past the returned text
    /// rather than into it).
    pub fn decoded_len(&self) -> usize {
        let decoded = self.emitted_chars + self.pending.chars().count();
        if !self.awaits_text() {
            return decoded;
        }
        // Tokens ending inside a character wait for its last bytes; the whole characters
        // before it (a space in the token that starts it) are decoded already, and so are
        // U+FFFDs of bytes no character can hold (a lone continuation byte), which are final.
        let skip = self.config.skip_special_tokens;
        let prefix_text = self.tokenizer.decode(&self.ids[self.prefix..self.read], skip);
        let full_text = self.tokenizer.decode(&self.ids[self.prefix..], skip);
        let mut awaiting = after_context(&prefix_text, &full_text);
        if self.ends_inside_a_char(self.read) {
            awaiting = awaiting.strip_suffix('\u{FFFD}').unwrap_or(awaiting);
        }
        decoded + awaiting.chars().count()
    }

    /// The text the ids after `read` add, once it is whole (or at the end, whatever it is).
    fn decode_new(&mut self, at_end: bool) -> String {
        if self.read >= self.ids.len() {
            return String::new();
        }
        let skip = self.config.skip_special_tokens;
        let prefix_text = self.tokenizer.decode(&self.ids[self.prefix..self.read], skip);
        let full_text = self.tokenizer.decode(&self.ids[self.prefix..], skip);
        // (a U+FFFD the model wrote, or of bytes no character can hold, is final: not waited on)
        let half = full_text.ends_with('\u{FFFD}') && self.ends_inside_a_char(self.prefix);
        // (compared as text, not by length: a character that completes one the context
        // started may be no longer than the U+FFFD the context alone decodes to)
        let mut new = after_context(&prefix_text, &full_text).to_string();
        if !at_end && (new.is_empty() || half) {
            // Half a character (or nothing visible yet): wait for the next token.
            return String::new();
        }
        // At the end, the first bytes of a character the output stops inside (max_tokens cut
        // it off) decode to U+FFFD: drop it, as vLLM does. The model never wrote that
        // character; a U+FFFD it did write is whole and stays.
        if at_end && new.ends_with('\u{FFFD}') && self.ends_inside_a_char(self.read) {
            new.pop();
        }
        // Slide the window: what was just decoded becomes the context for the next token.
        self.prefix = self.read;
        self.read = self.ids.len();
        if self.prefix > 0 {
            self.ids.drain(..self.prefix);
            self.read -= self.prefix;
            self.prefix = 0;
        }
        new
    }

    /// Whether the bytes of the ids from `from` on end inside a UTF-8 character: from `read`,
    /// those not yet decoded; from `prefix`, the window's (a character the context started, a
    /// prompt that ends inside one, counts too).
    fn ends_inside_a_char(&self, from: usize) -> bool {
        let bytes: Vec<u8> = self.ids[from..].iter().flat_map(|&id| self.tokenizer.token_bytes(id)).collect();
        ends_inside_a_char(&bytes)
    }

    /// Send what no stop string can claim; stop at the earliest match.
    fn release(&mut self, at_end: bool) -> DetokStep {
        if let Some((start, stop)) = self.find_stop(self.armed_from) {
            let end = if self.config.include_stop_str_in_output { start + stop.len() } else { start };
            let text = self.pending[..end].to_string();
            self.pending.clear();
            self.stopped = true;
            self.emitted_chars += text.chars().count();
            return DetokStep { text, stop: Some(stop) };
        }
        let keep = if at_end { 0 } else { self.partial_stop_len() };
        let cut = self.pending.len() - keep;
        let text = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        self.armed_from = self.armed_from.saturating_sub(cut);
        self.emitted_chars += text.chars().count();
        DetokStep { text, stop: None }
    }

    /// Earliest stop string in the pending text that ends past byte `min_end` (ties: the
    /// longer one).
    fn find_stop(&self, min_end: usize) -> Option<(usize, String)> {
        let mut best: Option<(usize, &String)> = None;
        for s in &self.config.stop {
            // Only a match that ends past `min_end` counts: none can start before `from`. (A
            // search costs the stop string's length to set up: a long one is not searched for
            // in text shorter than it, as every step's pending text is.)
            let mut from = (min_end + 1).saturating_sub(s.len());
            while !self.pending.is_char_boundary(from) {
                from -= 1;
            }
            if s.len() > self.pending.len() - from {
                continue;
            }
            let mut hits = self.pending[from..].match_indices(s.as_str()).map(|(at, _)| from + at);
            if let Some(at) = hits.find(|&at| at + s.len() > min_end) {
                let better = match best {
                    None => true,
                    Some((b, bs)) => at < b || (at == b && s.len() > bs.len()),
                };
                if better {
                    best = Some((at, s));
                }
            }
        }
        best.map(|(at, s)| (at, s.clone()))
    }

    /// Length in bytes of the longest suffix of pending that begins some stop string and is
    /// shorter than it (a whole stop string there was either matched or, within `min_tokens`,
    /// does not count).
    fn partial_stop_len(&self) -> usize {
        let p = &self.pending;
        let lo = p.len().saturating_sub(self.longest_stop);
        // Try the longest candidate suffix first; suffixes start on char boundaries.
        for start in (lo..p.len()).filter(|&i| p.is_char_boundary(i)) {
            let suffix = &p[start..];
            if self.config.stop.iter().any(|s| s.len() > suffix.len() && s.starts_with(suffix)) {
                return p.len() - start;
            }
        }
        0
    }
}

/// What `full` (the context's ids and new ones, decoded) adds to `context` (the context's
/// ids decoded). A context that ends inside a character decodes it as U+FFFD, which the new
/// ids turn into the character (so `context` is no prefix of `full`): the text after what the
/// two share is new, that whole character included (the text of a prompt that ends inside a
/// character starts with the character the first token completes).
fn after_context<'a>(context: &str, full: &'a str) -> &'a str {
    if let Some(rest) = full.strip_prefix(context) {
        return rest;
    }
    let shared =
        context.char_indices().zip(full.chars()).find(|((_, a), b)| a != b).map_or(full.len(), |((i, _), _)| i);
    &full[shared.min(full.len())..]
}

/// Whether `bytes` end with the first bytes of a UTF-8 character (not with bytes no
/// character can start with).
pub fn ends_inside_a_char(bytes: &[u8]) -> bool {
    bytes.utf8_chunks().last().is_some_and(|c| {
        let tail = c.invalid();
        !tail.is_empty() && std::str::from_utf8(tail).is_err_and(|e| e.error_len().is_none())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::GgufVocab;

    /// Bytes as tokens, plus two specials: ids 0 "<|endoftext|>", 1 "<|im_end|>", then
    /// byte b is id b + 2, then [`SPACE_HALF`].
    fn bytes_tokenizer() -> Arc<Tokenizer> {
        let table: Vec<char> = {
            // GPT-2 alphabet, built the same way as the tokenizer does.
            let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
            let mut next = 256u32;
            (0..=255u8)
                .map(|b| {
                    if printable(b) {
                        b as char
                    } else {
                        next += 1;
                        char::from_u32(next - 1).unwrap()
                    }
                })
                .collect()
        };
        let mut tokens = vec!["<|endoftext|>".to_string(), "<|im_end|>".to_string()];
        tokens.extend(table.iter().map(|c| c.to_string()));
        // id 258: a space and the first byte of a 4-byte character, as one token
        tokens.push(format!("{}{}", table[b' ' as usize], table[0xF0]));
        let mut types = vec![3, 3];
        types.resize(tokens.len(), 1);
        let v = GgufVocab {
            model: "gpt2".into(),
            arch: None,
            pre: Some("gpt2".into()),
            tokens,
            merges: vec![],
            token_types: types,
            scores: vec![],
            bos_token_id: None,
            eos_token_id: Some(0),
            unk_token_id: None,
            pad_token_id: None,
            add_bos_token: false,
            add_eos_token: false,
        };
        Arc::new(Tokenizer::from_gguf(&v).unwrap())
    }

    /// " " and the first byte of a 4-byte character.
    const SPACE_HALF: u32 = 258;

    fn ids(s: &str) -> Vec<u32> {
        s.bytes().map(|b| b as u32 + 2).collect()
    }

    fn stops(list: &[&str], include: bool) -> StopConfig {
        StopConfig {
            stop: list.iter().map(|s| s.to_string()).collect(),
            include_stop_str_in_output: include,
            skip_special_tokens: true,
            min_tokens: 0,
        }
    }

    /// Pushes `text` byte by byte; the concatenated output, and the stop that ended it.
    fn run(d: &mut Detokenizer, text: &str) -> (String, Option<String>) {
        let mut out = String::new();
        for id in ids(text) {
            let step = d.push(id);
            out.push_str(&step.text);
            if step.stop.is_some() {
                return (out, step.stop);
            }
        }
        (out, None)
    }

    #[test]
    fn min_tokens_hold_stop_strings_back() {
        let t = bytes_tokenizer();
        let cfg = |min_tokens| StopConfig { min_tokens, ..stops(&["."], false) };
        // "a.b.c": the first "." is token 2, within min_tokens 3; the second (token 4) stops.
        let mut d = Detokenizer::new(t.clone(), &[], cfg(3));
        assert_eq!(run(&mut d, "a.b.cd"), ("a.b".to_string(), Some(".".to_string())));
        // A stop ending in token min_tokens still does not count; one after it does.
        let mut d = Detokenizer::new(t.clone(), &[], cfg(2));
        assert_eq!(run(&mut d, "a.b.c"), ("a.b".to_string(), Some(".".to_string())));
        let mut d = Detokenizer::new(t.clone(), &[], cfg(1));
        assert_eq!(run(&mut d, "a.b"), ("a".to_string(), Some(".".to_string())));
        // Without a later stop, everything comes out, the ignored stop text included.
        let mut d = Detokenizer::new(t.clone(), &[], cfg(9));
        let (out, stop) = run(&mut d, "x.y.");
        assert_eq!((out + &d.flush().text, stop), ("x.y.".to_string(), None));
    }

    #[test]
    fn min_tokens_stop_spanning_the_boundary_is_never_sent() {
        let t = bytes_tokenizer();
        // "END" starts within the first 2 tokens and ends after them: it stops, and none of
        // it was streamed.
        let mut d = Detokenizer::new(t.clone(), &[], StopConfig { min_tokens: 2, ..stops(&["END"], false) });
        let mut streamed = Vec::new();
        let mut stop = None;
        for id in ids("xEND!") {
            let step = d.push(id);
            streamed.push(step.text);
            if step.stop.is_some() {
                stop = step.stop;
                break;
            }
        }
        assert_eq!(streamed, ["x", "", "", ""]);
        assert_eq!(stop.as_deref(), Some("END"));
        // Text held as a possible stop is released once it cannot be one: "EN" waits for a
        // "D", "ENx" goes out.
        let mut d = Detokenizer::new(t.clone(), &[], StopConfig { min_tokens: 3, ..stops(&["END"], false) });
        let streamed: Vec<String> = ids("ENxE").into_iter().map(|id| d.push(id).text).collect();
        assert_eq!(streamed, ["", "", "ENx", ""]);
        // The "N" of token 2 is within min_tokens 3; the one of token 5 stops.
        let mut d = Detokenizer::new(t.clone(), &[], StopConfig { min_tokens: 3, ..stops(&["END", "N"], false) });
        assert_eq!(run(&mut d, "ENDEND"), ("ENDE".to_string(), Some("N".to_string())));
        // Included stop text comes out once, with the stop.
        let mut d = Detokenizer::new(t, &[], StopConfig { min_tokens: 2, ..stops(&["."], true) });
        assert_eq!(run(&mut d, "..x."), ("..x.".to_string(), Some(".".to_string())));
    }

    #[test]
    fn finishing_on_a_token_releases_held_text() {
        let t = bytes_tokenizer();
        // Held back as a possible "</s>", then the sequence ends on eos (id 0, special).
        let mut d = Detokenizer::new(t.clone(), &[], stops(&["</s>"], false));
        assert_eq!(run(&mut d, "ok </").0, "ok ");
        assert_eq!(d.finish_on_token(0), "</");
        assert_eq!(d.finish_on_token(0), "");
        // include_stop_str_in_output keeps the stopping token's text; a skipped special has none.
        let mut d = Detokenizer::new(t.clone(), &[], stops(&[], true));
        assert_eq!(run(&mut d, "Paris").0, "Paris");
        assert_eq!(d.finish_on_token(ids(".")[0]), ".");
        let mut d = Detokenizer::new(t.clone(), &[], stops(&[], true));
        d.push(ids("a")[0]);
        assert_eq!(d.finish_on_token(0), "");
        let mut d = Detokenizer::new(t, &[], StopConfig { skip_special_tokens: false, ..stops(&[], true) });
        d.push(ids("a")[0]);
        assert_eq!(d.finish_on_token(1), "<|im_end|>");
        // Without it, the token's text is left out.
        let mut d = Detokenizer::new(bytes_tokenizer(), &[], stops(&[], false));
        assert_eq!(run(&mut d, "Paris").0, "Paris");
        assert_eq!(d.finish_on_token(ids(".")[0]), "");
    }

    #[test]
    fn holds_half_characters_back() {
        let t = bytes_tokenizer();
        let mut d = Detokenizer::new(t, &[], StopConfig::default());
        let emoji = ids("\u{1F600}");
        assert_eq!(emoji.len(), 4);
        for &id in &emoji[..3] {
            assert_eq!(d.push(id).text, "");
        }
        assert_eq!(d.push(emoji[3]).text, "\u{1F600}");
        assert_eq!(d.emitted_len(), 1);
    }

    #[test]
    fn ends_inside_a_char_only_for_the_start_of_a_character() {
        assert!(ends_inside_a_char(b"a\xf0\x9f"));
        assert!(ends_inside_a_char(b"\x80\xe6"), "a stray byte before it");
        assert!(!ends_inside_a_char(b"a\xf0\x9f\x98\x80"), "whole");
        assert!(!ends_inside_a_char(b"a\x80"), "no character starts with a continuation byte");
        assert!(!ends_inside_a_char(b"\xf0\x9fz"), "text after it");
        assert!(!ends_inside_a_char(b""));
    }

    #[test]
    fn a_prompt_that_ends_inside_a_character_leaves_it_to_the_output() {
        // The prompt holds 2 of the 4 bytes of U+1F469; the output's first tokens complete
        // it: the output's text starts with that character (it was lost, as the context's
        // U+FFFD was counted as a character of the prompt's).
        let woman = ids("\u{1F469}");
        let mut prompt = ids("story: \u{1F600}");
        prompt.extend(&woman[..2]);
        let mut d = Detokenizer::new(bytes_tokenizer(), &prompt, StopConfig::default());
        assert_eq!(d.push(woman[2]).text, "");
        assert_eq!(d.decoded_len(), 0);
        assert_eq!(d.push(woman[3]).text, "\u{1F469}");
        assert_eq!(run(&mut d, "\u{1F469}!").0 + &d.flush().text, "\u{1F469}!");
    }

    #[test]
    fn output_that_ends_inside_a_character_drops_it() {
        // max_tokens cut the second emoji after 2 of its 4 bytes: no U+FFFD the model never
        // wrote reaches the client.
        let emoji = ids("\u{1F600}");
        let mut d = Detokenizer::new(bytes_tokenizer(), &[], StopConfig::default());
        assert_eq!(run(&mut d, "a\u{1F600}b").0, "a\u{1F600}b");
        assert_eq!(d.push(emoji[0]).text + &d.push(emoji[1]).text, "");
        assert_eq!(d.flush().text, "");
        // Bytes that can no longer complete a character (text follows them) stay visible.
        let mut d = Detokenizer::new(bytes_tokenizer(), &[], StopConfig::default());
        assert_eq!(d.push(emoji[0]).text, "");
        assert_eq!(d.push(ids("z")[0]).text + &d.flush().text, "\u{FFFD}z");
        // A U+FFFD the model wrote is whole, and stays: sent at once, not held for more.
        let mut d = Detokenizer::new(bytes_tokenizer(), &[], StopConfig::default());
        let (text, _) = run(&mut d, "x\u{FFFD}");
        assert_eq!(text, "x\u{FFFD}");
        assert_eq!(d.flush().text, "");
        // So is the U+FFFD of a byte no character can hold (a lone continuation byte)...
        let mut d = Detokenizer::new(bytes_tokenizer(), &[], stops(&["\u{FFFD}"], true));
        let step = d.push(0x89 + 2);
        assert_eq!((step.text.as_str(), step.stop.as_deref()), ("\u{FFFD}", Some("\u{FFFD}")));
        // ... but the first bytes of one the prompt started wait for the rest of it
        let e = "\u{8D64}".as_bytes(); // (3 bytes: the prompt holds the first)
        let mut d = Detokenizer::new(bytes_tokenizer(), &[e[0] as u32 + 2], StopConfig::default());
        assert_eq!(d.push(e[1] as u32 + 2).text, "");
        assert_eq!(d.push(e[2] as u32 + 2).text, "\u{8D64}");
    }

    #[test]
    fn stop_string_split_across_tokens_is_never_sent() {
        let t = bytes_tokenizer();
        let mut d = Detokenizer::new(t, &[], stops(&["END"], false));
        let mut out = String::new();
        for &id in &ids("abENxEND tail") {
            let step = d.push(id);
            out.push_str(&step.text);
            if step.stop.is_some() {
                assert_eq!(step.stop.as_deref(), Some("END"));
                break;
            }
        }
        assert_eq!(out, "abENx");
        assert_eq!(d.flush().text, "");
        assert_eq!(d.push(ids("z")[0]), DetokStep::default());
    }

    #[test]
    fn decoded_len_counts_text_held_back_for_a_stop() {
        // Each byte token starts where the untrimmed text has its char, though "EN" and
        // "END" are held back (and "END" never sent).
        let mut d = Detokenizer::new(bytes_tokenizer(), &[], stops(&["END"], false));
        for (i, &id) in ids("abENxEND").iter().enumerate() {
            assert_eq!(d.decoded_len(), i, "before token {i}");
            d.push(id);
        }
        assert_eq!(d.emitted_len(), "abENx".len());
    }

    #[test]
    fn decoded_len_counts_bytes_no_character_can_hold() {
        // A lone continuation byte is a final U+FFFD (held back with the text after it only
        // while that ends inside a character): the next token's text starts after it.
        let emoji = ids("\u{1F600}");
        let mut d = Detokenizer::new(bytes_tokenizer(), &[], StopConfig::default());
        d.push(ids("a")[0]);
        d.push(0x89 + 2);
        assert_eq!(d.decoded_len(), 2);
        d.push(emoji[0]);
        assert_eq!(d.decoded_len(), 2, "the emoji's first byte is no character yet");
        d.push(ids("b")[0]);
        assert_eq!(d.decoded_len(), 4);
        assert_eq!(d.emitted_len(), 4);
    }

    #[test]
    fn flush_reports_a_stop_string_in_text_held_as_half_a_character() {
        // "x", then " " and half a character in one token, which waits for the rest; then
        // max_tokens ends it: the half character is dropped, and the stop string before it,
        // found only now, is reported.
        let mut d = Detokenizer::new(bytes_tokenizer(), &[], stops(&[" "], false));
        assert_eq!(d.push(ids("x")[0]).text, "x");
        assert_eq!(d.push(SPACE_HALF), DetokStep::default());
        assert_eq!(d.flush(), DetokStep { text: String::new(), stop: Some(" ".into()) });
        let mut d = Detokenizer::new(bytes_tokenizer(), &[], stops(&["x "], true));
        d.push(ids("x")[0]);
        d.push(SPACE_HALF);
        assert_eq!(d.flush(), DetokStep { text: "x ".into(), stop: Some("x ".into()) });
        // (no stop string there: the text only)
        let mut d = Detokenizer::new(bytes_tokenizer(), &[], stops(&["!"], false));
        d.push(SPACE_HALF);
        assert_eq!(d.flush(), DetokStep { text: " ".into(), stop: None });
    }

    #[test]
    fn flush_returns_a_held_back_partial_stop() {
        let t = bytes_tokenizer();
        let mut d = Detokenizer::new(t, &[], stops(&["</s>"], false));
        let mut out = String::new();
        for &id in &ids("ok </") {
            out.push_str(&d.push(id).text);
        }
        assert_eq!(out, "ok ");
        assert_eq!(d.flush().text, "</");
        assert_eq!(d.emitted_len(), 5);
    }

    #[test]
    fn include_stop_and_special_tokens() {
        let t = bytes_tokenizer();
        let mut d = Detokenizer::new(t.clone(), &[], stops(&["x"], true));
        let out: String = ids("abxc").iter().map(|&i| d.push(i).text).collect();
        assert_eq!(out, "abx");

        let mut keep =
            Detokenizer::new(t.clone(), &[], StopConfig { skip_special_tokens: false, ..Default::default() });
        let mut skip = Detokenizer::new(t, &[], StopConfig { skip_special_tokens: true, ..Default::default() });
        for id in [ids("a")[0], 1, ids("b")[0]] {
            keep.push(id);
            skip.push(id);
        }
        assert_eq!(keep.emitted_len(), "a<|im_end|>b".len());
        assert_eq!(skip.emitted_len(), 2);
    }

    #[test]
    fn long_stop_strings_are_found_once_the_text_holds_them() {
        // (a search costs the stop string's length to set up, so a long one is not searched
        // for in shorter text: 1000 stop strings of 7 KB cost 15 ms a token before)
        let long = "x".repeat(5000);
        let mut d = Detokenizer::new(bytes_tokenizer(), &[], stops(&[&long, "world"], false));
        assert_eq!(run(&mut d, "hello world"), ("hello ".to_string(), Some("world".to_string())));
        let stop = "ab".repeat(300);
        let mut d = Detokenizer::new(bytes_tokenizer(), &[], stops(&[&stop], false));
        let (out, hit) = run(&mut d, &format!("z{stop}c"));
        assert_eq!((out.as_str(), hit.as_deref()), ("z", Some(stop.as_str())));
    }
}
