//! OpenAI's deprecated function-calling fields on chat, read as the tools they became.
//!
//! The translation:
//! - `functions` -> `tools` (each a function tool), with one call at most: the old API never
//!   made parallel calls (`parallel_tool_calls: true` beside it is reported).
//! - `function_call` -> `tool_choice`: `"none"` and `"auto"` as they are, `{"name": n}` the
//!   named function.
//! - In the history, an assistant turn's `function_call` -> its one `tool_calls` entry (with an
//!   id made here), and a `function` message (`name`, `content`) -> the `tool` message that
//!   answers the latest call of that function before it.
//!
//! A request that sent `functions` is answered in the same terms: `message.function_call`
//! (streamed: `delta.function_call` pieces, the name first) and `finish_reason:
//! "function_call"` (`"stop"` under a named `function_call`, as OpenAI's). Errors and reported
//! fields name the fields the client sent (`functions[1].parameters`, `function_call.name`,
//! `messages[2].function_call`).
//!
//! Decisions: `functions` beside `tools`, or `function_call` beside `tool_choice`, is a 400
//! (each pair asks for the same thing twice); `function_call` goes with `functions`, as
//! `tool_choice` goes with `tools`. Legacy messages are read whichever the request sends.

use serde_json::{json, Value};

use super::chat::{missing, require_str};
use super::common::{as_object, invalid_type, kind_of, rename_error, rename_quoted, set};
use crate::error::ApiError;

/// A chat request with the deprecated fields, and where its translated parts came from.
pub(crate) struct Legacy {
    /// The chat request the fields mean.
    pub body: Value,
    /// `functions` was sent: the answer is given as a `function_call`.
    pub functions: bool,
    /// `parallel_tool_calls` was made here (never reported).
    made_parallel: bool,
    /// The request's fields that have no effect here (`parallel_tool_calls: true`).
    pub reported: Vec<String>,
    /// `function_call` was sent (as `tool_choice`).
    function_call: bool,
    /// Assistant messages whose `tool_calls` were their `function_call`.
    calls: Vec<usize>,
    /// `tool` messages that were `function` messages (their `tool_call_id` was made here).
    results: Vec<usize>,
}

/// The id given to the call of the assistant message at `index` (nine letters and digits:
/// Mistral's templates take no other).
fn call_id(index: usize) -> String {
    format!("call{:05}", index % 100_000)
}

/// The chat request `value` means, when it sends any of the deprecated fields (None when it
/// sends none).
pub(crate) fn translate(value: &Value) -> Result<Option<Legacy>, ApiError> {
    let Some(obj) = value.as_object() else { return Ok(None) };
    let functions = set(obj, "functions");
    let function_call = set(obj, "function_call");
    let messages = obj.get("messages").and_then(Value::as_array);
    let is_legacy = |m: &Value| m.get("role").and_then(Value::as_str) == Some("function") || set_in(m, "function_call");
    let legacy_messages = messages.is_some_and(|list| list.iter().any(is_legacy));
    if functions.is_none() && function_call.is_none() && !legacy_messages {
        return Ok(None);
    }
    let mut body = obj.clone();
    body.remove("functions");
    body.remove("function_call");
    if let Some(functions) = functions {
        if set(obj, "tools").is_some() {
            return Err(ApiError::invalid(
                "functions",
                "`functions` and `tools` cannot both be sent: `functions` is the deprecated form of `tools`. Send one of them.",
            ));
        }
        let list = functions.as_array().ok_or_else(|| {
            invalid_type("functions", format!("`functions` must be an array, not {}.", kind_of(functions)))
        })?;
        if list.is_empty() {
            return Err(ApiError::invalid(
                "functions",
                "`functions` must not be empty; leave it out when there are no functions.",
            ));
        }
        for (i, f) in list.iter().enumerate() {
            as_object(f, format!("functions[{i}]"), "Each function")?;
        }
        let tools = list.iter().map(|f| json!({"type": "function", "function": f})).collect();
        body.insert("tools".into(), Value::Array(tools));
        // (`true` asks for what an answer of one `function_call` cannot hold: reported)
        body.insert("parallel_tool_calls".into(), Value::Bool(false));
    }
    if let Some(choice) = function_call {
        let tool_choice = tool_choice(choice)?;
        if functions.is_none() {
            let why = if set(obj, "tools").is_some() {
                "`function_call` goes with the deprecated `functions`; with `tools`, send `tool_choice`."
            } else {
                "`function_call` is only allowed when `functions` are given."
            };
            return Err(ApiError::invalid("function_call", why));
        }
        if set(obj, "tool_choice").is_some() {
            return Err(ApiError::invalid(
                "function_call",
                "`function_call` and `tool_choice` cannot both be sent: `function_call` is the deprecated form of \
                 `tool_choice`. Send one of them.",
            ));
        }
        body.insert("tool_choice".into(), tool_choice);
    }
    let mut legacy = Legacy {
        body: Value::Null,
        functions: functions.is_some(),
        function_call: function_call.is_some(),
        made_parallel: functions.is_some() && set(obj, "parallel_tool_calls").is_none(),
        reported: if functions.is_some() && set(obj, "parallel_tool_calls") == Some(&Value::Bool(true)) {
            vec!["parallel_tool_calls".into()]
        } else {
            Vec::new()
        },
        calls: Vec::new(),
        results: Vec::new(),
    };
    if let Some(list) = messages.filter(|_| legacy_messages) {
        let translated = legacy.messages(list)?;
        body.insert("messages".into(), Value::Array(translated));
    }
    legacy.body = Value::Object(body);
    Ok(Some(legacy))
}

