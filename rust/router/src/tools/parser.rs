//! The streaming tool-call parser: splits one choice's generated text into content and
//! calls as it arrives, so a call's name goes out as soon as it is known and its arguments
//! follow in fragments.
//!
//! A call is *committed* once its opening markup, its function name and the start of its
//! arguments object have been read (`{"name": "f", "arguments": {`, or `<function=f>` in
//! XML); from then on it is a call whatever follows, and its arguments are the model's own
//! argument text, fragment by fragment. Before that point, text that turns out not to be a
//! call is given back as content.
//!
//! Under a forced `tool_choice` ([`ToolCallParser::forced`]) the grammar lets the output be
//! nothing but calls, so there is nothing to give back: a call commits as soon as its name
//! is complete (the closing quote of the name string; `<function=f>` in XML), and markup
//! left unfinished when the output ends (a call cut off before its name, a dangling
//! `<tool_call>`) is dropped, never returned as content. A call whose JSON puts `arguments` before `name`, or
//! sends arguments as a JSON string, cannot be streamed: it is read whole and sent in one
//! piece when it closes (arguments then re-serialized compactly).
//!
//! Invariants:
//! - The parser never loses text: what is not part of a call is content; only whitespace
//!   (and `;` between llama3 calls) around calls is dropped, and, forced, call markup the
//!   output ended inside.
//! - The events' meaning does not depend on how the text was split into pushes: the
//!   content, and each call's name and concatenated arguments, are the same.
//! - A call that ends complete has arguments that concatenate to the JSON of an object; one
//!   cut off (the output ran out) keeps the arguments sent so far, as OpenAI does.

use std::collections::HashMap;
use std::sync::Arc;

use serde_json::Value;

use super::xml::{XmlProgress, XmlReader};
use super::{call_id, ToolCallFormat, CLOSE, MISTRAL_TAG, OPEN, PYTHON_TAG};

/// One step of a choice's output, in order.
#[derive(Clone, Debug, PartialEq)]
pub enum ToolEvent {
    /// Text outside calls.
    Content(String),
    /// A call begins (streamed with its index, id, type and name).
    Start { id: String, name: String },
    /// The next fragment of the current call's arguments.
    Args(String),
    /// The current call is complete.
    End,
}

/// Splits one choice's generated text into content and tool calls, incrementally.
pub struct ToolCallParser {
    format: ToolCallFormat,
    /// The grammar forces calls: commit at the name, drop unfinished markup at the end.
    forced: bool,
    parameters: Arc<HashMap<String, Value>>,
    /// Text not yet consumed.
    buf: String,
    state: State,
    /// Whitespace seen since the last non-whitespace content: emitted when more content
    /// follows, dropped when a call follows.
    held_ws: String,
    /// Right after a call: whitespace (and llama3's `;`) separates calls, it is not content.
    after_call: bool,
    /// Nothing but whitespace has been seen so far (mistral and json read a bare leading
    /// array or object).
    at_start: bool,
    /// Calls begun, and completed.
    started: usize,
    ended: usize,
    out: Vec<ToolEvent>,
}

/// Where the parser is; `given` in each holds the text consumed since the opening marker,
/// given back as content if what follows turns out not to be a call.
enum State {
    Text,
    /// After a marker, skipping whitespace to the call (or array) that must follow.
    Open {
        given: String,
        then: Container,
    },
    /// Reading one JSON call object.
    Call {
        given: String,
        reader: CallReader,
        then: Container,
    },
    /// Between calls of an array: `,` (next call) or `]` (the end).
    Between,
    /// After a call's JSON, before the block's close tag.
    Closing {
        tag: &'static str,
    },
    /// Inside a Qwen3 XML block.
    Xml {
        given: String,
        reader: XmlReader,
    },
}

/// What holds the calls after the opening marker.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Container {
    /// One call object, then the block's close tag (Hermes).
    Block,
    /// One call object and nothing else (llama3, json).
    Single,
    /// `[` call (`,` call)* `]` (mistral, json with parallel calls).
    Array,
    /// Inside the array, the next element must be a call object.
    InArray,
}

impl ToolCallParser {
    pub fn new(format: ToolCallFormat, parameters: Arc<HashMap<String, Value>>) -> Self {
        Self {
            format,
            forced: false,
            parameters,
            buf: String::new(),
            state: State::Text,
            held_ws: String::new(),
            after_call: false,
            at_start: true,
            started: 0,
            ended: 0,
            out: Vec::new(),
        }
    }

    /// A parser for output that a forced `tool_choice` grammar constrains to calls only.
    pub fn forced(mut self, forced: bool) -> Self {
        self.forced = forced;
        self
    }

    /// Reads `text` as if the output began with it (its events come with the first push):
    /// the start of a call whose rest the output is.
    pub fn given(mut self, text: &str) -> Self {
        self.buf.insert_str(0, text);
        self
    }

    /// Calls completed so far.
    pub fn calls_ended(&self) -> usize {
        self.ended
    }

    /// Calls begun so far (complete or not).
    pub fn calls_started(&self) -> usize {
        self.started
    }

    pub fn push(&mut self, text: &str) -> Vec<ToolEvent> {
        self.buf.push_str(text);
        while self.step() {}
        std::mem::take(&mut self.out)
    }

