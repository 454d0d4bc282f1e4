//! Tool calls: the text format a model writes them in, the grammar that forces them
//! (`tool_choice: "required"` or a named function), and the parser that turns generated
//! text back into `tool_calls` as it streams ([`parser`]).
//!
//! Formats:
//! - `hermes`: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one block per
//!   call; chosen when the chat template's text mentions `<tool_call>` (Hermes, Qwen2.5+).
//! - `qwen3_xml` (alias `qwen3_coder`): Qwen3-Coder's XML blocks,
//!   `<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>\n</tool_call>`,
//!   values typed by the function's schema ([`xml`]); chosen when the template mentions
//!   `<function=` (checked before Hermes, whose marker it shares).
//! - `json`: llmserve's default for templates that know no tool format (SmolLM2): the whole
//!   output is a JSON array of call objects `{"name": ..., "arguments": {...}}`, of one call
//!   when parallel calls are not allowed (the form SmolLM2 writes calls in: forced into a bare
//!   object it wrote worse arguments); a bare call object parses too; under a named
//!   `tool_choice` it is the arguments object
//!   alone (the name is known: as vLLM, the model writes only what it must choose). It is only
//!   used under a forced `tool_choice`: with `"auto"` and no known format, a model's
//!   JSON-looking text stays text.
//! - `llama3_json`: Llama 3.1/3.2: `{"name": ..., "parameters": {...}}`, optionally after
//!   `<|python_tag|>`, several calls separated by `; `; chosen when the template mentions
//!   `<|python_tag|>`, `Environment: ipython` or `"parameters": ` (its tool instructions).
//! - `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`; chosen when the
//!   template mentions `[TOOL_CALLS]`. A bare array at the very start of the output is read
//!   the same way, because `[TOOL_CALLS]` is a special token that detokenizing may drop.

use std::collections::HashMap;
use std::sync::Arc;

use serde_json::{json, Map, Value};

use crate::protocol::schema_edit;
use crate::structured::GrammarSource;

pub mod parser;
pub mod xml;

pub use parser::{ToolCallParser, ToolEvent};

pub(crate) const OPEN: &str = "<tool_call>";
pub(crate) const CLOSE: &str = "</tool_call>";
pub(crate) const PYTHON_TAG: &str = "<|python_tag|>";
pub(crate) const MISTRAL_TAG: &str = "[TOOL_CALLS]";

/// How a chat request's output is read for tool calls.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolParsing {
    pub format: ToolCallFormat,
    /// false: the choice ends when its first call completes.
    pub parallel: bool,
    /// Each function's `parameters` schema by name: the XML format types its values by it.
    pub parameters: Arc<HashMap<String, Value>>,
    /// What `tool_choice` forces: a forced output is calls only (the grammar allows nothing
    /// else), which changes where a call commits and how the choice finishes.
    pub choice: ToolChoice,
    /// OpenAI's deprecated `functions` API: the call is answered as `function_call`, and a
    /// choice that makes one finishes `"function_call"`.
    pub functions: bool,
}

/// What a request's `tool_choice` forces.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ToolChoice {
    /// `"auto"` (or absent): the text may or may not hold calls.
    #[default]
    Auto,
    /// `"required"`: at least one call to any tool.
    Required,
    /// A named function: exactly one call to it; the choice then finishes `"stop"`, as
    /// OpenAI's does when it forces a specific function.
    Named,
}

impl ToolChoice {
    /// The grammar constrains the output to calls.
    pub fn is_forced(self) -> bool {
        self != Self::Auto
    }
}

impl ToolParsing {
    /// `functions` are the `function` objects of the request's tools.
    pub fn new(format: ToolCallFormat, parallel: bool, functions: &[&Value]) -> Self {
        let parameters = functions
            .iter()
            .filter_map(|f| {
                let name = f.get("name")?.as_str()?.to_string();
                Some((name, f.get("parameters").cloned().unwrap_or(Value::Null)))
            })
            .collect();
        Self { format, parallel, parameters: Arc::new(parameters), choice: ToolChoice::Auto, functions: false }
    }

    /// The same parsing for output that `choice` forces.
    pub fn with_choice(mut self, choice: ToolChoice) -> Self {
        self.choice = choice;
        self
    }