/// Whether `m` is an object with a non-null `key`.
fn set_in(m: &Value, key: &str) -> bool {
    m.get(key).is_some_and(|v| !v.is_null())
}

/// `function_call` as the `tool_choice` it means.
fn tool_choice(choice: &Value) -> Result<Value, ApiError> {
    match choice {
        Value::String(s) if s == "none" || s == "auto" => Ok(choice.clone()),
        Value::String(s) => Err(ApiError::invalid(
            "function_call",
            format!("Unknown `function_call` {s:?}: expected \"none\", \"auto\" or {{\"name\": ...}}."),
        )),
        Value::Object(o) => {
            match o.get("name") {
                None | Some(Value::Null) => return Err(missing("function_call.name".into())),
                Some(Value::String(_)) => {}
                Some(other) => {
                    return Err(invalid_type(
                        "function_call.name",
                        format!("`name` must be a string, not {}.", kind_of(other)),
                    ))
                }
            }
            // (its other keys are the named choice's, and reported as such)
            Ok(json!({"type": "function", "function": o}))
        }
        other => Err(invalid_type(
            "function_call",
            format!("`function_call` must be a string or an object, not {}.", kind_of(other)),
        )),
    }
}

impl Legacy {
    /// The messages with each legacy call and result in today's form.
    fn messages(&mut self, list: &[Value]) -> Result<Vec<Value>, ApiError> {
        let mut out = Vec::with_capacity(list.len());
        // the calls made so far, unanswered: (function name, id)
        let mut open: Vec<(String, String)> = Vec::new();
        for (i, m) in list.iter().enumerate() {
            let p = format!("messages[{i}]");
            let role = m.get("role").and_then(Value::as_str);
            if role == Some("function") {
                let obj = as_object(m, p.clone(), "Each message")?;
                let name = require_str(obj, "name", &p)?;
                let content = match obj.get("content") {
                    None => return Err(missing(format!("{p}.content"))),
                    Some(Value::Null) => Value::String(String::new()),
                    Some(c @ Value::String(_)) => c.clone(),
                    Some(other) => {
                        return Err(invalid_type(
                            format!("{p}.content"),
                            format!("A function message's `content` must be a string, not {}.", kind_of(other)),
                        ))
                    }
                };
                let id = match open.iter().rposition(|(n, _)| n == name) {
                    Some(at) => open.remove(at).1,
                    None => call_id(i),
                };
                let mut message = json!({"role": "tool", "tool_call_id": id, "name": name, "content": content});
                // (other keys stay, to be reported if the template never reads them)
                for (k, v) in obj.iter().filter(|(k, _)| !["role", "name", "content"].contains(&k.as_str())) {
                    message[k.as_str()] = v.clone();
                }
                self.results.push(i);
                out.push(message);
                continue;
            }
            let Some(call) = m.get("function_call").filter(|v| !v.is_null()) else {
                out.push(m.clone());
                continue;
            };
            if role != Some("assistant") {
                return Err(ApiError::invalid(
                    format!("{p}.function_call"),
                    "Only assistant messages may carry `function_call`.",
                ));
            }
            if m.get("tool_calls").and_then(Value::as_array).is_some_and(|c| !c.is_empty()) {
                return Err(ApiError::invalid(
                    format!("{p}.function_call"),
                    "An assistant message carries `tool_calls` or the deprecated `function_call`, not both.",
                ));
            }
            let cp = format!("{p}.function_call");
            let f = as_object(call, cp.clone(), "`function_call`")?;
            let name = require_str(f, "name", &cp)?;
            require_str(f, "arguments", &cp)?;
            let id = call_id(i);
            open.push((name.to_string(), id.clone()));
            let mut message = m.clone();
            let obj = message.as_object_mut().expect("checked above");
            obj.remove("function_call");
            obj.insert("tool_calls".into(), json!([{"id": id, "type": "function", "function": f}]));
            self.calls.push(i);
            out.push(message);
        }
        Ok(out)
    }