    /// Generation ended: classify what is left.
    pub fn finish(&mut self) -> Vec<ToolEvent> {
        while self.step() {}
        let rest = std::mem::take(&mut self.buf);
        let state = std::mem::replace(&mut self.state, State::Text);
        if self.forced {
            self.finish_forced(state, &rest);
            return std::mem::take(&mut self.out);
        }
        match state {
            State::Text => self.content(&rest),
            State::Open { given, .. } => self.content(&format!("{given}{rest}")),
            State::Call { given, reader, .. } if !reader.committed() => {
                self.content(&format!("{given}{}", reader.text))
            }
            State::Call { reader, .. } => {
                // Cut off inside a committed call: its arguments so far stay (they went out
                // as they came); a call whose arguments object closed is complete.
                if reader.args_done() {
                    self.end_call();
                }
            }
            State::Xml { given, reader } if !reader.committed() => self.content(&format!("{given}{}", reader.text())),
            // Cut off inside a committed XML call: the parameters sent so far stay.
            State::Xml { .. } => {}
            // A close tag cut short is markup, not content.
            State::Closing { tag } if tag.starts_with(rest.trim()) => {}
            State::Between | State::Closing { .. } => self.content(&rest),
        }
        if self.started == 0 {
            let ws = std::mem::take(&mut self.held_ws);
            self.content_raw(ws);
        }
        std::mem::take(&mut self.out)
    }

    /// `finish` under a forced choice: the output can only have been calls, so whatever
    /// call markup it ended inside is dropped rather than returned as content.
    fn finish_forced(&mut self, state: State, rest: &str) {
        match state {
            // A call cut off after its arguments object closed is complete.
            State::Call { reader, .. } if reader.args_done() => self.end_call(),
            // Text the grammar allowed outside calls (none in the built-in formats): content.
            State::Closing { tag } if tag.starts_with(rest.trim()) => {}
            State::Text | State::Between | State::Closing { .. } => {
                let held_marker = self.markers().iter().any(|m| m.starts_with(rest.trim()));
                if !held_marker {
                    self.content(rest);
                }
            }
            // A call cut off before its name, or after it (its arguments so far stay).
            State::Open { .. } | State::Call { .. } | State::Xml { .. } => {}
        }
    }

    /// Advances one state transition; false when it needs more text.
    fn step(&mut self) -> bool {
        match std::mem::replace(&mut self.state, State::Text) {
            State::Text => self.step_text(),
            State::Open { mut given, then } => {
                let ws = self.buf.len() - self.buf.trim_start().len();
                given.extend(self.buf.drain(..ws));
                let want = if then == Container::Array { '[' } else { '{' };
                match self.buf.chars().next() {
                    None => {
                        self.state = State::Open { given, then };
                        false
                    }
                    Some(c) if c == want && then == Container::Array => {
                        given.push(self.buf.remove(0));
                        self.state = State::Open { given, then: Container::InArray };
                        true
                    }
                    Some(c) if c == want => {
                        let reader = CallReader::new(self.format, self.forced, self.parameters.clone());
                        self.state = State::Call { given, reader, then };
                        true
                    }
                    Some(_) => {
                        self.give_back(given);
                        true
                    }
                }
            }
            State::Call { given, mut reader, then } => {
                let was_committed = reader.committed();
                let done = reader.feed(&mut self.buf, &mut self.out);
                if !was_committed && reader.committed() {
                    self.began_call();
                }
                if !done {
                    self.state = State::Call { given, reader, then };
                    return false;
                }
                if !reader.committed() {
                    match reader.whole_call() {
                        Some((name, arguments)) => {
                            self.start_call(name);
                            self.out.push(ToolEvent::Args(arguments));
                        }
                        None => {
                            // Not a call: all of it is content (what follows the object is
                            // read as text again).
                            self.give_back(format!("{given}{}", reader.text));
                            return true;
                        }
                    }
                }
                self.end_call();
                self.state = match then {
                    Container::Block => State::Closing { tag: CLOSE },
                    Container::InArray | Container::Array => State::Between,
                    Container::Single => State::Text,
                };
                true
            }
            State::Between => {
                let ws = self.buf.len() - self.buf.trim_start().len();
                self.buf.drain(..ws);
                match self.buf.chars().next() {
                    None => {
                        self.state = State::Between;
                        false
                    }
                    Some(',') => {
                        let comma = self.buf.remove(0).to_string();
                        self.state = State::Open { given: comma, then: Container::InArray };
                        true
                    }
                    Some(']') => {
                        self.buf.remove(0);
                        true
                    }
                    // A broken array after complete calls: the rest is text.
                    Some(_) => true,
                }
            }
            State::Closing { tag } => {
                let ws = self.buf.len() - self.buf.trim_start().len();
                let rest = &self.buf[ws..];
                if rest.starts_with(tag) {
                    self.buf.drain(..ws + tag.len());
                    true
                } else if tag.starts_with(rest) {
                    self.state = State::Closing { tag };
                    false
                } else {
                    // Text where the close tag belongs: content, and so is the tag if it
                    // follows.
                    true
                }
            }
            State::Xml { given, mut reader } => {
                let was_committed = reader.committed();
                let progress = reader.feed(&mut self.buf, &mut self.out, &self.parameters);
                if !was_committed && reader.committed() {
                    self.began_call();
                }
                match progress {
                    XmlProgress::NeedMore => {
                        self.state = State::Xml { given, reader };
                        false
                    }
                    XmlProgress::NotACall => {
                        let text = format!("{given}{}", reader.text());
                        self.give_back(text);
                        true
                    }
                    XmlProgress::Done => {
                        self.end_call();
                        self.state = State::Closing { tag: CLOSE };
                        true
                    }
                }
            }
        }
    }

    /// In text: emits content up to the next marker and opens it; false when the rest may
    /// still grow into a marker.
    fn step_text(&mut self) -> bool {
        if let Some(open) = self.leading_open() {
            return open;
        }
        let found = self.markers().iter().filter_map(|m| self.buf.find(m).map(|i| (i, *m))).min_by_key(|(i, _)| *i);
        if let Some((start, marker)) = found {
            let before: String = self.buf.drain(..start).collect();
            self.content(&before);
            self.open(marker);
            return true;
        }
        // Keep back the longest tail that may still grow into a marker.
        let keep = (1..self.buf.len() + 1)
            .rev()
            .find(|&k| {
                let i = self.buf.len() - k;
                self.buf.is_char_boundary(i)
                    && self.markers().iter().any(|m| m.len() > k && m.starts_with(&self.buf[i..]))
            })
            .unwrap_or(0);
        let emit: String = self.buf.drain(..self.buf.len() - keep).collect();
        self.content(&emit);
        false
    }

