"""Gemma 3, text only (`Gemma3ForCausalLM`: gemma-3-270m, gemma-3-1b): the Llama decoder with
Gemma's switches (llama.DecoderConfig):

- norms scale by 1 + w (the checkpoint holds w; 1 is added at load, and 1 + w stays float32:
  the normed activations are scaled in float32 and rounded once, as transformers does), and each
  layer norms its attention's and its MLP's outputs before the residual adds ("sandwich"
  norms: post_attention_layernorm, pre_/post_feedforward_layernorm);
- per-head RMSNorm of q and k before RoPE (as Qwen3), q . k scaled by
  query_pre_attn_scalar^-0.5;
- the embeddings are multiplied by sqrt(hidden_size), rounded to the model's dtype, and the LM
  head is tied to them;
- a GeGLU MLP (gelu_pytorch_tanh);
- sliding-window attention in the layers `layer_types` marks `sliding_attention` (by default
  five of every six, `sliding_window_pattern`), rotated with their own RoPE base
  (`rope_local_base_freq`, 10000); the full-attention layers use `rope_theta` (1e6) and its
  scaling.

Gemma 2's soft-capping (gemma.py) is read too where a config sets it (Gemma 3's leave it
null). Not served: bidirectional attention (EmbeddingGemma). The sliding windows are attended
through at any length on the torch and CPU paths, which serve Gemma's head_dim of 256 on CUDA
too (our CUDA kernels take 64 and 128).

The configs of gemma-3-4b and up scale the full-attention layers' RoPE linearly (factor 8);
`max_position_embeddings` already counts those positions, so the engine does not stretch them
again (positions_count_rope_scaling), as vLLM reads them.
"""

from __future__ import annotations

from llmserve.models.gemma import gemma_activation
from llmserve.models.llama import DecoderConfig, LlamaForCausalLM, layer_type_rope, layer_types, layer_windows
from llmserve.models.registry import register


@register("Gemma3ForCausalLM")
class Gemma3ForCausalLM(LlamaForCausalLM):
    positions_count_rope_scaling = True   # (module doc)

    @classmethod
    def parse_config(cls, hf_config: dict) -> DecoderConfig:
        if hf_config.get("use_bidirectional_attention"):
            raise ValueError("bidirectional attention (EmbeddingGemma) is not supported")
        act = gemma_activation(hf_config.get("hidden_activation") or hf_config.get("hidden_act"), False)
        types = layer_types(hf_config, 6)
        full = layer_type_rope(hf_config, "full_attention", hf_config.get("rope_theta") or 1e6,
                               hf_config.get("rope_scaling"))
        local = layer_type_rope(hf_config, "sliding_attention", hf_config.get("rope_local_base_freq") or 1e4, None)
        return DecoderConfig.from_hf(
            {**hf_config, "tie_word_embeddings": hf_config.get("tie_word_embeddings", True)},
            rope_theta=full[0], rope_scaling=full[1], qk_norm=True, norm_offset=1.0, sandwich_norms=True,
            embed_scale=hf_config["hidden_size"] ** 0.5, hidden_act=act,
            attn_scale=float(hf_config.get("query_pre_attn_scalar") or 256) ** -0.5,
            layer_windows=layer_windows(hf_config, types),
            attn_softcap=float(hf_config.get("attn_logit_softcapping") or 0.0),
            final_softcap=float(hf_config.get("final_logit_softcapping") or 0.0),
            local_rope=local, local_layers=frozenset(i for i, t in enumerate(types) if t == "sliding_attention"))
