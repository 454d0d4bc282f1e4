//! Structured outputs: compiling `response_format` (json_object, json_schema, and the `regex`
//! / `grammar` extensions) and forced tool calls into grammars that constrain decoding.
//!
//! The grammar engine is `llguidance`. One [`ParserFactory`] is built (lazily, on the first
//! constrained request) from the tokenizer's token bytes; each distinct grammar is compiled
//! once at prepare time into a fresh [`Matcher`] kept in a cache keyed by the grammar's
//! sha256, and each constrained sequence gets its own clone of it (see [`Grammar::matcher`]).
//! Compiling at prepare time means a schema the engine cannot handle is a 400 naming the
//! offending keyword before any generation, and a malformed regex or Lark grammar likewise.
//!
//! Invariants: a [`Grammar`] always holds a matcher that compiled without error; two
//! grammars are equal exactly when their keys (kind + canonical source hash) are equal.
//!
//! NOTE: JSON is generated with fixed separators (`", "`, `": "`) and no free whitespace
//! (`x-guidance` options merged into the schema): a small model given free whitespace can
//! loop on newlines until `max_tokens`; fixed separators are also what it most often writes.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, OnceLock};

use llguidance::api::{GrammarWithLexer, TopLevelGrammar};
use llguidance::toktrie::{ApproximateTokEnv, TokRxInfo, TokTrie};
pub use llguidance::Matcher;
use llguidance::ParserFactory;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::error::ApiError;
use crate::json_guard::{JsonGuard, JsonStart, TokenBytes};
use crate::tokenizer::Tokenizer;

/// Compiled grammars kept at most; beyond it the cache is cleared (schemas repeat in
/// practice, so a rare full reset costs less than LRU bookkeeping).
const CACHE_CAPACITY: usize = 256;

/// Source text the cached grammars may hold in all, a bound on their memory too: a compiled
/// grammar took about 75 times its text here (a Lark grammar of 20,000 literals, 270 KB,
/// about 20 MB), so 256 large ones would hold gigabytes. Past it the cache is cleared too.
const CACHE_TEXT_BYTES: usize = 4 << 20;

/// What a request asks the output to match.
#[derive(Clone, Debug, PartialEq)]
pub enum GrammarSource {
    /// A JSON schema (json_object is `{"type": "object"}`).
    JsonSchema(Value),
    /// A regular expression the whole output must match (extension).
    Regex(String),
    /// A grammar in llguidance's Lark dialect (extension).
    Lark(String),
    /// A forced tool call's grammar (llguidance's Lark, as `Lark`): JSON values between markup
    /// that holds no JSON punctuation but balanced brackets (`<tool_call>`, `[TOOL_CALLS]`,
    /// `; `), so the output's JSON can be followed from its start (see `json_guard`).
    Calls(String),
    /// A structural tag (`response_format` `{"type": "structural_tag"}`): free text and tagged
    /// structures as one Lark grammar, with the JSON schemas it inlines.
    Tagged(crate::protocol::structural_tag::Tagged),
    /// `body`, after the model's reasoning: free text up to `</think>` (and whitespace)
    /// comes first, opened by `<think>` unless the prompt `opened` the block; a model that
    /// does not think starts `body` at once (only when the prompt did not open the block).
    AfterThinking { opened: bool, body: Box<GrammarSource> },
}

impl GrammarSource {
    fn kind(&self) -> &'static str {
        match self {
            Self::JsonSchema(_) => "json_schema",
            Self::Regex(_) => "regex",
            Self::Lark(_) => "lark",
            // (a Lark grammar to whoever reads the key; its hash sets it apart from a client's)
            Self::Calls(_) => "lark",
            Self::Tagged(_) => "structural_tag",
            Self::AfterThinking { .. } => "after_thinking",
        }
    }

    /// The grammar `self` becomes for a request with this reasoning plan.
    pub fn after_reasoning(self, reasoning: Option<crate::reasoning::ReasoningPlan>) -> Self {
        match reasoning {
            Some(plan) => Self::AfterThinking { opened: plan.prompt_opened, body: Box::new(self) },
            None => self,
        }
    }

    /// The JSON schema, when this source is one (after any reasoning).
    fn json_schema(&self) -> Option<&Value> {
        match self {
            Self::JsonSchema(schema) => Some(schema),
            Self::AfterThinking { body, .. } => body.json_schema(),
            _ => None,
        }
    }

    /// Where the output's JSON starts, when its JSON can be followed (a schema's, a forced
    /// call's).
    fn json_start(&self) -> Option<JsonStart> {
        match self {
            Self::JsonSchema(_) | Self::Calls(_) => Some(JsonStart::Now),
            Self::AfterThinking { opened, body } => {
                body.json_start().map(|_| JsonStart::AfterThinking { opened: *opened })
            }
            _ => None,
        }
    }

    /// The JSON schemas a structural tag inlines, each with its param (after any reasoning).
    fn tagged_schemas(&self) -> &[(String, Value)] {
        match self {
            Self::Tagged(t) => &t.schemas,
            Self::AfterThinking { body, .. } => body.tagged_schemas(),
            _ => &[],
        }
    }

    /// The Lark text of a client's grammar or a forced call's (after any reasoning).
    fn grammar_text(&self) -> Option<&str> {
        match self {
            Self::Lark(g) | Self::Calls(g) => Some(g),
            Self::AfterThinking { body, .. } => body.grammar_text(),
            _ => None,
        }
    }

    /// The client's Lark grammar, when this source is one (after any reasoning).
    fn lark(&self) -> Option<&str> {
        match self {
            Self::Lark(g) => Some(g),
            Self::AfterThinking { body, .. } => body.lark(),
            _ => None,
        }
    }

    /// The Lark text that spells the client's literals: a client's grammar, a structural tag's.
    fn client_lark(&self) -> Option<&str> {
        match self {
            Self::Lark(g) => Some(g),
            Self::Tagged(t) => Some(&t.lark),
            Self::AfterThinking { body, .. } => body.client_lark(),
            _ => None,
        }
    }

    /// The client's regex, when this source is one (after any reasoning).
    fn regex(&self) -> Option<&str> {
        match self {
            Self::Regex(rx) => Some(rx),
            Self::AfterThinking { body, .. } => body.regex(),
            _ => None,
        }
    }

    /// The text the grammar is compiled from, as its cache key names it.
    fn text(&self) -> String {
        match self {
            Self::JsonSchema(v) => serde_json::to_string(v).expect("JSON values serialize"),
            Self::Regex(s) | Self::Lark(s) => s.clone(),
            Self::Calls(s) => format!("calls\n{s}"),
            Self::Tagged(t) => t.lark.clone(),
            Self::AfterThinking { opened, body } => format!("{opened}:{}", body.text()),
        }
    }

    /// The cache key: the kind and a hash of `text`.
    fn key_of(&self, text: &str) -> String {
        let digest = Sha256::digest(text.as_bytes());
        let hex: String = digest.iter().take(16).map(|b| format!("{b:02x}")).collect();
        format!("{}:{hex}", self.kind())
    }

    #[cfg(test)]
    fn key(&self) -> String {
        self.key_of(&self.text())
    }

    fn to_top_level(&self) -> TopLevelGrammar {
        match self {
            Self::JsonSchema(schema) => TopLevelGrammar::from_json_schema(for_generation(schema)),
            // NOTE: JSON Schema's (JavaScript's) classes, as for a schema's `pattern`: `\d` is
            // [0-9] and `\w` [0-9a-zA-Z_]. With Rust's Unicode classes `\d{3}` let a small
            // model write 🯸🯸🯸 (audit 8), which is never what a regex for a number means.
            Self::Regex(rx) => {
                let mut g = GrammarWithLexer::from_lark(format!("start: /{}/", llguidance::regex_to_lark(rx, "dw")));
                g.name = Some("regex".into());
                TopLevelGrammar::from_grammar(g)
            }
            Self::Lark(g) | Self::Calls(g) => TopLevelGrammar::from_lark(g.clone()),
            Self::Tagged(t) => TopLevelGrammar::from_lark(t.lark.clone()),
            Self::AfterThinking { opened, body } => {
                let mut body = body.to_top_level();
                for g in &mut body.grammars[..1] {
                    g.name = Some("body".into());
                }
                // NOTE: the thinking is a lazy `gen`: it ends at the first `</think>`.
                let start = if *opened { "start: think ws? @body" } else { "start: (\"<think>\" think ws?)? @body" };
                let wrapper = format!("{start}\nthink[suffix=\"</think>\"]: /(.|\\n)*/\nws: /[ \\t\\r\\n]+/\n");
                let mut grammars = vec![GrammarWithLexer::from_lark(wrapper)];
                grammars.extend(body.grammars);
                TopLevelGrammar { grammars, max_tokens: None }
            }
        }
    }
}