    /// At the very start of the output, the formats that read a bare leading JSON value
    /// (mistral's array without its tag, json's object or array). None: not at the start,
    /// or nothing to decide.
    fn leading_open(&mut self) -> Option<bool> {
        if !self.at_start || !matches!(self.format, ToolCallFormat::Mistral | ToolCallFormat::Json) {
            return None;
        }
        let lead = self.buf.len() - self.buf.trim_start().len();
        let head = &self.buf[lead..];
        if head.is_empty() {
            return Some(false);
        }
        if self.format == ToolCallFormat::Mistral && (head.starts_with(MISTRAL_TAG) || !head.starts_with('[')) {
            return None;
        }
        // "[", "[TOOL" ... may still grow into the tag: wait for more text.
        if self.format == ToolCallFormat::Mistral && MISTRAL_TAG.starts_with(head) {
            return Some(false);
        }
        let json = self.format == ToolCallFormat::Json;
        if json && !head.starts_with(['{', '[']) {
            // The json format's output is a call only when it is one from its first byte.
            self.at_start = false;
            return None;
        }
        let then = if head.starts_with('{') { Container::Single } else { Container::Array };
        self.buf.drain(..lead);
        self.at_start = false;
        self.state = State::Open { given: String::new(), then };
        Some(true)
    }

    fn markers(&self) -> &'static [&'static str] {
        match self.format {
            ToolCallFormat::Json => &[],
            ToolCallFormat::Hermes | ToolCallFormat::Qwen3Xml => &[OPEN],
            ToolCallFormat::Llama3Json => &[PYTHON_TAG, "{"],
            ToolCallFormat::Mistral => &[MISTRAL_TAG],
        }
    }

    /// `buf` starts with `marker`: enters the call it opens.
    fn open(&mut self, marker: &'static str) {
        // A bare `{` is part of the call's JSON: it stays in the buffer.
        let given: String = if marker == "{" { String::new() } else { self.buf.drain(..marker.len()).collect() };
        self.state = match (self.format, marker) {
            (ToolCallFormat::Qwen3Xml, _) => State::Xml { given, reader: XmlReader::default() },
            (ToolCallFormat::Hermes, _) => State::Open { given, then: Container::Block },
            (ToolCallFormat::Mistral, _) => State::Open { given, then: Container::Array },
            _ => State::Open { given, then: Container::Single },
        };
    }

    /// What looked like a call is not one: `text` (already out of the buffer) is content,
    /// and reading goes on after it.
    fn give_back(&mut self, text: String) {
        self.content(&text);
        self.state = State::Text;
    }

    fn start_call(&mut self, name: String) {
        self.out.push(ToolEvent::Start { id: call_id(self.format), name });
        self.began_call();
    }

    /// A call's Start went out: whitespace held before it is dropped.
    fn began_call(&mut self) {
        self.started += 1;
        self.held_ws.clear();
        self.at_start = false;
    }

    fn end_call(&mut self) {
        self.out.push(ToolEvent::End);
        self.ended += 1;
        self.after_call = true;
        self.held_ws.clear();
    }

    /// Emits content so that the result does not depend on how text was split: whitespace
    /// is held until non-whitespace follows, and dropped right after a call.
    fn content(&mut self, text: &str) {
        let llama3 = self.format == ToolCallFormat::Llama3Json;
        let sep = |c: char| c.is_whitespace() || (llama3 && c == ';');
        let mut rest = text;
        while !rest.is_empty() {
            if self.after_call {
                rest = rest.trim_start_matches(sep);
                if rest.is_empty() {
                    break;
                }
                self.after_call = false;
            }
            let ws = rest.len() - rest.trim_start().len();
            self.held_ws.push_str(&rest[..ws]);
            rest = &rest[ws..];
            let word = rest.find(char::is_whitespace).unwrap_or(rest.len());
            if word > 0 {
                let mut piece = std::mem::take(&mut self.held_ws);
                piece.push_str(&rest[..word]);
                self.content_raw(piece);
                self.at_start = false;
                rest = &rest[word..];
            }
        }
    }

    fn content_raw(&mut self, text: String) {
        if text.is_empty() {
            return;
        }
        match self.out.last_mut() {
            Some(ToolEvent::Content(c)) => c.push_str(&text),
            _ => self.out.push(ToolEvent::Content(text)),
        }
    }
}

/// Reads one JSON call object `{"name": ..., "arguments": {...}}` as its text arrives.
struct CallReader {
    /// The object's text so far, from its `{`.
    text: String,
    scan: Brackets,
    phase: Phase,
    /// The format's ids ([`call_id`]).
    format: ToolCallFormat,
    /// Forced choice: the call's Start goes out once its name is complete.
    forced: bool,
    /// Start has gone out (at the name, forced; else at the arguments' `{`).
    started: bool,
    /// The functions the request offers (none listed: any name is one): under `"auto"` an
    /// object naming another is no call, and is given back as content, as the name is not
    /// one the client can run (OpenAI never answers a name outside `tools`).
    offered: Arc<HashMap<String, Value>>,
}

#[derive(Default, Clone, Copy, PartialEq, Eq, Debug)]
enum Phase {
    /// Before the name and the arguments' `{` are known.
    #[default]
    Head,
    /// Committed: the arguments went out up to `text[..sent]`.
    Args { sent: usize },
    /// The arguments object closed; waiting for the call object to close.
    Tail,
    /// The call cannot be streamed: read it whole, decide when it closes.
    Whole,
}

