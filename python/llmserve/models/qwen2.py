"""Qwen2 (and Qwen2.5): the Llama decoder with a bias on the fused QKV projection (never on
o_proj), no sliding window."""

from __future__ import annotations

from llmserve.models.llama import DecoderConfig, LlamaForCausalLM
from llmserve.models.registry import register


@register("Qwen2ForCausalLM")
class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def parse_config(cls, hf_config: dict) -> DecoderConfig:
        if hf_config.get("use_sliding_window"):
            raise ValueError("Qwen2 sliding-window attention is not supported")
        return DecoderConfig.from_hf(hf_config, qkv_bias=True, o_bias=False)
