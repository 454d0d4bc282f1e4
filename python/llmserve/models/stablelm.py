"""StableLM (`StableLmForCausalLM`: stablelm-2-1_6b and its zephyr/chat tunes, stablelm-3b-4e1t,
stablelm-zephyr-3b): the Llama decoder with LayerNorms that have a bias (llama.DecoderConfig's
`layer_norm`), RoPE on the leading quarter of each head (`partial_rotary_factor`), biases on
q/k/v when `use_qkv_bias` says so, and with `use_parallel_residual` the attention and the MLP
both reading the layer's one normed input. The per-head q/k LayerNorms of stablelm-2-12b
(`qk_layernorm`) are refused."""

from __future__ import annotations

from llmserve.models.llama import DecoderConfig, LlamaForCausalLM, require_silu
from llmserve.models.registry import register


@register("StableLmForCausalLM")
class StableLmForCausalLM(LlamaForCausalLM):
    @classmethod
    def parse_config(cls, hf_config: dict) -> DecoderConfig:
        require_silu(hf_config, "StableLM")
        if hf_config.get("qk_layernorm"):
            raise ValueError("StableLM's per-head q/k LayerNorms (qk_layernorm, stablelm-2-12b) are not supported")
        return DecoderConfig.from_hf(
            hf_config, partial_rotary_default=0.25, rms_norm_eps=hf_config.get("layer_norm_eps", 1e-5),
            layer_norm=True, qkv_bias=bool(hf_config.get("use_qkv_bias", False)), o_bias=False,
            parallel_residual=bool(hf_config.get("use_parallel_residual", False)))