impl CallReader {
    fn new(format: ToolCallFormat, forced: bool, offered: Arc<HashMap<String, Value>>) -> Self {
        Self {
            text: String::new(),
            scan: Brackets::default(),
            phase: Phase::Head,
            format,
            forced,
            started: false,
            offered,
        }
    }

    fn committed(&self) -> bool {
        self.started
    }

    fn args_done(&self) -> bool {
        self.phase == Phase::Tail
    }

    /// Moves text from `buf` into the object; pushes Start and Args events once committed.
    /// True when the object closed (the excess stays in `buf`).
    fn feed(&mut self, buf: &mut String, out: &mut Vec<ToolEvent>) -> bool {
        let from = self.text.len();
        self.text.push_str(buf);
        buf.clear();
        if self.phase == Phase::Head {
            let (head, name) = head(&self.text);
            if let (true, false, Some(name)) = (self.forced, self.started, name) {
                out.push(ToolEvent::Start { id: call_id(self.format), name });
                self.started = true;
            }
            match head {
                Head::Pending => {}
                Head::Whole => self.phase = Phase::Whole,
                // (not offered: read it whole, and give it back when it closes)
                Head::Commit { name, .. } if !self.started && !self.offers(&name) => self.phase = Phase::Whole,
                Head::Commit { name, args_at } => {
                    if !self.started {
                        out.push(ToolEvent::Start { id: call_id(self.format), name });
                        self.started = true;
                    }
                    self.phase = Phase::Args { sent: args_at };
                }
            }
        }
        let mut closed = None;
        let mut args_end = None;
        for (i, c) in self.text[from..].char_indices() {
            let at = from + i;
            let depth = self.scan.push(c);
            if depth == Some(0) {
                closed = Some(at + c.len_utf8());
                break;
            }
            // The arguments object is the only value at depth 2 after the commit point.
            if let (Phase::Args { sent }, Some(1)) = (self.phase, depth) {
                if at >= sent && args_end.is_none() {
                    args_end = Some(at + c.len_utf8());
                }
            }
        }
        if let Some(end) = closed {
            buf.push_str(&self.text[end..]);
            self.text.truncate(end);
            // Started at its name but read whole: the arguments go out in one piece.
            if self.phase == Phase::Whole && self.started {
                if let Some((_, arguments)) = self.whole_call() {
                    out.push(ToolEvent::Args(arguments));
                }
            }
        }
        if let Phase::Args { sent } = self.phase {
            let upto = args_end.unwrap_or(self.text.len());
            if upto > sent {
                out.push(ToolEvent::Args(self.text[sent..upto].to_string()));
            }
            self.phase = if args_end.is_some() { Phase::Tail } else { Phase::Args { sent: upto } };
        }
        closed.is_some()
    }

    /// A whole (not streamed) object read as a call: name and compact arguments.
    fn whole_call(&self) -> Option<(String, String)> {
        call_from_value(&serde_json::from_str(&self.text).ok()?).filter(|(name, _)| self.offers(name))
    }

    fn offers(&self, name: &str) -> bool {
        self.forced || self.offered.is_empty() || self.offered.contains_key(name)
    }
}

/// Bracket depth outside JSON strings, one character at a time.
#[derive(Default)]
struct Brackets {
    depth: usize,
    in_str: bool,
    escaped: bool,
}

impl Brackets {
    /// The depth after `c` when `c` opened or closed a bracket.
    fn push(&mut self, c: char) -> Option<usize> {
        if self.in_str {
            match c {
                _ if self.escaped => self.escaped = false,
                '\\' => self.escaped = true,
                '"' => self.in_str = false,
                _ => {}
            }
            return None;
        }
        match c {
            '"' => self.in_str = true,
            '{' | '[' => {
                self.depth += 1;
                return Some(self.depth);
            }
            '}' | ']' => {
                self.depth = self.depth.saturating_sub(1);
                return Some(self.depth);
            }
            _ => {}
        }
        None
    }
}

/// The start of a call object, read as far as it goes.
#[derive(Debug, PartialEq)]
enum Head {
    /// Consistent so far; more text decides.
    Pending,
    /// `{"name": "<name>", "arguments": {` (or `"parameters"`), the `{` at `args_at`.
    Commit { name: String, args_at: usize },
    /// Some other shape: read the object whole.
    Whole,
}

/// The start of a call object read as far as it goes, and its name once the name string
/// (the object's first key) is complete.
fn head(text: &str) -> (Head, Option<String>) {
    let mut c = Cursor { text, at: 0, name: None };
    match c.call_head() {
        Ok(head) | Err(head) => (head, c.name),
    }
}

struct Cursor<'a> {
    text: &'a str,
    at: usize,
    name: Option<String>,
}

impl Cursor<'_> {
    fn call_head(&mut self) -> Result<Head, Head> {
        self.ws();
        self.lit("{")?;
        self.ws();
        if self.string()? != "name" {
            return Err(Head::Whole);
        }
        self.ws();
        self.lit(":")?;
        self.ws();
        let name = self.string()?;
        self.name = Some(name.clone());
        self.ws();
        self.lit(",")?;
        self.ws();
        if !matches!(self.string()?.as_str(), "arguments" | "parameters") {
            return Err(Head::Whole);
        }
        self.ws();
        self.lit(":")?;
        self.ws();
        match self.text[self.at..].chars().next() {
            None => Err(Head::Pending),
            Some('{') => Ok(Head::Commit { name, args_at: self.at }),
            Some(_) => Err(Head::Whole),
        }
    }

    fn ws(&mut self) {
        let rest = &self.text[self.at..];
        self.at += rest.len() - rest.trim_start().len();
    }

    fn lit(&mut self, lit: &str) -> Result<(), Head> {
        let rest = &self.text[self.at..];
        if rest.starts_with(lit) {
            self.at += lit.len();
            Ok(())
        } else if lit.starts_with(rest) {
            Err(Head::Pending)
        } else {
            Err(Head::Whole)
        }
    }

    /// A complete JSON string, decoded.
    fn string(&mut self) -> Result<String, Head> {
        let rest = &self.text[self.at..];
        match rest.chars().next() {
            None => return Err(Head::Pending),
            Some('"') => {}
            Some(_) => return Err(Head::Whole),
        }
        let mut escaped = false;
        for (i, c) in rest.char_indices().skip(1) {
            match c {
                _ if escaped => escaped = false,
                '\\' => escaped = true,
                '"' => {
                    let s = serde_json::from_str(&rest[..=i]).map_err(|_| Head::Whole)?;
                    self.at += i + 1;
                    return Ok(s);
                }
                _ => {}
            }
        }
        Err(Head::Pending)
    }
}