    /// A chat `param` in the request's own terms.
    fn rename(&self, param: &str) -> String {
        if let Some(rest) = param.strip_prefix("messages[") {
            let Some((index, tail)) = rest.split_once(']') else { return param.into() };
            let Ok(i) = index.parse::<usize>() else { return param.into() };
            if self.calls.contains(&i) {
                if let Some(call) = tail.strip_prefix(".tool_calls") {
                    // .tool_calls[0].function.x -> .function_call.x
                    let x = call.split_once(".function").map_or("", |(_, x)| x);
                    return format!("messages[{i}].function_call{x}");
                }
            }
            if self.results.contains(&i) && tail == ".tool_call_id" {
                return format!("messages[{i}].name");
            }
            return param.into();
        }
        if let Some(rest) = param.strip_prefix("tools").filter(|_| self.functions) {
            // tools[i].function.x -> functions[i].x
            return match rest.split_once(']') {
                Some((i, tail)) => format!("functions{i}]{}", tail.strip_prefix(".function").unwrap_or(tail)),
                None => format!("functions{rest}"),
            };
        }
        if let Some(rest) = param.strip_prefix("tool_choice").filter(|_| self.function_call) {
            return format!("function_call{}", rest.strip_prefix(".function").unwrap_or(rest));
        }
        param.into()
    }

    /// A reported chat field in the request's terms (None: a field made here, such as a
    /// result's `tool_call_id`).
    pub(crate) fn rename_reported(&self, param: &str) -> Option<String> {
        let made_id = param
            .strip_prefix("messages[")
            .and_then(|rest| rest.strip_suffix("].tool_call_id"))
            .and_then(|i| i.parse::<usize>().ok())
            .is_some_and(|i| self.results.contains(&i));
        let made = made_id || (param == "parallel_tool_calls" && self.made_parallel);
        (!made).then(|| self.rename(param))
    }

