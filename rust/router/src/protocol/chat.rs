//! `POST /v1/chat/completions`: the chat-only fields, message and tool validation, template
//! rendering and tokenization of the one prompt.
//!
//! Messages go to the template as the JSON the client sent (content parts included): chat
//! templates differ in what they expect, and the template layer owns that difference.

use std::collections::BTreeMap;

use serde::de::IgnoredAny;
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::budget::{check_context, settle_budget};
use super::common::{
    as_object, from_value, header_list, header_text, ignored_header, invalid_type, kind_of, new_id, parse_body,
    settle_ignored, truncate_prompt, unix_now, unknown_keys, unsupported, vllm_unsupported, CommonFields,
};
use super::{constrained, Checked, Endpoint, Prepared};
use crate::content_format::ContentFormat;
use crate::error::ApiError;
use crate::reasoning::ReasoningParser;
use crate::router::Router;
use crate::structured::GrammarSource;
use crate::template::{ChatTemplate, RenderError, RenderInput, Rendered};
use crate::tools::{ToolCallFormat, ToolChoice, ToolParsing};

const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

/// Message keys every template reads (`role`, `content`) or that it may leave out by design:
/// the reasoning of earlier turns, under the names transformers aliases, which most templates
/// drop on purpose. Never reported. Other keys (OpenAI's `name`, `tool_calls`, `tool_call_id`
/// included) count as used only when the template names them: a template without tool
/// support drops a tool call from the history, and the client is told.
const ALWAYS_READ_KEYS: [&str; 5] = ["role", "content", "reasoning_content", "reasoning", "thinking"];

/// The keys of a text content part, of a tool and of its function, and of
/// `response_format` and its `json_schema`: any other key there is reported.
const PART_KEYS: [&str; 2] = ["type", "text"];
const REFUSAL_PART_KEYS: [&str; 2] = ["type", "refusal"];
const TOOL_KEYS: [&str; 2] = ["type", "function"];
const FUNCTION_KEYS: [&str; 4] = ["name", "description", "parameters", "strict"];

#[derive(Deserialize, Debug)]
pub struct ChatFields {
    pub messages: Vec<Value>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<u32>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    /// false: at most one call (grammar-enforced when forced; else the choice ends after
    /// its first call).
    pub parallel_tool_calls: Option<bool>,
    pub chat_template_kwargs: Option<Map<String, Value>>,
    pub add_generation_prompt: Option<bool>,
    pub continue_final_message: Option<bool>,
    pub documents: Option<Vec<Value>>,
    /// vLLM's: the reply's content starts with the last message's, when that is the
    /// assistant's (a continued final message, read whole).
    pub echo: Option<bool>,
    /// vLLM's: the most tokens each choice may think before its think block is closed for
    /// it ([`crate::reasoning::ThinkingBudget`]); -1 is vLLM's "no bound", as if not sent.
    pub thinking_token_budget: Option<i64>,
    /// vLLM's: false leaves the thinking out of the answer
    pub include_reasoning: Option<bool>,
    /// Per-request templates are refused (see `prepare`).
    pub chat_template: Option<Value>,
    /// OpenAI's Predicted Outputs (`prediction_ids`).
    pub prediction: Option<Value>,
    #[serde(flatten)]
    pub extra: BTreeMap<String, IgnoredAny>,
}

/// What the template gets, borrowed from the request body.
pub(crate) struct ChatRender<'a> {
    pub messages: &'a Value,
    pub tools: Option<&'a Value>,
    pub documents: Option<&'a Value>,
    pub add_generation_prompt: bool,
    pub continue_final_message: bool,
    pub kwargs: Option<&'a Map<String, Value>>,
}

/// OpenAI's `prediction` (Predicted Outputs): `{"type": "content", "content": TEXT}`, the text
/// a string or an array of text parts, tokenized as an output would spell it (no special
/// tokens added). The output does not depend on it: the scheduler drafts from it, and usage
/// reports how much of it the output holds. Empty when absent or null; its other keys are
/// reported (`prediction.<key>`).
fn prediction_ids(router: &Router, value: Option<&Value>, ignored: &mut Vec<String>) -> Result<Vec<u32>, ApiError> {
    let Some(value) = value.filter(|v| !v.is_null()) else { return Ok(Vec::new()) };
    let obj = as_object(value, "prediction", "`prediction`")?;
    match obj.get("type") {
        Some(Value::String(t)) if t == "content" => {}
        None => return Err(missing("prediction.type".into())),
        Some(other) => {
            return Err(ApiError::invalid(
                "prediction.type",
                format!("`prediction.type` must be \"content\", got {other}."),
            ))
        }
    }
    let text = match obj.get("content") {
        Some(Value::String(text)) => text.clone(),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for (i, part) in parts.iter().enumerate() {
                let param = format!("prediction.content[{i}]");
                let part = as_object(part, &param, "A prediction's content part")?;
                match (part.get("type").and_then(Value::as_str), part.get("text")) {
                    (Some("text"), Some(Value::String(t))) => text.push_str(t),
                    _ => {
                        return Err(ApiError::invalid(
                            param,
                            "A prediction's content parts are `{\"type\": \"text\", \"text\": ...}`.",
                        ))
                    }
                }
                ignored.extend(
                    part.keys()
                        .filter(|k| !PART_KEYS.contains(&k.as_str()))
                        .map(|k| format!("prediction.content[{i}].{k}")),
                );
            }
            text
        }
        None => return Err(missing("prediction.content".into())),
        Some(other) => {
            return Err(invalid_type(
                "prediction.content",
                format!("`prediction.content` must be a string or an array of text parts, not {}.", kind_of(other)),
            ))
        }
    };
    ignored
        .extend(obj.keys().filter(|k| !["type", "content"].contains(&k.as_str())).map(|k| format!("prediction.{k}")));
    let ids = router.tokenizer.encode(&text, false);
    // (no answer is longer than the context; this also bounds what usage keeps per choice)
    let most = router.config.max_model_len as usize;
    if ids.len() > most {
        return Err(ApiError::invalid(
            "prediction.content",
            format!("The prediction is {} tokens; an answer holds at most {most} (the context length).", ids.len()),
        ));
    }
    Ok(ids)
}

/// `add_generation_prompt` defaults to true unless `continue_final_message` is set (then
/// false); both true is a contradiction.
pub(crate) fn generation_flags(add: Option<bool>, cont: Option<bool>) -> Result<(bool, bool), ApiError> {
    let cont = cont.unwrap_or(false);
    let add = add.unwrap_or(!cont);
    if add && cont {
        return Err(ApiError::invalid(
            "continue_final_message",
            "`continue_final_message` and `add_generation_prompt` cannot both be true: the first \
             continues the last message, the second starts a new one.",
        ));
    }
    Ok((add, cont))
}

/// Whether `template` switches a think block that is parsed out of the output with its
/// `enable_thinking` variable (Qwen3's), so a request's switch for thinking can set it.
pub(crate) fn switches_thinking(router: &Router, template: &ChatTemplate) -> bool {
    let parsed = router.config.reasoning_parser.unwrap_or_else(|| ReasoningParser::detect(template.source()));
    template.reads("enable_thinking") && parsed == ReasoningParser::Think
}

/// The template kwargs that carry out `reasoning_effort` (the request's `chat_template_kwargs`
/// beside them), or None when it asks for nothing `template` can do:
/// - a template that reads `reasoning_effort` gets it, over a kwarg of that name (as vLLM
///   passes it; gpt-oss's template reads it);
/// - `"none"` on a template that switches a parsed think block with `enable_thinking` sets it
///   false, unless the request's own kwargs set it (as Anthropic's `thinking: disabled` does).
fn effort_kwargs(
    router: &Router,
    template: &ChatTemplate,
    value: &Value,
    kwargs: Option<&Map<String, Value>>,
) -> Option<Map<String, Value>> {
    let effort = value.get("reasoning_effort")?.as_str()?;
    let mut all = kwargs.cloned().unwrap_or_default();
    if template.reads("reasoning_effort") {
        all.insert("reasoning_effort".into(), Value::from(effort));
    } else if effort == "none" && switches_thinking(router, template) && !all.contains_key("enable_thinking") {
        all.insert("enable_thinking".into(), Value::Bool(false));
    } else {
        return None;
    }
    Some(all)
}

/// Renders through the template chosen by whether tools are rendered.
/// The `llmserve-chat-template` header of a response whose prompt `template` rendered: its
/// origin and hash.
pub(crate) fn template_header(template: &ChatTemplate) -> (String, String) {
    // (a --chat-template file's path can hold any character)
    ("llmserve-chat-template".into(), format!("{} {}", header_text(template.origin()), template.hash()))
}

