"""Phi-3 and Phi-4-mini (`Phi3ForCausalLM`): the Llama decoder over checkpoints that hold q|k|v
and gate|up fused (`qkv_proj`, `gate_up_proj`: loaded as they are), with

- `partial_rotary_factor` (Phi-4-mini: 0.75): RoPE rotates each head's leading dims only;
- LongRoPE scaling (Phi-3.5, Phi-4-mini: `rope_scaling` `longrope`): rotary frequencies
  divided by `short_factor`, or `long_factor` from `original_max_position_embeddings` on, and
  cos and sin multiplied by `attention_factor` (default sqrt(1 + ln(max / original) /
  ln(original)), as transformers computes it). A token is rotated by its own position: those
  before the original length with the short factors, those after with the long, so a long
  sequence's cached keys keep their rotation. (transformers recomputes a whole sequence with
  the long factors once it passes that length, and vLLM switches a whole batch; under the
  original length, 4096 tokens, all three agree.)
- `sliding_window` (Phi-3-mini-4k: 2047) in every layer.
"""

from __future__ import annotations

import math

from llmserve.models.llama import DecoderConfig, LlamaForCausalLM
from llmserve.models.registry import register


def longrope(hf_config: dict) -> dict | None:
    """The LongRoPE scaling RotaryEmbedding takes (factors, original length, attention
    factor), from `rope_scaling` (transformers 4) or `rope_parameters` (5); None without it."""
    params = hf_config.get("rope_scaling") or hf_config.get("rope_parameters") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return None
    if kind != "longrope":
        raise ValueError(f"Phi-3 RoPE scaling {kind!r} is not supported (longrope)")
    original = params.get("original_max_position_embeddings") or hf_config.get("original_max_position_embeddings")
    if not original:
        raise ValueError("longrope needs original_max_position_embeddings")
    factor = params.get("factor") or hf_config["max_position_embeddings"] / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {"rope_type": "longrope", "short_factor": params["short_factor"], "long_factor": params["long_factor"],
            "original_max_position_embeddings": int(original), "attention_factor": float(attention)}


@register("Phi3ForCausalLM")
class Phi3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def parse_config(cls, hf_config: dict) -> DecoderConfig:
        if hf_config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"Phi-3's hidden_act {hf_config['hidden_act']!r} is not supported (silu)")
        c = super().parse_config(hf_config)   # (its sliding window, when the config has one)
        scaling = longrope(hf_config)
        return DecoderConfig(**{**c.__dict__, "rope_scaling": scaling}) if scaling else c