    /// A parser for one choice's output. A named call in the json format is its arguments
    /// alone: the parser reads them as the rest of a call object it was given the start of.
    pub fn parser(&self) -> ToolCallParser {
        let parser = ToolCallParser::new(self.format, self.parameters.clone()).forced(self.choice.is_forced());
        match (self.format, self.choice, self.parameters.keys().next()) {
            (ToolCallFormat::Json, ToolChoice::Named, Some(name)) if self.parameters.len() == 1 => {
                let name = serde_json::to_string(name).expect("strings serialize");
                parser.given(&format!("{{\"name\": {name}, \"arguments\": "))
            }
            _ => parser,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolCallFormat {
    Json,
    Hermes,
    #[serde(rename = "llama3_json")]
    Llama3Json,
    Mistral,
    #[serde(rename = "qwen3_xml", alias = "qwen3_coder")]
    Qwen3Xml,
}

impl ToolCallFormat {
    /// `--tool-call-format` values: "json", "hermes", "llama3_json", "mistral", "qwen3_xml"
    /// (also "qwen3_coder", vLLM's name for it).
    pub fn from_name(s: &str) -> Option<Self> {
        match s {
            "json" => Some(Self::Json),
            "hermes" => Some(Self::Hermes),
            "llama3_json" => Some(Self::Llama3Json),
            "mistral" => Some(Self::Mistral),
            "qwen3_xml" | "qwen3_coder" => Some(Self::Qwen3Xml),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Json => "json",
            Self::Hermes => "hermes",
            Self::Llama3Json => "llama3_json",
            Self::Mistral => "mistral",
            Self::Qwen3Xml => "qwen3_xml",
        }
    }

    /// The format a chat template teaches its model, if it teaches one we parse.
    /// Qwen3's XML goes first (its blocks are also `<tool_call>`), then Hermes: some
    /// templates mention several formats' markers in passing.
    pub fn detect(template_source: &str) -> Option<Self> {
        let t = template_source;
        if t.contains(xml::FUNCTION) {
            Some(Self::Qwen3Xml)
        } else if t.contains(OPEN) {
            Some(Self::Hermes)
        } else if t.contains(MISTRAL_TAG) {
            Some(Self::Mistral)
        } else if t.contains(PYTHON_TAG) || t.contains("Environment: ipython") || t.contains("\"parameters\": ") {
            Some(Self::Llama3Json)
        } else {
            None
        }
    }

    /// The grammar forcing at least one call (exactly one unless `parallel`) to one of
    /// `functions` (each the `function` object of a tool as sent), with arguments that
    /// match that function's `parameters` schema.
    ///
    /// The llama3 and mistral calls may open with their marker (`<|python_tag|>`,
    /// `[TOOL_CALLS]`): `marker` is the vocabulary's id of that special token, which the
    /// grammar then allows as the model writes it (None: the marker's text); the parsers
    /// read the calls with or without it.
    ///
    /// Fails only for the XML format, whose grammar cannot follow every schema.
    pub fn forced_grammar(
        self,
        functions: &[&Value],
        parallel: bool,
        marker: Option<u32>,
    ) -> Result<GrammarSource, Unenforceable> {
        self.grammar(functions, parallel, false, marker)
    }

    /// The grammar forcing one call to `function` (a named `tool_choice`): as
    /// `forced_grammar`, except that the json format's output is the arguments object alone
    /// (`ToolParsing::parser` reads it so).
    pub fn named_grammar(self, function: &Value, marker: Option<u32>) -> Result<GrammarSource, Unenforceable> {
        self.grammar(&[function], false, true, marker)
    }

    /// What may open the calls in a grammar: llama3's and Mistral's marker, optional (as
    /// the special token `marker` names, else as text; see `forced_grammar`).
    fn opening(self, marker: Option<u32>) -> String {
        let tag = |text: &str| marker.map_or_else(|| format!("{text:?}"), |id| format!("<[{id}]>"));
        match self {
            Self::Mistral => format!("({} /[ \\t\\r\\n]+/?)? ", tag(MISTRAL_TAG)),
            Self::Llama3Json => format!("({})? ", tag(PYTHON_TAG)),
            _ => String::new(),
        }
    }

    /// The grammar of a `tool_choice: "auto"` output whose shape is enforced (a `strict`
    /// tool, or a `response_format` schema beside the tools): either calls from the output's
    /// very start, as [`Self::forced_grammar`] has them (arguments that match their
    /// functions' schemas), or the answer: given `answer` (a JSON schema), that JSON; else
    /// text that never opens a call (not empty: an answer that is nothing at all stops
    /// llguidance's parser after a reasoning model's thinking).
    ///
    /// What the text answer may never write (what the parser would read as a call): Hermes
    /// and Qwen3 XML, `<tool_call>`; Mistral, its `[TOOL_CALLS]` marker, nor start with the
    /// array; llama3, `<|python_tag|>` or a call object (`{"name"`), nor start with `{`.
    /// `marker`: as for `forced_grammar`. None for the json format (a call there is any
    /// JSON the output starts with) and for XML calls whose schemas its grammar cannot
    /// follow.
    pub fn auto_grammar(
        self,
        functions: &[&Value],
        parallel: bool,
        answer: Option<&Value>,
        marker: Option<u32>,
    ) -> Option<GrammarSource> {
        // (what the text answer may not start with, nor hold)
        let (first, held) = match self {
            Self::Hermes | Self::Qwen3Xml => ("", OPEN),
            Self::Mistral => ("\\[", "\\[TOOL_CALLS\\]"),
            Self::Llama3Json => ("{", "(\\{[ \\t\\r\\n]*\"name\"|<\\|python_tag\\|>)"),
            Self::Json => return None,
        };
        let (GrammarSource::Lark(calls) | GrammarSource::Calls(calls)) =
            self.forced_grammar(functions, parallel, marker).ok()?
        else {
            return None;
        };
        let calls = calls.replacen("start:", "calls:", 1);
        let (answer, calls_start) = match answer {
            Some(schema) => {
                let schema = crate::structured::for_generation(schema);
                (format!("answer: %json {}", serde_json::to_string(&schema).expect("JSON values serialize")), "calls")
            }
            // NOTE: leading whitespace is a lexeme of its own, which either branch may
            // follow: were it the text's, a call after it (`</think>\n\n<tool_call>`) would
            // be refused at its `>`, the text having taken the whitespace
            None => (
                format!(
                    "answer: WS? TEXT\n\
                     TEXT: /[^{first} \\t\\r\\n](.|\\n)*/ & ~/(.|\\n)*{held}(.|\\n)*/\ncalls_ws: WS? calls"
                ),
                "calls_ws",
            ),
        };
        Some(GrammarSource::Lark(format!("start: answer | {calls_start}\n{answer}\nWS: /[ \\t\\r\\n]+/\n{calls}")))
    }

    fn grammar(
        self,
        functions: &[&Value],
        parallel: bool,
        named: bool,
        marker: Option<u32>,
    ) -> Result<GrammarSource, Unenforceable> {
        if self == Self::Json && named {
            let mut defs = Map::new();
            let mut args = args_schema(functions[0], &mut defs);
            if !defs.is_empty() {
                args = json!({"$ref": args["$ref"], "$defs": defs});
            }
            return Ok(GrammarSource::JsonSchema(args));
        }
        if self == Self::Qwen3Xml {
            return xml::forced_grammar(functions, parallel);
        }
        let args_key = if self == Self::Llama3Json { "parameters" } else { "arguments" };
        let mut defs = Map::new();
        let calls: Vec<Value> = functions.iter().map(|f| call_schema(f, args_key, &mut defs)).collect();
        let mut one = if calls.len() == 1 { calls[0].clone() } else { json!({"anyOf": calls}) };
        let with_defs = |mut root: Value| {
            if !defs.is_empty() {
                root["$defs"] = Value::Object(defs.clone());
            }
            root
        };
        if self != Self::Json {
            one = with_defs(one);
        }
        let schema = crate::structured::for_generation(&one);
        let call = format!("call: %json {}\n", serde_json::to_string(&schema).expect("JSON values serialize"));
        let open = self.opening(marker);
        Ok(match self {
            Self::Llama3Json => {
                let calls = if parallel { "call (\"; \" call)*" } else { "call" };
                GrammarSource::Calls(format!("start: {open}{calls}\n{call}"))
            }
            Self::Mistral => {
                let calls = if parallel { "\"[\" call (\", \" call)* \"]\"" } else { "\"[\" call \"]\"" };
                GrammarSource::Calls(format!("start: {open}{calls}\n{call}"))
            }
            Self::Json => {
                let mut calls = json!({"type": "array", "items": one, "minItems": 1});
                if !parallel {
                    calls["maxItems"] = json!(1);
                }
                GrammarSource::JsonSchema(with_defs(calls))
            }
            Self::Hermes => {
                let start = if parallel { "start: block (\"\\n\" block)*" } else { "start: block" };
                GrammarSource::Calls(format!("{start}\nblock: \"{OPEN}\\n\" call \"\\n{CLOSE}\"\n{call}"))
            }
            Self::Qwen3Xml => unreachable!("handled above"),
        })
    }
}

/// A forced call's `parameters` schema that the tool-call format's grammar cannot enforce:
/// `function` is its position in the list given, `at` the place in its `parameters` (a path
/// such as `.properties.city.pattern`), `why` what cannot be enforced.
#[derive(Debug)]
pub struct Unenforceable {
    pub function: usize,
    pub at: String,
    pub why: String,
}

/// The schema of one call to `function`, its arguments under `args_key`. Parameters that
/// use local `$ref`s move to `defs` (to become the root's `$defs`), with their refs rewritten,
/// since inside the call object they would resolve against the wrong root.
fn call_schema(function: &Value, args_key: &str, defs: &mut Map<String, Value>) -> Value {
    let name = function.get("name").cloned().unwrap_or(Value::Null);
    let params = args_schema(function, defs);
    json!({
        "type": "object",
        "properties": {"name": {"const": name}, args_key: params},
        "required": ["name", args_key],
        "additionalProperties": false,
    })
}

/// The schema of `function`'s arguments; one that uses local `$ref`s moves to `defs` (see
/// `call_schema`) and a `$ref` to it is returned.
fn args_schema(function: &Value, defs: &mut Map<String, Value>) -> Value {
    // Arguments are always a JSON object (clients `json.loads` them into keyword arguments):
    // a schema without a `type` gets "object" (validation refuses any other root type), and
    // no `parameters` at all is OpenAI's empty parameter list, `{}`.
    let mut params = match function.get("parameters") {
        Some(Value::Object(p)) => {
            let mut p = p.clone();
            p.entry("type").or_insert_with(|| json!("object"));
            Value::Object(p)
        }
        _ => json!({"type": "object", "properties": {}, "additionalProperties": false}),
    };
    schema_edit::localize_refs(&mut params);
    schema_edit::close_objects(&mut params);
    if schema_edit::has_local_ref(&params) {
        let key = format!("args{}", defs.len());
        schema_edit::rebase_refs(&mut params, &format!("/$defs/{key}"));
        defs.insert(key.clone(), params);
        params = json!({"$ref": format!("#/$defs/{key}")});
    }
    params
}

/// A new call id: `call_` and 24 hex digits; in the Mistral format 9 of them alone, since
/// Mistral's chat templates refuse any other id when the call comes back (vLLM's ids there
/// are 9 characters too).
pub(crate) fn call_id(format: ToolCallFormat) -> String {
    let hex = uuid::Uuid::new_v4().simple().to_string();
    match format {
        ToolCallFormat::Mistral => hex[..9].to_string(),
        _ => format!("call_{}", &hex[..24]),
    }
}

#[cfg(test)]
mod tests {
    use super::parser::tests::{run_parser, run_with};
    use super::*;

    #[test]
    fn detect_and_grammar_shapes() {
        assert_eq!(ToolCallFormat::detect("{% if tools %}<tool_call>{% endif %}"), Some(ToolCallFormat::Hermes));
        assert_eq!(ToolCallFormat::detect("{{ messages }}"), None);
        let f = json!({"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}});
        // (one call: an array of one, the form SmolLM2 writes its calls in)
        match ToolCallFormat::Json.forced_grammar(&[&f], false, None).unwrap() {
            GrammarSource::JsonSchema(s) => {
                assert_eq!((&s["type"], &s["maxItems"]), (&json!("array"), &json!(1)));
                assert_eq!(s["items"]["properties"]["name"]["const"], "f");
            }
            other => panic!("{other:?}"),
        }
        match ToolCallFormat::Json.forced_grammar(&[&f, &f], true, None).unwrap() {
            GrammarSource::JsonSchema(s) => assert_eq!(s["type"], "array"),
            other => panic!("{other:?}"),
        }
        match ToolCallFormat::Hermes.forced_grammar(&[&f], true, None).unwrap() {
            GrammarSource::Calls(g) => assert!(g.contains("%json") && g.contains("block (")),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn formats_detect_and_name() {
        let llama = "Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its value}.";
        assert_eq!(ToolCallFormat::detect(llama), Some(ToolCallFormat::Llama3Json));
        assert_eq!(ToolCallFormat::detect("{{- \"Environment: ipython\\n\" }}"), Some(ToolCallFormat::Llama3Json));
        assert_eq!(ToolCallFormat::detect("{{ '[TOOL_CALLS]' }}"), Some(ToolCallFormat::Mistral));
        assert_eq!(ToolCallFormat::detect("<tool_call> <|python_tag|> [TOOL_CALLS]"), Some(ToolCallFormat::Hermes));
        let qwen3_coder = "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n\
                           </parameter>\n</function>\n</tool_call>";
        assert_eq!(ToolCallFormat::detect(qwen3_coder), Some(ToolCallFormat::Qwen3Xml));
        let all = [
            ToolCallFormat::Json,
            ToolCallFormat::Hermes,
            ToolCallFormat::Llama3Json,
            ToolCallFormat::Mistral,
            ToolCallFormat::Qwen3Xml,
        ];
        for f in all {
            assert_eq!(ToolCallFormat::from_name(f.name()), Some(f));
            let via_serde: ToolCallFormat = serde_json::from_value(json!(f.name())).unwrap();
            assert_eq!(via_serde, f);
        }
        assert_eq!(ToolCallFormat::from_name("qwen3_coder"), Some(ToolCallFormat::Qwen3Xml));
        let alias: ToolCallFormat = serde_json::from_value(json!("qwen3_coder")).unwrap();
        assert_eq!(alias, ToolCallFormat::Qwen3Xml);
        let f = json!({"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}});
        match ToolCallFormat::Llama3Json.forced_grammar(&[&f], true, None).unwrap() {
            GrammarSource::Calls(g) => assert!(g.contains("\"parameters\"") && g.contains("\"; \" call")),
            other => panic!("{other:?}"),
        }
        match ToolCallFormat::Mistral.forced_grammar(&[&f], false, None).unwrap() {
            GrammarSource::Calls(g) => {
                assert!(g.starts_with("start: (\"[TOOL_CALLS]\" /[ \\t\\r\\n]+/?)? \"[\" call \"]\""), "{g}");
                assert!(g.contains("\"arguments\""));
            }
            other => panic!("{other:?}"),
        }
    }

    /// Under "auto" with an enforced shape (Hermes), the output is a call that follows its
    /// schema from the start, or an answer: text that never opens a call, or the given JSON.
    #[test]
    fn auto_grammars_allow_an_answer_or_calls_that_follow_their_schemas() {
        use crate::structured::tests::{byte_tokenizer, drive, refuses};
        let tok = byte_tokenizer();
        let g = crate::structured::Grammars::new(tok.clone(), vec![0]);
        let f = json!({"name": "f", "parameters": {"type": "object",
            "properties": {"city": {"enum": ["London", "Rome"]}}, "required": ["city"], "additionalProperties": false}});
        let call = "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"city\": \"Rome\"}}\n</tool_call>";
        let done = |grammar: &crate::structured::Grammar, text: &str| {
            let mut m = drive(grammar, &tok, text);
            m.is_stopped() || m.is_accepting().unwrap()
        };

        let text = g.compile(&ToolCallFormat::Hermes.auto_grammar(&[&f], true, None, None).unwrap(), "tools").unwrap();
        assert!(done(&text, call));
        assert!(done(&text, &format!("{call}\n{call}")));
        assert!(done(&text, "It is sunny <tool> and < tool_call> are not calls."));
        assert!(done(&text, "Sunny."));
        assert!(refuses(&text, &tok, "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"city\": \"Paris\""));
        assert!(refuses(&text, &tok, "<tool_call>\n{\"name\": \"g\""));
        assert!(refuses(&text, &tok, "Let me look. <tool_call>"));
        let one = g.compile(&ToolCallFormat::Hermes.auto_grammar(&[&f], false, None, None).unwrap(), "tools").unwrap();
        assert!(drive(&one, &tok, call).is_stopped() || refuses(&one, &tok, &format!("{call}\n<")));

        let schema = json!({"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]});
        let json = g.compile(&ToolCallFormat::Hermes.auto_grammar(&[&f], true, Some(&schema), None).unwrap(), "tools");
        let json = json.unwrap();
        assert!(done(&json, call));
        assert!(done(&json, "{\"answer\": \"Rome\"}"));
        assert!(refuses(&json, &tok, "It is"));
        assert!(refuses(&json, &tok, "{\"city\""));

        // After thinking (the prompt opened the block): the whitespace after `</think>` comes
        // before either branch, and the text answer may start with whitespace too.
        for (parallel, answer) in [(true, None), (false, None), (true, Some(&schema))] {
            let body = ToolCallFormat::Hermes.auto_grammar(&[&f], parallel, answer, None).unwrap();
            let thinking = crate::structured::GrammarSource::AfterThinking { opened: true, body: Box::new(body) };
            let g = g.compile(&thinking, "tools").unwrap();
            // (the test tokenizer has no token for "\n\n")
            assert!(done(&g, &format!("I call f.\n</think>\n \n{call}")), "{answer:?}");
            assert!(done(&g, &format!("I call f.</think>{call}")), "{answer:?}");
            if answer.is_none() {
                assert!(done(&g, "Hmm.\n</think>\n \nIt is sunny."));
                assert!(refuses(&g, &tok, "Hmm.</think>\n \nIt is <tool_call>"));
            }
        }
        assert!(done(&text, "\n \nIt is sunny."));
        assert!(done(&text, &format!("\n{call}")));

        assert_eq!(ToolCallFormat::Json.auto_grammar(&[&f], true, None, None), None);
    }

    /// Mistral's and llama3's calls open with a special token (or bare JSON): the answer may
    /// not start as a call does, nor write what the parser reads as one.
    #[test]
    fn the_mistral_and_llama3_auto_grammars_take_their_markers() {
        use crate::structured::tests::{byte_tokenizer, drive, refuses};
        let f = json!({"name": "f", "parameters": {"type": "object",
            "properties": {"city": {"enum": ["London", "Rome"]}}, "required": ["city"], "additionalProperties": false}});
        let done = |grammar: &crate::structured::Grammar, tok: &crate::tokenizer::Tokenizer, text: &str| {
            let mut m = drive(grammar, tok, text);
            m.is_stopped() || m.is_accepting().unwrap()
        };
        // the markers as text (a vocabulary without them as special tokens)
        let tok = byte_tokenizer();
        let g = crate::structured::Grammars::new(tok.clone(), vec![0]);
        let mistral =
            g.compile(&ToolCallFormat::Mistral.auto_grammar(&[&f], true, None, None).unwrap(), "tools").unwrap();
        let call = "[{\"name\": \"f\", \"arguments\": {\"city\": \"Rome\"}}]";
        assert!(done(&mistral, &tok, call));
        assert!(done(&mistral, &tok, &format!("[TOOL_CALLS] {call}")));
        assert!(done(&mistral, &tok, "Sunny, [1] and all."));
        assert!(refuses(&mistral, &tok, "[1, 2]"), "a bare array is read as calls");
        assert!(refuses(&mistral, &tok, " [{\"name\": \"g\""));
        assert!(refuses(&mistral, &tok, "[{\"name\": \"f\", \"arguments\": {\"city\": \"Paris"));
        assert!(refuses(&mistral, &tok, "Now [TOOL_CALLS]"));
        let llama =
            g.compile(&ToolCallFormat::Llama3Json.auto_grammar(&[&f], true, None, None).unwrap(), "tools").unwrap();
        let call = "{\"name\": \"f\", \"parameters\": {\"city\": \"Rome\"}}";
        assert!(done(&llama, &tok, call));
        assert!(done(&llama, &tok, &format!("<|python_tag|>{call}; {call}")));
        assert!(done(&llama, &tok, "Use {x} or a dict."));
        assert!(refuses(&llama, &tok, "{\"name\": \"g\""));
        assert!(refuses(&llama, &tok, "Call: {\"name\""));
        let schema = json!({"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]});
        let json = ToolCallFormat::Llama3Json.auto_grammar(&[&f], true, Some(&schema), None).unwrap();
        let json = g.compile(&json, "tools").unwrap();
        assert!(done(&json, &tok, call));
        assert!(done(&json, &tok, "{\"answer\": \"Rome\"}"));
        assert!(refuses(&json, &tok, "It is"));

        // the markers as the special tokens the models write
        let tok = crate::structured::tests::tokenizer_with_specials(&["[TOOL_CALLS]", "<|python_tag|>"]);
        let g = crate::structured::Grammars::new(tok.clone(), vec![0]);
        let tag = |t: &str| tok.token_to_id(t).filter(|&id| tok.is_special(id));
        let mistral = ToolCallFormat::Mistral.auto_grammar(&[&f], false, None, tag("[TOOL_CALLS]")).unwrap();
        let mistral = g.compile(&mistral, "tools").unwrap();
        let call = "[{\"name\": \"f\", \"arguments\": {\"city\": \"Rome\"}}]";
        assert!(done(&mistral, &tok, &format!("[TOOL_CALLS]{call}")));
        assert!(done(&mistral, &tok, "Sunny."));
        let llama = ToolCallFormat::Llama3Json.auto_grammar(&[&f], false, None, tag("<|python_tag|>")).unwrap();
        let llama = g.compile(&llama, "tools").unwrap();
        assert!(done(&llama, &tok, "<|python_tag|>{\"name\": \"f\", \"parameters\": {\"city\": \"Rome\"}}"));
        // forced calls may open with the token too, or go without it
        let forced = ToolCallFormat::Mistral.forced_grammar(&[&f], false, tag("[TOOL_CALLS]")).unwrap();
        let forced = g.compile(&forced, "tools").unwrap();
        assert!(done(&forced, &tok, &format!("[TOOL_CALLS] {call}")));
        assert!(done(&forced, &tok, call));
        assert!(refuses(&forced, &tok, "Sunny"));
        let named = ToolCallFormat::Llama3Json.named_grammar(&f, tag("<|python_tag|>")).unwrap();
        let named = g.compile(&named, "tools").unwrap();
        assert!(done(&named, &tok, "<|python_tag|>{\"name\": \"f\", \"parameters\": {\"city\": \"Rome\"}}"));
    }

    #[test]
    fn the_xml_auto_grammar_allows_an_answer_or_calls_to_the_allowed_functions() {
        use crate::structured::tests::{byte_tokenizer, drive, refuses};
        let tok = byte_tokenizer();
        let g = crate::structured::Grammars::new(tok.clone(), vec![0]);
        let f = json!({"name": "f", "parameters": {"type": "object",
            "properties": {"city": {"enum": ["London", "Rome"]}}, "required": ["city"]}});
        let call = "<tool_call>\n<function=f>\n<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>";
        let done = |grammar: &crate::structured::Grammar, text: &str| {
            let mut m = drive(grammar, &tok, text);
            m.is_stopped() || m.is_accepting().unwrap()
        };
        let source = ToolCallFormat::Qwen3Xml.auto_grammar(&[&f], true, None, None).unwrap();
        let auto = g.compile(&source, "tools").unwrap();
        assert!(done(&auto, call));
        assert!(done(&auto, &format!("{call}\n{call}")));
        assert!(done(&auto, "Sunny, and <tool> is no call."));
        assert!(refuses(&auto, &tok, "<tool_call>\n<function=g>"), "only the functions given");
        assert!(refuses(&auto, &tok, "<tool_call>\n<function=f>\n<parameter=city>\nParis"));
        assert!(refuses(&auto, &tok, "Let me look. <tool_call>"));
        // a schema the XML grammar cannot follow: no grammar
        let free = json!({"name": "h", "parameters": {"type": "object", "anyOf": [{"required": ["a"]}]}});
        assert!(ToolCallFormat::Qwen3Xml.auto_grammar(&[&free], true, None, None).is_none());
    }

    /// The forced grammars accept exactly what the parsers read back as calls, and only
    /// that: a wrong function name or an argument of the wrong type is refused.
    #[test]
    fn forced_grammars_accept_what_the_parsers_read() {
        use crate::structured::tests::{byte_tokenizer, drive, refuses};
        let tok = byte_tokenizer();
        let g = crate::structured::Grammars::new(tok.clone(), vec![0]);
        let f = json!({"name": "f", "parameters": {"type": "object",
            "properties": {"a": {"type": "integer"}, "note": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["a"], "additionalProperties": false}});
        let xml_one = "<tool_call>\n<function=f>\n<parameter=a>\n7\n</parameter>\n<parameter=note>\nx < y\nand z\n\
                       </parameter>\n<parameter=unit>\nc\n</parameter>\n</function>\n</tool_call>";
        let xml_two = "<tool_call>\n<function=f>\n<parameter=a>\n7\n</parameter>\n</function>\n</tool_call>\n\
                       <tool_call>\n<function=f>\n<parameter=a>\n8\n</parameter>\n</function>\n</tool_call>";
        let cases = [
            (ToolCallFormat::Llama3Json, false, "{\"name\": \"f\", \"parameters\": {\"a\": 7}}".to_string()),
            (
                ToolCallFormat::Llama3Json,
                true,
                "{\"name\": \"f\", \"parameters\": {\"a\": 7}}; {\"name\": \"f\", \"parameters\": {\"a\": 8}}".into(),
            ),
            (ToolCallFormat::Mistral, false, "[{\"name\": \"f\", \"arguments\": {\"a\": 7}}]".into()),
            (
                ToolCallFormat::Mistral,
                true,
                "[{\"name\": \"f\", \"arguments\": {\"a\": 7}}, {\"name\": \"f\", \"arguments\": {\"a\": 8}}]".into(),
            ),
            (
                ToolCallFormat::Hermes,
                false,
                "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 7}}\n</tool_call>".into(),
            ),
            (ToolCallFormat::Json, false, "[{\"name\": \"f\", \"arguments\": {\"a\": 7}}]".into()),
            (ToolCallFormat::Qwen3Xml, false, xml_one.into()),
            (ToolCallFormat::Qwen3Xml, true, xml_two.into()),
        ];
        for (format, parallel, text) in cases {
            let grammar = g.compile(&format.forced_grammar(&[&f], parallel, None).unwrap(), "tools").unwrap();
            let mut m = drive(&grammar, &tok, &text);
            assert!(m.is_stopped() || m.is_accepting().unwrap(), "{format:?} {text}");
            let parsing = ToolParsing::new(format, parallel, &[&f]);
            let (content, calls) = run_with(format, parsing.parameters.clone(), &[&text]);
            // Forced, the same complete output reads the same.
            let forced = parsing.with_choice(ToolChoice::Required).parser();
            assert_eq!(run_parser(forced, &[&text]), (content.clone(), calls.clone()), "{format:?} forced");
            assert_eq!(content, "", "{format:?}");
            assert_eq!(calls.len(), if parallel { 2 } else { 1 }, "{format:?}");
            assert_eq!(calls[0].0, "f");
            let args: Value = serde_json::from_str(&calls[0].1).unwrap();
            assert_eq!(args["a"], 7, "{format:?} {}", calls[0].1);
        }
        // A named call: the json format's output is the arguments alone (also through $refs);
        // the others write the whole call, as for "required".
        let with_ref = json!({"name": "w", "parameters": {"type": "object", "properties": {"u": {"$ref": "#/$defs/U"}},
            "required": ["u"], "$defs": {"U": {"enum": ["c", "f"]}}}});
        for (function, text, want) in [
            (&f, "{\"a\": 7, \"unit\": \"f\"}", ("f", "{\"a\": 7, \"unit\": \"f\"}")),
            (&with_ref, "{\"u\": \"c\"}", ("w", "{\"u\": \"c\"}")),
        ] {
            let grammar = g.compile(&ToolCallFormat::Json.named_grammar(function, None).unwrap(), "tools").unwrap();
            let mut m = drive(&grammar, &tok, text);
            assert!(m.is_stopped() || m.is_accepting().unwrap(), "{text}");
            assert!(refuses(&grammar, &tok, "{\"name\""));
            let named = ToolParsing::new(ToolCallFormat::Json, false, &[function]).with_choice(ToolChoice::Named);
            let (content, calls) = run_parser(named.parser(), &[&text[..3], &text[3..]]);
            assert_eq!((content.as_str(), calls), ("", vec![(want.0.to_string(), want.1.to_string())]));
        }
        let hermes = ToolCallFormat::Hermes.named_grammar(&f, None).unwrap();
        assert_eq!(hermes, ToolCallFormat::Hermes.forced_grammar(&[&f], false, None).unwrap());
        let xml = g.compile(&ToolCallFormat::Qwen3Xml.forced_grammar(&[&f], false, None).unwrap(), "tools").unwrap();
        assert!(refuses(&xml, &tok, "<tool_call>\n<function=g>"));
        assert!(refuses(&xml, &tok, "<tool_call>\n<function=f>\n<parameter=a>\nseven"));
        assert!(refuses(&xml, &tok, "<tool_call>\n<function=f>\n</function>"), "a is required");
        assert!(refuses(&xml, &tok, "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n<parameter=unit>\nk"));
    }

    /// Arguments are a JSON object whatever the schema leaves open: `parameters: {}` is any
    /// object, and no `parameters` is the empty parameter list.
    #[test]
    fn forced_arguments_are_always_an_object() {
        use crate::structured::tests::{byte_tokenizer, drive, refuses};
        let tok = byte_tokenizer();
        let g = crate::structured::Grammars::new(tok.clone(), vec![0]);
        let open = json!({"name": "f", "parameters": {}});
        let grammar = g.compile(&ToolCallFormat::Json.forced_grammar(&[&open], false, None).unwrap(), "tools").unwrap();
        assert!(refuses(&grammar, &tok, "[{\"name\": \"f\", \"arguments\": \"x"));
        assert!(refuses(&grammar, &tok, "[{\"name\": \"f\", \"arguments\": ["));
        assert!(drive(&grammar, &tok, "[{\"name\": \"f\", \"arguments\": {\"when\": 1}}]").is_stopped());
        // one call, not two (parallel_tool_calls: false), and not a bare object
        assert!(refuses(&grammar, &tok, "[{\"name\": \"f\", \"arguments\": {}}, "));
        assert!(refuses(&grammar, &tok, "{"));
        let none = json!({"name": "f"});
        let grammar = g.compile(&ToolCallFormat::Json.forced_grammar(&[&none], false, None).unwrap(), "tools").unwrap();
        assert!(refuses(&grammar, &tok, "[{\"name\": \"f\", \"arguments\": {\""));
        assert!(drive(&grammar, &tok, "[{\"name\": \"f\", \"arguments\": {}}]").is_stopped());
    }

    /// Parameters with local `$ref`s (what pydantic writes for nested models and enums, and a
    /// recursive `#`) keep their meaning inside the call, in every format, beside a second
    /// function with refs of its own; keys a schema does not list are refused.
    #[test]
    fn forced_calls_follow_refs_and_listed_keys() {
        use crate::structured::tests::{byte_tokenizer, drive, refuses};
        let tok = byte_tokenizer();
        let g = crate::structured::Grammars::new(tok.clone(), vec![0]);
        let weather = json!({"name": "w", "parameters": {
            "$defs": {"Unit": {"enum": ["c", "f"], "type": "string"},
                      "Place": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
            "type": "object",
            "properties": {"place": {"$ref": "#/$defs/Place"}, "unit": {"$ref": "#/$defs/Unit"},
                           "days": {"anyOf": [{"$ref": "#/$defs/Days"}, {"type": "null"}]}},
            "required": ["place", "unit"]}});
        let mut weather = weather;
        weather["parameters"]["$defs"]["Days"] = json!({"type": "integer"});
        let tree = json!({"name": "t", "parameters": {"type": "object",
            "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#"}}},
            "required": ["v"]}});
        let args = "{\"place\": {\"city\": \"Oslo\"}, \"unit\": \"c\", \"days\": 3}";
        let kids = "{\"v\": 1, \"kids\": [{\"v\": 2}]}";
        let cases = [
            (
                ToolCallFormat::Hermes,
                false,
                format!("<tool_call>\n{{\"name\": \"w\", \"arguments\": {args}}}\n</tool_call>"),
            ),
            (ToolCallFormat::Json, false, format!("[{{\"name\": \"t\", \"arguments\": {kids}}}]")),
            (
                ToolCallFormat::Json,
                true,
                format!("[{{\"name\": \"t\", \"arguments\": {kids}}}, {{\"name\": \"w\", \"arguments\": {args}}}]"),
            ),
            (ToolCallFormat::Llama3Json, false, format!("{{\"name\": \"w\", \"parameters\": {args}}}")),
            (ToolCallFormat::Mistral, false, format!("[{{\"name\": \"t\", \"arguments\": {kids}}}]")),
        ];
        for (format, parallel, text) in cases {
            let grammar =
                g.compile(&format.forced_grammar(&[&weather, &tree], parallel, None).unwrap(), "tools").unwrap();
            let mut m = drive(&grammar, &tok, &text);
            assert!(m.is_stopped() || m.is_accepting().unwrap(), "{format:?} {text}");
            let cut = text.find("\"c\"").or(text.find("[{\"v\": 2")).unwrap();
            let wrong = if text[cut..].starts_with("\"c\"") { "\"k\"" } else { "[{\"v\": \"two\"" };
            assert!(refuses(&grammar, &tok, &format!("{}{wrong}", &text[..cut])), "{format:?}");
        }
        let grammar =
            g.compile(&ToolCallFormat::Json.forced_grammar(&[&weather], false, None).unwrap(), "tools").unwrap();
        assert!(refuses(&grammar, &tok, "[{\"name\": \"w\", \"arguments\": {\"place\": {\"city\": \"x\", \"co"));
        assert!(refuses(&grammar, &tok, "[{\"name\": \"w\", \"arguments\": {\"season"));
        let xml =
            g.compile(&ToolCallFormat::Qwen3Xml.forced_grammar(&[&weather], false, None).unwrap(), "tools").unwrap();
        let call = "<tool_call>\n<function=w>\n<parameter=place>\n{\"city\": \"Oslo\"}\n</parameter>\n\
                    <parameter=unit>\nc\n</parameter>\n</function>\n</tool_call>";
        assert!(drive(&xml, &tok, call).is_stopped());
        assert!(refuses(
            &xml,
            &tok,
            "<tool_call>\n<function=w>\n<parameter=place>\n{\"city\": \"Oslo\"}\n</parameter>\n<parameter=unit>\nk"
        ));
        let parsing = ToolParsing::new(ToolCallFormat::Qwen3Xml, false, &[&weather]);
        let xml_days = "<tool_call>\n<function=w>\n<parameter=days>\n4\n</parameter>\n</function>\n</tool_call>";
        let (_, calls) = run_with(ToolCallFormat::Qwen3Xml, parsing.parameters.clone(), &[xml_days]);
        assert_eq!(serde_json::from_str::<Value>(&calls[0].1).unwrap(), json!({"days": 4}), "typed through the ref");
    }

    /// Schemas audit 11 found broken by the ref rewrite or the closing of objects: a base
    /// extended through `allOf` or a `$ref` with sibling keywords, a union beside
    /// `properties`, a property named like a keyword, an `$id`, pydantic v1's `allOf` wrapper,
    /// and parameters that are a `$ref`. Each compiles in every format and takes a valid call.
    #[test]
    fn forced_calls_take_composed_schemas() {
        use crate::structured::tests::{byte_tokenizer, drive};
        let tok = byte_tokenizer();
        let g = crate::structured::Grammars::new(tok.clone(), vec![0]);
        let base = json!({"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]});
        let cases = [
            (
                json!({"type": "object", "$defs": {"Base": base},
                       "properties": {"dog": {"allOf": [{"$ref": "#/$defs/Base"},
                                                        {"properties": {"bark": {"type": "boolean"}}, "required": ["bark"]}]}},
                       "required": ["dog"]}),
                json!({"dog": {"name": "rex", "bark": true}}),
            ),
            (
                json!({"type": "object", "$defs": {"Base": base},
                       "properties": {"cat": {"$ref": "#/$defs/Base", "properties": {"meow": {"type": "integer"}}}},
                       "required": ["cat"]}),
                json!({"cat": {"name": "tom", "meow": 2}}),
            ),
            (
                json!({"type": "object", "$defs": {"Color": {"enum": ["red", "blue"], "type": "string"}},
                       "properties": {"default": {"$ref": "#/$defs/Color"}, "enum": {"$ref": "#/$defs/Color"}},
                       "required": ["default", "enum"]}),
                json!({"default": "red", "enum": "blue"}),
            ),
            (
                json!({"$id": "https://example.com/args.json", "type": "object",
                       "$defs": {"U": {"type": "integer"}}, "properties": {"u": {"$ref": "#/$defs/U"}}, "required": ["u"]}),
                json!({"u": 4}),
            ),
            (
                json!({"$id": "https://example.com/args.json", "type": "object", "$defs": {"U": {"type": "integer"}},
                       "properties": {"u": {"$ref": "https://example.com/args.json#/$defs/U"}, "v": {"$ref": "#/$defs/U"}},
                       "required": ["u", "v"]}),
                json!({"u": 4, "v": 5}),
            ),
            (
                json!({"type": "object", "definitions": {"Inner": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}},
                       "properties": {"inner": {"title": "Inner", "allOf": [{"$ref": "#/definitions/Inner"}]}},
                       "required": ["inner"]}),
                json!({"inner": {"x": 1}}),
            ),
            (
                json!({"$ref": "#/$defs/Args", "$defs": {"Args": {"type": "object", "properties": {"z": {"type": "integer"}}, "required": ["z"]}}}),
                json!({"z": 1}),
            ),
        ];
        for (params, args) in cases {
            let f = json!({"name": "f", "parameters": params});
            let text = serde_json::to_string(&json!([{"name": "f", "arguments": args}]))
                .unwrap()
                .replace(",", ", ")
                .replace(":", ": ");
            let grammar = g.compile(&ToolCallFormat::Json.forced_grammar(&[&f], false, None).unwrap(), "tools");
            let grammar = grammar.unwrap_or_else(|e| panic!("{params}: {}", e.message()));
            let mut m = drive(&grammar, &tok, &text);
            assert!(m.is_stopped() || m.is_accepting().unwrap(), "{params}: {text}");
            for format in
                [ToolCallFormat::Hermes, ToolCallFormat::Llama3Json, ToolCallFormat::Mistral, ToolCallFormat::Qwen3Xml]
            {
                g.compile(&format.forced_grammar(&[&f], false, None).unwrap(), "tools")
                    .unwrap_or_else(|e| panic!("{format:?} {params}: {}", e.message()));
            }
            // XML: every parameter as its grammar and the parser read it
            let mut xml = String::from("<tool_call>\n<function=f>\n");
            for (key, value) in args.as_object().unwrap() {
                let raw = value.as_str().map_or_else(
                    || serde_json::to_string(value).unwrap().replace(",", ", ").replace(":", ": "),
                    str::to_string,
                );
                xml.push_str(&format!("<parameter={key}>\n{raw}\n</parameter>\n"));
            }
            xml.push_str("</function>\n</tool_call>");
            let grammar =
                g.compile(&ToolCallFormat::Qwen3Xml.forced_grammar(&[&f], false, None).unwrap(), "tools").unwrap();
            assert!(drive(&grammar, &tok, &xml).is_stopped(), "{params}: {xml}");
            let parsing = ToolParsing::new(ToolCallFormat::Qwen3Xml, false, &[&f]);
            let (_, calls) = run_with(ToolCallFormat::Qwen3Xml, parsing.parameters.clone(), &[&xml]);
            assert_eq!(serde_json::from_str::<Value>(&calls[0].1).unwrap(), args, "{xml}");
        }
    }

    /// The XML format writes each value as raw text in its own tag: string `const`s become
    /// literals and lengths bounded text; what a rule per property cannot follow (root
    /// combinators, `pattern`, `required` names without a property...) is refused, naming
    /// where, instead of generated unchecked.
    #[test]
    fn xml_forced_calls_enforce_string_keywords_or_refuse() {
        use crate::structured::tests::{byte_tokenizer, drive, refuses};
        let tok = byte_tokenizer();
        let g = crate::structured::Grammars::new(tok.clone(), vec![0]);
        let f = json!({"name": "f", "parameters": {"type": "object", "properties": {
            "c": {"const": "fixed"},
            "short": {"type": "string", "maxLength": 3},
            "long": {"type": "string", "minLength": 2},
            "pick": {"anyOf": [{"enum": ["a", "b"]}, {"const": "c"}], "maxLength": null},
            "code": {"allOf": [{"$ref": "#/$defs/Code"}]}},
            "required": ["c", "short", "long", "pick", "code"],
            "$defs": {"Code": {"type": "string", "enum": ["x1", "toolong"], "maxLength": 2}}}});
        let grammar =
            g.compile(&ToolCallFormat::Qwen3Xml.forced_grammar(&[&f], false, None).unwrap(), "tools").unwrap();
        let head = "<tool_call>\n<function=f>\n<parameter=c>\n";
        let call = format!(
            "{head}fixed\n</parameter>\n<parameter=short>\nab<\n</parameter>\n<parameter=long>\nxy\n</parameter>\n\
             <parameter=pick>\nc\n</parameter>\n<parameter=code>\nx1\n</parameter>\n</function>\n</tool_call>"
        );
        let call = call.replace("ab<", "abc");
        assert!(drive(&grammar, &tok, &call).is_stopped(), "{call}");
        let cut = |marker: &str, wrong: &str| format!("{}{wrong}", &call[..call.find(marker).unwrap() + marker.len()]);
        assert!(refuses(&grammar, &tok, &format!("{head}fixes")));
        assert!(refuses(&grammar, &tok, &cut("<parameter=short>\n", "abcd")));
        assert!(refuses(&grammar, &tok, &cut("<parameter=long>\n", "x\n<")));
        assert!(refuses(&grammar, &tok, &cut("<parameter=pick>\n", "d")));
        assert!(refuses(&grammar, &tok, &cut("<parameter=code>\n", "t")));

        let refused = |params: Value| {
            let f = json!({"name": "f", "parameters": params});
            let err = ToolCallFormat::Qwen3Xml.forced_grammar(&[&f, &f], false, None).unwrap_err();
            assert_eq!(err.function, 0);
            err.at
        };
        let a = json!({"a": {"type": "integer"}});
        let cases = [
            (json!({"properties": {"s": {"type": "string", "pattern": "^[A-Z]+$"}}}), ".properties.s.pattern"),
            (
                json!({"properties": {"s": {"type": "string", "minLength": 5, "maxLength": 3}}}),
                ".properties.s.minLength",
            ),
            (json!({"properties": {"s": {"type": "string", "maxLength": 4294967296u64}}}), ".properties.s.maxLength"),
            (json!({"properties": {"s": {"enum": ["a", "x</parameter>"]}}}), ".properties.s"),
            (
                json!({"properties": {"s": {"anyOf": [{"type": "string", "maxLength": 2}, {"type": "string"}]}}}),
                ".properties.s.anyOf",
            ),
            (json!({"properties": {"s": {"oneOf": [{"enum": ["a", "b"]}, {"enum": ["b"]}]}}}), ".properties.s.oneOf"),
            (json!({"properties": a, "allOf": [{"required": ["a"]}]}), ".allOf"),
            (json!({"properties": a, "anyOf": [{"required": ["a"]}]}), ".anyOf"),
            (json!({"properties": a, "required": ["a", "b"]}), ".required"),
            (json!({"type": "object", "required": ["a"]}), ".required"),
            (json!({"properties": a, "minProperties": 1}), ".minProperties"),
            (json!({"properties": {"a": {}, "b": {}}, "maxProperties": 1}), ".maxProperties"),
            (json!({"properties": {"a>b": {"type": "integer"}}}), ".properties.a>b"),
            (json!({"$ref": "#/$defs/A", "$defs": {"A": {"properties": a}}, "properties": {"w": {}}}), ".properties"),
            (json!({"$ref": "#/$defs/A", "$defs": {"A": {"properties": a, "if": {"required": ["a"]}}}}), ".$defs.A.if"),
        ];
        for (params, at) in cases {
            assert_eq!(refused(params.clone()), at, "{params}");
        }
        // a value whose types cannot be told (an anchor ref) but that constrains it is JSON,
        // which the JSON engine enforces, and is read back as JSON
        let f = json!({"name": "f", "parameters": {"type": "object", "required": ["dog"], "properties": {
            "dog": {"allOf": [{"$ref": "#base"}, {"properties": {"bark": {"type": "boolean"}}, "required": ["bark"]}]}},
            "$defs": {"Base": {"$anchor": "base", "type": "object", "properties": {"name": {"type": "string"}}}}}});
        let grammar =
            g.compile(&ToolCallFormat::Qwen3Xml.forced_grammar(&[&f], false, None).unwrap(), "tools").unwrap();
        let call = "<tool_call>\n<function=f>\n<parameter=dog>\n{\"name\": \"rex\", \"bark\": true}\n</parameter>\n\
                    </function>\n</tool_call>";
        assert!(drive(&grammar, &tok, call).is_stopped());
        assert!(refuses(&grammar, &tok, "<tool_call>\n<function=f>\n<parameter=dog>\nrex"));
        let parsing = ToolParsing::new(ToolCallFormat::Qwen3Xml, false, &[&f]);
        let (_, calls) = run_with(ToolCallFormat::Qwen3Xml, parsing.parameters.clone(), &[call]);
        assert_eq!(serde_json::from_str::<Value>(&calls[0].1).unwrap(), json!({"dog": {"name": "rex", "bark": true}}));

        // what is enforced fully or not at all passes: objects with bounds they meet, strings
        // in unions with free text, values that are JSON
        for params in [
            // `format` is an annotation: left unenforced in raw text, as JSON engines leave
            // formats they do not know
            json!({"properties": {"when": {"type": "string", "format": "date-time"}}, "required": ["when"]}),
            json!({"properties": a, "required": ["a"], "minProperties": 1, "maxProperties": 1}),
            json!({"properties": {"s": {"anyOf": [{"type": "string"}, {"enum": ["a"]}]}, "n": {"type": "integer", "minimum": 2}}}),
        ] {
            let f = json!({"name": "f", "parameters": params});
            g.compile(&ToolCallFormat::Qwen3Xml.forced_grammar(&[&f], false, None).unwrap(), "tools").unwrap();
        }
    }
}