pub(crate) fn render<'r>(router: &'r Router, input: &ChatRender) -> Result<(Rendered, &'r ChatTemplate), ApiError> {
    let template = router.templates.select(input.tools.is_some()).ok_or_else(|| {
        let names = router.templates.names();
        let message = if names.is_empty() {
            "This model has no chat template, so chat requests cannot be rendered. Start the server \
             with `--chat-template <file or template text>`, or send a raw prompt to /v1/completions."
                .to_string()
        } else {
            // transformers refuses this too ("multiple chat templates with no default")
            format!(
                "This model's chat templates are named ({}) and none is `default`, so a request without \
                 `tools` cannot be rendered. Send `tools`, start the server with `--chat-template <file or \
                 template text>`, or send a raw prompt to /v1/completions.",
                names.join(", ")
            )
        };
        ApiError::with_code("chat_template_missing", None, message)
    })?;
    let config = &router.config;
    // `--default-chat-template-kwargs` under the request's own, whose keys win; only the
    // request's keys are reported unused (the server's were checked at start)
    let merged;
    let kwargs = if config.default_chat_template_kwargs.is_empty() {
        input.kwargs
    } else {
        let mut all = config.default_chat_template_kwargs.clone();
        all.extend(input.kwargs.into_iter().flatten().map(|(k, v)| (k.clone(), v.clone())));
        merged = all;
        Some(&merged)
    };
    // `wrap`: strings as one text part each, the shape a template that only walks parts shows
    let shaped = |format: ContentFormat, wrap: bool| {
        let mut messages = crate::content_format::normalize(input.messages, format);
        if !template.source().contains("developer") {
            developer_as_system(&mut messages);
        }
        if wrap {
            messages = std::borrow::Cow::Owned(crate::content_format::wrap_strings(&messages));
        }
        messages
    };
    let try_render = |messages: &Value| {
        let mut rendered = template.try_render(&RenderInput {
            messages,
            tools: input.tools,
            documents: input.documents,
            add_generation_prompt: input.add_generation_prompt,
            continue_final_message: input.continue_final_message,
            kwargs,
            special_tokens: &config.special_tokens,
            fuel: Some(config.template_fuel),
            special_texts: router.special_texts.as_ref(),
        })?;
        rendered.unused_kwargs.retain(|k| input.kwargs.is_some_and(|sent| sent.contains_key(k)));
        Ok::<_, RenderError>(rendered)
    };
    let render_messages = |messages: &Value| try_render(messages).map_err(ApiError::from);
    if let Some(told) = config.chat_template_content_format {
        return Ok((render_messages(&shaped(told, told == ContentFormat::OpenAi))?, template));
    }
    // The detected shape first, with string content as sent (most parts templates test `is
    // string`, as transformers renders them). Detection reads the template's text, and a
    // template may reach the content in ways it does not see (an alias, a macro, a filter):
    // if the render fails or leaves out some of the messages' text, the other shape is tried,
    // and kept if it renders where the first failed, or shows all of it (content_format.rs).
    let rendered = match try_render(&shaped(template.content_format(), false)) {
        // (the template refused these messages with its own words: no other shape of them
        // is tried, as transformers raises them)
        Err(RenderError::Raised(e)) => return Err(e),
        other => other.map_err(ApiError::from),
    };
    if rendered.as_ref().is_err_and(crate::template::engine_failed) {
        // (the engine, not the template, failed: another shape's render would be another prompt)
        return rendered.map(|r| (r, template));
    }
    let texts = crate::content_format::message_texts(input.messages);
    let shows_all = |r: &Rendered| crate::content_format::shows_all(&r.text, &texts);
    if rendered.as_ref().is_ok_and(shows_all) {
        return Ok((rendered?, template));
    }
    // Then parts as sent and strings as one part each (the first render had strings as sent,
    // and parts joined for a string template). A template that prints `content` as it is
    // (`~`, `| trim`) prints the wrapped parts as their repr, which holds every text too:
    // such a render is the template not walking parts, never a better one.
    let shows_parts = |text: &str| text.contains("\"type\": \"text\"") || text.contains("'type': 'text'");
    let first_shows_parts = rendered.as_ref().is_ok_and(|r| shows_parts(&r.text));
    match render_messages(&shaped(ContentFormat::OpenAi, true)) {
        Ok(second) if shows_parts(&second.text) && !first_shows_parts => Ok((rendered?, template)),
        Ok(second) if rendered.is_err() || shows_all(&second) => Ok((second, template)),
        _ => Ok((rendered?, template)),
    }
}

/// OpenAI's `developer` role is its newer name for system instructions. A template that never
/// names it would render a turn of a role its model never saw (SmolLM2's, after its own
/// default system prompt): it gets `system`, as OpenAI's older models read it.
fn developer_as_system(messages: &mut std::borrow::Cow<'_, Value>) {
    let is_developer = |m: &Value| m.get("role").and_then(Value::as_str) == Some("developer");
    if !messages.as_array().is_some_and(|list| list.iter().any(is_developer)) {
        return;
    }
    for m in messages.to_mut().as_array_mut().into_iter().flatten().filter(|m| is_developer(m)) {
        m["role"] = Value::String("system".into());
    }
}

/// `chat_template_kwargs` keys the render never read: a 400 under strict field checking (else
/// the response names them in `llmserve-unused-template-kwargs`).
pub(crate) fn check_unused_kwargs(unused: &[String], strict: bool) -> Result<(), ApiError> {
    match unused.first().filter(|_| strict) {
        Some(key) => Err(unsupported(
            format!("chat_template_kwargs.{key}"),
            format!(
                "The chat template does not read `{key}`, so it would have no effect (strict field checking is on)."
            ),
        )),
        None => Ok(()),
    }
}

/// Unused `chat_template_kwargs` keys as the fields `llmserve-ignored-fields` names (beside
/// their own header): each is a field accepted with no effect.
pub(crate) fn unused_kwarg_fields(unused: &[String]) -> impl Iterator<Item = String> + '_ {
    unused.iter().map(|key| format!("chat_template_kwargs.{key}"))
}

/// The 400 at `param` for a function whose `parameters` a forced call's grammar refused
/// (`err`): a malformed `pattern` is named by its place in those `parameters`.
fn blame_parameters(function: &Value, param: String, err: &ApiError) -> ApiError {
    crate::structured::parameters_keyword_error(&function["parameters"], param.clone()).unwrap_or_else(|| {
        // (a keyword's place was found in the grammar's own schema, which wraps the call: named
        // again within these `parameters`)
        let message = err.message();
        let message = match message.rsplit_once(" (`").filter(|(_, place)| place.contains("` at ")) {
            Some((cause, _)) => {
                format!("{cause}{}", crate::structured::unimplemented_places(cause, &[&function["parameters"]]))
            }
            None => message,
        };
        ApiError::invalid(param, message)
    })
}

/// A `chat_template` sent with a request (vLLM's per-request template) is refused: a request
/// must not inject template code.
pub(crate) fn refuse_request_template(template: Option<&Value>) -> Result<(), ApiError> {
    match template {
        Some(t) if !t.is_null() => Err(unsupported(
            "chat_template",
            "Per-request chat templates are not accepted: a request must not inject template code. \
             The server's template is set with `--chat-template`.",
        )),
        _ => Ok(()),
    }
}

pub(crate) fn validate_messages(messages: &[Value]) -> Result<(), ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid("messages", "`messages` must contain at least one message."));
    }
    for (i, m) in messages.iter().enumerate() {
        validate_message(i, m)?;
    }
    Ok(())
}

/// Each document (RAG templates' `documents`) is an object of fields such as `title` and
/// `text`, as vLLM types them: anything else would reach the template as a document.
pub(crate) fn validate_documents(documents: &[Value]) -> Result<(), ApiError> {
    match documents.iter().enumerate().find(|(_, d)| !d.is_object()) {
        Some((i, d)) => Err(invalid_type(
            format!("documents[{i}]"),
            format!("A document must be an object (its fields, such as `title` and `text`), not {}.", kind_of(d)),
        )),
        None => Ok(()),
    }
}