    /// `err` with its `param`, and the chat fields its message quotes, in the request's terms.
    pub(crate) fn rename_error(&self, err: ApiError) -> ApiError {
        let words = |message: String, _: Option<&str>| {
            let chat_fields = ["messages[", "tools", "tool_choice"];
            let out = rename_quoted(&message, |part| {
                chat_fields.iter().any(|f| part.starts_with(f)).then(|| self.rename(part))
            });
            if self.functions {
                out.replace("tools of type", "functions of type")
            } else {
                out
            }
        };
        rename_error(err, |p| self.rename(p), words)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn legacy(body: Value) -> Legacy {
        translate(&body).unwrap().expect("legacy fields")
    }

    #[test]
    fn requests_without_the_deprecated_fields_are_left_alone() {
        let body = json!({"messages": [{"role": "user", "content": "hi"}], "tools": [], "tool_choice": "auto"});
        assert!(translate(&body).unwrap().is_none());
    }

    #[test]
    fn functions_and_function_call_become_tools_and_tool_choice() {
        let f = json!({"name": "get_weather", "parameters": {"type": "object"}});
        let l = legacy(json!({"messages": [], "functions": [f], "function_call": {"name": "get_weather"}}));
        assert!(l.functions);
        assert_eq!(l.body["tools"], json!([{"type": "function", "function": f}]));
        assert_eq!(l.body["tool_choice"], json!({"type": "function", "function": {"name": "get_weather"}}));
        assert_eq!(l.body["parallel_tool_calls"], json!(false));
        assert!(l.body.get("functions").is_none() && l.body.get("function_call").is_none());
        for choice in ["none", "auto"] {
            let l = legacy(json!({"messages": [], "functions": [f], "function_call": choice}));
            assert_eq!(l.body["tool_choice"], json!(choice));
        }
    }

    #[test]
    fn history_calls_and_results_are_matched_by_name() {
        let messages = json!([
            {"role": "user", "content": "weather and time?"},
            {"role": "assistant", "content": null, "function_call": {"name": "weather", "arguments": "{}"}},
            {"role": "assistant", "content": null, "function_call": {"name": "time", "arguments": "{}"}},
            {"role": "function", "name": "weather", "content": "sunny"},
            {"role": "function", "name": "time", "content": null},
        ]);
        let l = legacy(json!({"messages": messages}));
        assert!(!l.functions);
        let out = &l.body["messages"];
        assert_eq!(out[1]["tool_calls"][0]["id"], "call00001");
        assert_eq!(out[1]["tool_calls"][0]["function"]["name"], "weather");
        assert!(out[1].get("function_call").is_none());
        assert_eq!(out[3], json!({"role": "tool", "tool_call_id": "call00001", "name": "weather", "content": "sunny"}));
        assert_eq!(out[4], json!({"role": "tool", "tool_call_id": "call00002", "name": "time", "content": ""}));
        assert_eq!(l.rename("messages[1].tool_calls[0].function.arguments"), "messages[1].function_call.arguments");
        assert_eq!(l.rename_reported("messages[3].tool_call_id"), None);
        assert_eq!(l.rename_reported("messages[1].tool_calls").as_deref(), Some("messages[1].function_call"));
    }

    #[test]
    fn chat_params_are_named_as_sent() {
        let l = legacy(json!({"messages": [], "functions": [{"name": "f"}], "function_call": "auto"}));
        assert_eq!(l.rename("tools[0].function.parameters.type"), "functions[0].parameters.type");
        assert_eq!(l.rename("tools[2]"), "functions[2]");
        assert_eq!(l.rename("tools"), "functions");
        assert_eq!(l.rename("tool_choice.function.name"), "function_call.name");
        let e = l.rename_error(ApiError::invalid(
            "tool_choice.function.name",
            "`tool_choice` names the function \"g\", which is not in `tools`.",
        ));
        assert_eq!(e.param(), Some("function_call.name"));
        assert_eq!(e.message(), "`function_call` names the function \"g\", which is not in `functions`.");
    }

    #[test]
    fn contradictions_and_bad_shapes_are_400s_at_their_field() {
        let f = json!([{"name": "f"}]);
        let cases = [
            (json!({"functions": f, "tools": [{"type": "function", "function": {"name": "g"}}]}), "functions"),
            (json!({"functions": f, "tool_choice": "auto", "function_call": "auto"}), "function_call"),
            (json!({"tools": [], "function_call": "auto"}), "function_call"),
            (json!({"function_call": "auto"}), "function_call"),
            (json!({"functions": {}}), "functions"),
            (json!({"functions": []}), "functions"),
            (json!({"functions": f, "function_call": "required"}), "function_call"),
            (json!({"functions": f, "function_call": {}}), "function_call.name"),
            (json!({"functions": f, "function_call": 3}), "function_call"),
            (json!({"messages": [{"role": "function", "content": "x"}]}), "messages[0].name"),
            (json!({"messages": [{"role": "function", "name": "f", "content": [1]}]}), "messages[0].content"),
            (json!({"messages": [{"role": "user", "content": "x", "function_call": {}}]}), "messages[0].function_call"),
            (
                json!({"messages": [{"role": "assistant", "function_call": {"name": "f"}}]}),
                "messages[0].function_call.arguments",
            ),
            (
                json!({"messages": [{"role": "assistant", "function_call": {"name": "f", "arguments": "{}"},
                                     "tool_calls": [{"id": "a"}]}]}),
                "messages[0].function_call",
            ),
        ];
        for (body, param) in cases {
            let err = translate(&body).err().unwrap_or_else(|| panic!("{body} passed"));
            assert_eq!(err.param(), Some(param), "{body}: {}", err.message());
            assert_eq!(err.status(), 400);
        }
    }
}
