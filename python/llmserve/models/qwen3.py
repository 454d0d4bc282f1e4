"""Qwen3: the Llama decoder with per-head RMSNorm on q and k before RoPE, an explicit head_dim
(not hidden / heads), and `attention_bias` (default off) on q/k/v and o."""

from __future__ import annotations

from llmserve.models.llama import DecoderConfig, LlamaForCausalLM
from llmserve.models.registry import register


@register("Qwen3ForCausalLM")
class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def parse_config(cls, hf_config: dict) -> DecoderConfig:
        if hf_config.get("use_sliding_window"):
            raise ValueError("Qwen3 sliding-window attention is not supported")
        return DecoderConfig.from_hf(hf_config, qk_norm=True)
