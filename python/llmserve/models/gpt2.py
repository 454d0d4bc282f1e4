"""GPT-2 (`GPT2LMHeadModel`: gpt2 to gpt2-xl, distilgpt2, and models trained with its code): the
Llama decoder with a learned embedding of each position added to the token's instead of RoPE
(llama.DecoderConfig's `learned_positions`), LayerNorms that have a bias, biases on every
linear, an ungated GELU MLP (`activation_function`, the tanh approximation `gelu_new` in the
released models) and the LM head tied to the token embeddings.

Its config names its shape `n_embd`, `n_layer`, `n_head`, `n_inner` and `n_positions`:
`llama_keys` gives the engine and the shared decoder the Llama names (registry.normalize_config).
A model has `n_positions` learned positions and none past them, so it is served up to that
length and a longer --max-model-len is refused (engine/build.py).

Its checkpoints store the linears as Conv1D weights ([in, out], transposed at load) with
q|k|v fused in `c_attn` (already q|k|v rows once transposed), under `transformer.` (older
files: no prefix). The per-layer score scale of some GPT-2-code models
(`scale_attn_by_inverse_layer_idx`) is refused; `reorder_and_upcast_attn`, which asks only
that attention compute in float32, is what our attention does already (and transformers'
default SDPA path ignores it)."""

from __future__ import annotations

import torch

from llmserve.models.llama import DecoderConfig, LlamaForCausalLM, renamed_weights
from llmserve.models.registry import register

# The checkpoint's names (its `transformer.` prefix removed) -> the shared decoder's: the
# leading part, then the parts within a layer.
TOP = (("wte.", "model.embed_tokens."), ("wpe.", "model.embed_positions."), ("ln_f.", "model.norm."),
       ("h.", "model.layers."))
LAYER = ((".ln_1.", ".input_layernorm."), (".ln_2.", ".post_attention_layernorm."),
         (".attn.c_attn.", ".self_attn.qkv_proj."), (".attn.c_proj.", ".self_attn.o_proj."))
# Conv1D weights, stored [in, out]: transposed into a linear's [out, in].
CONV1D = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")
# Causal-mask buffers older checkpoints saved in each layer: nothing to load.
BUFFERS = (".attn.bias", ".attn.masked_bias")
# activation_function -> the shared MLP's (the tanh approximations: the same function, to rounding).
ACTIVATIONS = {"gelu_new": "gelu_pytorch_tanh", "gelu_pytorch_tanh": "gelu_pytorch_tanh",
               "gelu_fast": "gelu_pytorch_tanh", "gelu": "gelu"}


def llama_keys(cfg: dict) -> dict:
    """The Llama-named keys a GPT-2 config means (registry.normalize_config)."""
    h, heads = cfg["n_embd"], cfg["n_head"]
    return {"hidden_size": h, "num_hidden_layers": cfg["n_layer"], "num_attention_heads": heads,
            "num_key_value_heads": heads, "intermediate_size": cfg.get("n_inner") or 4 * h,
            "max_position_embeddings": cfg["n_positions"]}


def _renamed(name: str) -> str:
    name = name.removeprefix("transformer.")
    for theirs, ours in TOP:
        if name.startswith(theirs):
            name = ours + name[len(theirs):]
            break
    for theirs, ours in LAYER:
        name = name.replace(theirs, ours)
    return name


@register("GPT2LMHeadModel", llama_keys=llama_keys)
class GPT2LMHeadModel(LlamaForCausalLM):
    @classmethod
    def parse_config(cls, hf_config: dict) -> DecoderConfig:
        act = hf_config.get("activation_function") or "gelu_new"
        if act not in ACTIVATIONS:
            raise ValueError(f"GPT-2's activation_function {act!r} is not supported ({', '.join(ACTIVATIONS)})")
        if hf_config.get("scale_attn_by_inverse_layer_idx"):
            raise ValueError("GPT-2's scores scaled by each layer's inverse index (scale_attn_by_inverse_layer_idx) "
                             "are not supported")
        if hf_config.get("add_cross_attention"):
            raise ValueError("GPT-2 with cross-attention (add_cross_attention) is not supported")
        scaled = hf_config.get("scale_attn_weights", True)
        # (transformers' default ties the head, and the hub configs rely on it)
        return DecoderConfig.from_hf(
            {**hf_config, "tie_word_embeddings": hf_config.get("tie_word_embeddings", True)},
            rms_norm_eps=hf_config.get("layer_norm_epsilon", 1e-5), qkv_bias=True, o_bias=True,
            layer_norm=True, plain_mlp=True, hidden_act=ACTIVATIONS[act], learned_positions=True,
            nope_layers=frozenset(range(hf_config["num_hidden_layers"])), attn_scale=None if scaled else 1.0)

    @classmethod
    def from_hf(cls, hf_config: dict, weights: dict[str, torch.Tensor], *args, **kwargs):
        def transposed(name: str, t: torch.Tensor) -> torch.Tensor:
            return t.t() if name.endswith(CONV1D) else t

        weights = renamed_weights(weights, kwargs.get("serving", False), _renamed, transposed, BUFFERS)
        return super().from_hf(hf_config, weights, *args, **kwargs)
