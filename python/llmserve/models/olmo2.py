"""OLMo 2 and OLMo 3.

`Olmo2ForCausalLM` (OLMo-2-0425-1B, OLMo-2-1124-7B/13B, OLMo-2-0325-32B): the Llama decoder with
OLMo 2's norms (llama.DecoderConfig): no norm before the attention or the MLP, each one's output
normed before its residual add (HF's post_attention_layernorm, post_feedforward_layernorm), and
q and k each RMS-normed across all their heads at once, before RoPE. Its norms scale in float32
and round once, as transformers' Olmo2RMSNorm does.

`Olmo3ForCausalLM` (Olmo-3-7B, -32B): OLMo 2's layers, three of every four with sliding-window
attention (`layer_types`, `sliding_window` 4096); the RoPE scaling of its long-context configs
(YaRN) rotates the full-attention layers only, the sliding ones keep plain RoPE."""

from __future__ import annotations

from dataclasses import replace

from llmserve.models.llama import (DecoderConfig, LlamaForCausalLM, layer_type_rope, layer_types, layer_windows,
                                   require_silu)
from llmserve.models.registry import register


@register("Olmo2ForCausalLM")
class Olmo2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def parse_config(cls, hf_config: dict) -> DecoderConfig:
        require_silu(hf_config, "OLMo 2")
        return DecoderConfig.from_hf(hf_config, qk_norm=True, qk_norm_across_heads=True, pre_norms=False,
                                     sandwich_norms=True, fp32_norms=True)


@register("Olmo3ForCausalLM")
class Olmo3ForCausalLM(Olmo2ForCausalLM):
    @classmethod
    def parse_config(cls, hf_config: dict) -> DecoderConfig:
        types = layer_types(hf_config, 4)
        theta = hf_config.get("rope_theta") or 500000.0
        full = layer_type_rope(hf_config, "full_attention", theta, hf_config.get("rope_scaling"))
        local = layer_type_rope(hf_config, "sliding_attention", theta, None)
        return replace(super().parse_config(hf_config), rope_theta=full[0], rope_scaling=full[1],
                       layer_windows=layer_windows(hf_config, types), local_rope=local,
                       local_layers=frozenset(i for i, t in enumerate(types) if t == "sliding_attention"))