/// `schema` as its grammar is compiled: llguidance's options for the JSON it generates (fixed
/// separators and no free whitespace, see the module's NOTE), under any `x-guidance` options
/// the schema has, its open integers and fractional seconds bounded
/// (`schema_edit::bound_values`), and the formats the engine does not enforce left out
/// (`schema_edit::drop_unenforced_annotations`).
pub(crate) fn for_generation(schema: &Value) -> Value {
    let mut schema = schema.clone();
    crate::protocol::schema_edit::drop_unenforced_annotations(&mut schema);
    crate::protocol::schema_edit::bound_values(&mut schema);
    if let Value::Object(obj) = &mut schema {
        let mut opts = json!({
            "whitespace_flexible": false,
            "item_separator": ", ",
            "key_separator": ": ",
        });
        if let Some(user) = obj.get("x-guidance") {
            llguidance::json_merge(&mut opts, user);
        }
        obj.insert("x-guidance".into(), opts);
    }
    schema
}

/// A compiled grammar: cheap to clone, shared by every request that sends the same source.
#[derive(Clone)]
pub struct Grammar {
    key: Arc<str>,
    /// The request field it came from (`response_format`, `structured_outputs`, `tools`, ...):
    /// each request's own, as requests with the same source share the compiled grammar.
    param: Arc<str>,
    /// Its source text's bytes (what the cache counts).
    size: usize,
    template: Arc<Mutex<Matcher>>,
    /// A JSON schema's or forced call's: where the JSON starts, and the vocabulary's bytes,
    /// for JSON guards.
    json: Option<(JsonStart, Arc<TokenBytes>)>,
}

/// `m`'s guard, poisoned or not: a cache entry and a matcher template are whole between calls
/// (nothing mutates one in place), so a panic elsewhere while one was held leaves them usable,
/// rather than failing every constrained request after it.
fn locked<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Grammar {
    /// "<kind>:<first 32 hex chars of the source's sha256>".
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The request field this grammar came from, for an error about it.
    pub fn param(&self) -> &str {
        &self.param
    }

    /// Names the field in the terms of the route that translated the request (Responses'
    /// `text.format.schema`, Messages' `output_config.format.schema`), as its own errors do.
    pub(crate) fn rename_param(&mut self, rename: impl FnOnce(&str) -> String) {
        self.param = rename(&self.param).into();
    }

    /// A fresh matcher for one sequence, at the grammar's start.
    pub fn matcher(&self) -> Matcher {
        locked(&self.template).clone()
    }

    /// For a JSON schema's or forced call's grammar, a fresh guard that keeps one sequence's
    /// object keys distinct and its numbers' digits bounded (see `json_guard`); other grammars'
    /// output is not JSON to follow.
    pub fn json_guard(&self) -> Option<JsonGuard> {
        self.json.as_ref().map(|(start, tokens)| JsonGuard::new(Arc::clone(tokens), *start))
    }
}

impl fmt::Debug for Grammar {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Grammar").field(&self.key).finish()
    }
}

impl PartialEq for Grammar {
    fn eq(&self, other: &Self) -> bool {
        self.key == other.key
    }
}

/// The grammar compiler and cache of one served tokenizer. `Send + Sync`.
pub struct Grammars {
    tokenizer: Arc<Tokenizer>,
    eos_token_ids: Vec<u32>,
    factory: OnceLock<Result<ParserFactory, String>>,
    /// Over single bytes: whether a grammar admits any text at all, whatever the vocabulary.
    byte_factory: OnceLock<Result<ParserFactory, String>>,
    /// Every token's bytes, for the guards of JSON grammars.
    token_bytes: OnceLock<Arc<TokenBytes>>,
    cache: Mutex<Cache>,
}

/// The compiled grammars by key, and the bytes of source text they were compiled from, in all.
#[derive(Default)]
struct Cache {
    grammars: HashMap<Arc<str>, Grammar>,
    text_bytes: usize,
}

impl Cache {
    /// Keeps `grammar`, first clearing the cache if it would then hold more than
    /// CACHE_CAPACITY grammars or CACHE_TEXT_BYTES of text. (A grammar larger than that alone
    /// is not kept: each request of it compiles it afresh.)
    fn insert(&mut self, grammar: Grammar) {
        if grammar.size > CACHE_TEXT_BYTES {
            return;
        }
        if self.grammars.len() >= CACHE_CAPACITY || self.text_bytes + grammar.size > CACHE_TEXT_BYTES {
            self.grammars.clear();
            self.text_bytes = 0;
        }
        self.text_bytes += grammar.size;
        if let Some(old) = self.grammars.insert(grammar.key.clone(), grammar) {
            self.text_bytes -= old.size;
        }
    }

    fn remove(&mut self, key: &str) {
        if let Some(old) = self.grammars.remove(key) {
            self.text_bytes -= old.size;
        }
    }
}

impl Grammars {
    pub fn new(tokenizer: Arc<Tokenizer>, eos_token_ids: Vec<u32>) -> Self {
        Self {
            tokenizer,
            eos_token_ids,
            factory: OnceLock::new(),
            byte_factory: OnceLock::new(),
            token_bytes: OnceLock::new(),
            cache: Mutex::new(Cache::default()),
        }
    }

    /// The token count masks are computed over (the tokenizer's vocabulary).
    pub fn vocab_size(&self) -> usize {
        self.tokenizer.vocab_size()
    }

    fn token_bytes(&self) -> &Arc<TokenBytes> {
        self.token_bytes.get_or_init(|| Arc::new(TokenBytes::of(&self.tokenizer)))
    }

    fn factory(&self) -> Result<&ParserFactory, ApiError> {
        self.factory
            .get_or_init(|| build_factory(&self.tokenizer, &self.eos_token_ids))
            .as_ref()
            .map_err(|e| ApiError::Internal { message: format!("grammar engine: {e}") })
    }

