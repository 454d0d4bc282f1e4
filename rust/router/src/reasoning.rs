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

use std::collections::VecDeque;

const OPEN: &str = "<think>";
/// The marker that ends a think block.
pub const CLOSE: &str = "</think>";

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
            parser @ Self::Think => {
                Some(ReasoningPlan { parser, prompt_opened: prompt_opens(prompt), budget: None, hidden: false })
            }
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
    /// `thinking_token_budget`: the most tokens a choice may think ([`ThinkingBudget`]).
    pub budget: Option<u32>,
    /// `include_reasoning: false` (vLLM's): the thinking is split off the content, counted in
    /// usage, and not returned (neither its text nor its tokens' logprobs).
    pub hidden: bool,
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
    /// Characters pushed so far: positions below are in the output's characters, as the
    /// detokenizer's token offsets are.
    pos: usize,
    /// Where the block's text begins (after `<think>`), and where `</think>` begins.
    opened_at: Option<usize>,
    closed_at: Option<usize>,
    /// Where the text of each token pushed and not yet classified starts and ends: one that
    /// ends in held-back text may hold part of a marker.
    undecided: VecDeque<(usize, usize)>,
    /// Tokens whose text lies inside the block (not those holding part of a marker).
    tokens: u64,
    /// Tokens pushed with their offsets (listed in the output).
    listed: u64,
}

impl ReasoningSplitter {
    pub fn new(plan: ReasoningPlan) -> Self {
        let state = if plan.prompt_opened { State::Inside } else { State::Before };
        Self {
            state,
            buf: String::new(),
            pos: 0,
            opened_at: plan.prompt_opened.then_some(0),
            closed_at: None,
            undecided: VecDeque::new(),
            tokens: 0,
            listed: 0,
        }
    }

    /// [`Self::push`], with the output offsets (in characters) where the tokens that spelled
    /// `text` start (the detokenizer's): each token's text runs to the next one's start, the
    /// last one's to the end of `text`. A token counts as reasoning once its text is known to
    /// lie inside the block.
    pub fn push_tokens(&mut self, text: &str, starts: impl IntoIterator<Item = usize>) -> Split {
        let out = self.push(text);
        let mut starts = starts.into_iter().peekable();
        while let Some(start) = starts.next() {
            let end = starts.peek().copied().unwrap_or(self.pos);
            self.undecided.push_back((start, end.max(start)));
            self.listed += 1;
        }
        self.classify(self.pos - self.buf.chars().count());
        out
    }

    /// Whether a token whose text starts at `start` (output characters, as pushed) is part of
    /// the content: before a `<think>` the output opened, or after `</think>`; not inside the
    /// block or its markers. Known for every token pushed so far.
    pub fn in_content(&self, start: usize) -> bool {
        let Some(open) = self.opened_at else { return true };
        // (a block the prompt opened has no marker and nothing before it in the output)
        let before = open >= OPEN.len() && start + OPEN.len() < open;
        before || self.closed_at.is_some_and(|c| start >= c + CLOSE.len())
    }

    /// The reasoning tokens counted so far (OpenAI's `completion_tokens_details.reasoning_tokens`).
    pub fn reasoning_tokens(&self) -> u64 {
        self.tokens
    }

    /// Classifies the tokens whose text ends by `decided` (text that can no longer be part
    /// of a marker; all of it once the block has closed).
    fn classify(&mut self, decided: usize) {
        let decided = if self.state == State::After { usize::MAX } else { decided };
        while let Some(&(start, end)) = self.undecided.front().filter(|&&(_, e)| e <= decided) {
            self.undecided.pop_front();
            let inside = self.opened_at.is_some_and(|o| start >= o) && self.closed_at.is_none_or(|c| end <= c);
            self.tokens += u64::from(inside);
        }
    }

