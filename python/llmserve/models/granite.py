"""IBM Granite 3 dense models (`GraniteForCausalLM`): the Llama decoder with four multipliers
from its config (llama.DecoderConfig): `embedding_multiplier` on the embeddings,
`attention_multiplier` as the q . k scale (in place of head_dim^-0.5), `residual_multiplier`
on each attention and MLP output before its residual add, and the logits divided by
`logits_scaling`."""

from __future__ import annotations

from llmserve.models.llama import DecoderConfig, LlamaForCausalLM
from llmserve.models.registry import register


@register("GraniteForCausalLM")
class GraniteForCausalLM(LlamaForCausalLM):
    @classmethod
    def parse_config(cls, hf_config: dict) -> DecoderConfig:
        c = super().parse_config(hf_config)
        return DecoderConfig(**{
            **c.__dict__,
            "embed_scale": float(hf_config.get("embedding_multiplier", 1.0)),
            "attn_scale": float(hf_config.get("attention_multiplier", c.head_dim ** -0.5)),
            "residual_scale": float(hf_config.get("residual_multiplier", 1.0)),
            "logits_scale": float(hf_config.get("logits_scaling", 1.0)),
        })