    /// Compiles `source` (or finds it in the cache). `param` names the request field the
    /// source came from, for the 400 when it does not compile.
    pub fn compile(&self, source: &GrammarSource, param: &str) -> Result<Grammar, ApiError> {
        let text = source.text();
        let key = source.key_of(&text);
        if let Some(g) = locked(&self.cache).grammars.get(key.as_str()) {
            return Ok(Grammar { param: param.into(), ..g.clone() });
        }
        // A forced (or strict) call's grammar is ours; only the `parameters` schema in it is the
        // client's, so its errors name that and leave our grammar's text out.
        let what =
            if param == "tools" { "`parameters` schema of a forced or strict tool call" } else { describe(source) };
        // (every schema the source holds: its own, or those its grammar inlines; a structural
        // tag's were checked as it was built, each at its own param)
        let inlined = source.grammar_text().map(crate::engine_limits::inlined_schemas).unwrap_or_default();
        let checked = match source.regex() {
            Some(rx) => check_regex(rx, "regex"),
            None => source.json_schema().into_iter().chain(&inlined).try_for_each(check_for_engine),
        }
        .and_then(|()| source.lark().map_or(Ok(()), crate::engine_limits::check_lark))
        .and_then(|()| source.client_lark().map_or(Ok(()), crate::engine_limits::check_lark_literals));
        if let Err(cause) = checked {
            return Err(ApiError::invalid(
                param,
                format!("The {what} cannot be used to constrain generation: {cause}"),
            ));
        }
        let factory = self.factory()?;
        let parser = factory.create_parser(source.to_top_level());
        let matcher = Matcher::new(parser);
        if let Some(err) = matcher.get_error() {
            // (a structural tag's JSON schema that fails alone is blamed at its own param)
            for (at, schema) in source.tagged_schemas() {
                self.compile(&GrammarSource::JsonSchema(schema.clone()), at)?;
            }
            let cause = if param == "tools" { without_grammar_position(&first_line(&err)) } else { first_line(&err) };
            let cause = in_clients_terms(&cause);
            let schemas: Vec<&Value> = source.json_schema().into_iter().chain(&inlined).collect();
            let place = unimplemented_places(&cause, &schemas);
            return Err(ApiError::invalid(
                param,
                format!("The {what} cannot be used to constrain generation: {cause}{place}"),
            ));
        }
        if let Err(err) = self.probe(source, &matcher) {
            let (what, hint) = if param == "tools" {
                (
                    "forced tool call",
                    " A forced call can choose between about 2000 tools at most (llguidance allows 2000 parser \
                     items per step); send fewer tools, or `tool_choice` \"auto\".",
                )
            } else {
                (describe(source), "")
            };
            return Err(ApiError::invalid(
                param,
                format!(
                    "The {what} is beyond what the grammar engine can follow while generating: {}.{hint}",
                    first_line(&err)
                ),
            ));
        }
        let json = source.json_start().map(|start| (start, Arc::clone(self.token_bytes())));
        let grammar = Grammar {
            key: key.as_str().into(),
            param: param.into(),
            size: text.len(),
            template: Arc::new(Mutex::new(matcher)),
            json,
        };
        locked(&self.cache).insert(grammar.clone());
        Ok(grammar)
    }

    /// Walks the text the grammar forces at its start (`[{"name": "` before a forced call's
    /// name), token by token as generation will. A grammar past one of the engine's limits
    /// fails here, at prepare time, instead of at its first token: llguidance allows 2000
    /// Earley items per row, and a choice between ~2000 tools needs one per tool (the row
    /// is built when the token before the choice is consumed).
    ///
    /// A first mask that cannot be computed fails when the grammar admits no text at all, not
    /// even a first byte (`{"$ref": "#"}`, Lark `a: a`: rules that never reach a terminal):
    /// generation could only end every choice at once. (A grammar that starts but can never
    /// end, such as `a: "x" a`, passes: it runs to `max_tokens`, which reports `length`.)
    /// Past that, only a token the grammar's own mask allowed and then refused is a failure:
    /// a mask that cannot be computed because this vocabulary cannot spell the grammar's
    /// text, or one that refuses our tokenization of the text (a special token), leaves the
    /// grammar to generation (which fails the request if it cannot go on).
    fn probe(&self, source: &GrammarSource, matcher: &Matcher) -> Result<(), String> {
        // NOTE: deep clones only. A clone shares its lexer with the template (llguidance
        // caches lexer states across a grammar's matchers), and a probe that runs out of
        // lexer budget (the forced bytes of `a{1000000}`) would leave the lexer failed for
        // every request of this grammar.
        if let Err(e) = matcher.deep_clone().compute_mask() {
            let e = e.to_string();
            if beyond_limits(&e) || !self.admits_text(source) {
                return Err(e);
            }
            return Ok(());
        }
        // The forced bytes come from a clone of their own: a matcher that computed them
        // takes them as given and would not build the rows generation builds.
        let forced = matcher.deep_clone().compute_ff_bytes();
        let text = match std::str::from_utf8(&forced) {
            Ok(s) => s,
            Err(e) => std::str::from_utf8(&forced[..e.valid_up_to()]).expect("valid up to here"),
        };
        let mut m = matcher.deep_clone();
        for id in self.tokenizer.encode(text, false).into_iter().take(MAX_PROBE_TOKENS) {
            if !m.compute_mask().is_ok_and(|mask| mask.is_allowed(id)) {
                return Ok(());
            }
            m.consume_token(id).map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    /// Whether `source` can start some text when every byte is a token of its own.
    fn admits_text(&self, source: &GrammarSource) -> bool {
        let Ok(factory) = self.byte_factory.get_or_init(byte_factory).as_ref() else { return true };
        let m = Matcher::new(factory.create_parser(source.to_top_level()));
        m.get_error().is_none() && m.clone().compute_mask().is_ok()
    }

    /// Drop `key` from the cache: one of its matchers failed, and its matchers share one
    /// lexer (llguidance caches lexer states across them), which may now fail them all.
    /// The next request with the same grammar compiles it afresh.
    pub fn evict(&self, key: &str) {
        locked(&self.cache).remove(key);
    }

    /// Compiled grammars now cached.
    pub fn cached(&self) -> usize {
        locked(&self.cache).grammars.len()
    }
}

/// Whether a mask failed on one of llguidance's budgets (lexer fuel or states, parser items),
/// which the same grammar meets again at the same place in every request: its first mask
/// fails so for every vocabulary, not only for one that cannot spell the grammar's text (and,
/// met while generating, in every run of the same request: the request's, not the server's).
pub fn beyond_limits(err: &str) -> bool {
    err.starts_with("lexer error:") || err.starts_with("parser error:")
}

/// Forced tokens `probe` walks: the start of a forced call (`[{"name": "`) is a few; a
/// forced text of thousands (`a{100000}`) is left to generation.
const MAX_PROBE_TOKENS: usize = 64;

/// `text` as a Lark string literal: JSON's escapes, and DEL escaped too (llguidance's lexer
/// refuses it raw).
pub(crate) fn lark_literal(text: &str) -> String {
    serde_json::to_string(text).expect("strings serialize").replace('\u{7f}', "\\u007f")
}

/// `rx` parsed as llguidance's regex engine (derivre) parses it: regex-syntax with its default
/// settings. A malformed regex is then told in the client's terms, what is wrong and where in
/// the regex, not at llguidance's place in the grammar it wraps the regex in; and what that
/// wrapping (`regex_to_lark`) would drop without a word, a trailing lone backslash, is refused.
pub(crate) fn check_regex(rx: &str, what: &str) -> Result<(), String> {
    let (kind, span) = match regex_syntax::Parser::new().parse(rx) {
        Ok(_) => return Ok(()),
        Err(regex_syntax::Error::Parse(e)) => (e.kind().to_string(), *e.span()),
        Err(regex_syntax::Error::Translate(e)) => (e.kind().to_string(), *e.span()),
        Err(e) => return Err(e.to_string()),
    };
    let at = rx.get(..span.start.offset).map_or(0, |before| before.chars().count()) + 1;
    Err(format!("{kind} (at character {at} of the {what})"))
}

/// Keywords whose value is a subschema or an array of them, and those whose value maps names
/// to subschemas.
const SUBSCHEMA: [&str; 15] = [
    "items",
    "prefixItems",
    "additionalItems",
    "unevaluatedItems",
    "contains",
    "additionalProperties",
    "unevaluatedProperties",
    "propertyNames",
    "not",
    "if",
    "then",
    "else",
    "anyOf",
    "allOf",
    "oneOf",
];
const SUBSCHEMA_MAPS: [&str; 5] = ["properties", "$defs", "definitions", "dependentSchemas", "patternProperties"];

/// The 400 at `param` for a tool's `parameters` holding a malformed `pattern` or an integer
/// bound the engine cannot hold, its place a pointer into those `parameters` (the forced
/// call's grammar wraps them in a call object, a place the client never wrote); None when
/// their keywords are well formed.
pub fn parameters_keyword_error(parameters: &Value, param: String) -> Option<ApiError> {
    let cause = check_keywords(parameters, &mut String::new()).err()?;
    Some(ApiError::invalid(
        param,
        format!(
            "The `parameters` schema of a forced or strict tool call cannot be used to constrain generation: {cause}"
        ),
    ))
}

/// Ok, or why the grammar engine cannot take `schema`: its keywords (`check_keywords`), and
/// its depth (`engine_limits::check_depth`).
pub(crate) fn check_for_engine(schema: &Value) -> Result<(), String> {
    check_keywords(schema, &mut String::new())?;
    crate::engine_limits::check_depth(schema)
}

/// Every `pattern` and `patternProperties` key in `schema` checked as `check_regex` checks a
/// regex: llguidance rewrites them as it rewrites a `regex` constraint (dropping a trailing
/// lone backslash) before its engine parses them; and every integer schema's bounds within
/// what the engine holds (`engine_limits::bound_past_64_bits`). Walks the subschema keywords
/// only, so data (`const`, `enum`, `default`, `examples`) is never read as a schema. `at` is
/// the JSON pointer of `schema`, named in the error.
pub(crate) fn check_keywords(schema: &Value, at: &mut String) -> Result<(), String> {
    let Value::Object(obj) = schema else { return Ok(()) };
    let place = |at: &str| if at.is_empty() { "the schema's root".to_string() } else { at.to_string() };
    if let Some(key) = crate::engine_limits::bound_past_64_bits(obj) {
        return Err(format!(
            "`{key}` {} at {} is beyond the integers the grammar engine holds (-2^63 < n < 2^63)",
            obj[key],
            place(at)
        ));
    }
    if let Some(Value::String(rx)) = obj.get("pattern") {
        check_regex(rx, "pattern").map_err(|cause| format!("`pattern` at {}: {cause}", place(at)))?;
    }
    if let Some(Value::Object(map)) = obj.get("patternProperties") {
        for key in map.keys() {
            check_regex(key, "pattern")
                .map_err(|cause| format!("`patternProperties` key at {}: {cause}", place(at)))?;
        }
    }
    for (path, sub) in subschemas(obj) {
        let len = at.len();
        at.push('/');
        at.push_str(&path);
        let result = check_keywords(sub, at);
        at.truncate(len);
        result?;
    }
    Ok(())
}

/// The subschemas a schema object holds, each with its pointer segments below the object
/// (`properties/a~1b`, `anyOf/1`, `items`; names escaped). Data keywords (`const`, `enum`,
/// `default`, `examples`) hold none.
fn subschemas(obj: &serde_json::Map<String, Value>) -> Vec<(String, &Value)> {
    let mut out = Vec::new();
    for (key, value) in obj {
        let key = key.as_str();
        if SUBSCHEMA.contains(&key) {
            match value {
                Value::Array(items) => out.extend(items.iter().enumerate().map(|(i, sub)| (format!("{key}/{i}"), sub))),
                sub => out.push((key.to_string(), sub)),
            }
        } else if let (true, Value::Object(map)) = (SUBSCHEMA_MAPS.contains(&key), value) {
            out.extend(
                map.iter().map(|(name, sub)| (format!("{key}/{}", name.replace('~', "~0").replace('/', "~1")), sub)),
            );
        }
    }
    out
}

/// The JSON pointer of the first subschema of `schema` that uses keyword `key` ("" for the
/// root itself), or None.
fn keyword_place(schema: &Value, key: &str) -> Option<String> {
    let Value::Object(obj) = schema else { return None };
    if obj.contains_key(key) {
        return Some(String::new());
    }
    subschemas(obj).into_iter().find_map(|(path, sub)| keyword_place(sub, key).map(|below| format!("/{path}{below}")))
}

/// Where the keywords llguidance names as unimplemented (`Unimplemented keys: ["uniqueItems"]`)
/// are used in `schemas`, which it does not say: ` (`uniqueItems` at /properties/tags)`, for
/// the first one found; "" when the error names none or none is found.
pub(crate) fn unimplemented_places(cause: &str, schemas: &[&Value]) -> String {
    let Some(names) = cause.split_once("Unimplemented keys: ").and_then(|(_, rest)| {
        let list = &rest[..=rest.find(']')?];
        serde_json::from_str::<Vec<String>>(list).ok()
    }) else {
        return String::new();
    };
    names
        .iter()
        .find_map(|key| {
            let at = schemas.iter().find_map(|schema| keyword_place(schema, key))?;
            Some(format!(" (`{key}` at {})", if at.is_empty() { "the schema's root" } else { &at }))
        })
        .unwrap_or_default()
}

fn describe(source: &GrammarSource) -> &'static str {
    match source {
        GrammarSource::JsonSchema(_) => "JSON schema",
        GrammarSource::Regex(_) => "regular expression",
        GrammarSource::Lark(_) | GrammarSource::Calls(_) => "grammar",
        GrammarSource::Tagged(_) => "structural tag",
        GrammarSource::AfterThinking { body, .. } => describe(body),
    }
}

/// llguidance errors can carry a multi-line context dump (numbered lines of the grammar,
/// `2 | block: ...`) or the parser's state and grammar (`<state>` lines); the first lines
/// before it name the cause. A regex syntax error names it on a line of its own after the
/// pattern and a caret (`error: unclosed group`): kept too.
fn first_line(err: &str) -> String {
    let is_context = |l: &str| {
        l.trim() == "<state>" || l.trim_start().split_once(" | ").is_some_and(|(n, _)| n.parse::<u32>().is_ok())
    };
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).take_while(|l| !is_context(l)).collect();
    let mut kept: Vec<&str> = lines.iter().take(3).copied().collect();
    kept.extend(lines.iter().skip(3).find(|l| l.trim_start().starts_with("error:")));
    kept.join(" ")
}

