"""OLMo 2 (`Olmo2ForCausalLM`: OLMo-2-0425-1B, OLMo-2-1124-7B/13B, OLMo-2-0325-32B): the Llama
decoder with OLMo 2's norms (llama.DecoderConfig): no norm before the attention or the MLP, each
one's output normed before its residual add (HF's post_attention_layernorm,
post_feedforward_layernorm), and q and k each RMS-normed across all their heads at once, before
RoPE. Its norms scale in float32 and round once, as transformers' Olmo2RMSNorm does."""

from __future__ import annotations

from llmserve.models.llama import DecoderConfig, LlamaForCausalLM
from llmserve.models.registry import register


@register("Olmo2ForCausalLM")
class Olmo2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def parse_config(cls, hf_config: dict) -> DecoderConfig:
        act = hf_config.get("hidden_act") or "silu"
        if act != "silu":
            raise ValueError(f"OLMo 2's hidden_act {act!r} is not supported (silu)")
        return DecoderConfig.from_hf(hf_config, qk_norm=True, qk_norm_across_heads=True, pre_norms=False,
                                     sandwich_norms=True, fp32_norms=True)