    /// Classifies `text` (after whatever was held back); returns what is decided now.
    pub fn push(&mut self, text: &str) -> Split {
        self.buf.push_str(text);
        self.pos += text.chars().count();
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
                let marker_at = self.pos - self.buf.chars().count() + self.buf[..at].chars().count();
                self.buf.drain(..at + marker.len());
                if self.state == State::Before {
                    self.state = State::Inside;
                    self.opened_at = Some(marker_at + marker.len());
                } else {
                    self.state = State::After;
                    self.closed_at = Some(marker_at);
                }
                continue;
            }
            let keep = partial_suffix(&self.buf, marker);
            let cut = self.buf.len() - keep;
            target.push_str(&self.buf[..cut]);
            self.buf.drain(..cut);
            return out;
        }
    }

    /// The choice ended after `generated` tokens: what was held back goes where it stands
    /// (unterminated reasoning stays reasoning). Tokens never listed with text (an ending eos
    /// or stop token, text a stop string cut) are reasoning if the block is still open.
    pub fn finish(&mut self, generated: u64) -> Split {
        let rest = std::mem::take(&mut self.buf);
        self.classify(usize::MAX);
        if self.state == State::Inside {
            self.tokens += generated.saturating_sub(self.listed);
        }
        match self.state {
            State::Inside => Split { reasoning: rest, content: String::new() },
            _ => Split { reasoning: String::new(), content: rest },
        }
    }
}

/// `thinking_token_budget` for one sequence: counts the tokens it generates inside its think
/// block and, once `budget` of them have come with the block still open, asks for the tokens
/// of `</think>`, one per step ([`Self::forced`]); the answer then follows as the model writes
/// it. The markers are found in the tokens' bytes, so one spelled by several tokens counts.
///
/// The count includes a token that holds the start of a `</think>` the model spells over
/// several tokens, which [`ReasoningSplitter::reasoning_tokens`] leaves out: the tokens usage
/// reports as reasoning are never more than the budget.
#[derive(Clone, Debug)]
pub struct ThinkingBudget {
    budget: u32,
    /// The ids that spell `</think>`.
    close: std::sync::Arc<[u32]>,
    phase: Phase,
    /// The last bytes generated, shorter than a marker: where one split across tokens starts.
    tail: Vec<u8>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// No block opened yet (the prompt did not open one).
    Before,
    /// Inside the block, after this many tokens.
    Inside(u32),
    /// The budget is spent: `close[i]` comes next.
    Closing(usize),
    /// The block closed; nothing more to bound.
    Done,
}

impl ThinkingBudget {
    /// `close`: the ids `</think>` encodes to. `prompt_opened`: the output starts inside the
    /// block.
    pub fn new(budget: u32, close: std::sync::Arc<[u32]>, prompt_opened: bool) -> Self {
        let mut b = Self { budget, close, phase: Phase::Before, tail: Vec::new() };
        if prompt_opened {
            b.enter(0);
        }
        b
    }

    /// The token the sequence's next step must sample, while the budget closes its block.
    pub fn forced(&self) -> Option<u32> {
        match self.phase {
            Phase::Closing(i) => self.close.get(i).copied(),
            _ => None,
        }
    }

    /// Whether [`Self::push`] reads the tokens' bytes: before the block has closed or its
    /// closing began.
    pub fn reads_text(&self) -> bool {
        matches!(self.phase, Phase::Before | Phase::Inside(_))
    }

    /// Whether a step within the next two may be forced: the plan after one holding this
    /// sequence must wait for its token (with a step planned ahead, the mask of the step
    /// after this one would otherwise be chosen before this step's token is known).
    pub fn may_force_soon(&self) -> bool {
        let steps_left = match self.phase {
            Phase::Before => u64::from(self.budget) + 1,
            Phase::Inside(n) => u64::from(self.budget - n),
            Phase::Closing(_) => 0,
            Phase::Done => return false,
        };
        steps_left <= 2
    }

    /// The sequence generated token `id`, whose bytes are `bytes`.
    pub fn push(&mut self, id: u32, bytes: &[u8]) {
        match self.phase {
            Phase::Done => return,
            Phase::Closing(i) => {
                // (a token other than the one asked for: a mask that could not force it,
                // a grammar's or allowed_token_ids'; the budget gives way)
                let next = i + 1;
                self.phase = if self.close.get(i) == Some(&id) && next < self.close.len() {
                    Phase::Closing(next)
                } else {
                    Phase::Done
                };
                return;
            }
            Phase::Before | Phase::Inside(_) => {}
        }
        let mut window = std::mem::take(&mut self.tail);
        window.extend_from_slice(bytes);
        if self.phase == Phase::Before {
            let Some(at) = find(&window, OPEN.as_bytes()) else {
                self.keep_tail(&window);
                return;
            };
            let from = at + OPEN.len();
            self.enter(0);
            if find(&window[from..], CLOSE.as_bytes()).is_some() {
                self.phase = Phase::Done;
            }
            // (the token that opened the block is not counted)
            self.keep_tail(&window[from..]);
            return;
        }
        if find(&window, CLOSE.as_bytes()).is_some() {
            self.phase = Phase::Done;
            return;
        }
        if let Phase::Inside(n) = self.phase {
            self.enter(n + 1);
        }
        self.keep_tail(&window);
    }