/// llguidance's words for what a schema asks beyond it, in terms a client can act on: it
/// names an option of its own for `oneOf`, and its size limits in its internal terms.
fn in_clients_terms(cause: &str) -> String {
    if cause.contains("oneOf constraints are not supported") {
        return "`oneOf` is supported only where the engine can tell its branches apart (objects whose `const` \
                string tags differ, as pydantic's discriminated unions): it cannot hold a value to exactly one of \
                them while generating; send `anyOf` if a value may match several"
            .into();
    }
    if cause.contains("too big (limit for this grammar") {
        return format!(
            "{cause}: the grammar the schema compiles to is larger than the engine holds (optional properties make it \
             grow fastest: several hundred of them in one object are too many)"
        );
    }
    cause.into()
}

/// A Lark error without its place in the grammar (`at 3(7): `), which the client never saw.
fn without_grammar_position(cause: &str) -> String {
    let place = cause.strip_prefix("at ").and_then(|rest| rest.split_once("): ")).filter(|(at, _)| {
        at.split_once('(').is_some_and(|(line, col)| line.parse::<u32>().is_ok() && col.parse::<u32>().is_ok())
    });
    place.map_or_else(|| cause.to_string(), |(_, rest)| rest.to_string())
}

/// A factory over 256 one-byte tokens and an EOS (id 256): any text can be spelled.
fn byte_factory() -> Result<ParserFactory, String> {
    let mut words: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
    words.push(vec![TokTrie::SPECIAL_TOKEN_MARKER, b'e']);
    factory_over(&words, &[256])
}

/// The token trie: each token's bytes; special tokens get toktrie's 0xFF marker before
/// their text so that grammar text can never match them by accident.
fn build_factory(tokenizer: &Tokenizer, eos_token_ids: &[u32]) -> Result<ParserFactory, String> {
    let vocab = tokenizer.vocab_size();
    let words: Vec<Vec<u8>> = (0..vocab as u32)
        .map(|id| {
            if tokenizer.is_special(id) {
                let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                w.extend_from_slice(tokenizer.id_to_token(id).unwrap_or_default().as_bytes());
                w
            } else {
                tokenizer.token_bytes(id)
            }
        })
        .collect();
    factory_over(&words, eos_token_ids)
}

