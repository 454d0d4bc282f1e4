//! The LoRA adapters served beside the base model, each a model of its own name: those of
//! `--lora-modules`, and, with runtime updating on, those vLLM's `POST /v1/load_lora_adapter`
//! adds and `POST /v1/unload_lora_adapter` removes.
//!
//! An adapter's *index* (1, 2, ...; 0 is the base model) is what its requests carry to the
//! scheduler (prefix-cache roots) and the model (which weights a row takes). Indices are never
//! reused: blocks cached under an unloaded adapter can never match another adapter's prompt.
//!
//! Loading is three steps, because the weights are read and installed by the engine (Python)
//! between the router's checks: [`LoraTable::reserve`] an index, install the weights under
//! it, then [`LoraTable::publish`] the name (which refuses a name taken meanwhile). Unloading
//! [`LoraTable::retire`]s the name: requests can no longer name it, while those already
//! admitted keep its index, name and fingerprint until the engine frees its weights and
//! [`LoraTable::forget`]s it.

use std::collections::BTreeMap;

use serde::de::IgnoredAny;
use serde::Deserialize;
use serde_json::Value;

use crate::error::ApiError;
use crate::protocol::common::{from_value, ignored_header, parse_body, set_keys, settle_ignored};
use crate::router::LoraAdapter;

struct Entry {
    index: u32,
    adapter: LoraAdapter,
    /// false once unloaded (retired): no request can name it any more.
    live: bool,
}

/// The adapters by index, in the order they were loaded.
pub struct LoraTable {
    entries: Vec<Entry>,
    next: u32,
}

impl LoraTable {
    /// `--lora-modules`' adapters, indices 1..=n in the order given.
    pub fn new(adapters: Vec<LoraAdapter>) -> Self {
        let entries: Vec<Entry> =
            adapters.into_iter().zip(1..).map(|(adapter, index)| Entry { index, adapter, live: true }).collect();
        let next = entries.len() as u32 + 1;
        Self { entries, next }
    }

    /// The live adapters, in load order.
    pub fn live(&self) -> impl Iterator<Item = &LoraAdapter> {
        self.entries.iter().filter(|e| e.live).map(|e| &e.adapter)
    }

    /// The index of the live adapter named `name`.
    pub fn index_of(&self, name: &str) -> Option<u32> {
        self.entries.iter().find(|e| e.live && e.adapter.name == name).map(|e| e.index)
    }

    /// The adapter of `index`, live or retired (until forgotten).
    pub fn get(&self, index: u32) -> Option<&LoraAdapter> {
        self.entries.iter().find(|e| e.index == index).map(|e| &e.adapter)
    }

    /// Whether any adapter is served or retired.
    pub fn any(&self) -> bool {
        !self.entries.is_empty()
    }

    /// A fresh index for an adapter about to be installed.
    pub fn reserve(&mut self) -> u32 {
        let index = self.next;
        self.next += 1;
        index
    }

    /// Serves the adapter installed under `index` (from [`reserve`](Self::reserve)) by its
    /// name. A live adapter of that name is retired when `replace`, else refused; the retired
    /// index is returned.
    pub fn publish(&mut self, index: u32, adapter: LoraAdapter, replace: bool) -> Result<Option<u32>, ApiError> {
        if index == 0 || index >= self.next || self.get(index).is_some() {
            return Err(ApiError::Internal { message: format!("LoRA index {index} was not reserved") });
        }
        let replaced = match self.index_of(&adapter.name) {
            Some(_) if !replace => return Err(already_loaded(&adapter.name)),
            Some(old) => self.retire(&adapter.name).filter(|&i| i == old),
            None => None,
        };
        self.entries.push(Entry { index, adapter, live: true });
        Ok(replaced)
    }

    /// Stops serving the adapter named `name`; its index, if it was live.
    pub fn retire(&mut self, name: &str) -> Option<u32> {
        let entry = self.entries.iter_mut().find(|e| e.live && e.adapter.name == name)?;
        entry.live = false;
        Some(entry.index)
    }

    /// Drops a retired adapter once no request holds it (a live one stays).
    pub fn forget(&mut self, index: u32) {
        self.entries.retain(|e| e.live || e.index != index);
    }
}

