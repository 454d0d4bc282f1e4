//! Fill-in-the-middle: `/v1/completions`' `suffix`, for models whose vocabulary has a FIM
//! token set, found by the tokens' text as llama.cpp finds them. The prompt is laid out
//! prefix-suffix-middle, as each of these models was trained:
//! `<PRE>{prompt}<SUF>{suffix}<MID>`, and the model writes the middle.
//!
//! The sets: `<|fim_prefix|>`, `<|fim_suffix|>`, `<|fim_middle|>` (Qwen2.5-Coder, Qwen3-Coder,
//! CodeGemma); `<fim_prefix>`, `<fim_suffix>`, `<fim_middle>` (StarCoder, StarCoder2,
//! SantaCoder, Granite Code); `<｜fim▁begin｜>`, `<｜fim▁hole｜>`, `<｜fim▁end｜>`
//! (DeepSeek-Coder). An infill ends at the model's end of text, or at a token these models
//! write after one (`<|fim_pad|>`, `<|file_sep|>`, `<|repo_name|>`, CodeGemma's
//! `<|file_separator|>`, StarCoder's `<file_sep>`, ...: llama.cpp's end-of-generation tokens
//! for FIM vocabularies), which a FIM request stops at as at EOS.

use crate::tokenizer::Tokenizer;

/// The FIM token sets, (prefix, suffix, middle), as the vocabularies spell them.
const SETS: [[&str; 3]; 3] = [
    ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"],
    ["<fim_prefix>", "<fim_suffix>", "<fim_middle>"],
    ["<\u{ff5c}fim\u{2581}begin\u{ff5c}>", "<\u{ff5c}fim\u{2581}hole\u{ff5c}>", "<\u{ff5c}fim\u{2581}end\u{ff5c}>"],
];

/// Tokens that end an infill where the vocabulary has them.
const ENDS: [&str; 9] = [
    "<|endoftext|>",
    "<|fim_pad|>",
    "<|file_sep|>",
    "<|repo_name|>",
    "<|file_separator|>",
    "<fim_pad>",
    "<file_sep>",
    "<reponame>",
    "<\u{ff5c}end\u{2581}of\u{2581}sentence\u{ff5c}>",
];

/// A vocabulary's FIM tokens.
#[derive(Clone, Debug, PartialEq)]
pub struct Fim {
    pub prefix: u32,
    pub suffix: u32,
    pub middle: u32,
    /// The tokens an infill stops at (besides the model's EOS), sorted.
    pub ends: Vec<u32>,
}

impl Fim {
    /// The FIM set `tokenizer` has, if any: each of its three tokens one token of the
    /// vocabulary that its text encodes to (an added token, not pieces that happen to merge).
    pub fn detect(tokenizer: &Tokenizer) -> Option<Self> {
        let single = |text: &str| tokenizer.token_to_id(text).filter(|&id| tokenizer.encode(text, false) == [id]);
        SETS.iter().find_map(|[p, s, m]| {
            let (prefix, suffix, middle) = (single(p)?, single(s)?, single(m)?);
            let mut ends: Vec<u32> = ENDS.iter().filter_map(|t| single(t)).collect();
            ends.sort_unstable();
            ends.dedup();
            Some(Self { prefix, suffix, middle, ends })
        })
    }

    /// The prompt the model reads: `lead` (the tokenizer's BOS, when it adds one), then
    /// `<PRE> prompt <SUF> suffix <MID>`.
    pub fn layout(&self, lead: &[u32], prompt: &[u32], suffix: &[u32]) -> Vec<u32> {
        let mut ids = Vec::with_capacity(lead.len() + prompt.len() + suffix.len() + 3);
        ids.extend_from_slice(lead);
        ids.push(self.prefix);
        ids.extend_from_slice(prompt);
        ids.push(self.suffix);
        ids.extend_from_slice(suffix);
        ids.push(self.middle);
        ids
    }
}
