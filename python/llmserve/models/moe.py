"""Mixture-of-experts families: the Llama decoder with sparse MoE MLPs (llama.MoEConfig,
layers.MoEMLP), served from HF folders (and Mixtral, Qwen2-MoE and Qwen3-MoE from GGUF files too:
loaders/gguf_file.py maps llama.cpp's stacked experts to transformers 5's names).

- `MixtralForCausalLM` (Mixtral-8x7B/8x22B): every layer's MLP is 8 experts, 2 per token, the
  top probabilities renormalized; Mistral's sliding window when the config sets one. Its
  checkpoints name the block `block_sparse_moe` and the experts' projections w1 (gate), w3
  (up) and w2 (down).
- `Qwen3MoeForCausalLM` (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-30B-A3B): Qwen3's
  attention (per-head q/k norms), 128 experts, 8 per token; `norm_topk_prob` as the config
  says; `mlp_only_layers` and `decoder_sparse_step` give dense layers.
- `Qwen2MoeForCausalLM` (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (q/k/v bias),
  and a shared expert every token takes, weighted by the sigmoid of its own gate.
- `OlmoeForCausalLM` (OLMoE-1B-7B): q and k RMS-normed across all their heads, 64 experts,
  8 per token.
- `GraniteMoeForCausalLM` (granite-3.x-1b-a400m, -3b-a800m): Granite's multipliers
  (granite.py), experts stacked in the checkpoint (`input_linear`, `output_linear`), each
  token's weights a softmax over its top k router scores.

On CUDA their steps run eagerly, with our attention kernels but no CUDA graphs
(worker/cuda_graphs.py: the routing decides on the host which experts run)."""

from __future__ import annotations

from dataclasses import replace

from llmserve.models.granite import GraniteForCausalLM
from llmserve.models.llama import DecoderConfig, LlamaForCausalLM, MoEConfig, require_silu
from llmserve.models.registry import register


def _num_experts(hf_config: dict) -> int:
    # (hub configs say num_experts, or Mixtral's num_local_experts; transformers 5 reads both)
    n = hf_config.get("num_experts") or hf_config.get("num_local_experts")
    if not n:
        raise ValueError("the config gives no num_experts")
    return int(n)


def _qwen_moe(hf_config: dict, family: str) -> MoEConfig:
    """Qwen2-MoE's and Qwen3-MoE's experts. The layers with a dense MLP are those in
    `mlp_only_layers`, and with `decoder_sparse_step` s every layer i where (i + 1) is not a
    multiple of s (transformers' reading)."""
    require_silu(hf_config, family)
    if hf_config.get("use_sliding_window"):
        raise ValueError(f"{family} sliding-window attention is not supported")
    step = hf_config.get("decoder_sparse_step") or 1
    only = set(hf_config.get("mlp_only_layers") or ())
    dense = frozenset(i for i in range(hf_config["num_hidden_layers"]) if i in only or (i + 1) % step)
    return MoEConfig(num_experts=_num_experts(hf_config), top_k=hf_config["num_experts_per_tok"],
                     intermediate_size=hf_config["moe_intermediate_size"],
                     norm_topk_prob=bool(hf_config.get("norm_topk_prob", False)),
                     shared_intermediate_size=hf_config.get("shared_expert_intermediate_size") or 0,
                     dense_layers=dense)


@register("MixtralForCausalLM")
class MixtralForCausalLM(LlamaForCausalLM):
    @classmethod
    def parse_config(cls, hf_config: dict) -> DecoderConfig:
        require_silu(hf_config, "Mixtral")
        moe = MoEConfig(num_experts=_num_experts(hf_config), top_k=hf_config.get("num_experts_per_tok", 2),
                        intermediate_size=hf_config["intermediate_size"], norm_topk_prob=True,
                        prefix="block_sparse_moe", expert_names=("w1", "w3", "w2"))
        return replace(super().parse_config(hf_config), moe=moe)


@register("Qwen3MoeForCausalLM")
class Qwen3MoeForCausalLM(LlamaForCausalLM):
    @classmethod
    def parse_config(cls, hf_config: dict) -> DecoderConfig:
        return DecoderConfig.from_hf(hf_config, qk_norm=True, moe=_qwen_moe(hf_config, "Qwen3-MoE"))


@register("Qwen2MoeForCausalLM")
class Qwen2MoeForCausalLM(LlamaForCausalLM):
    @classmethod
    def parse_config(cls, hf_config: dict) -> DecoderConfig:
        # (q/k/v have biases, as in every released model; transformers 5 names it `qkv_bias`)
        return DecoderConfig.from_hf(hf_config, qkv_bias=bool(hf_config.get("qkv_bias", True)), o_bias=False,
                                     moe=_qwen_moe(hf_config, "Qwen2-MoE"))


@register("OlmoeForCausalLM")
class OlmoeForCausalLM(LlamaForCausalLM):
    @classmethod
    def parse_config(cls, hf_config: dict) -> DecoderConfig:
        require_silu(hf_config, "OLMoE")
        if hf_config.get("clip_qkv") is not None:
            raise ValueError("OLMoE's clip_qkv is not supported")
        moe = MoEConfig(num_experts=_num_experts(hf_config), top_k=hf_config["num_experts_per_tok"],
                        intermediate_size=hf_config["intermediate_size"],
                        norm_topk_prob=bool(hf_config.get("norm_topk_prob", False)))
        return DecoderConfig.from_hf(hf_config, qk_norm=True, qk_norm_across_heads=True, moe=moe)


@register("GraniteMoeForCausalLM")
class GraniteMoeForCausalLM(GraniteForCausalLM):
    @classmethod
    def parse_config(cls, hf_config: dict) -> DecoderConfig:
        require_silu(hf_config, "GraniteMoE")
        moe = MoEConfig(num_experts=_num_experts(hf_config), top_k=hf_config["num_experts_per_tok"],
                        intermediate_size=hf_config["intermediate_size"], norm_topk_prob=True, softmax_topk=True,
                        prefix="block_sparse_moe")
        return replace(super().parse_config(hf_config), moe=moe)