/// The 400 of a load naming a loaded adapter without `load_inplace`.
pub fn already_loaded(name: &str) -> ApiError {
    ApiError::with_code(
        "lora_adapter_exists",
        Some("lora_name".into()),
        format!(
            "A LoRA adapter named '{name}' is already loaded: unload it first, or send `load_inplace: true` to \
             replace its weights."
        ),
    )
}

/// Response headers (`llmserve-ignored-fields`).
pub type Headers = Vec<(String, String)>;

/// A `POST /v1/load_lora_adapter` body (vLLM's).
#[derive(Debug, Clone, PartialEq)]
pub struct LoadRequest {
    /// The model name its requests will send.
    pub name: String,
    /// A PEFT adapter folder on the server, or a Hugging Face id.
    pub path: String,
    /// Replace the weights of a loaded adapter of that name (vLLM's `load_inplace`).
    pub inplace: bool,
    pub headers: Headers,
}

#[derive(Deserialize)]
struct LoadBody {
    lora_name: Option<String>,
    lora_path: Option<String>,
    #[serde(default)]
    load_inplace: Option<bool>,
    #[serde(flatten)]
    extra: BTreeMap<String, IgnoredAny>,
}

#[derive(Deserialize)]
struct UnloadBody {
    lora_name: Option<String>,
    /// vLLM's internal id of an adapter; this server names adapters only by name.
    #[serde(default)]
    lora_int_id: Option<IgnoredAny>,
    #[serde(flatten)]
    extra: BTreeMap<String, IgnoredAny>,
}

fn ignored(
    extra: &BTreeMap<String, IgnoredAny>,
    body: &Value,
    also: &[&str],
    strict: bool,
) -> Result<Headers, ApiError> {
    let mut keys: Vec<String> = set_keys(extra, body).cloned().collect();
    keys.extend(also.iter().filter(|k| body.get(**k).is_some_and(|v| !v.is_null())).map(|k| k.to_string()));
    Ok(ignored_header(&settle_ignored(keys, strict)?).into_iter().collect())
}

/// A name or path: given, a string, not empty.
fn required(value: Option<String>, param: &str) -> Result<String, ApiError> {
    match value {
        Some(v) if !v.trim().is_empty() => Ok(v),
        Some(_) => Err(ApiError::invalid(param, format!("`{param}` must not be empty."))),
        None => Err(ApiError::with_code(
            "missing_required_parameter",
            Some(param.into()),
            format!("Missing required parameter: `{param}`."),
        )),
    }
}

/// Reads a load body; `served` are the base model's names (an adapter may not take one).
pub fn parse_load(body: &[u8], served: &[String], strict: bool) -> Result<LoadRequest, ApiError> {
    let value = parse_body(body)?;
    let b: LoadBody = from_value(&value)?;
    let headers = ignored(&b.extra, &value, &[], strict)?;
    let name = required(b.lora_name, "lora_name")?;
    let path = required(b.lora_path, "lora_path")?;
    if name.chars().any(char::is_control) || name.len() > 256 {
        return Err(ApiError::invalid(
            "lora_name",
            "`lora_name` is a model name: at most 256 bytes, without control characters.",
        ));
    }
    if served.contains(&name) {
        return Err(ApiError::invalid(
            "lora_name",
            format!("'{name}' is the base model's name: name the adapter otherwise."),
        ));
    }
    Ok(LoadRequest { name, path, inplace: b.load_inplace.unwrap_or(false), headers })
}

/// Reads an unload body: the adapter's name, and the response headers.
pub fn parse_unload(body: &[u8], strict: bool) -> Result<(String, Headers), ApiError> {
    let value = parse_body(body)?;
    let b: UnloadBody = from_value(&value)?;
    let headers = ignored(&b.extra, &value, if b.lora_int_id.is_some() { &["lora_int_id"] } else { &[] }, strict)?;
    Ok((required(b.lora_name, "lora_name")?, headers))
}

