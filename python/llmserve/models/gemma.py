"""Gemma (1) and Gemma 2: the Llama decoder with Gemma's switches (llama.DecoderConfig).

`GemmaForCausalLM` (gemma-2b, gemma-7b, gemma-1.1, CodeGemma), the switches Gemma 2 and 3 kept:

- norms scale by 1 + w in float32 (the checkpoint holds w; see gemma3.py);
- the embeddings are multiplied by sqrt(hidden_size), rounded to the model's dtype, and the LM
  head is tied to them;
- a GeGLU MLP with the tanh approximation of GELU: the first releases' configs say
  `hidden_act: "gelu"`, which meant the approximation (transformers and vLLM read it so);
- q . k scaled by head_dim^-0.5, full attention in every layer, one RoPE.

`Gemma2ForCausalLM` (gemma-2-2b, -9b, -27b) adds:
- "sandwich" norms (each sublayer's output normed before its residual add, as Gemma 3);
- q . k scaled by query_pre_attn_scalar^-0.5;
- sliding-window attention (4096) in every other layer, from the first (`layer_types`), one
  RoPE for all layers;
- soft-capping: each scaled attention score s becomes 50 tanh(s / 50) and each logit
  30 tanh(x / 30) (`attn_logit_softcapping`, `final_logit_softcapping`; null: none). The CPU
  kernel and the torch path cap the scores; our CUDA kernels do not, so the torch path serves a
  capped model there, as it serves head_dim 256 (our kernels take 64 and 128).
"""

from __future__ import annotations

from dataclasses import replace

from llmserve.models.llama import DecoderConfig, LlamaForCausalLM, layer_types, layer_windows
from llmserve.models.registry import register

GEGLU = "gelu_pytorch_tanh"


def gemma_activation(act: str | None, legacy_gelu: bool) -> str:
    """The MLP's activation, GEGLU's unless the config names another (which is refused); with
    `legacy_gelu`, "gelu" names it too (Gemma 1's configs)."""
    act = act or GEGLU
    if act != GEGLU and not (legacy_gelu and act == "gelu"):
        raise ValueError(f"Gemma's hidden activation {act!r} is not supported ({GEGLU})")
    return GEGLU


@register("GemmaForCausalLM")
class GemmaForCausalLM(LlamaForCausalLM):
    @classmethod
    def activation(cls, hf_config: dict) -> str:
        # (transformers 4 read `hidden_activation` first, 5 reads `hidden_act`: Gemma 1.1's
        # configs hold both, the one GEGLU and the other the legacy "gelu")
        return gemma_activation(hf_config.get("hidden_activation") or hf_config.get("hidden_act"), True)

    @classmethod
    def parse_config(cls, hf_config: dict) -> DecoderConfig:
        if hf_config.get("use_bidirectional_attention"):
            raise ValueError("bidirectional attention is not supported")
        return DecoderConfig.from_hf(
            {**hf_config, "tie_word_embeddings": hf_config.get("tie_word_embeddings", True)},
            norm_offset=1.0, embed_scale=hf_config["hidden_size"] ** 0.5, hidden_act=cls.activation(hf_config))


@register("Gemma2ForCausalLM")
class Gemma2ForCausalLM(GemmaForCausalLM):
    @classmethod
    def activation(cls, hf_config: dict) -> str:
        return gemma_activation(hf_config.get("hidden_activation"), False)   # (as transformers)

    @classmethod
    def parse_config(cls, hf_config: dict) -> DecoderConfig:
        return replace(
            super().parse_config(hf_config), sandwich_norms=True,
            attn_scale=float(hf_config.get("query_pre_attn_scalar") or 256) ** -0.5,
            layer_windows=layer_windows(hf_config, layer_types(hf_config, 2)),
            attn_softcap=float(hf_config.get("attn_logit_softcapping") or 0.0),
            final_softcap=float(hf_config.get("final_logit_softcapping") or 0.0))