fn factory_over(words: &[Vec<u8>], eos_token_ids: &[u32]) -> Result<ParserFactory, String> {
    let eos = eos_token_ids.first().copied().unwrap_or(0);
    let mut info = TokRxInfo::new(words.len() as u32, eos);
    info.tok_end_of_turn = eos_token_ids.get(1).copied();
    let trie = TokTrie::from(&info, words);
    let env: llguidance::toktrie::TokEnv = Arc::new(ApproximateTokEnv::new(trie));
    let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
    factory.quiet();
    Ok(factory)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn byte_tokenizer() -> Arc<Tokenizer> {
        // A tiny char-level vocabulary: newline, every printable ASCII char, and an EOS.
        let chars: Vec<String> = std::iter::once(b'\n').chain(32u8..127).map(|c| (c as char).to_string()).collect();
        char_tokenizer(&chars)
    }

    /// A vocabulary of an EOS (id 0) and one token per character of `chars` (ids from 1).
    fn char_tokenizer(chars: &[String]) -> Arc<Tokenizer> {
        char_tokenizer_with(chars, &[])
    }

    /// `byte_tokenizer`'s vocabulary and special tokens `specials` (after it).
    pub(crate) fn tokenizer_with_specials(specials: &[&str]) -> Arc<Tokenizer> {
        let chars: Vec<String> = std::iter::once(b'\n').chain(32u8..127).map(|c| (c as char).to_string()).collect();
        char_tokenizer_with(&chars, specials)
    }

    fn char_tokenizer_with(chars: &[String], specials: &[&str]) -> Arc<Tokenizer> {
        let mut vocab = serde_json::Map::new();
        vocab.insert("<eos>".into(), json!(0));
        for (i, c) in chars.iter().enumerate() {
            vocab.insert(c.clone(), json!(i + 1));
        }
        let special = |id: usize, content: &str| {
            json!({"id": id, "content": content, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        };
        let mut added = vec![special(0, "<eos>")];
        for (i, content) in specials.iter().enumerate() {
            let id = chars.len() + 1 + i;
            vocab.insert(content.to_string(), json!(id));
            added.push(special(id, content));
        }
        let tj = json!({
            "version": "1.0",
            "added_tokens": added,
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<eos>"},
            "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "."}, "behavior": "Isolated", "invert": false},
        });
        Arc::new(Tokenizer::from_json_str(&tj.to_string()).expect("tokenizer"))
    }

    pub(crate) fn drive(g: &Grammar, tok: &Tokenizer, text: &str) -> Matcher {
        let mut m = g.matcher();
        for id in tok.encode(text, false) {
            let mask = m.compute_mask().expect("mask");
            assert!(mask.is_allowed(id), "token {id:?} of {text:?} not allowed");
            m.consume_token(id).expect("consume");
        }
        m
    }

    /// Whether the grammar refuses some token of `text` (consumed up to that point).
    pub(crate) fn refuses(g: &Grammar, tok: &Tokenizer, text: &str) -> bool {
        let mut m = g.matcher();
        for id in tok.encode(text, false) {
            if !m.compute_mask().expect("mask").is_allowed(id) {
                return true;
            }
            m.consume_token(id).expect("consume");
        }
        false
    }

    /// Schemas that ended the process inside llguidance (audit: a stack overflow, a recursion
    /// that never ends) are 400s, as a schema, inlined in a grammar, or a forced call's.
    #[test]
    fn schemas_the_engine_would_die_on_are_refused() {
        let g = Grammars::new(byte_tokenizer(), vec![0]);
        let int =
            json!({"type": "object", "properties": {"v": {"type": "integer", "minimum": -1e19, "maximum": -1e19}}});
        let mut defs = serde_json::Map::new();
        for i in 0..1000 {
            let next = json!({"$ref": format!("#/$defs/A{}", i + 1)});
            defs.insert(format!("A{i}"), json!({"type": "object", "properties": {"a": next}, "required": ["a"]}));
        }
        defs.insert("A1000".into(), json!({"type": "integer"}));
        let deep = json!({"$defs": defs, "$ref": "#/$defs/A0"});
        for schema in [int, deep] {
            let text = serde_json::to_string(&schema).unwrap();
            for source in [
                GrammarSource::JsonSchema(schema.clone()),
                GrammarSource::Lark(format!("start: %json {text}")),
                GrammarSource::Calls(format!("start: \"<tool_call>\" %json {text} \"</tool_call>\"")),
            ] {
                let e = g.compile(&source, "p").unwrap_err();
                assert_eq!((e.status(), e.param()), (400, Some("p")), "{}", e.message());
            }
        }
        // a Lark grammar whose rules chain 5000 deep (8 MB of stack held ~2500)
        let mut lark = String::from("start: r0\n");
        for i in 0..5000 {
            lark.push_str(&format!("r{i}: \"a\" r{}\n", i + 1));
        }
        lark.push_str("r5000: \"b\"\n");
        let e = g.compile(&GrammarSource::Lark(lark), "p").unwrap_err();
        assert!(e.message().contains("more than the 500"), "{}", e.message());
    }

    /// A number under an exclusive bound never reads back as the bound (llguidance compared
    /// the digits as text: `0` passed `exclusiveMinimum: 0` with `maximum: 0.5`, and
    /// `1.0000000000000001`, a double's 1, passed `exclusiveMinimum: 1`).
    #[test]
    fn exclusive_number_bounds_hold_as_doubles() {
        let tok = byte_tokenizer();
        let g = Grammars::new(tok.clone(), vec![0]);
        let ends = |schema: Value, text: &str| {
            let grammar = g.compile(&GrammarSource::JsonSchema(schema), "p").unwrap();
            let mut m = grammar.matcher();
            for id in tok.encode(text, false) {
                if !m.compute_mask().expect("mask").is_allowed(id) {
                    return false;
                }
                m.consume_token(id).expect("consume");
            }
            m.compute_mask().is_ok_and(|mask| mask.is_allowed(0))
        };
        let above_zero = json!({"type": "number", "exclusiveMinimum": 0, "maximum": 0.5});
        assert!(!ends(above_zero.clone(), "0") && !ends(above_zero.clone(), "0.0"));
        assert!(ends(above_zero, "0.25"));
        let below_zero = json!({"type": "number", "exclusiveMaximum": 0, "minimum": -0.5});
        assert!(!ends(below_zero.clone(), "-0") && ends(below_zero, "-0.25"));
        let above_one = json!({"type": "number", "exclusiveMinimum": 1, "maximum": 2});
        assert!(!ends(above_one.clone(), "1.0000000000000001") && !ends(above_one.clone(), "1"));
        assert!(ends(above_one.clone(), "1.0000000000000002") && ends(above_one, "1.5"));
    }

    #[test]
    fn json_schema_accepts_valid_and_stops_when_complete() {
        let tok = byte_tokenizer();
        let g = Grammars::new(tok.clone(), vec![0]);
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                            "additionalProperties": false});
        let grammar = g.compile(&GrammarSource::JsonSchema(schema.clone()), "p").unwrap();
        let m = drive(&grammar, &tok, "{\"a\": 12}");
        assert!(m.is_stopped());
        // A second compile of the same schema is served from the cache.
        let again = g.compile(&GrammarSource::JsonSchema(schema), "p").unwrap();
        assert_eq!(again, grammar);
        assert_eq!(g.cached(), 1);
    }

    /// What a "model" that takes the first of `prefer`'s characters its mask allows writes
    /// (up to `limit` tokens), with or without the grammar's JSON guard; and whether the
    /// grammar then stopped.
    fn preferring(grammar: &Grammar, tok: &Tokenizer, prefer: &str, guarded: bool, limit: usize) -> (String, bool) {
        let prefer: Vec<u32> = prefer.chars().map(|c| tok.encode(&c.to_string(), false)[0]).collect();
        let (mut m, mut guard) = (grammar.matcher(), grammar.json_guard().expect("a JSON grammar's guard"));
        let mut text = Vec::new();
        while !m.is_stopped() && text.len() < limit {
            let mut bits: Vec<i32> = m.compute_mask().unwrap().as_slice().iter().map(|&w| w as i32).collect();
            if guarded {
                guard.restrict(&mut bits);
            }
            let allowed = |t: u32| bits[t as usize / 32] & (1 << (t % 32)) != 0;
            let id = *prefer.iter().find(|&&t| allowed(t)).expect("a preferred token");
            m.consume_token(id).unwrap();
            guard.push(id);
            text.extend(tok.token_bytes(id));
        }
        (String::from_utf8(text).unwrap(), m.is_stopped())
    }

    #[test]
    fn a_key_guard_keeps_open_keys_distinct() {
        let tok = byte_tokenizer();
        let g = Grammars::new(tok.clone(), vec![0]);
        let schema = json!({"type": "object", "patternProperties": {"^[ab]+$": {"type": "integer"}},
                            "additionalProperties": false, "minProperties": 3});
        let grammar = g.compile(&GrammarSource::JsonSchema(schema), "p").unwrap();
        // A "model" that takes the first token of these its mask allows: it would write key "a"
        // each time it can.
        let walk = |guarded: bool| preferring(&grammar, &tok, "\": },1a{", guarded, 60).0;
        assert_eq!(walk(false), "{\"a\": 1, \"a\": 1, \"a\": 1}", "what the grammar alone allows");
        assert_eq!(walk(true), "{\"a\": 1, \"aa\": 1, \"aaa\": 1}");
        // a forced call's arguments too, after the call's markup
        let f = json!({"name": "f", "parameters": {"type": "object", "additionalProperties": {"type": "integer"}}});
        let quote = tok.encode("\"", false)[0];
        for (format, text) in [
            (crate::tools::ToolCallFormat::Hermes, "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1, \"x"),
            (crate::tools::ToolCallFormat::Mistral, "[TOOL_CALLS] [{\"name\": \"f\", \"arguments\": {\"x\": 1, \"x"),
        ] {
            let grammar = g.compile(&format.forced_grammar(&[&f], true, None).unwrap(), "tools").unwrap();
            let m = drive(&grammar, &tok, text);
            let mut guard = grammar.json_guard().expect("a call grammar's guard");
            for id in tok.encode(text, false) {
                guard.push(id);
            }
            let mut bits: Vec<i32> = m.clone().compute_mask().unwrap().as_slice().iter().map(|&w| w as i32).collect();
            assert!(bits[quote as usize / 32] & (1 << (quote % 32)) != 0, "{format:?}: the grammar allows it");
            guard.restrict(&mut bits);
            assert!(bits[quote as usize / 32] & (1 << (quote % 32)) == 0, "{format:?}");
        }
        // only JSON grammars are followed
        assert!(g.compile(&GrammarSource::Regex("a+".into()), "p").unwrap().json_guard().is_none());
    }

    #[test]
    fn an_open_integer_ends_within_sixteen_digits() {
        let tok = byte_tokenizer();
        let g = Grammars::new(tok.clone(), vec![0]);
        let schema = json!({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]});
        let grammar = g.compile(&GrammarSource::JsonSchema(schema), "p").unwrap();
        let zero = tok.encode("0", false)[0];
        let digits_allowed = |text: &str| drive(&grammar, &tok, text).compute_mask().unwrap().is_allowed(zero);
        // 2^53 - 1 = 9007199254740991: sixteen digits at most, the largest of them bounded
        assert!(digits_allowed(&format!("{{\"n\": 1{}", "0".repeat(14))));
        assert!(!digits_allowed(&format!("{{\"n\": 1{}", "0".repeat(15))), "a 17th digit");
        assert!(!digits_allowed(&format!("{{\"n\": -9{}", "0".repeat(15))), "below -(2^53 - 1)");
        assert!(drive(&grammar, &tok, "{\"n\": -9007199254740991}").is_stopped());
    }

    #[test]
    fn fractional_seconds_end_within_nine_digits() {
        let tok = byte_tokenizer();
        let g = Grammars::new(tok.clone(), vec![0]);
        let zero = tok.encode("0", false)[0];
        for (format, head) in [("time", "\"20:30:11."), ("date-time", "\"2024-02-29T20:30:11.")] {
            let schema = json!({"type": "object", "properties": {"t": {"type": "string", "format": format}},
                                "required": ["t"]});
            let grammar = g.compile(&GrammarSource::JsonSchema(schema), "p").unwrap();
            let digit_allowed = |text: &str| drive(&grammar, &tok, text).compute_mask().unwrap().is_allowed(zero);
            let at = format!("{{\"t\": {head}");
            assert!(digit_allowed(&format!("{at}{}", "1".repeat(8))), "{format}");
            assert!(!digit_allowed(&format!("{at}{}", "1".repeat(9))), "{format}: a 10th digit");
            assert!(drive(&grammar, &tok, &format!("{at}123456789Z\"}}")).is_stopped());
            // (without a fraction, and with an offset, as the format has them)
            let whole = format!("{{\"t\": {}+01:00\"}}", head.trim_end_matches('.'));
            assert!(drive(&grammar, &tok, &whole).is_stopped(), "{whole}");
        }
        // a pattern of the client's own is left to say what it says
        let own = json!({"type": "string", "format": "time", "pattern": "^.*$"});
        let grammar = g.compile(&GrammarSource::JsonSchema(own), "p").unwrap();
        assert!(drive(&grammar, &tok, &format!("\"00:00:00.{}", "1".repeat(12)))
            .compute_mask()
            .unwrap()
            .is_allowed(zero));
    }

    #[test]
    fn an_email_local_part_ends_within_sixty_four_characters() {
        let tok = byte_tokenizer();
        let g = Grammars::new(tok.clone(), vec![0]);
        let (a, at) = (tok.encode("a", false)[0], tok.encode("@", false)[0]);
        let schema = json!({"type": "object", "properties": {"e": {"type": "string", "format": "email"}},
                            "required": ["e"]});
        let grammar = g.compile(&GrammarSource::JsonSchema(schema), "p").unwrap();
        let mask = |text: &str| drive(&grammar, &tok, text).compute_mask().unwrap();
        assert!(mask(&format!("{{\"e\": \"{}", "a".repeat(63))).is_allowed(a));
        let full = mask(&format!("{{\"e\": \"{}", "a".repeat(64)));
        assert!(!full.is_allowed(a) && full.is_allowed(at), "a 65th character before the @");
        assert!(drive(&grammar, &tok, "{\"e\": \"john.smith@example.com\"}").is_stopped());
    }

    #[test]
    fn a_json_guard_ends_every_number() {
        let tok = byte_tokenizer();
        let g = Grammars::new(tok.clone(), vec![0]);
        let schema = json!({"type": "object", "properties": {"n": {"type": "number"}}, "required": ["n"]});
        let grammar = g.compile(&GrammarSource::JsonSchema(schema), "p").unwrap();
        // A "model" that takes the first token of these its mask allows: it writes 1s for as
        // long as it may.
        let walk = |guarded: bool| preferring(&grammar, &tok, "1.e}{\"n: ", guarded, 80);
        let (text, stopped) = walk(false);
        assert!(!stopped && text.ends_with("1111"), "the grammar alone: {text}");
        let ones = |n: usize| "1".repeat(n);
        assert_eq!(walk(true), (format!("{{\"n\": {}.{}e{}}}", ones(17), ones(17), ones(3)), true));
    }

    #[test]
    fn json_schema_masks_wrong_tokens() {
        let tok = byte_tokenizer();
        let g = Grammars::new(tok.clone(), vec![0]);
        let schema = json!({"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"]});
        let grammar = g.compile(&GrammarSource::JsonSchema(schema), "p").unwrap();
        let mut m = drive(&grammar, &tok, "{\"a\": \"");
        let mask = m.compute_mask().unwrap();
        let allowed: Vec<String> = mask.to_list().iter().map(|&id| tok.decode(&[id], false)).collect();
        assert_eq!(allowed, vec!["x".to_string(), "y".to_string()]);
    }

    #[test]
    fn bad_schema_is_a_400_naming_the_keyword() {
        let g = Grammars::new(byte_tokenizer(), vec![0]);
        let schema = json!({"type": "object", "properties": {"a": {"type": "string", "uniqueItems": true}}});
        let err = g.compile(&GrammarSource::JsonSchema(schema), "response_format.json_schema.schema").unwrap_err();
        assert_eq!(err.status(), 400);
        assert_eq!(err.param(), Some("response_format.json_schema.schema"));
        assert!(err.message().contains("uniqueItems"), "{}", err.message());
    }

    #[test]
    fn hermes_forced_call_grammar_compiles_and_accepts_a_call() {
        let tok = byte_tokenizer();
        let g = Grammars::new(tok.clone(), vec![0]);
        let f = json!({"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}},
                                                   "required": ["a"], "additionalProperties": false}});
        let src = crate::tools::ToolCallFormat::Hermes.forced_grammar(&[&f], false, None).unwrap();
        let grammar = g.compile(&src, "tools").unwrap();
        let m = drive(&grammar, &tok, "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 7}}\n</tool_call>");
        assert!(m.is_stopped());
    }

    /// A forced call's schema error names the client's `parameters`, without our grammar's
    /// text or a place in it.
    #[test]
    fn forced_call_schema_errors_leave_our_grammar_out() {
        let g = Grammars::new(byte_tokenizer(), vec![0]);
        let f = json!({"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "string", "uniqueItems": true}}}});
        for format in [crate::tools::ToolCallFormat::Hermes, crate::tools::ToolCallFormat::Mistral] {
            let err = g.compile(&format.forced_grammar(&[&f], false, None).unwrap(), "tools").unwrap_err();
            let msg = err.message();
            assert!(msg.starts_with("The `parameters` schema of a forced or strict tool call cannot"), "{msg}");
            assert!(msg.contains("uniqueItems"), "{msg}");
            assert!(!msg.contains("tool_call") && !msg.contains(" | ") && !msg.contains("at 2("), "{msg}");
        }
        assert_eq!(without_grammar_position("at 3(7): failed"), "failed");
        assert_eq!(without_grammar_position("at x(7): failed"), "at x(7): failed");
    }

    /// A forced call among too many tools overflows llguidance's row limit at the call's
    /// first token: a 400 at prepare time, not an output cut short by the failed matcher.
    #[test]
    fn too_many_tools_are_refused_up_front() {
        let tok = byte_tokenizer();
        let g = Grammars::new(tok.clone(), vec![0]);
        let tools = |n: usize| -> Vec<Value> {
            (0..n)
                .map(|i| {
                    json!({"name": format!("f{i}"), "parameters": {"type": "object",
                                 "properties": {"a": {"type": "string"}}}})
                })
                .collect()
        };
        let json = crate::tools::ToolCallFormat::Json;
        let fns = tools(2000);
        let err =
            g.compile(&json.forced_grammar(&fns.iter().collect::<Vec<_>>(), true, None).unwrap(), "tools").unwrap_err();
        assert_eq!((err.status(), err.param(), err.code()), (400, Some("tools"), "invalid_value"));
        assert!(err.message().contains("max is 2000"), "{}", err.message());
        let fns = tools(1500);
        let ok =
            g.compile(&json.forced_grammar(&fns.iter().collect::<Vec<_>>(), true, None).unwrap(), "tools").unwrap();
        assert!(drive(&ok, &tok, "[{\"name\": \"f1499\", \"arguments\": {\"a\": \"x\"}}]").is_stopped());
    }

    /// A grammar whose first mask runs past llguidance's lexer budget fails so in every
    /// request: a 400 at prepare, not a 500 at its first token. (The budget is met by walking
    /// the vocabulary, so a vocabulary of long tokens meets it where single bytes do not.)
    #[test]
    fn a_first_mask_past_the_lexer_budget_is_refused() {
        let mut words: Vec<String> = std::iter::once(b'\n').chain(32u8..127).map(|c| (c as char).to_string()).collect();
        words.extend((2..=256).map(|k| "a".repeat(k)));
        let tok = char_tokenizer(&words);
        let g = Grammars::new(tok, vec![0]);
        let err = g.compile(&GrammarSource::Regex("(.{1,999}){1,999}".into()), "structured_outputs.regex").unwrap_err();
        assert_eq!((err.status(), err.param()), (400, Some("structured_outputs.regex")));
        assert!(err.message().ends_with("lexer error: too many expressions constructed."), "{}", err.message());
    }

    /// Compiling must not spend the lexer budget its requests share: the forced bytes of
    /// `a{1000000}` run llguidance's lexer out of fuel, and a probe on a shallow clone left
    /// every matcher of the grammar failing at its first mask.
    #[test]
    fn probing_leaves_the_shared_lexer_usable() {
        let tok = byte_tokenizer();
        let g = Grammars::new(tok.clone(), vec![0]);
        let grammar = g.compile(&GrammarSource::Regex("a{1000000}".into()), "response_format.regex").unwrap();
        let m = drive(&grammar, &tok, "aaaaaaaaaa");
        assert!(!m.is_stopped() && !m.is_error());
        assert!(grammar.matcher().compute_mask().unwrap().is_allowed(tok.encode("a", false)[0]));
    }

    /// The cache holds at most CACHE_TEXT_BYTES of grammar text: past it, it starts afresh;
    /// a grammar larger than that alone compiles but is not kept.
    #[test]
    fn the_cache_is_bounded_by_the_text_it_holds() {
        let tok = byte_tokenizer();
        let g = Grammars::new(tok, vec![0]);
        // (Lark text padded by a comment)
        let grammar =
            |tag: &str, bytes: usize| GrammarSource::Lark(format!("start: \"{tag}\"\n// {}", "x".repeat(bytes)));
        let third = CACHE_TEXT_BYTES / 3;
        for tag in ["a", "b"] {
            g.compile(&grammar(tag, third), "p").unwrap();
        }
        assert_eq!(g.cached(), 2);
        g.compile(&grammar("a", third), "p").unwrap(); // (found: nothing is added)
        assert_eq!(g.cached(), 2);
        g.compile(&grammar("c", third + 1024), "p").unwrap();
        assert_eq!(g.cached(), 1, "cleared, then kept");
        g.evict(&grammar("c", third + 1024).key());
        assert_eq!((g.cached(), locked(&g.cache).text_bytes), (0, 0));
        g.compile(&grammar("d", CACHE_TEXT_BYTES), "p").unwrap();
        assert_eq!(g.cached(), 0, "too large to keep");
    }

    /// A lexer failure in one matcher fails the grammar's other matchers (they share the
    /// lexer); eviction makes the next compile a fresh one.
    #[test]
    fn a_failed_grammar_is_compiled_afresh_after_eviction() {
        let tok = byte_tokenizer();
        let g = Grammars::new(tok.clone(), vec![0]);
        let src = GrammarSource::Regex("[a-z]+".into());
        let grammar = g.compile(&src, "p").unwrap();
        let mut broken = grammar.matcher();
        broken.test_trigger_lexer_error().unwrap_err();
        assert!(grammar.matcher().compute_mask().is_err(), "matchers share the failed lexer");
        assert!(g.compile(&src, "p").unwrap().matcher().compute_mask().is_err(), "still cached");
        g.evict(grammar.key());
        assert_eq!(g.cached(), 0);
        assert!(g.compile(&src, "p").unwrap().matcher().compute_mask().is_ok());
    }

    /// `\d` and `\w` in a regex are ASCII classes (JSON Schema's semantics), `\s` stays
    /// Unicode whitespace.
    #[test]
    fn regex_classes_are_ascii() {
        let chars: Vec<String> = ["1", "٣", "🯸", "a", "é", "_", " ", "\u{3000}"].map(String::from).to_vec();
        let tok = char_tokenizer(&chars);
        let g = Grammars::new(tok.clone(), vec![0]);
        let allowed = |rx: &str| -> Vec<String> {
            let grammar = g.compile(&GrammarSource::Regex(rx.into()), "p").unwrap();
            let mask = grammar.matcher().compute_mask().unwrap();
            mask.to_list().iter().filter(|&&t| t != 0).map(|&t| tok.decode(&[t], false)).collect()
        };
        assert_eq!(allowed("\\d+"), vec!["1"]);
        assert_eq!(allowed("\\w+"), vec!["1", "a", "_"]);
        assert_eq!(allowed("\\s+"), vec![" ", "\u{3000}"]);
        assert_eq!(allowed("[^\\d]"), vec!["٣", "🯸", "a", "é", "_", " ", "\u{3000}"]);
    }

    #[test]
    fn grammars_start_after_the_reasoning() {
        let tok = byte_tokenizer();
        let g = Grammars::new(tok.clone(), vec![0]);
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                            "additionalProperties": false});
        let body = GrammarSource::JsonSchema(schema);
        let wrap = |opened| GrammarSource::AfterThinking { opened, body: Box::new(body.clone()) };
        let opened = g.compile(&wrap(true), "p").unwrap();
        assert!(drive(&opened, &tok, "Let me think: {a} < 3\n</think>\n {\"a\": 2}").is_stopped());
        // Inside the open block any text goes (even the answer's), but not the end.
        let mut m = drive(&opened, &tok, "{\"a\": 2}");
        assert!(!m.compute_mask().unwrap().is_allowed(0));
        let closed = g.compile(&wrap(false), "p").unwrap();
        assert!(drive(&closed, &tok, "<think>hmm</think>{\"a\": 1}").is_stopped());
        assert!(drive(&closed, &tok, "{\"a\": 1}").is_stopped());
        assert!(refuses(&closed, &tok, "Sure: {"));
        assert_ne!(opened.key(), closed.key());
        let rx = GrammarSource::Regex("[0-9]+".into()).after_reasoning(None);
        assert_eq!(rx, GrammarSource::Regex("[0-9]+".into()));
    }

    #[test]
    fn regex_and_lark() {
        let tok = byte_tokenizer();
        let g = Grammars::new(tok.clone(), vec![0]);
        let rx = g.compile(&GrammarSource::Regex("[0-9]{3}-ok".into()), "p").unwrap();
        assert!(drive(&rx, &tok, "123-ok").is_stopped());
        let lark = g.compile(&GrammarSource::Lark("start: \"yes\" | \"no\"".into()), "p").unwrap();
        assert!(drive(&lark, &tok, "no").is_stopped());
        assert!(g.compile(&GrammarSource::Regex("(".into()), "p").is_err());
        assert!(g.compile(&GrammarSource::Lark("start: ???".into()), "p").is_err());
    }

    #[test]
    fn a_schemas_malformed_pattern_is_told_with_its_place() {
        let g = Grammars::new(byte_tokenizer(), vec![0]);
        let message = |schema: Value| g.compile(&GrammarSource::JsonSchema(schema), "p").err().map(|e| e.message());
        let root = message(json!({"type": "string", "pattern": r"ab\"})).unwrap();
        assert!(root.contains("`pattern` at the schema's root: incomplete escape"), "{root}");
        let deep = json!({"type": "object", "properties": {"a/b": {"anyOf": [{"type": "null"},
            {"type": "array", "items": {"type": "string", "pattern": "x("}}]}}});
        let deep = message(deep).unwrap();
        assert!(
            deep.contains(
                "`pattern` at /properties/a~1b/anyOf/1/items: unclosed group (at character 2 of the pattern)"
            ),
            "{deep}"
        );
        let keyed = message(json!({"type": "object", "patternProperties": {"^k[": {"type": "integer"}}})).unwrap();
        assert!(keyed.contains("`patternProperties` key at the schema's root: unclosed character class"), "{keyed}");
        // data (`default`, `examples`) is not a pattern; a property named "pattern" is a
        // subschema, not a regex
        let fine = json!({"type": "object", "default": {"pattern": "x("}, "examples": [{"pattern": "("}],
            "properties": {"pattern": {"type": "string", "pattern": r"^\d+\\$"}}});
        assert_eq!(message(fine), None);
    }

    #[test]
    fn formats_the_engine_does_not_enforce_are_annotations() {
        let g = Grammars::new(byte_tokenizer(), vec![0]);
        let tok = byte_tokenizer();
        // (pydantic's SecretStr, bytes; OpenAPI's int64 on a string; JSON Schema's uri-reference)
        for format in ["password", "binary", "int64", "uri-reference"] {
            let schema = json!({"type": "object", "properties": {"a": {"type": "string", "format": format}},
                                "required": ["a"]});
            let grammar = g.compile(&GrammarSource::JsonSchema(schema), "p").expect(format);
            assert!(drive(&grammar, &tok, r#"{"a": "x y"}"#).is_stopped(), "{format}");
        }
        // the enforced ones still hold
        let date = json!({"type": "string", "format": "date"});
        let grammar = g.compile(&GrammarSource::JsonSchema(date), "p").unwrap();
        assert!(refuses(&grammar, &tok, r#""20x"#));
        assert!(drive(&grammar, &tok, r#""2024-02-03""#).is_stopped());
        // a property named "format" is no format
        let named = json!({"type": "object", "properties": {"format": {"const": "x"}}, "required": ["format"]});
        let grammar = g.compile(&GrammarSource::JsonSchema(named), "p").unwrap();
        assert!(drive(&grammar, &tok, r#"{"format": "x"}"#).is_stopped());
    }

    #[test]
    fn llguidances_limits_are_told_in_the_clients_terms() {
        let g = Grammars::new(byte_tokenizer(), vec![0]);
        let message = |schema: Value| g.compile(&GrammarSource::JsonSchema(schema), "p").err().map(|e| e.message());
        let one_of = message(json!({"oneOf": [{"type": "integer"}, {"type": "number"}]})).unwrap();
        assert!(one_of.contains("send `anyOf`") && !one_of.contains("coerce_one_of"), "{one_of}");
    }

    #[test]
    fn an_unimplemented_keyword_is_told_with_its_place() {
        let g = Grammars::new(byte_tokenizer(), vec![0]);
        let message = |schema: Value| g.compile(&GrammarSource::JsonSchema(schema), "p").err().map(|e| e.message());
        let deep = json!({"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}, "$defs": {"A":
            {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"},
            "uniqueItems": true}}}}});
        let deep = message(deep).unwrap();
        assert!(deep.contains("uniqueItems"), "{deep}");
        assert!(deep.ends_with("(`uniqueItems` at /$defs/A/properties/tags)"), "{deep}");
        let root = message(json!({"type": "array", "items": {"type": "integer"}, "uniqueItems": true})).unwrap();
        assert!(root.ends_with("(`uniqueItems` at the schema's root)"), "{root}");
        // (`false`, the default, asks nothing: no refusal)
        assert_eq!(message(json!({"type": "array", "uniqueItems": false})), None);
        // (a property of that name is no use of the keyword)
        let named = json!({"type": "object", "properties": {"uniqueItems": {"type": "array", "uniqueItems": true}}});
        assert!(message(named).unwrap().ends_with("(`uniqueItems` at /properties/uniqueItems)"));
    }

    #[test]
    fn a_malformed_regex_is_told_in_the_clients_terms() {
        let g = Grammars::new(byte_tokenizer(), vec![0]);
        let message = |rx: &str| g.compile(&GrammarSource::Regex(rx.into()), "p").err().map(|e| e.message());
        let unclosed = message("ab(c").unwrap();
        assert!(unclosed.ends_with("unclosed group (at character 3 of the regex)"), "{unclosed}");
        // the character, not the byte: é is two bytes
        let class = message("é[a-").unwrap();
        assert!(class.ends_with("unclosed character class (at character 2 of the regex)"), "{class}");
        // llguidance's rewrite into its grammar drops a trailing lone backslash
        assert!(message(r"ab\").is_some());
        assert!(message(r"ab\\").is_none());
        assert!(message("(?<=a)b").unwrap().contains("look-around"));
        let thinking =
            GrammarSource::AfterThinking { opened: false, body: Box::new(GrammarSource::Regex("a(".into())) };
        assert!(g.compile(&thinking, "p").is_err());
    }
}
