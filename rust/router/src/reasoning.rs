//! Reasoning output: the `--reasoning-parser` setting and the splitter that separates a
//! reasoning model's thinking (between `<think>` and `</think>`) from its answer.
//!
//! Chat choices run their text through a [`ReasoningSplitter`]; what lies between the
//! markers becomes `reasoning_content`, what follows `</think>` is `content`, and the markers
//! themselves are dropped. Templates that already open the block in the prompt (Qwen3 ends
//! the generation prompt with `<think>\n`) make the output reasoning from its first token.
//!
//! Invariant (streaming): a marker split across pushes never leaks in part: a suffix that
//! could still grow into the marker being looked for is held back until it can be decided,
//! as the detokenizer does for stop strings.

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

/// `--reasoning-parser` values; None in [`crate::router::RouterConfig`] detects it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Deserialize)]
pub enum ReasoningParser {
    /// Text between `<think>` and `</think>` is reasoning.
    #[serde(rename = "think")]
    Think,
    /// No reasoning parsing.
    #[serde(rename = "none")]
    Off,
}

impl ReasoningParser {
    pub fn name(self) -> &'static str {
        match self {
            Self::Think => "think",
            Self::Off => "none",
        }
    }

    pub fn from_name(s: &str) -> Option<Self> {
        match s {
            "think" => Some(Self::Think),
            "none" => Some(Self::Off),
            _ => None,
        }
    }

    /// The parser a chat template implies: `think` when it mentions `<think>`.
    pub fn detect(template_source: &str) -> Self {
        if template_source.contains(OPEN) {
            Self::Think
        } else {
            Self::Off
        }
    }

    /// The plan for a chat request: the configured parser (or the detected one) and whether
    /// the rendered prompt already opened the think block. None when no parser is active.
    pub fn plan(configured: Option<Self>, template_source: &str, prompt: &str) -> Option<ReasoningPlan> {
        match configured.unwrap_or_else(|| Self::detect(template_source)) {
            Self::Off => None,
            parser @ Self::Think => Some(ReasoningPlan { parser, prompt_opened: prompt_opens(prompt) }),
        }
    }
}

/// Whether the prompt ends with a closed think block (Qwen3 with `enable_thinking: false`
/// renders an empty one): the answer comes next.
pub fn prompt_closes(prompt: &str) -> bool {
    prompt.trim_end().ends_with(CLOSE)
}

/// Whether the prompt ends inside an open think block (ignoring trailing whitespace).
fn prompt_opens(prompt: &str) -> bool {
    prompt.trim_end().ends_with(OPEN)
}

/// How a chat request's output is read for reasoning.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReasoningPlan {
    pub parser: ReasoningParser,
    /// The rendered prompt ends with `<think>`: the output starts as reasoning.
    pub prompt_opened: bool,
}

/// What a push or the finish produced, in order: reasoning comes before content.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Split {
    pub reasoning: String,
    pub content: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Before `<think>`: text is content (a model may skip thinking).
    Before,
    Inside,
    /// After `</think>`: everything is content, markers included.
    After,
}

/// Splits one choice's generated text into reasoning and content, incrementally.
#[derive(Debug)]
pub struct ReasoningSplitter {
    state: State,
    /// Held-back text: a suffix that may be the start of the marker looked for.
    buf: String,
    /// Tokens generated inside the block, not counting those that spell its markers.
    tokens: u64,
    /// Tokens inside the block whose text is held back as a possible `</think>`: reasoning
    /// unless that marker completes.
    held_tokens: u64,
}

impl ReasoningSplitter {
    pub fn new(plan: ReasoningPlan) -> Self {
        let state = if plan.prompt_opened { State::Inside } else { State::Before };
        Self { state, buf: String::new(), tokens: 0, held_tokens: 0 }
    }

    /// [`Self::push`] for the text of one generated token, which counts as a reasoning token
    /// when it lies inside the block (the tokens that complete a marker do not).
    pub fn push_token(&mut self, text: &str) -> Split {
        let inside = self.state == State::Inside;
        let out = self.push(text);
        if inside {
            if self.state != State::Inside {
                self.held_tokens = 0;
            } else if self.buf.is_empty() {
                self.tokens += 1 + std::mem::take(&mut self.held_tokens);
            } else {
                self.held_tokens += 1;
            }
        }
        out
    }

    /// The reasoning tokens counted so far (OpenAI's `completion_tokens_details.reasoning_tokens`).
    pub fn reasoning_tokens(&self) -> u64 {
        self.tokens
    }

    /// Classifies `text` (after whatever was held back); returns what is decided now.
    pub fn push(&mut self, text: &str) -> Split {
        self.buf.push_str(text);
        let mut out = Split::default();
        loop {
            let marker = match self.state {
                State::Before => OPEN,
                State::Inside => CLOSE,
                State::After => {
                    out.content.push_str(&self.buf);
                    self.buf.clear();
                    return out;
                }
            };
            let target = if self.state == State::Inside { &mut out.reasoning } else { &mut out.content };
            if let Some(at) = self.buf.find(marker) {
                target.push_str(&self.buf[..at]);
                self.buf.drain(..at + marker.len());
                self.state = if self.state == State::Before { State::Inside } else { State::After };
                continue;
            }
            let keep = partial_suffix(&self.buf, marker);
            let cut = self.buf.len() - keep;
            target.push_str(&self.buf[..cut]);
            self.buf.drain(..cut);
            return out;
        }
    }