/// `{"name": ..., "arguments": {...}}` (also `parameters`, or arguments as a JSON string).
fn call_from_value(v: &Value) -> Option<(String, String)> {
    let obj = v.as_object()?;
    let name = obj.get("name")?.as_str()?.to_string();
    let args = match obj.get("arguments").or_else(|| obj.get("parameters")) {
        None => serde_json::json!({}),
        Some(Value::String(s)) => serde_json::from_str::<Value>(s).ok().filter(Value::is_object)?,
        Some(v @ Value::Object(_)) => v.clone(),
        Some(_) => return None,
    };
    Some((name, serde_json::to_string(&args).expect("JSON values serialize")))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use serde_json::json;

    fn params() -> Arc<HashMap<String, Value>> {
        let weather = json!({"type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
            "hours": {"type": "array", "items": {"type": "integer"}}, "zip": {"type": "string"}}});
        let mut tools = HashMap::from([("get_weather".to_string(), weather)]);
        // (the other functions the recorded outputs call)
        for name in ["a", "b", "echo", "f", "f1", "f2", "g", "get_time"] {
            tools.insert(name.to_string(), json!({"type": "object"}));
        }
        Arc::new(tools)
    }

    /// Content and the calls as (name, concatenated arguments); checks the event order.
    pub(crate) fn run(format: ToolCallFormat, pieces: &[&str]) -> (String, Vec<(String, String)>) {
        run_with(format, params(), pieces)
    }

    pub(crate) fn run_with(
        format: ToolCallFormat,
        parameters: Arc<HashMap<String, Value>>,
        pieces: &[&str],
    ) -> (String, Vec<(String, String)>) {
        run_parser(ToolCallParser::new(format, parameters), pieces)
    }

    pub(crate) fn run_parser(mut p: ToolCallParser, pieces: &[&str]) -> (String, Vec<(String, String)>) {
        let mut events = Vec::new();
        for piece in pieces {
            events.extend(p.push(piece));
        }
        events.extend(p.finish());
        let mut content = String::new();
        let mut calls: Vec<(String, String)> = Vec::new();
        let mut open = false;
        for e in events {
            match e {
                ToolEvent::Content(c) => content.push_str(&c),
                ToolEvent::Start { id, name } => {
                    // (Mistral's templates take ids of 9 characters alone)
                    let mistral = id.len() == 9 && id.chars().all(|c| c.is_ascii_alphanumeric());
                    assert!((id.starts_with("call_") && id.len() == 29) || mistral, "{id}");
                    calls.push((name, String::new()));
                    open = true;
                }
                ToolEvent::Args(a) => {
                    assert!(open, "arguments outside a call");
                    calls.last_mut().expect("a call").1.push_str(&a);
                }
                ToolEvent::End => {
                    assert!(open, "end outside a call");
                    open = false;
                }
            }
        }
        assert_eq!(p.calls_started(), calls.len());
        (content, calls)
    }

    fn same_calls(got: &[(String, String)], want: &[(&str, &str)]) -> bool {
        got.len() == want.len()
            && got.iter().zip(want).all(|((n, a), (wn, wa))| {
                let got: Option<Value> = serde_json::from_str(a).ok();
                n == wn && got.is_some() && got == serde_json::from_str(wa).ok()
            })
    }

    /// (format, recorded output, expected content, expected (name, arguments JSON) calls)
    type Recorded = (ToolCallFormat, &'static str, &'static str, Vec<(&'static str, &'static str)>);

    fn recorded() -> Vec<Recorded> {
        use ToolCallFormat::*;
        vec![
            (
                Hermes,
                "I'll check both cities.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 2}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Tōkyō\"}}\n</tool_call>",
                "I'll check both cities.",
                vec![("get_weather", "{\"city\": \"Paris\", \"days\": 2}"), ("get_weather", "{\"city\": \"Tōkyō\"}")],
            ),
            (
                Hermes,
                "<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call>\n Done, see  above. ",
                "Done, see  above.",
                vec![("a", "{}")],
            ),
            // Keys in another order, and arguments as a string: read whole.
            (
                Hermes,
                "<tool_call>{\"arguments\": {\"x\": [1, {\"y\": \"}\"}]}, \"name\": \"a\"}</tool_call><tool_call>{\"name\": \"b\", \"arguments\": \"{\\\"x\\\": 1}\"}</tool_call>",
                "",
                vec![("a", "{\"x\": [1, {\"y\": \"}\"}]}"), ("b", "{\"x\": 1}")],
            ),
            (
                Hermes,
                "x <tool_call>not json</tool_call> y <tool_call>{\"a\": 1}</tool_call> <tool_call>{\"na",
                "x <tool_call>not json</tool_call> y <tool_call>{\"a\": 1}</tool_call> <tool_call>{\"na",
                vec![],
            ),
            (Hermes, "a < b <tool", "a < b <tool", vec![]),
            (
                Llama3Json,
                "<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}; {\"name\": \"get_time\", \"parameters\": {\"tz\": \"Europe/Paris\"}}",
                "",
                vec![("get_weather", "{\"city\": \"Paris\"}"), ("get_time", "{\"tz\": \"Europe/Paris\"}")],
            ),
            (
                Llama3Json,
                "Let me look that up. {\"name\": \"echo\", \"parameters\": {\"text\": \"a } b \\\" { café\"}}",
                "Let me look that up.",
                vec![("echo", "{\"text\": \"a } b \\\" { café\"}")],
            ),
            (Llama3Json, "Use {x} or {\"a\": {\"b\": 1}} here.", "Use {x} or {\"a\": {\"b\": 1}} here.", vec![]),
            (
                Mistral,
                "Sure.[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}, {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Tokyo\"}}]",
                "Sure.",
                vec![("get_weather", "{\"city\": \"Paris\"}"), ("get_weather", "{\"city\": \"Tokyo\"}")],
            ),
            // The special token was dropped by detokenizing: a bare array at the start.
            (Mistral, " [{\"name\": \"f\", \"arguments\": {}}]", "", vec![("f", "{}")]),
            (Mistral, "[1, 2] is a list, [TOOL_CALLS] is a tag", "[1, 2] is a list, [TOOL_CALLS] is a tag", vec![]),
            (
                Json,
                "[{\"name\": \"f\", \"arguments\": {\"q\": \"x\"}}, {\"name\": \"g\", \"arguments\": {}}]",
                "",
                vec![("f", "{\"q\": \"x\"}"), ("g", "{}")],
            ),
            (Json, "{\"name\": \"f\", \"arguments\": {\"a\": [1, 2]}}", "", vec![("f", "{\"a\": [1, 2]}")]),
            (Json, "Sure: {\"name\": \"f\", \"arguments\": {}}", "Sure: {\"name\": \"f\", \"arguments\": {}}", vec![]),
            (
                Qwen3Xml,
                "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n<parameter=hours>\n[9, 17]\n</parameter>\n<parameter=zip>\n94110\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
                "Checking.",
                vec![
                    ("get_weather", "{\"city\": \"San Francisco\", \"days\": 3, \"metric\": true, \"hours\": [9, 17], \"zip\": \"94110\"}"),
                    ("get_time", "{}"),
                ],
            ),
            // Multi-line text, a value that is not of its type, an unknown parameter.
            (
                Qwen3Xml,
                "<tool_call>\n<function=get_weather>\n<parameter=city>\nline 1\n<b>line 2</b>\n\n</parameter>\n<parameter=days>\nthree\n</parameter>\n<parameter=other>\n4\n</parameter>\n</function>\n</tool_call> Done.",
                "Done.",
                vec![("get_weather", "{\"city\": \"line 1\\n<b>line 2</b>\\n\", \"days\": \"three\", \"other\": \"4\"}")],
            ),
            // Multi-byte characters next to the closing tag (its search resumes mid-value).
            (
                Qwen3Xml,
                "<tool_call>\n<function=get_weather>\n<parameter=city>\nZürich </東京>\n</parameter>\n</function>\n</tool_call>",
                "",
                vec![("get_weather", "{\"city\": \"Zürich </東京>\"}")],
            ),
            (
                Qwen3Xml,
                "<tool_call>\n<function name=x>\n</tool_call> and <tool_call>",
                "<tool_call>\n<function name=x>\n</tool_call> and <tool_call>",
                vec![],
            ),
        ]
    }

    #[test]
    fn mistral_calls_have_the_nine_character_ids_its_templates_take() {
        let ids = |format, text: &str| {
            let mut p = ToolCallParser::new(format, params());
            let mut events = p.push(text);
            events.extend(p.finish());
            events.into_iter().filter_map(|e| if let ToolEvent::Start { id, .. } = e { Some(id) } else { None })
        };
        let call = "{\"name\": \"f\", \"arguments\": {}}";
        for id in ids(ToolCallFormat::Mistral, &format!("[TOOL_CALLS] [{call}, {call}]")) {
            assert!(id.len() == 9 && id.chars().all(|c| c.is_ascii_alphanumeric()), "{id}");
        }
        assert!(ids(ToolCallFormat::Hermes, &format!("<tool_call>{call}</tool_call>")).all(|id| id.len() == 29));
    }

    #[test]
    fn a_function_not_offered_is_no_call_under_auto() {
        // (OpenAI never answers a name outside `tools`: an agent that dispatches by name would
        // fail on it) the text is content, streamed or not, however it is split
        let unknown = "<tool_call>\n{\"name\": \"unknown_fn\", \"arguments\": {\"x\": 1}}\n</tool_call>";
        for pieces in [vec![unknown], unknown.split_inclusive(['{', '"', ':']).collect()] {
            assert_eq!(run(ToolCallFormat::Hermes, &pieces), (unknown.to_string(), vec![]));
        }
        let llama = "{\"name\": \"lookup\", \"parameters\": {\"q\": \"x\"}}";
        assert_eq!(run(ToolCallFormat::Llama3Json, &[llama]), (llama.to_string(), vec![]));
        let mistral = "[TOOL_CALLS] [{\"name\": \"lookup\", \"arguments\": {}}]";
        assert_eq!(run(ToolCallFormat::Mistral, &[mistral]).1, vec![]);
        // an offered one beside it is still a call
        let both = format!("{unknown}\n<tool_call>\n{{\"name\": \"f\", \"arguments\": {{}}}}\n</tool_call>");
        assert_eq!(run(ToolCallFormat::Hermes, &[&both]).1, vec![("f".to_string(), "{}".to_string())]);
    }

    #[test]
    fn recorded_outputs_parse_the_same_however_split() {
        for (format, text, content, calls) in recorded() {
            let whole = run(format, &[text]);
            assert_eq!(whole.0, content, "{format:?} {text}");
            assert!(same_calls(&whole.1, &calls), "{format:?} {text}: {:?}", whole.1);
            for at in (0..=text.len()).filter(|&i| text.is_char_boundary(i)) {
                assert_eq!(run(format, &[&text[..at], &text[at..]]), whole, "{format:?} split at {at}");
            }
            for width in 1..=3 {
                let chars: Vec<char> = text.chars().collect();
                let pieces: Vec<String> = chars.chunks(width).map(|c| c.iter().collect()).collect();
                let pieces: Vec<&str> = pieces.iter().map(String::as_str).collect();
                let split = run(format, &pieces);
                assert_eq!(split, whole, "{format:?} chunks of {width}");
                if !calls.is_empty() {
                    for mark in [OPEN, CLOSE, PYTHON_TAG, MISTRAL_TAG, "<function=", "</parameter>"] {
                        assert!(!split.0.contains(mark), "{format:?} leaked {mark}");
                    }
                }
            }
        }
    }

    /// The name goes out as soon as it is known, the arguments as they arrive.
    #[test]
    fn calls_stream_before_they_complete() {
        let mut p = ToolCallParser::new(ToolCallFormat::Hermes, params());
        assert_eq!(p.push("Hi <tool_call>\n{\"name\": \"get_wea"), vec![ToolEvent::Content("Hi".into())]);
        let events = p.push("ther\", \"arguments\": {\"city\": \"Pa");
        assert!(matches!(&events[..], [ToolEvent::Start { name, .. }, ToolEvent::Args(a)]
            if name == "get_weather" && a == "{\"city\": \"Pa"));
        assert_eq!(p.push("ris\"}"), vec![ToolEvent::Args("ris\"}".into())]);
        assert_eq!(p.push("}\n</tool_call>"), vec![ToolEvent::End]);
        assert_eq!(p.calls_ended(), 1);

        let mut p = ToolCallParser::new(ToolCallFormat::Qwen3Xml, params());
        let events = p.push("<tool_call>\n<function=get_weather>\n<parameter=city>\nPar");
        assert!(matches!(&events[..], [ToolEvent::Start { name, .. }] if name == "get_weather"));
        assert_eq!(p.push("is\n</parameter>\n"), vec![ToolEvent::Args("{\"city\": \"Paris\"".into())]);
        assert_eq!(p.push("</function>"), vec![ToolEvent::Args("}".into()), ToolEvent::End]);
    }

    /// Cut off inside a call: the call keeps what was sent, with no End.
    #[test]
    fn truncated_calls() {
        let (content, calls) =
            run(ToolCallFormat::Hermes, &["<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": [1,"]);
        assert_eq!((content.as_str(), calls), ("", vec![("f".to_string(), "{\"a\": [1,".to_string())]));
        // Before the commit point it is still text.
        let (content, calls) = run(ToolCallFormat::Json, &["{\"name\": \"f\", \"argum"]);
        assert!(calls.is_empty());
        assert_eq!(content, "{\"name\": \"f\", \"argum");
        let (content, calls) =
            run(ToolCallFormat::Qwen3Xml, &["<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n<par"]);
        assert_eq!((content.as_str(), calls), ("", vec![("f".to_string(), "{\"a\": \"1\"".to_string())]));
    }

    /// Recorded outputs of forced `tool_choice` requests cut off by `max_tokens` (the first
    /// two from SmolLM2 with 20 and 2000 tools), and the calls they keep.
    fn recorded_forced() -> Vec<Recorded> {
        use ToolCallFormat::*;
        let call = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
        let leak = |tail: &str| -> &'static str { Box::leak(format!("{call}{tail}").into_boxed_str()) };
        vec![
            (Json, "[{\"name\": \"f2\", \"arguments", "", vec![("f2", "")]),
            (Json, "{\"name\": \"f1999\", \"", "", vec![("f1999", "")]),
            (Json, "{\"name\": \"f1999\", \"arguments\": {\"a\": \"x", "", vec![("f1999", "{\"a\": \"x")]),
            (Json, "[{\"name\": \"f1\", \"arguments\": {}}, {\"name\": \"f", "", vec![("f1", "{}")]),
            // Cut off inside the name: no call, and the markup is not content either.
            (Json, "{\"name\": \"f19", "", vec![]),
            (Json, "[", "", vec![]),
            (Hermes, leak("\n<tool_call>"), "", vec![("get_weather", "{\"city\": \"Paris\"}")]),
            (Hermes, leak("\n<tool_"), "", vec![("get_weather", "{\"city\": \"Paris\"}")]),
            (Hermes, leak("\n<tool_call>\n{\"name\": \"get_w"), "", vec![("get_weather", "{\"city\": \"Paris\"}")]),
            (
                Hermes,
                leak("\n<tool_call>\n{\"name\": \"get_time\", \"argu"),
                "",
                vec![("get_weather", "{\"city\": \"Paris\"}"), ("get_time", "")],
            ),
            (
                Hermes,
                "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Pa",
                "",
                vec![("get_weather", "{\"city\": \"Pa")],
            ),
            (
                Hermes,
                "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {}}\n</tool",
                "",
                vec![("get_weather", "{}")],
            ),
            (Qwen3Xml, "<tool_call>\n<function=get_weather>\n<para", "", vec![("get_weather", "")]),
            (Qwen3Xml, "<tool_call>\n<function=get_wea", "", vec![]),
            (Mistral, "[{\"name\": \"f\", \"arguments\": {}}, {\"na", "", vec![("f", "{}")]),
            (Mistral, "[", "", vec![]),
            (Llama3Json, "{\"name\": \"f\", \"parameters\": {\"a", "", vec![("f", "{\"a")]),
        ]
    }

    /// Forced: a call commits at its name and keeps what was generated when cut off; call
    /// markup never reaches content; however the text is split.
    #[test]
    fn forced_calls_cut_off_keep_their_name_and_arguments() {
        let forced = |format| ToolCallParser::new(format, params()).forced(true);
        for (format, text, content, calls) in recorded_forced() {
            let whole = run_parser(forced(format), &[text]);
            assert_eq!(whole.0, content, "{format:?} {text}");
            let names_args: Vec<(&str, &str)> = whole.1.iter().map(|(n, a)| (n.as_str(), a.as_str())).collect();
            assert_eq!(names_args, calls, "{format:?} {text}");
            for at in (0..=text.len()).filter(|&i| text.is_char_boundary(i)) {
                assert_eq!(run_parser(forced(format), &[&text[..at], &text[at..]]), whole, "{format:?} split at {at}");
            }
            let chars: Vec<String> = text.chars().map(String::from).collect();
            let chars: Vec<&str> = chars.iter().map(String::as_str).collect();
            assert_eq!(run_parser(forced(format), &chars), whole, "{format:?} char by char");
        }
        // Auto mode keeps the old commit point: the same text may still turn out not to be
        // a call, so it stays content.
        let (content, calls) = run(ToolCallFormat::Json, &["{\"name\": \"f1999\", \""]);
        assert_eq!((content.as_str(), calls.len()), ("{\"name\": \"f1999\", \"", 0));
        let (content, _) = run(
            ToolCallFormat::Hermes,
            &["<tool_call>\n{\"name\": \"f\", \"arguments\": {}}</tool_call>\n<tool_call>"],
        );
        assert_eq!(content, "<tool_call>", "auto: a dangling marker is text, as today");
    }

    /// Forced: the id and name go out as soon as the name's closing quote arrives.
    #[test]
    fn forced_calls_start_at_the_name() {
        let mut p = ToolCallParser::new(ToolCallFormat::Json, params()).forced(true);
        assert_eq!(p.push("[{\"name\": \"f2"), vec![]);
        let events = p.push("\"");
        assert!(matches!(&events[..], [ToolEvent::Start { name, .. }] if name == "f2"), "{events:?}");
        assert_eq!(p.push(", \"arguments\": "), vec![]);
        assert_eq!(p.push("{\"a\": \"b"), vec![ToolEvent::Args("{\"a\": \"b".into())]);
        assert_eq!(p.push("\"}}"), vec![ToolEvent::Args("\"}".into()), ToolEvent::End]);
        assert_eq!(p.calls_started(), 1);
        // Arguments sent as a string (not streamable): the call started at its name gets
        // them whole when the object closes.
        let (content, calls) = run_parser(
            ToolCallParser::new(ToolCallFormat::Hermes, params()).forced(true),
            &["<tool_call>{\"name\": \"b\", \"arguments\": \"{\\\"x\\\": 1}\"}</tool_call>"],
        );
        assert_eq!((content.as_str(), calls), ("", vec![("b".to_string(), "{\"x\":1}".to_string())]));
    }

    #[test]
    fn forced_calls_may_open_with_their_markers() {
        let cases = [
            (ToolCallFormat::Mistral, "[TOOL_CALLS][{\"name\": \"b\", \"arguments\": {\"x\": 1}}]"),
            (ToolCallFormat::Mistral, "[TOOL_CALLS] [{\"name\": \"b\", \"arguments\": {\"x\": 1}}]"),
            (ToolCallFormat::Mistral, " [{\"name\": \"b\", \"arguments\": {\"x\": 1}}]"),
            (ToolCallFormat::Llama3Json, "<|python_tag|>{\"name\": \"b\", \"parameters\": {\"x\": 1}}"),
            (ToolCallFormat::Llama3Json, "{\"name\": \"b\", \"parameters\": {\"x\": 1}}"),
        ];
        for (format, text) in cases {
            for split in [1, 3, 14, text.len()] {
                let (head, tail) = text.split_at(split.min(text.len()));
                let parser = ToolCallParser::new(format, params()).forced(true);
                let (content, calls) = run_parser(parser, &[head, tail]);
                assert_eq!(
                    (content.as_str(), calls),
                    ("", vec![("b".to_string(), "{\"x\": 1}".to_string())]),
                    "{text}"
                );
            }
        }
    }

    #[test]
    fn xml_values_are_typed_by_schema() {
        use super::super::xml::typed_value;
        let t = |raw: &str, schema: Value| typed_value(raw, Some(&schema), &Value::Null);
        assert_eq!(t("3", json!({"type": "integer"})), json!(3));
        assert_eq!(t("3.5", json!({"type": "integer"})), json!("3.5"));
        assert_eq!(t("3.5", json!({"type": "number"})), json!(3.5));
        assert_eq!(t("FALSE", json!({"type": "boolean"})), json!(false));
        assert_eq!(t("null", json!({"type": ["string", "null"]})), json!(null));
        assert_eq!(t("007", json!({"type": "string"})), json!("007"));
        assert_eq!(t("{\"a\": 1}", json!({"type": "object"})), json!({"a": 1}));
        assert_eq!(t("2", json!({"enum": [1, 2, "x"]})), json!(2));
        assert_eq!(t("x", json!({"anyOf": [{"type": "integer"}, {"type": "string"}]})), json!("x"));
        assert_eq!(typed_value("5", None, &Value::Null), json!("5"));
        // no type: text unless the schema shapes the value as JSON (as vLLM's parser reads
        // an untyped parameter)
        for untyped in [
            json!({}),
            json!({"description": "zip"}),
            json!({"nullable": true}),
            json!({"maxLength": 5}),
            json!({"x-unit": "cm"}),
        ] {
            assert_eq!(t("10001", untyped.clone()), json!("10001"), "{untyped}");
        }
        assert_eq!(t("{\"a\": 1}", json!({"properties": {"a": {}}})), json!({"a": 1}));
        assert_eq!(t("[1]", json!({"items": {}})), json!([1]));
    }
}