/// Message keys the render never looked up, as `messages[i].key` (null values are as good
/// as absent: clients echo back `refusal: null` and the like), after `ALWAYS_READ_KEYS` and an
/// assistant message's `parsed`: the openai SDK's `parse()` and `stream()` helpers keep the
/// reply's content as an object there, which is sent back with the message and repeats its
/// content.
pub(crate) fn unread_message_keys<'a>(
    rendered: &'a Rendered,
    messages: &'a Value,
) -> impl Iterator<Item = String> + 'a {
    let assistant = |i: usize| messages.get(i).and_then(|m| m.get("role")).and_then(Value::as_str) == Some("assistant");
    rendered
        .unread_keys
        .iter()
        .filter(|(_, k)| !ALWAYS_READ_KEYS.contains(&k.as_str()))
        .filter(move |(i, k)| !(k == "parsed" && assistant(*i)))
        .map(|(i, k)| format!("messages[{i}].{k}"))
}

/// Keys of the messages' text parts that mean nothing, as `messages[i].content[j].key`.
pub(crate) fn unknown_part_keys(messages: &[Value]) -> Vec<String> {
    let mut out = Vec::new();
    for (i, m) in messages.iter().enumerate() {
        if let Some(parts) = m.get("content").and_then(Value::as_array) {
            for (j, part) in parts.iter().enumerate() {
                let known: &[&str] = if part.get("type").and_then(Value::as_str) == Some("refusal") {
                    &REFUSAL_PART_KEYS
                } else {
                    &PART_KEYS
                };
                out.extend(unknown_keys_of(part, known, &format!("messages[{i}].content[{j}]")));
            }
        }
    }
    out
}

/// `prefix.key` for each non-null key of `v` (an object) outside `known`.
pub(crate) fn unknown_keys_of(v: &Value, known: &[&str], prefix: &str) -> Vec<String> {
    v.as_object().map(|obj| unknown_keys_in(obj, known, prefix)).unwrap_or_default()
}

/// [`unknown_keys_of`] of an object.
pub(crate) fn unknown_keys_in(obj: &Map<String, Value>, known: &[&str], prefix: &str) -> Vec<String> {
    obj.iter()
        .filter(|(k, v)| !known.contains(&k.as_str()) && !v.is_null())
        .map(|(k, _)| format!("{prefix}.{k}"))
        .collect()
}

/// Keys of `tools[i]` and `tools[i].function` that mean nothing to the server.
fn unknown_tool_keys(tools: &[Value]) -> Vec<String> {
    let mut out = Vec::new();
    for (i, tool) in tools.iter().enumerate() {
        out.extend(unknown_keys_of(tool, &TOOL_KEYS, &format!("tools[{i}]")));
        if let Some(f) = tool.get("function") {
            out.extend(unknown_keys_of(f, &FUNCTION_KEYS, &format!("tools[{i}].function")));
        }
    }
    out
}

/// Whether `tools[i]` gives its function a description.
fn has_description(tool: &Value) -> bool {
    tool.pointer("/function/description").and_then(Value::as_str).is_some_and(|d| !d.is_empty())
}

/// The function names of the calls a history's assistant turns made, by call id (the latest
/// call of an id wins), read as the history grows: each message once, and the last again (its
/// calls may still grow), so a history of k calls and k results costs k lookups, not k^2.
#[derive(Default)]
pub(crate) struct CallNames {
    names: std::collections::HashMap<String, Value>,
    read: usize,
}

impl CallNames {
    fn name(&mut self, history: &[Value], id: &str) -> Option<Value> {
        for m in &history[self.read.saturating_sub(1).min(history.len())..] {
            for call in m["tool_calls"].as_array().map(Vec::as_slice).unwrap_or_default() {
                if let Some(call_id) = call["id"].as_str() {
                    self.names.insert(call_id.to_string(), call["function"]["name"].clone());
                }
            }
        }
        self.read = history.len();
        self.names.get(id).cloned()
    }
}

/// A `tool` message answering call `id` with `content`, with the called function's `name` when
/// one of `history`'s assistant turns made that call (templates that show a result with its
/// function's name read it); and whether it got one. The Responses and Messages routes build
/// their tool results with it, `names` following their history.
pub(crate) fn tool_message(history: &[Value], names: &mut CallNames, id: &str, content: Value) -> (Value, bool) {
    let mut message = json!({"role": "tool", "tool_call_id": id, "content": content});
    let name = names.name(history, id);
    let named = name.is_some();
    if let Some(name) = name {
        message["name"] = name;
    }
    (message, named)
}

/// The text of the last message when it is the assistant's (vLLM's `echo`: the reply takes
/// the same role), as a string template sees it (parts joined with newlines); None when there
/// is none.
fn echo_message(messages: &[Value]) -> Option<String> {
    let last = messages.last().filter(|m| m["role"] == "assistant")?;
    let one = Value::Array(vec![last.clone()]);
    let as_string = crate::content_format::normalize(&one, ContentFormat::String);
    as_string[0]["content"].as_str().filter(|t| !t.is_empty()).map(String::from)
}

pub(crate) fn missing(param: String) -> ApiError {
    ApiError::with_code(
        "missing_required_parameter",
        Some(param.clone()),
        format!("Missing required parameter: `{param}`."),
    )
}

fn validate_message(i: usize, m: &Value) -> Result<(), ApiError> {
    let p = format!("messages[{i}]");
    let obj = as_object(m, p.clone(), "Each message")?;
    // (read by templates as text, whatever they find: an earlier reply's thinking)
    for key in ["reasoning_content", "reasoning", "thinking"] {
        if let Some(v) = obj.get(key).filter(|v| !v.is_string() && !v.is_null()) {
            return Err(invalid_type(format!("{p}.{key}"), format!("`{key}` must be a string, not {}.", kind_of(v))));
        }
    }
    let role = match obj.get("role") {
        None => return Err(missing(format!("{p}.role"))),
        Some(Value::String(r)) => r.as_str(),
        Some(other) => {
            return Err(invalid_type(format!("{p}.role"), format!("`role` must be a string, not {}.", kind_of(other))))
        }
    };
    if !ROLES.contains(&role) {
        return Err(ApiError::invalid(
            format!("{p}.role"),
            format!("Unknown role {role:?}: expected one of {} (or the legacy `function`).", ROLES.join(", ")),
        ));
    }
    // Assistant turns may be content-less (a tool call, or an empty turn to continue).
    match obj.get("content") {
        None | Some(Value::Null) if role == "assistant" => {}
        None => return Err(missing(format!("{p}.content"))),
        // (sent as null: a required field of the wrong type, as OpenAI answers it)
        Some(Value::Null) => {
            return Err(invalid_type(
                format!("{p}.content"),
                "`content` must be a string or an array of content parts, not null.",
            ))
        }
        // NOTE: OpenAI refuses an empty parts list; only an assistant turn may be empty.
        Some(Value::Array(parts)) if parts.is_empty() && role != "assistant" => {
            return Err(ApiError::invalid(
                format!("{p}.content"),
                "`content` must not be an empty array: send at least one text part.",
            ))
        }
        Some(content) => validate_content(&format!("{p}.content"), content, role == "assistant")?,
    }
    for key in ["name", "refusal"] {
        if obj.get(key).is_some_and(|v| !v.is_string() && !v.is_null()) {
            return Err(invalid_type(format!("{p}.{key}"), format!("`{key}` must be a string.")));
        }
    }
    match obj.get("tool_calls") {
        None | Some(Value::Null) => {}
        Some(_) if role != "assistant" => {
            return Err(ApiError::invalid(format!("{p}.tool_calls"), "Only assistant messages may carry `tool_calls`."))
        }
        Some(Value::Array(calls)) => {
            for (j, call) in calls.iter().enumerate() {
                validate_tool_call(&format!("{p}.tool_calls[{j}]"), call)?;
            }
        }
        Some(other) => {
            return Err(invalid_type(
                format!("{p}.tool_calls"),
                format!("`tool_calls` must be an array, not {}.", kind_of(other)),
            ))
        }
    }
    if role == "tool" {
        require_str(obj, "tool_call_id", &p)?;
    }
    Ok(())
}

/// `obj[key]` must be an object; `p` is the path of `obj`.
fn require_object<'a>(obj: &'a Map<String, Value>, key: &str, p: &str) -> Result<&'a Map<String, Value>, ApiError> {
    match obj.get(key) {
        Some(Value::Object(o)) => Ok(o),
        None => Err(missing(format!("{p}.{key}"))),
        Some(other) => as_object(other, format!("{p}.{key}"), &format!("`{key}`")),
    }
}

/// `obj[key]`, which must be a string; `p` is the path of `obj`.
pub(crate) fn require_str<'a>(obj: &'a Map<String, Value>, key: &str, p: &str) -> Result<&'a str, ApiError> {
    match obj.get(key) {
        Some(Value::String(s)) => Ok(s),
        None => Err(missing(format!("{p}.{key}"))),
        Some(other) => {
            Err(invalid_type(format!("{p}.{key}"), format!("`{key}` must be a string, not {}.", kind_of(other))))
        }
    }
}