    /// The choice ended: what was held back goes where it stands (unterminated reasoning
    /// stays reasoning).
    pub fn finish(&mut self) -> Split {
        let rest = std::mem::take(&mut self.buf);
        if self.state == State::Inside {
            self.tokens += std::mem::take(&mut self.held_tokens);
        }
        match self.state {
            State::Inside => Split { reasoning: rest, content: String::new() },
            _ => Split { reasoning: String::new(), content: rest },
        }
    }
}

/// The length of the longest proper prefix of `marker` that `text` ends with.
fn partial_suffix(text: &str, marker: &str) -> usize {
    (1..marker.len().min(text.len() + 1))
        .rev()
        .find(|&k| text.is_char_boundary(text.len() - k) && text.ends_with(&marker[..k]))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(prompt_opened: bool) -> ReasoningPlan {
        ReasoningPlan { parser: ReasoningParser::Think, prompt_opened }
    }

    /// Runs `pieces` through a splitter and finishes it.
    fn run(opened: bool, pieces: &[&str]) -> Split {
        let mut s = ReasoningSplitter::new(plan(opened));
        let mut all = Split::default();
        for p in pieces {
            // A leaked piece of a marker would show in the concatenation.
            let out = s.push(p);
            all.reasoning.push_str(&out.reasoning);
            all.content.push_str(&out.content);
        }
        let rest = s.finish();
        all.reasoning.push_str(&rest.reasoning);
        all.content.push_str(&rest.content);
        all
    }

    fn split(reasoning: &str, content: &str) -> Split {
        Split { reasoning: reasoning.into(), content: content.into() }
    }

    #[test]
    fn whole_text_splits_at_the_markers() {
        assert_eq!(run(false, &["<think>hmm, 2+2</think>It is 4."]), split("hmm, 2+2", "It is 4."));
        assert_eq!(run(true, &["hmm</think>4"]), split("hmm", "4"));
    }

    #[test]
    fn a_split_at_every_byte_position_gives_the_same_result() {
        let text = "<think>ré sumé</think>an¢ swer";
        for opened in [false, true] {
            let text = if opened { &text[OPEN.len()..] } else { text };
            let expected = split("ré sumé", "an¢ swer");
            for i in (0..=text.len()).filter(|&i| text.is_char_boundary(i)) {
                for j in (i..=text.len()).filter(|&j| text.is_char_boundary(j)) {
                    let got = run(opened, &[&text[..i], &text[i..j], &text[j..]]);
                    assert_eq!(got, expected, "cut at {i} and {j}");
                }
            }
            let bytes: Vec<String> = text.chars().map(String::from).collect();
            let pieces: Vec<&str> = bytes.iter().map(String::as_str).collect();
            assert_eq!(run(opened, &pieces), expected);
        }
    }

    #[test]
    fn text_without_markers_is_content() {
        assert_eq!(run(false, &["just ", "an answer < 3 <t"]), split("", "just an answer < 3 <t"));
        // A held-back prefix that turns out not to be a marker is released in order.
        let mut s = ReasoningSplitter::new(plan(false));
        assert_eq!(s.push("a <thi"), split("", "a "));
        assert_eq!(s.push("s"), split("", "<this"));
    }

    #[test]
    fn unterminated_reasoning_is_all_reasoning() {
        assert_eq!(run(true, &["still thinking </thi"]), split("still thinking </thi", ""));
        assert_eq!(run(false, &["<think>still", " thinking"]), split("still thinking", ""));
    }

    /// Reasoning tokens after pushing `tokens` one at a time and finishing.
    fn count(opened: bool, tokens: &[&str]) -> u64 {
        let mut s = ReasoningSplitter::new(plan(opened));
        for t in tokens {
            s.push_token(t);
        }
        s.finish();
        s.reasoning_tokens()
    }

    #[test]
    fn reasoning_tokens_are_those_inside_the_block_without_its_markers() {
        assert_eq!(count(false, &["<think>", "a", "b", "</think>", "c"]), 2);
        assert_eq!(count(true, &["a", "b", "</think>", "c", "d"]), 2);
        // a marker spelled by several tokens: none of them is reasoning
        assert_eq!(count(true, &["a", "</", "think", ">", "c"]), 1);
        // held as a possible marker, then released: reasoning after all
        assert_eq!(count(true, &["a", "</", "b>", "c"]), 4);
        assert_eq!(count(true, &["a", "</thi"]), 2, "unterminated: the held token is reasoning");
        assert_eq!(count(false, &["no", " block", "<thi"]), 0);
        assert_eq!(count(false, &["<think>", "a", "</think>", "<think>", "b"]), 1, "after the block, content");
    }

    #[test]
    fn text_after_the_block_is_content_even_with_markers() {
        assert_eq!(run(false, &["<think>a</think>b<think>c</think>"]), split("a", "b<think>c</think>"));
    }

    #[test]
    fn the_plan_follows_the_setting_or_the_template() {
        let think_tpl = "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}";
        assert_eq!(ReasoningParser::plan(None, "plain", "p<think>\n"), None);
        assert_eq!(ReasoningParser::plan(None, think_tpl, "x<think>\n"), Some(plan(true)));
        assert_eq!(ReasoningParser::plan(None, think_tpl, "x<think>\n\n</think>\n\n"), Some(plan(false)));
        assert_eq!(ReasoningParser::plan(Some(ReasoningParser::Off), think_tpl, "x<think>"), None);
        assert_eq!(ReasoningParser::plan(Some(ReasoningParser::Think), "plain", "x"), Some(plan(false)));
        assert_eq!(ReasoningParser::from_name("think"), Some(ReasoningParser::Think));
        assert_eq!(ReasoningParser::from_name("none"), Some(ReasoningParser::Off));
        assert_eq!(ReasoningParser::from_name("x"), None);
    }
}
