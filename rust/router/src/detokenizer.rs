//! Incremental detokenization and stop strings: the one place generated ids become text.
//!
//! Invariants of what [`Detokenizer::push`] returns:
//! - never broken UTF-8: a byte-level piece that ends mid-character is held back until the
//!   character completes (the prefix-offset / read-offset window: decode a window of recent
//!   ids and send the new suffix only once it does not end in U+FFFD);
//! - never text a stop string could still claim: the longest suffix of pending text that is a
//!   prefix of some stop string is withheld until it is resolved;
//! - nothing after a matched stop string, ever; the stop string itself only with
//!   `include_stop_str_in_output`.
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
}

/// One sequence's decoder. Holds `Arc<Tokenizer>`.
pub struct Detokenizer {
    tokenizer: Arc<Tokenizer>,
    config: StopConfig,
    /// Ids from `prefix_offset` on; older ones are dropped as the window moves.
    ids: Vec<u32>,
    /// `ids[..read]` is text already produced; `ids[..prefix]` is the window's context.
    prefix: usize,
    read: usize,
    /// Decoded but not yet sent: may still be the start of a stop string.
    pending: String,
    emitted_chars: usize,
    stopped: bool,
    longest_stop: usize,
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
        }
    }

    /// Feed one generated token: text now safe to send (never broken UTF-8, never a prefix
    /// of a stop string that may still complete) and whether a stop string matched.
    pub fn push(&mut self, id: u32) -> DetokStep {
        if self.stopped {
            return DetokStep::default();
        }
        self.ids.push(id);
        let new = self.decode_new(false);
        self.pending.push_str(&new);
        self.release(false)
    }

    /// Generation ended without a stop string: the held-back text.
    pub fn flush(&mut self) -> String {
        if self.stopped {
            return String::new();
        }
        let rest = self.decode_new(true);
        self.pending.push_str(&rest);
        let step = self.release(true);
        self.stopped = true;
        step.text
    }

    /// Chars sent so far (completions `text_offset`).
    pub fn emitted_len(&self) -> usize {
        self.emitted_chars
    }

    /// The text the ids after `read` add, once it is whole (or at the end, whatever it is).
    fn decode_new(&mut self, at_end: bool) -> String {
        if self.read >= self.ids.len() {
            return String::new();
        }
        let skip = self.config.skip_special_tokens;
        let prefix_text = self.tokenizer.decode(&self.ids[self.prefix..self.read], skip);
        let full_text = self.tokenizer.decode(&self.ids[self.prefix..], skip);
        if !at_end && (full_text.len() <= prefix_text.len() || full_text.ends_with('\u{FFFD}')) {
            // Half a character (or nothing visible yet): wait for the next token.
            return String::new();
        }
        let new = match full_text.strip_prefix(prefix_text.as_str()) {
            Some(rest) => rest.to_string(),
            // The decoder rewrote the context (a completed character replacing U+FFFD):
            // fall back to counting chars.
            None => full_text.chars().skip(prefix_text.chars().count()).collect(),
        };
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

    /// Send what no stop string can claim; stop at the earliest match.
    fn release(&mut self, at_end: bool) -> DetokStep {
        if let Some((start, stop)) = self.find_stop() {
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
        self.emitted_chars += text.chars().count();
        DetokStep { text, stop: None }
    }

    /// Earliest stop string in the pending text (ties: the longer one).
    fn find_stop(&self) -> Option<(usize, String)> {
        let mut best: Option<(usize, &String)> = None;
        for s in &self.config.stop {
            if let Some(at) = self.pending.find(s.as_str()) {
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

    /// Length in bytes of the longest suffix of pending that begins some stop string.
    fn partial_stop_len(&self) -> usize {
        let p = &self.pending;
        let lo = p.len().saturating_sub(self.longest_stop);
        // Try the longest candidate suffix first; suffixes start on char boundaries.
        for start in (lo..p.len()).filter(|&i| p.is_char_boundary(i)) {
            let suffix = &p[start..];
            if self.config.stop.iter().any(|s| s.starts_with(suffix)) {
                return p.len() - start;
            }
        }
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::GgufVocab;

    /// Bytes as tokens, plus two specials: ids 0 "<|endoftext|>", 1 "<|im_end|>", then
    /// byte b is id b + 2.
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
        let mut types = vec![3, 3];
        types.resize(tokens.len(), 1);
        let v = GgufVocab {
            model: "gpt2".into(),
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

    fn ids(s: &str) -> Vec<u32> {
        s.bytes().map(|b| b as u32 + 2).collect()
    }

    fn stops(list: &[&str], include: bool) -> StopConfig {
        StopConfig {
            stop: list.iter().map(|s| s.to_string()).collect(),
            include_stop_str_in_output: include,
            skip_special_tokens: true,
        }
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
        assert_eq!(d.flush(), "");
        assert_eq!(d.push(ids("z")[0]), DetokStep::default());
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
        assert_eq!(d.flush(), "</");
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
}