/// A string, or a list of `{"type": "text", "text": ...}` parts; an assistant turn may also
/// hold OpenAI's `{"type": "refusal", "refusal": ...}` parts (an assistant reply echoed back),
/// which the template sees as text (content_format.rs).
fn validate_content(p: &str, content: &Value, assistant: bool) -> Result<(), ApiError> {
    match content {
        Value::String(_) => Ok(()),
        Value::Array(parts) => {
            for (j, part) in parts.iter().enumerate() {
                let pp = format!("{p}[{j}]");
                let obj = part.as_object().ok_or_else(|| {
                    invalid_type(pp.clone(), format!("Content parts must be objects, not {}.", kind_of(part)))
                })?;
                match obj.get("type") {
                    None => return Err(missing(format!("{pp}.type"))),
                    Some(Value::String(t)) if t == "text" => {}
                    Some(Value::String(t)) if t == "refusal" && assistant => {
                        require_str(obj, "refusal", &pp)?;
                        continue;
                    }
                    Some(Value::String(t)) => {
                        return Err(unsupported(
                            format!("{pp}.type"),
                            format!(
                                "Content parts of type {t:?} are not supported: this server accepts text parts \
                                 (and refusal parts in assistant turns) only."
                            ),
                        ))
                    }
                    Some(other) => {
                        return Err(invalid_type(
                            format!("{pp}.type"),
                            format!("`type` must be a string, not {}.", kind_of(other)),
                        ))
                    }
                }
                require_str(obj, "text", &pp)?;
            }
            Ok(())
        }
        other => Err(invalid_type(
            p.to_string(),
            format!("`content` must be a string or an array of text parts, not {}.", kind_of(other)),
        )),
    }
}

fn validate_tool_call(p: &str, call: &Value) -> Result<(), ApiError> {
    let obj = as_object(call, p, "A tool call")?;
    // NOTE: OpenAI requires an `id`; templates that never show one (Llama 3's) do without, so
    // a call without one passes, but one of another type is a mistake.
    match obj.get("id") {
        None | Some(Value::Null) | Some(Value::String(_)) => {}
        Some(other) => {
            return Err(invalid_type(format!("{p}.id"), format!("`id` must be a string, not {}.", kind_of(other))))
        }
    }
    match obj.get("type") {
        None | Some(Value::Null) => {}
        Some(Value::String(t)) if t == "function" => {}
        Some(_) => return Err(ApiError::invalid(format!("{p}.type"), "Tool calls must have type \"function\".")),
    }
    let f = require_object(obj, "function", p)?;
    match f.get("name") {
        Some(Value::String(_)) => {}
        None | Some(Value::Null) => return Err(missing(format!("{p}.function.name"))),
        Some(_) => return Err(invalid_type(format!("{p}.function.name"), "`name` must be a string.")),
    }
    // OpenAI sends arguments as a JSON string (and requires them); an object is also
    // unambiguous, so both pass.
    match f.get("arguments") {
        Some(Value::String(_)) | Some(Value::Object(_)) => Ok(()),
        None | Some(Value::Null) => Err(missing(format!("{p}.function.arguments"))),
        Some(_) => Err(invalid_type(format!("{p}.function.arguments"), "`arguments` must be a JSON string.")),
    }
}

