//! Chat templates end to end: resolution, selection by tools, and rendering SmolLM2's own
//! template (the GGUF's `tokenizer.chat_template`) as transformers does.

use llmserve_router::template::{RenderInput, TemplateSet, TemplateSources};
use serde_json::json;
use std::collections::BTreeMap;

const SMOLLM: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

fn input<'a>(messages: &'a serde_json::Value, gen: bool, cont: bool) -> RenderInput<'a> {
    static TOKENS: std::sync::LazyLock<BTreeMap<String, String>> = std::sync::LazyLock::new(|| {
        [("bos_token", "<|im_start|>"), ("eos_token", "<|im_end|>")].map(|(n, t)| (n.to_string(), t.to_string())).into()
    });
    RenderInput {
        messages,
        tools: None,
        documents: None,
        add_generation_prompt: gen,
        continue_final_message: cont,
        kwargs: None,
        special_tokens: &TOKENS,
        fuel: Some(100_000),
        special_texts: None,
    }
}

#[test]
fn smollm_template_from_gguf() {
    let set = TemplateSet::resolve(TemplateSources { gguf: Some(SMOLLM.into()), ..Default::default() }).unwrap();
    let t = set.select(false).unwrap();
    assert_eq!(t.origin(), "gguf");
    assert!(t.hash().starts_with("sha256:") && t.hash().len() == 23);
    let msgs = json!([{"role": "user", "content": "Hi"}]);
    let out = t.render(&input(&msgs, true, false)).unwrap();
    assert_eq!(
        out.text,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    let msgs = json!([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]);
    let out = t.render(&input(&msgs, false, true)).unwrap();
    assert!(out.text.ends_with("<|im_start|>assistant\nHel"), "{:?}", out.text);
}

#[test]
fn tool_use_template_is_chosen_when_tools_are_sent() {
    let named = json!([
        {"name": "default", "template": "D:{{ messages | length }}"},
        {"name": "tool_use", "template": "T:{% for t in tools %}{{ t.function.name }}{% endfor %}"},
    ]);
    let set = TemplateSet::resolve(TemplateSources { tokenizer_config: Some(named), ..Default::default() }).unwrap();
    let msgs = json!([{"role": "user", "content": "x"}]);
    let tools = json!([{"type": "function", "function": {"name": "f"}}]);
    let mut inp = input(&msgs, false, false);
    assert_eq!(set.select(false).unwrap().render(&inp).unwrap().text, "D:1");
    inp.tools = Some(&tools);
    assert_eq!(set.select(true).unwrap().render(&inp).unwrap().text, "T:f");
}

#[test]
fn missing_template_and_bad_sources() {
    assert!(TemplateSet::resolve(TemplateSources::default()).unwrap().select(false).is_none());
    assert!(TemplateSet::resolve(TemplateSources { cli: Some("{% if %}".into()), ..Default::default() }).is_err());
    let bad = json!([{"name": "default"}]);
    assert!(TemplateSet::resolve(TemplateSources { tokenizer_config: Some(bad), ..Default::default() }).is_err());
}
