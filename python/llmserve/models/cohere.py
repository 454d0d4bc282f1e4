"""Cohere's Command models.

`CohereForCausalLM` (Command R 35B, Aya Expanse 8B/32B, Aya 23): the Llama decoder with
LayerNorms that have no bias and compute in float32, one norm per layer whose output both the
attention and the MLP read (a parallel residual), RoPE over adjacent pairs of each head's dims
(q and k rows reordered at load: llama.rope_rows) and the logits multiplied by `logit_scale`
(llama.DecoderConfig's `layer_norm_bias`, `fp32_norms`, `parallel_residual`,
`interleaved_rope`). The per-head q/k LayerNorms of Command R+ (`use_qk_norm`) are refused.

`Cohere2ForCausalLM` (Command R7B, Command A): Cohere's layers, three of every four with a
sliding window and RoPE, the fourth attending fully with no position encoding at all."""

from __future__ import annotations

from dataclasses import replace

from llmserve.models.llama import DecoderConfig, LlamaForCausalLM, layer_types, layer_windows, require_silu
from llmserve.models.registry import register


@register("CohereForCausalLM")
class CohereForCausalLM(LlamaForCausalLM):
    @classmethod
    def parse_config(cls, hf_config: dict) -> DecoderConfig:
        require_silu(hf_config, "Cohere")
        if hf_config.get("use_qk_norm"):
            raise ValueError("Cohere's per-head q/k norms (use_qk_norm, Command R+) are not supported")
        scale = float(hf_config.get("logit_scale") or 1.0)
        # (transformers' default ties the head, and the hub configs rely on it)
        return DecoderConfig.from_hf(
            {**hf_config, "tie_word_embeddings": hf_config.get("tie_word_embeddings", True)},
            rms_norm_eps=hf_config.get("layer_norm_eps", 1e-5), layer_norm=True, layer_norm_bias=False,
            fp32_norms=True, parallel_residual=True, interleaved_rope=True, logits_scale=1.0 / scale)


@register("Cohere2ForCausalLM")
class Cohere2ForCausalLM(CohereForCausalLM):
    @classmethod
    def parse_config(cls, hf_config: dict) -> DecoderConfig:
        types = layer_types(hf_config, 4)
        full = frozenset(i for i, t in enumerate(types) if t == "full_attention")
        return replace(super().parse_config(hf_config), layer_windows=layer_windows(hf_config, types),
                       nope_layers=full)