/// OpenAI's rule for function names: `^[a-zA-Z0-9_-]{1,64}$`.
fn valid_function_name(name: &str) -> bool {
    (1..=64).contains(&name.len()) && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// Checks `tools`; returns the function names.
pub(crate) fn validate_tools(tools: &[Value]) -> Result<Vec<String>, ApiError> {
    if tools.is_empty() {
        return Err(ApiError::invalid("tools", "`tools` must not be empty; leave it out when there are no tools."));
    }
    let mut names = Vec::with_capacity(tools.len());
    for (i, tool) in tools.iter().enumerate() {
        let p = format!("tools[{i}]");
        let obj = as_object(tool, p.clone(), "Each tool")?;
        match obj.get("type") {
            None => return Err(missing(format!("{p}.type"))),
            Some(Value::String(t)) if t == "function" => {}
            // OpenAI's other tool types ("custom": free-form input) are not served here
            Some(Value::String(t)) if t == "custom" => {
                return Err(unsupported(format!("{p}.type"), "Only tools of type \"function\" are supported."))
            }
            Some(_) => {
                return Err(ApiError::invalid(format!("{p}.type"), "Only tools of type \"function\" are supported."))
            }
        }
        let f = require_object(obj, "function", &p)?;
        match f.get("name") {
            // A repeated name would make a named `tool_choice`, and the calls the model writes,
            // ambiguous about which definition they mean.
            Some(Value::String(n)) if names.contains(n) => {
                return Err(ApiError::invalid(
                    format!("{p}.function.name"),
                    format!("Function names must be unique; `{n}` is defined more than once."),
                ))
            }
            Some(Value::String(n)) if valid_function_name(n) => names.push(n.clone()),
            Some(Value::String(n)) => {
                return Err(ApiError::invalid(
                    format!("{p}.function.name"),
                    format!(
                    "Function names are 1 to 64 letters, digits, underscores or dashes, as in OpenAI's API; got {:?}.",
                    n
                ),
                ))
            }
            None | Some(Value::Null) => return Err(missing(format!("{p}.function.name"))),
            Some(_) => return Err(invalid_type(format!("{p}.function.name"), "`name` must be a string.")),
        }
        if let Some(params) = f.get("parameters") {
            if !params.is_object() && !params.is_null() {
                return Err(invalid_type(
                    format!("{p}.function.parameters"),
                    "`parameters` must be a JSON Schema object.",
                ));
            }
            if let Some(t) = params.get("type").filter(|t| t.as_str() != Some("object")) {
                return Err(ApiError::invalid(
                    format!("{p}.function.parameters"),
                    format!(
                        "`parameters` must be a JSON Schema of type \"object\", not {t}: arguments are a JSON object."
                    ),
                ));
            }
            // (an `enum` or `const` of no object, without a `type`, admits no arguments either)
            let no_object = match (params.get("enum"), params.get("const")) {
                (Some(Value::Array(values)), _) => values.iter().all(|x| !x.is_object()),
                (None, Some(value)) => !value.is_object(),
                _ => false,
            };
            if no_object {
                return Err(ApiError::invalid(
                    format!("{p}.function.parameters"),
                    "`parameters` must be a JSON Schema of JSON objects: its `enum` or `const` holds none, and arguments \
                     are a JSON object.",
                ));
            }
            if params.is_object() {
                super::schema_check::check_schema(params).map_err(|e| {
                    ApiError::invalid(format!("{p}.function.parameters"), format!("Invalid JSON Schema: {e}."))
                })?;
            }
        }
        if let Some(d) = f.get("description") {
            if !d.is_string() && !d.is_null() {
                return Err(invalid_type(format!("{p}.function.description"), "`description` must be a string."));
            }
        }
        if let Some(strict) = f.get("strict").filter(|v| !v.is_boolean() && !v.is_null()) {
            return Err(invalid_type(
                format!("{p}.function.strict"),
                format!("`strict` must be a boolean, not {}.", kind_of(strict)),
            ));
        }
    }
    Ok(names)
}

/// Most tools a forced call's refused grammar is compiled again for, one at a time, to name
/// the one whose `parameters` failed.
const BLAMED_TOOLS: usize = 32;

/// What `tool_choice` forces: nothing, a call to any tool, or a call to the named one.
#[derive(Clone, Debug, PartialEq)]
enum Forced {
    No,
    Any,
    Named(String),
}

/// The functions `tool_choice` lets the model call, when it lists them (`allowed_tools`).
type Allowed = Option<Vec<String>>;

/// How the output is read for tool calls, and the grammar a forced `tool_choice` imposes
/// with the `param` its errors name.
type ToolPlan = (Option<ToolParsing>, Option<(GrammarSource, &'static str)>);

/// The tools' [`ToolPlan`]: a 400 at a function's `parameters` if the format's grammar
/// cannot enforce them.
fn tool_plan(
    router: &Router,
    chat: &ChatFields,
    template: &ChatTemplate,
    forced: &Forced,
    allowed: Option<&[String]>,
) -> Result<ToolPlan, ApiError> {
    let detected = router.config.tool_call_format.or_else(|| ToolCallFormat::detect(template.source()));
    let tools = chat.tools.as_deref().unwrap_or_default();
    let functions = |only: Option<&str>| -> Vec<&Value> {
        tools
            .iter()
            .filter(|t| callable(t, allowed))
            .filter_map(|t| t.get("function"))
            .filter(|f| only.is_none_or(|n| f.get("name").and_then(Value::as_str) == Some(n)))
            .collect()
    };
    let parallel = chat.parallel_tool_calls.unwrap_or(true);
    Ok(match forced {
        Forced::No => (detected.map(|format| ToolParsing::new(format, parallel, &functions(None))), None),
        Forced::Any | Forced::Named(_) => {
            let format = detected.unwrap_or(ToolCallFormat::Json);
            // NOTE: a named function is called exactly once, as OpenAI does.
            let (fns, parallel, choice) = match forced {
                Forced::Named(n) => (functions(Some(n)), false, ToolChoice::Named),
                _ => (functions(None), parallel, ToolChoice::Required),
            };
            let tool_index = |f: &Value| {
                let index = tools.iter().position(|t| t.get("function").is_some_and(|g| std::ptr::eq(f, g)));
                index.unwrap_or_default()
            };
            let marker = call_marker(router, format);
            let grammar = |fns: &[&Value]| match choice {
                ToolChoice::Named => format.named_grammar(fns[0], marker),
                _ => format.forced_grammar(fns, parallel, marker),
            };
            let source = grammar(&fns).map_err(|u| {
                ApiError::invalid(
                    format!("tools[{}].function.parameters{}", tool_index(fns[u.function]), u.at),
                    format!(
                        "The {} tool-call format cannot enforce {} in a forced call's arguments (each \
                         value is raw text in its own tag); leave it out of the schema, or send `tool_choice` \"auto\".",
                        format.name(),
                        u.why
                    ),
                )
            })?;
            if let Err(err) = router.grammars.compile(&source, "tools") {
                // name the tool whose `parameters` the engine refused, if one alone fails (a
                // choice among many tools fails as a whole: the engine's per-step limit)
                if fns.len() > BLAMED_TOOLS {
                    return Err(err);
                }
                let alone = |f: &Value| grammar(&[f]).is_ok_and(|g| router.grammars.compile(&g, "tools").is_err());
                return Err(match fns.iter().copied().find(|f| alone(f)) {
                    Some(f) => blame_parameters(f, format!("tools[{}].function.parameters", tool_index(f)), &err),
                    None => err,
                });
            }
            (Some(ToolParsing::new(format, parallel, &fns).with_choice(choice)), Some((source, "tools")))
        }
    })
}

/// How a `tool_choice: "auto"` output, with tools the model can call, is constrained.
enum AutoShape {
    /// Not at all: text or calls, as the model writes them.
    Free,
    /// Calls whose `strict` tools' arguments follow their schemas, or the answer (shaped by
    /// `response_format`, if sent): the grammar.
    Grammar(GrammarSource),
    /// By the `response_format` alone, which leaves no way to write a call: the tools are
    /// reported (as `tools`) and the output is not read for calls.
    NoCalls,
}

/// The vocabulary's special token that a Mistral or llama3 call opens with (`[TOOL_CALLS]`,
/// `<|python_tag|>`), if it has one: the grammars allow it as the model writes it.
fn call_marker(router: &Router, format: ToolCallFormat) -> Option<u32> {
    let tag = match format {
        ToolCallFormat::Mistral => crate::tools::MISTRAL_TAG,
        ToolCallFormat::Llama3Json => crate::tools::PYTHON_TAG,
        _ => return None,
    };
    router.tokenizer.token_to_id(tag).filter(|&id| router.tokenizer.is_special(id))
}

/// The [`AutoShape`] of a request whose calls are read in `format`: a `strict` tool asks for
/// its arguments to follow its schema, and a `response_format` beside tools asks for an
/// answer in that shape when the model does not call one (OpenAI's meaning of both). Where
/// the format's grammar cannot say that (the json format; XML calls whose schemas its
/// grammar cannot follow; a `response_format` that is not a JSON schema), the tools'
/// `strict` is reported, or the tools are.
fn auto_shape(
    router: &Router,
    chat: &ChatFields,
    format: ToolCallFormat,
    answer: Option<&(GrammarSource, &'static str)>,
    allowed: Option<&[String]>,
    ignored: &mut Vec<String>,
) -> Result<AutoShape, ApiError> {
    let tools = chat.tools.as_deref().unwrap_or_default();
    let is_strict = |t: &Value| t.pointer("/function/strict") == Some(&Value::Bool(true));
    if answer.is_none() && allowed.is_none() && !tools.iter().any(is_strict) {
        return Ok(AutoShape::Free);
    }
    // A structural tag shapes the whole output, calls included (a client spells the model's
    // call format with it, as vLLM's users do): the output is read for calls in `format`,
    // and what the tag alone decides (the strict tools' arguments, `allowed_tools`) is
    // reported.
    if let Some((tagged @ GrammarSource::Tagged(_), param)) = answer {
        router.grammars.compile(tagged, param)?;
        ignored.extend(
            tools.iter().enumerate().filter(|(_, t)| is_strict(t)).map(|(i, _)| format!("tools[{i}].function.strict")),
        );
        if allowed.is_some() {
            ignored.push("tool_choice.allowed_tools".into());
        }
        return Ok(AutoShape::Grammar(tagged.clone()));
    }
    let schema = match answer {
        None => None,
        Some((GrammarSource::JsonSchema(schema), _)) => Some(schema),
        Some(_) => {
            ignored.push("tools".into());
            return Ok(AutoShape::NoCalls);
        }
    };
    // The tools that may be called (`allowed_tools`), by their index in `tools`; one that is
    // not strict may be called with any arguments object, but in the XML format, whose calls
    // write the properties their schema lists (an open object lists none), as forced calls do.
    let chosen: Vec<usize> = (0..tools.len()).filter(|&i| callable(&tools[i], allowed)).collect();
    let functions: Vec<Value> = chosen
        .iter()
        .map(|&i| {
            let (t, f) = (&tools[i], &tools[i]["function"]);
            if is_strict(t) || format == ToolCallFormat::Qwen3Xml {
                f.clone()
            } else {
                json!({"name": f.get("name"), "parameters": {"type": "object"}})
            }
        })
        .collect();
    let refs: Vec<&Value> = functions.iter().collect();
    let parallel = chat.parallel_tool_calls.unwrap_or(true);
    let unenforced = |ignored: &mut Vec<String>| {
        if answer.is_some() {
            ignored.push("tools".into());
            return AutoShape::NoCalls;
        }
        let strict = tools.iter().enumerate().filter(|(_, t)| is_strict(t));
        ignored.extend(strict.map(|(i, _)| format!("tools[{i}].function.strict")));
        if allowed.is_some() {
            ignored.push("tool_choice.allowed_tools".into());
        }
        AutoShape::Free
    };
    let marker = call_marker(router, format);
    let Some(source) = format.auto_grammar(&refs, parallel, schema, marker) else { return Ok(unenforced(ignored)) };
    // the response_format alone first, so that its errors name it
    if let Some((answer, param)) = answer {
        router.grammars.compile(answer, param)?;
    }
    // Then the calls alone, which a probe follows to a call's name: a strict tool whose
    // `parameters` the engine refuses is a 400 at them; more tools than the engine can
    // choose between (about 2000) are not enforced, as in formats without such a grammar.
    let calls =
        |fns: &[&Value]| format.forced_grammar(fns, parallel, marker).map(|g| router.grammars.compile(&g, "tools"));
    if let Ok(Err(err)) = calls(&refs) {
        let fails = |i: usize| is_strict(&tools[chosen[i]]) && matches!(calls(&[refs[i]]), Ok(Err(_)));
        return match (0..refs.len().min(BLAMED_TOOLS)).find(|&i| fails(i)) {
            Some(i) => Err(blame_parameters(refs[i], format!("tools[{}].function.parameters", chosen[i]), &err)),
            None => Ok(unenforced(ignored)),
        };
    }
    router.grammars.compile(&source, "tools")?;
    Ok(AutoShape::Grammar(source))
}

/// Whether the tools are rendered through the template, what `tool_choice` forces, and the
/// tools it allows to be called when it lists them (`allowed_tools`; None: all of them).
///
/// NOTE: with `tool_choice: "none"` the tools are not passed to the template (vLLM's
/// `--exclude-tools-when-tool-choice-none` behaviour, made the default): showing a model tools
/// it must not call invites tool-call text we would return as content.
fn tools_rendered(tools: Option<&[Value]>, tool_choice: Option<&Value>) -> Result<(bool, Forced, Allowed), ApiError> {
    let choice = tool_choice.filter(|v| !v.is_null());
    let Some(tools) = tools else {
        return match choice {
            None => Ok((false, Forced::No, None)),
            Some(_) => Err(ApiError::invalid("tool_choice", "`tool_choice` is only allowed when `tools` are given.")),
        };
    };
    let names = validate_tools(tools)?;
    let (with_tools, forced) = match choice {
        None => (true, Forced::No),
        Some(Value::String(s)) if s == "auto" => (true, Forced::No),
        Some(Value::String(s)) if s == "none" => (false, Forced::No),
        Some(Value::String(s)) if s == "required" => (true, Forced::Any),
        Some(Value::Object(o)) if o.get("type").and_then(Value::as_str) == Some("allowed_tools") => {
            let (mode, allowed) = allowed_tools(o, &names)?;
            return Ok((true, mode, Some(allowed)));
        }
        Some(Value::String(s)) => {
            return Err(ApiError::invalid(
                "tool_choice",
                format!("Unknown `tool_choice` {s:?}: expected \"none\", \"auto\", \"required\" or a named function."),
            ))
        }
        Some(Value::Object(o)) => {
            match o.get("type") {
                Some(Value::String(t)) if t == "function" => {}
                None => return Err(missing("tool_choice.type".into())),
                Some(Value::String(t)) if t == "custom" => {
                    return Err(unsupported(
                        "tool_choice.type",
                        format!("`tool_choice` of type {t:?} is not supported: send \"none\", \"auto\", \"required\" or a named function."),
                    ))
                }
                Some(_) => {
                    return Err(ApiError::invalid("tool_choice.type", "`tool_choice.type` must be \"function\"."))
                }
            }
            let function = match o.get("function") {
                None | Some(Value::Null) => return Err(missing("tool_choice.function".into())),
                Some(f) => as_object(f, "tool_choice.function", "`tool_choice.function`")?,
            };
            let name = match function.get("name") {
                None | Some(Value::Null) => return Err(missing("tool_choice.function.name".into())),
                Some(Value::String(n)) => n,
                Some(_) => return Err(invalid_type("tool_choice.function.name", "`name` must be a string.")),
            };
            if !names.iter().any(|n| n == name) {
                return Err(ApiError::invalid(
                    "tool_choice.function.name",
                    format!("`tool_choice` names the function {name:?}, which is not in `tools`."),
                ));
            }
            (true, Forced::Named(name.clone()))
        }
        Some(other) => {
            return Err(invalid_type(
                "tool_choice",
                format!("`tool_choice` must be a string or an object, not {}.", kind_of(other)),
            ))
        }
    };
    Ok((with_tools, forced, None))
}

/// `tool_choice: {"type": "allowed_tools", "allowed_tools": {"mode", "tools"}}` (OpenAI's): every
/// tool is still shown (the prompt stays the same, and its cache with it), and only the listed
/// ones may be called, `mode` "auto" (a call or an answer) or "required" (at least one call).
/// What it forces and the names it allows; `names` are the tools'.
fn allowed_tools(choice: &Map<String, Value>, names: &[String]) -> Result<(Forced, Vec<String>), ApiError> {
    let p = "tool_choice.allowed_tools";
    let obj = match choice.get("allowed_tools") {
        None | Some(Value::Null) => return Err(missing(p.into())),
        Some(v) => as_object(v, p, "`allowed_tools`")?,
    };
    let mode = match obj.get("mode") {
        None | Some(Value::Null) => return Err(missing(format!("{p}.mode"))),
        Some(Value::String(m)) if m == "auto" => Forced::No,
        Some(Value::String(m)) if m == "required" => Forced::Any,
        Some(Value::String(m)) => {
            return Err(ApiError::invalid(
                format!("{p}.mode"),
                format!("Unknown `mode` {m:?}: expected \"auto\" or \"required\"."),
            ))
        }
        Some(other) => {
            return Err(invalid_type(format!("{p}.mode"), format!("`mode` must be a string, not {}.", kind_of(other))))
        }
    };
    let list = match obj.get("tools") {
        None | Some(Value::Null) => return Err(missing(format!("{p}.tools"))),
        Some(Value::Array(list)) if list.is_empty() => {
            return Err(ApiError::invalid(format!("{p}.tools"), "`tools` must list at least one tool."))
        }
        Some(Value::Array(list)) => list,
        Some(other) => {
            return Err(invalid_type(
                format!("{p}.tools"),
                format!("`tools` must be an array, not {}.", kind_of(other)),
            ))
        }
    };
    let mut allowed = Vec::with_capacity(list.len());
    for (i, tool) in list.iter().enumerate() {
        let tp = format!("{p}.tools[{i}]");
        let t = as_object(tool, tp.clone(), "Each allowed tool")?;
        match t.get("type") {
            Some(Value::String(k)) if k == "function" => {}
            None => return Err(missing(format!("{tp}.type"))),
            Some(_) => {
                return Err(ApiError::invalid(format!("{tp}.type"), "Allowed tools must have type \"function\"."))
            }
        }
        let f = require_object(t, "function", &tp)?;
        let name = require_str(f, "name", &format!("{tp}.function"))?;
        if !names.iter().any(|n| n == name) {
            return Err(ApiError::invalid(
                format!("{tp}.function.name"),
                format!("`allowed_tools` names the function {name:?}, which is not in `tools`."),
            ));
        }
        allowed.push(name.to_string());
    }
    Ok((mode, allowed))
}

/// Whether `tool` may be called under `allowed` (None: every tool may).
fn callable(tool: &Value, allowed: Option<&[String]>) -> bool {
    let name = tool.pointer("/function/name").and_then(Value::as_str);
    allowed.is_none_or(|names| name.is_some_and(|n| names.iter().any(|a| a == n)))
}

/// Whether the request's `tools` have no effect: under `tool_choice: "none"` (not rendered,
/// nothing parsed), or not forced by a grammar while the template they would render through
/// never reads `tools` and nothing parses calls from the output (no tool-call format).
fn tools_unused(router: &Router, with_tools: bool, forced: &Forced) -> bool {
    if *forced != Forced::No {
        return false;
    }
    if !with_tools {
        return true;
    }
    let Some(template) = router.templates.select(true) else { return false };
    if template.reads("tools") {
        return false;
    }
    let parsed =
        with_tools && router.config.tool_call_format.or_else(|| ToolCallFormat::detect(template.source())).is_some();
    !parsed
}

/// Validates a chat request and renders + tokenizes its prompt.
/// A kept completion (or response) is read back at a path holding its id, which holds the
/// request's id: one that a URL path cannot carry as one segment (`/`, `?`, `#`, whitespace;
/// clients write an id into the path as it is) would name an object no route can reach. The
/// body's `request_id` is then refused; an X-Request-Id header no longer names the object.
pub(crate) fn check_kept_id(body_id: Option<&str>) -> Result<(), ApiError> {
    match body_id {
        Some(id) if !path_safe(id) => Err(ApiError::invalid(
            "request_id",
            "`request_id` names the object `store: true` keeps, which is read back by a URL holding its id: it \
             must not hold '/', '?', '#' or whitespace.",
        )),
        _ => Ok(()),
    }
}

/// Whether an id can be one segment of a URL path as it is.
pub(crate) fn path_safe(id: &str) -> bool {
    !id.contains(|c: char| matches!(c, '/' | '?' | '#') || c.is_whitespace())
}

/// `header_id`: the request's `X-Request-Id`, which names it when the body's `request_id`
/// does not.
pub(crate) fn prepare(router: &Router, body: &[u8], header_id: Option<&str>) -> Result<Checked, ApiError> {
    let value = parse_body(body)?;
    let checked = prepare_for(router, &value, header_id, false, router.config.strict_fields)?;
    check_tool_turns(&value["messages"])?;
    Ok(checked)
}

/// OpenAI's rule for a chat's tool calls: the `tool` messages that answer an assistant
/// message's `tool_calls` come right after it, one for each call, each naming the `id` of the
/// call it answers (a template renders a result of no call, or a call that never returned,
/// without complaint). A call without an `id` (Llama 3's template shows none) is answered by
/// any one `tool` message. Only a chat body's own messages are held to it: the Responses and
/// Anthropic routes check their conversations by their own APIs' rules, and the deprecated
/// `function` messages are matched to their calls by name.
pub(crate) fn check_tool_turns(messages: &Value) -> Result<(), ApiError> {
    let Some(list) = messages.as_array() else { return Ok(()) };
    let mut open: Option<OpenCalls> = None;
    for (i, m) in list.iter().enumerate() {
        if m["role"] == "tool" {
            let Some((a, calls)) = open.as_mut() else {
                return Err(ApiError::invalid(
                    format!("messages[{i}].role"),
                    "A message with role `tool` must answer a call of the assistant message with `tool_calls` \
                     right before it (or before the `tool` messages that follow it).",
                ));
            };
            let id = m["tool_call_id"].as_str();
            let waiting = |k: &usize| !calls[*k].1;
            let Some(k) = (0..calls.len())
                .filter(waiting)
                .find(|&k| calls[k].0.is_some() && calls[k].0 == id)
                .or_else(|| (0..calls.len()).filter(waiting).find(|&k| calls[k].0.is_none()))
            else {
                return Err(ApiError::invalid(
                    format!("messages[{i}].tool_call_id"),
                    format!(
                        "`tool_call_id` {:?} answers no call of `messages[{a}].tool_calls` still waiting for its \
                         result: each call is answered once, by the `tool` messages right after it.",
                        id.unwrap_or_default()
                    ),
                ));
            };
            calls[k].1 = true;
            continue;
        }
        unanswered(open.take())?;
        let calls = m["tool_calls"].as_array().filter(|c| m["role"] == "assistant" && !c.is_empty());
        open = calls.map(|c| (i, c.iter().map(|call| (call["id"].as_str(), false)).collect()));
    }
    unanswered(open)
}

/// The assistant message the `tool` messages since answer: its index, and its calls' ids with
/// whether each was answered.
type OpenCalls<'a> = (usize, Vec<(Option<&'a str>, bool)>);

/// The 400 of an assistant message's call that no `tool` message answered.
fn unanswered(open: Option<OpenCalls>) -> Result<(), ApiError> {
    let Some((a, calls)) = open else { return Ok(()) };
    match calls.iter().position(|(_, answered)| !answered) {
        Some(j) => Err(ApiError::invalid(
            format!("messages[{a}].tool_calls[{j}]"),
            format!(
                "{} has no result: an assistant message with `tool_calls` must be followed by a `tool` message \
                 answering each call (its `tool_call_id` the call's `id`).",
                calls[j].0.map_or("The call".to_string(), |id| format!("The call {id:?}"))
            ),
        )),
        None => Ok(()),
    }
}

/// `prepare` of a chat body that another route translated its request into (Responses,
/// Anthropic Messages). OpenAI's deprecated `functions`, `function_call` and `function`
/// messages are read as the tools they became ([`super::functions`]). Fields without effect
/// are reported, never refused here, whatever `--strict-fields` says: the caller settles them
/// (`settle_ignored`) in its own request's terms, leaving out the fields its translation made.
pub(crate) fn prepare_value(router: &Router, value: &Value, header_id: Option<&str>) -> Result<Checked, ApiError> {
    prepare_for(router, value, header_id, false, false)
}

/// `prepare_value` of a request whose prompt is only counted (Anthropic's
/// `/v1/messages/count_tokens`, `/v1/responses/input_tokens`): a prompt longer than the
/// context is counted too, since that count is what a client asks for to trim it.
pub(crate) fn prepare_to_count(router: &Router, value: &Value) -> Result<Checked, ApiError> {
    prepare_for(router, value, None, true, false)
}

/// `strict`: fields without effect are a 400 (`--strict-fields`), named as the client sent
/// them.
fn prepare_for(
    router: &Router,
    value: &Value,
    header_id: Option<&str>,
    counting: bool,
    strict: bool,
) -> Result<Checked, ApiError> {
    let Some(legacy) = super::functions::translate(value)? else {
        return prepare_chat(router, value, value, header_id, counting, strict);
    };
    // (settled once renamed: the tools' `parallel_tool_calls: false` is ours, not the client's)
    let mut checked =
        prepare_chat(router, &legacy.body, value, header_id, counting, false).map_err(|e| legacy.rename_error(e))?;
    let renamed = checked.ignored.iter().filter_map(|p| legacy.rename_reported(p));
    let ignored = settle_ignored(legacy.reported.iter().cloned().chain(renamed).collect(), strict)?;
    checked.report(ignored);
    if legacy.functions {
        if let Some(tools) = checked.prepared.tools.as_mut() {
            tools.functions = true;
        }
    }
    Ok(checked)
}

/// `prepare_value` of a chat request in today's terms; `sent` is the body as the client sent
/// it (what `store: true` keeps); `counting`: its prompt is only counted (no context budget);
/// `strict`: fields without effect are a 400.
fn prepare_chat(
    router: &Router,
    value: &Value,
    sent: &Value,
    header_id: Option<&str>,
    counting: bool,
    strict: bool,
) -> Result<Checked, ApiError> {
    let common: CommonFields = from_value(value)?;
    let chat: ChatFields = from_value(value)?;
    let lora = router.check_model(&common.model)?;
    let config = &router.config;

    let unknown = unknown_keys(&common.extra, &chat.extra, value).cloned().collect();
    let mut ignored: Vec<String> = vllm_unsupported(unknown, value)?;
    let c = common.resolve(config, &router.tokenizer, None)?;
    ignored.extend(c.inert.iter().cloned());

    refuse_request_template(chat.chat_template.as_ref())?;
    validate_messages(&chat.messages)?;
    validate_documents(chat.documents.as_deref().unwrap_or_default())?;

    let mut params = c.params;
    params.logprobs = match (chat.logprobs, chat.top_logprobs) {
        (Some(true), k) => {
            let k = k.unwrap_or(0);
            if k > config.max_logprobs {
                return Err(ApiError::invalid(
                    "top_logprobs",
                    format!("`top_logprobs` must be between 0 and {}, got {k}.", config.max_logprobs),
                ));
            }
            Some(k)
        }
        (_, Some(_)) => {
            return Err(ApiError::invalid("top_logprobs", "`top_logprobs` requires `logprobs` to be true."))
        }
        (_, None) => None,
    };
    if params.logprobs.is_none() && super::common::asks_tokens_as_ids(value) {
        // (it names the tokens of logprobs, and none are asked for)
        ignored.push("return_tokens_as_token_ids".into());
    }

    let (with_tools, forced, allowed) = tools_rendered(chat.tools.as_deref(), chat.tool_choice.as_ref())?;
    let template = router.templates.select(with_tools);
    ignored.extend(unknown_part_keys(&chat.messages));
    if let Some(choice @ Value::Object(_)) = &chat.tool_choice {
        if allowed.is_some() {
            let p = "tool_choice.allowed_tools";
            ignored.extend(unknown_keys_of(choice, &["type", "allowed_tools"], "tool_choice"));
            ignored.extend(unknown_keys_of(&choice["allowed_tools"], &["mode", "tools"], p));
            for (i, t) in choice["allowed_tools"]["tools"].as_array().into_iter().flatten().enumerate() {
                ignored.extend(unknown_keys_of(t, &["type", "function"], &format!("{p}.tools[{i}]")));
                ignored.extend(unknown_keys_of(&t["function"], &["name"], &format!("{p}.tools[{i}].function")));
            }
        } else {
            ignored.extend(unknown_keys_of(choice, &["type", "function"], "tool_choice"));
            if let Some(function) = choice.get("function") {
                ignored.extend(unknown_keys_of(function, &["name"], "tool_choice.function"));
            }
        }
    }
    let unused_tools = tools_unused(router, with_tools, &forced);
    if let Some(tools) = &chat.tools {
        ignored.extend(unknown_tool_keys(tools));
        if unused_tools {
            ignored.push("tools".into());
        } else if !template.is_some_and(|t| t.reads("tools")) {
            // Forced calls with a template that never shows the tools: the grammar uses
            // their names and parameters, but the model never reads their descriptions; under
            // a named function the other tools do nothing at all.
            let named = match &forced {
                Forced::Named(n) => Some(n.as_str()),
                _ => None,
            };
            for (i, t) in tools.iter().enumerate() {
                let name = t.pointer("/function/name").and_then(Value::as_str);
                if named.is_some_and(|n| name != Some(n)) || !callable(t, allowed.as_deref()) {
                    ignored.push(format!("tools[{i}]"));
                } else if has_description(t) {
                    ignored.push(format!("tools[{i}].function.description"));
                }
            }
        }
    }
    let auto = match template.filter(|_| forced == Forced::No && with_tools && !unused_tools) {
        Some(t) => match config.tool_call_format.or_else(|| ToolCallFormat::detect(t.source())) {
            Some(format) => auto_shape(router, &chat, format, c.constraint.as_ref(), allowed.as_deref(), &mut ignored)?,
            None => AutoShape::Free,
        },
        None => AutoShape::Free,
    };
    if chat.documents.is_some() && !template.is_some_and(|t| t.reads("documents")) {
        ignored.push("documents".into());
    }
    // Inert here: without tools nothing is called; under a forced `tool_choice` the output
    // is the call, never the text a response_format (or structured_outputs) shapes (OpenAI
    // accepts both).
    let no_calls = unused_tools || matches!(auto, AutoShape::NoCalls);
    // (`true`, OpenAI's default, asks for nothing where no call is made)
    if chat.parallel_tool_calls == Some(false) && (chat.tools.is_none() || !with_tools || no_calls) {
        ignored.push("parallel_tool_calls".into());
    }
    // (with the tools reported, the choice between calling them and answering is no choice)
    if no_calls && chat.tool_choice.as_ref().is_some_and(|c| c == "auto") {
        ignored.push("tool_choice".into());
    }
    if let Some((_, param)) = c.constraint.as_ref().filter(|_| forced != Forced::No) {
        ignored.push(param.split('.').next().unwrap_or(param).into());
    }
    let (add_generation_prompt, continue_final_message) =
        generation_flags(chat.add_generation_prompt, chat.continue_final_message)?;
    let effort = template.and_then(|t| effort_kwargs(router, t, value, chat.chat_template_kwargs.as_ref()));
    if effort.is_some() {
        ignored.retain(|k| k != "reasoning_effort");
    }
    let input = ChatRender {
        messages: &value["messages"],
        tools: if with_tools { value.get("tools") } else { None },
        documents: value.get("documents").filter(|d| !d.is_null()),
        add_generation_prompt,
        continue_final_message,
        kwargs: effort.as_ref().or(chat.chat_template_kwargs.as_ref()),
    };
    let (rendered, template) = render(router, &input)?;
    ignored.extend(unread_message_keys(&rendered, &value["messages"]));
    let mut reasoning = ReasoningParser::plan(config.reasoning_parser, template.source(), &rendered.text);
    // (false without a parser does nothing: nothing is split off, so any thinking the model
    // writes stays in the content)
    match (chat.include_reasoning, reasoning.as_mut()) {
        (Some(false), Some(plan)) => plan.hidden = true,
        (Some(false), None) => ignored.push("include_reasoning".into()),
        _ => {}
    }
    let budget = match chat.thinking_token_budget {
        None | Some(-1) => None,
        Some(b) if b < 0 => {
            return Err(ApiError::invalid(
                "thinking_token_budget",
                format!("`thinking_token_budget` must be a non-negative integer, or -1 for no bound; got {b}."),
            ))
        }
        // (more tokens than any context holds is no bound either)
        Some(b) => Some(u32::try_from(b).unwrap_or(u32::MAX)),
    };
    if let Some(budget) = budget {
        match reasoning.as_mut() {
            Some(plan) if params.beam_search.is_none() => plan.budget = Some(budget),
            Some(_) => {
                return Err(unsupported(
                    "thinking_token_budget",
                    "`thinking_token_budget` cannot be combined with `use_beam_search`: beams are not sampled, so \
                     their thinking cannot be closed for them.",
                ))
            }
            // (no reasoning parser reads the output: nothing here knows a think block)
            None => ignored.push("thinking_token_budget".into()),
        }
    }
    // A grammar constrains the answer, not the thinking before it (none comes when the
    // prompt already closed the thinking).
    let thinking = reasoning.filter(|_| !crate::reasoning::prompt_closes(&rendered.text));
    if thinking.is_none() && value.get("reasoning_effort") == Some(&json!("none")) {
        // (no reasoning is what this request gets)
        ignored.retain(|k| k != "reasoning_effort");
    }
    // `store: true` keeps the completion, with its `metadata` (OpenAI's stored completions;
    // with no store they stay reported)
    let keeping = value.get("store") == Some(&Value::Bool(true)) && router.chat_store().enabled();
    if keeping {
        ignored.retain(|p| p != "store" && p != "metadata");
        check_kept_id(c.request_id.as_deref())?;
    }
    let header_id = header_id.filter(|id| !keeping || path_safe(id));
    check_unused_kwargs(&rendered.unused_kwargs, config.strict_fields)?;
    ignored.extend(unused_kwarg_fields(&rendered.unused_kwargs));
    let prediction = prediction_ids(router, chat.prediction.as_ref(), &mut ignored)?;
    // (vLLM's `echo` starts the reply with the last message only when it is the assistant's)
    if chat.echo == Some(true) && echo_message(&chat.messages).is_none() {
        ignored.push("echo".into());
    }
    let ignored = settle_ignored(ignored, strict)?;
    let (mut tools, tool_grammar) =
        if with_tools { tool_plan(router, &chat, template, &forced, allowed.as_deref())? } else { (None, None) };
    let mut requested = c.constraint;
    if forced != Forced::No {
        // without effect beside a forced call (reported above), yet checked as it would be
        // alone: a schema that cannot compile is still the client's error
        constrained::compile(router, requested.take(), &params)?;
    }
    match auto {
        AutoShape::Free => {}
        AutoShape::Grammar(source) => requested = Some((source, "tools")),
        AutoShape::NoCalls => tools = None,
    }
    let constraint = tool_grammar.or(requested).map(|(g, param)| (g.after_reasoning(thinking), param));
    let grammar = constrained::compile(router, constraint, &params)?;
    if continue_final_message && grammar.is_some() {
        return Err(unsupported(
            "continue_final_message",
            "`continue_final_message` cannot be combined with a constrained output (response_format, \
             structured_outputs, a forced tool_choice or strict tools): the grammar would start a new value \
             instead of continuing the final message, and the two together would not follow it.",
        ));
    }
    // NOTE: the template writes the special tokens (BOS); `add_special_tokens` adds the
    // tokenizer's too, as vLLM does when asked.
    let add_special_tokens = c.add_special_tokens.unwrap_or(false);
    let mut prompt = router.tokenizer.encode_with_text_spans(&rendered.text, &rendered.text_spans, add_special_tokens);
    if prompt.is_empty() {
        return Err(ApiError::invalid("messages", "The messages render to an empty prompt."));
    }
    let prompt_text = if truncate_prompt(&mut prompt, c.truncate_prompt_tokens) {
        router.tokenizer.decode(&prompt, false)
    } else {
        rendered.text
    };
    if !counting {
        check_context(prompt.len(), params.max_tokens, c.max_tokens_param, config.max_model_len, "messages")?;
        settle_budget(&mut params, c.max_tokens_param, std::iter::once(prompt.len()), config.max_model_len)?;
    }

    let mut headers = Vec::new();
    headers.extend(ignored_header(&ignored));
    headers.push(template_header(template));
    if !rendered.unused_kwargs.is_empty() {
        headers.push(("llmserve-unused-template-kwargs".into(), header_list(&rendered.unused_kwargs)));
    }
    let echo_message = match chat.echo {
        Some(true) => echo_message(&chat.messages),
        _ => None,
    };
    if echo_message.is_some() && (tools.is_some() || reasoning.is_some()) {
        // (the content is then what a parser leaves of the output: no place to start it)
        return Err(unsupported(
            "echo",
            "`echo` cannot be combined with tool calls or a reasoning parser: the content is what they leave of \
             the output.",
        ));
    }
    let id = c.request_id.as_deref().or(header_id).map_or_else(|| new_id("chatcmpl"), |id| format!("chatcmpl-{id}"));
    let keep = keeping.then(|| {
        let metadata = value.get("metadata").and_then(Value::as_object).cloned().unwrap_or_default();
        let sent = sent["messages"].as_array().map(Vec::as_slice).unwrap_or_default();
        std::sync::Arc::new(crate::chat_store::Keep::new(router.chat_store().clone(), &id, sent, &c.model, metadata))
    });
    let prepared = Prepared {
        endpoint: Endpoint::Chat,
        id,
        created: unix_now(),
        system_fingerprint: router.fingerprint(lora),
        model: c.model,
        prompts: vec![prompt],
        prompt_texts: vec![prompt_text],
        params,
        stream: c.stream,
        include_usage: c.include_usage,
        continuous_usage_stats: c.continuous_usage_stats,
        echo: false,
        return_token_ids: c.return_token_ids,
        tokens_as_ids: c.tokens_as_ids,
        prompt_logprobs_k: c.prompt_logprobs,
        priority: c.priority,
        cache_salt: c.cache_salt,
        lora,
        keep,
        user: c.user,
        headers,
        ignored: ignored.clone(),
        grammar,
        tools,
        reasoning,
        responses: None,
        embedding: None,
        best_of: None,
        echo_message,
        prediction,
    };
    Ok(Checked {
        prepared,
        template: Some((template.origin().to_string(), template.hash().to_string())),
        unused_kwargs: rendered.unused_kwargs,
        ignored,
    })
}