    /// Inside the block after `n` tokens: closing once they reach the budget.
    fn enter(&mut self, n: u32) {
        self.phase = if n < self.budget {
            Phase::Inside(n)
        } else if self.close.is_empty() {
            Phase::Done // (nothing spells the close: there is nothing to force)
        } else {
            Phase::Closing(0)
        };
    }

    fn keep_tail(&mut self, window: &[u8]) {
        let keep = window.len().min(CLOSE.len() - 1);
        self.tail = window[window.len() - keep..].to_vec();
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
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
        ReasoningPlan { parser: ReasoningParser::Think, prompt_opened, budget: None, hidden: false }
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
        let rest = s.finish(0);
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

    /// Reasoning tokens after pushing `tokens` one at a time (each with its own text) and
    /// finishing.
    fn count(opened: bool, tokens: &[&str]) -> u64 {
        let mut s = ReasoningSplitter::new(plan(opened));
        let mut at = 0;
        for t in tokens {
            s.push_tokens(t, [at]);
            at += t.chars().count();
        }
        s.finish(tokens.len() as u64);
        s.reasoning_tokens()
    }

    /// Which of `tokens` (pushed one at a time) `in_content` counts as the answer's.
    fn content_tokens(opened: bool, tokens: &[&str]) -> Vec<bool> {
        let mut s = ReasoningSplitter::new(plan(opened));
        let mut at = 0;
        let mut starts = Vec::new();
        for t in tokens {
            s.push_tokens(t, [at]);
            starts.push(at);
            at += t.chars().count();
        }
        starts.into_iter().map(|start| s.in_content(start)).collect()
    }

    #[test]
    fn content_tokens_are_those_outside_the_block_and_its_markers() {
        assert_eq!(content_tokens(true, &["a", "</think>", "b", "c"]), [false, false, true, true]);
        assert_eq!(content_tokens(false, &["x", "<think>", "a", "</think>", "b"]), [true, false, false, false, true]);
        // a marker spelled by several tokens: none of them is the answer's
        assert_eq!(content_tokens(true, &["a", "</", "think", ">", "b"]), [false, false, false, false, true]);
        // no block at all: every token is
        assert_eq!(content_tokens(false, &["a", "b"]), [true, true]);
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
        // reasoning that ends with the marker's first characters (audit 38, A38-1)
        assert_eq!(count(true, &["a", "</", "</", "think>", "c"]), 2);
        assert_eq!(count(true, &["a<", "/think>"]), 0, "a token holding part of a marker is no reasoning");
        assert_eq!(count(false, &["x<th", "ink>y", "z"]), 1);
    }

    #[test]
    fn tokens_are_placed_by_their_offsets() {
        // The detokenizer may release several tokens' text at once (held for a stop string),
        // or a token with no text yet (part of a character): offsets place them.
        let mut s = ReasoningSplitter::new(plan(true));
        s.push_tokens("é a", [0, 0, 1, 2]);
        assert_eq!(s.reasoning_tokens(), 4);
        s.push_tokens("b</", [3, 4]);
        assert_eq!(s.reasoning_tokens(), 5, "a token that may hold part of the marker waits");
        s.push_tokens("think>ok", [6, 12]);
        s.finish(9);
        assert_eq!(s.reasoning_tokens(), 5, "an unlisted eos after the block is not reasoning");
        // bytes that never made a character are replaced, and the token after them reads as
        // starting where they do: it holds the marker all the same (audit 38)
        let mut s = ReasoningSplitter::new(plan(true));
        s.push_tokens("\u{fffd}</think>Y", [0, 0, 9]);
        s.finish(3);
        assert_eq!(s.reasoning_tokens(), 1);
    }

    #[test]
    fn tokens_without_text_that_end_the_thinking_are_reasoning() {
        // an eos or stop token not shown, or a stop string's tokens cut from the text, while
        // the block is open (audit 39, A39-1)
        let mut s = ReasoningSplitter::new(plan(true));
        s.push_tokens("ab", [0, 1]);
        s.finish(4);
        assert_eq!(s.reasoning_tokens(), 4);
        let mut s = ReasoningSplitter::new(plan(false));
        s.push_tokens("ab", [0, 1]);
        s.finish(3);
        assert_eq!(s.reasoning_tokens(), 0, "no block, no reasoning");
    }

    /// The tokens a budget forces while `tokens` are generated one at a time (each forced one
    /// taken in place of the next), and the tokens generated in all.
    fn forced_run(budget: u32, opened: bool, tokens: &[&str]) -> (Vec<u32>, usize) {
        const CLOSE_IDS: [u32; 3] = [900, 901, 902];
        let spelled = ["</", "think", ">"];
        let mut b = ThinkingBudget::new(budget, CLOSE_IDS.into(), opened);
        let (mut forced, mut generated) = (Vec::new(), 0);
        let mut sampled = tokens.iter().copied();
        loop {
            let (id, text) = match b.forced() {
                Some(id) => {
                    forced.push(id);
                    (id, spelled[(id - 900) as usize])
                }
                None => match sampled.next() {
                    Some(t) => (1, t),
                    None => return (forced, generated),
                },
            };
            b.push(id, text.as_bytes());
            generated += 1;
        }
    }

    #[test]
    fn a_budget_closes_the_block_after_that_many_tokens() {
        let close = vec![900, 901, 902];
        assert_eq!(forced_run(2, true, &["a", "b", "c", "d"]), (close.clone(), 7), "a, b, then </think>, c, d");
        assert_eq!(forced_run(0, true, &["a"]), (close.clone(), 4), "0: closed at once");
        // opened by the output: the opening token is not counted
        assert_eq!(forced_run(1, false, &["x", "<think>", "a", "b"]), (close.clone(), 7));
        assert_eq!(forced_run(0, false, &["x<th", "ink>", "b"]), (close.clone(), 6), "a marker over two tokens");
        // closed by the model within the budget: nothing forced, and no later block is bounded
        assert_eq!(forced_run(3, true, &["a", "</think>", "b", "<think>", "c", "d", "e", "f"]), (vec![], 8));
        assert_eq!(forced_run(3, true, &["a", "</thi", "nk>", "b", "c"]), (vec![], 5));
        assert_eq!(forced_run(5, false, &["no", " block", " at", " all", "x", "y", "z"]), (vec![], 7));
        // an open and a close in one token
        assert_eq!(forced_run(0, false, &["<think></think>", "a"]), (vec![], 2));
    }

    #[test]
    fn a_budget_gives_way_to_a_token_it_did_not_ask_for() {
        let mut b = ThinkingBudget::new(1, [900, 901].into(), true);
        b.push(5, b"a");
        assert_eq!(b.forced(), Some(900));
        b.push(7, b"b"); // (a grammar or allowed_token_ids kept 900 out)
        assert_eq!(b.forced(), None);
        b.push(8, b"c");
        assert_eq!(b.forced(), None, "done: not forced again");
    }

    #[test]
    fn may_force_soon_starts_two_steps_before_the_close() {
        let mut b = ThinkingBudget::new(4, [900].into(), false);
        let mut soon = Vec::new();
        for t in ["x", "<think>", "a", "b", "c", "d"] {
            soon.push(b.may_force_soon());
            b.push(1, t.as_bytes());
        }
        soon.push(b.may_force_soon());
        // before: 5 steps away; after <think>: 4; after a, b: 2
        assert_eq!(soon, [false, false, false, false, true, true, true]);
        assert_eq!(b.forced(), Some(900));
        b.push(900, b"</think>");
        assert!(!b.may_force_soon());
        assert!(ThinkingBudget::new(1, [900].into(), false).may_force_soon(), "open then force: 2 steps");
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