/// The 404 of an unload naming no loaded adapter (listing the first few loaded, as a 404
/// for an unknown model lists the served names).
pub fn not_loaded(name: &str, loaded: Vec<String>) -> ApiError {
    let short = |s: &str| match s.char_indices().nth(100) {
        Some((at, _)) => format!("{}...", &s[..at]),
        None => s.to_string(),
    };
    let which = if loaded.is_empty() {
        "none is loaded".to_string()
    } else {
        let more = loaded.len().saturating_sub(8);
        let names: Vec<String> = loaded.iter().take(8).map(|n| short(n)).collect();
        format!("loaded: {}{}", names.join(", "), if more > 0 { format!(" and {more} more") } else { String::new() })
    };
    ApiError::NotFound { message: format!("No LoRA adapter named '{}' is loaded ({which}).", short(name)) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn adapter(name: &str) -> LoraAdapter {
        LoraAdapter { name: name.into(), path: format!("/a/{name}"), parent: None, system_fingerprint: None }
    }

    #[test]
    fn indices_are_never_reused_and_retired_adapters_stay_readable_until_forgotten() {
        let mut t = LoraTable::new(vec![adapter("a"), adapter("b")]);
        assert_eq!((t.index_of("a"), t.index_of("b")), (Some(1), Some(2)));
        assert_eq!(t.retire("a"), Some(1));
        assert_eq!(t.retire("a"), None);
        assert_eq!(t.index_of("a"), None);
        assert_eq!(t.get(1).map(|a| a.name.as_str()), Some("a")); // (its requests still run)
        let i = t.reserve();
        assert_eq!(i, 3);
        assert_eq!(t.publish(i, adapter("a"), false), Ok(None));
        assert_eq!(t.index_of("a"), Some(3));
        t.forget(1);
        assert!(t.get(1).is_none());
        t.forget(3); // (a live adapter is not forgotten)
        assert_eq!(t.index_of("a"), Some(3));
        assert_eq!(t.live().map(|a| a.name.as_str()).collect::<Vec<_>>(), ["b", "a"]);
    }

    #[test]
    fn a_taken_name_is_refused_unless_replaced() {
        let mut t = LoraTable::new(vec![adapter("a")]);
        let i = t.reserve();
        let err = t.publish(i, adapter("a"), false).unwrap_err();
        assert_eq!((err.status(), err.code()), (400, "lora_adapter_exists"));
        assert_eq!(t.publish(i, adapter("a"), true), Ok(Some(1)));
        assert_eq!(t.index_of("a"), Some(i));
        assert!(t.publish(i, adapter("c"), false).is_err()); // (an index publishes once)
        assert!(t.publish(99, adapter("c"), false).is_err()); // (and only when reserved)
    }

    #[test]
    fn bodies_are_checked() {
        let served = vec!["base".to_string()];
        let ok = parse_load(br#"{"lora_name": "x", "lora_path": "/p", "load_inplace": true}"#, &served, false).unwrap();
        assert_eq!((ok.name.as_str(), ok.path.as_str(), ok.inplace), ("x", "/p", true));
        let code = |b: &[u8]| parse_load(b, &served, false).map(|_| ()).unwrap_err();
        assert_eq!(code(br#"{"lora_path": "/p"}"#).code(), "missing_required_parameter");
        assert_eq!(code(br#"{"lora_name": "", "lora_path": "/p"}"#).param(), Some("lora_name"));
        assert_eq!(code(br#"{"lora_name": "x", "lora_path": 3}"#).code(), "invalid_type");
        assert_eq!(code(br#"{"lora_name": "base", "lora_path": "/p"}"#).param(), Some("lora_name"));
        assert_eq!(code(b"[]").code(), "invalid_type");
        let extra = parse_load(br#"{"lora_name": "x", "lora_path": "/p", "rank": 8}"#, &served, false).unwrap();
        assert_eq!(extra.headers, [("llmserve-ignored-fields".to_string(), "rank".to_string())]);
        assert!(parse_load(br#"{"lora_name": "x", "lora_path": "/p", "rank": 8}"#, &served, true).is_err());
        let (name, headers) = parse_unload(br#"{"lora_name": "x", "lora_int_id": 4}"#, false).unwrap();
        assert_eq!((name.as_str(), headers[0].1.as_str()), ("x", "lora_int_id"));
        assert_eq!(parse_unload(b"{}", false).unwrap_err().code(), "missing_required_parameter");
        let many: Vec<String> = (0..20).map(|i| format!("a{i}")).collect();
        let message = not_loaded("x", many).message();
        assert!(message.ends_with("(loaded: a0, a1, a2, a3, a4, a5, a6, a7 and 12 more)."), "{message}");
    }
}
