"""Phi-1.5 and Phi-2 (`PhiForCausalLM`): the decoder with LayerNorms that have a bias, the
attention and an ungated GELU MLP both reading the layer's one normed input (a parallel
residual), RoPE on the leading part of each head (`partial_rotary_factor`, 0.4 in phi-2),
biases on every linear and on the LM head. Its checkpoints name the output projection
`dense`, the MLP `fc1`/`fc2` and the final norm `final_layernorm`: they are read under the
names the shared decoder takes (StarCoder2's `c_fc`/`c_proj` for the MLP). The per-head q/k
LayerNorms some configs switch on (`qk_layernorm`) are refused. Phi-3 and up are phi3.py."""

from __future__ import annotations

from typing import MutableMapping

import torch

from llmserve.models.llama import DecoderConfig, LlamaForCausalLM, renamed_weights
from llmserve.models.registry import register

# The checkpoint's names -> the shared decoder's.
RENAMES = ((".self_attn.dense.", ".self_attn.o_proj."), (".mlp.fc1.", ".mlp.c_fc."), (".mlp.fc2.", ".mlp.c_proj."),
           ("model.final_layernorm.", "model.norm."))


def _renamed(name: str) -> str:
    for theirs, ours in RENAMES:
        name = name.replace(theirs, ours)
    return name


@register("PhiForCausalLM")
class PhiForCausalLM(LlamaForCausalLM):
    @classmethod
    def parse_config(cls, hf_config: dict) -> DecoderConfig:
        act = hf_config.get("hidden_act") or "gelu_new"
        if act not in ("gelu_new", "gelu_pytorch_tanh"):   # (the same function)
            raise ValueError(f"Phi's hidden_act {act!r} is not supported (gelu_new)")
        if hf_config.get("qk_layernorm"):
            raise ValueError("Phi's q/k LayerNorms (qk_layernorm) are not supported")
        return DecoderConfig.from_hf(
            hf_config, partial_rotary_default=0.5, rms_norm_eps=hf_config.get("layer_norm_eps", 1e-5),
            qkv_bias=True, o_bias=True, layer_norm=True, plain_mlp=True, hidden_act="gelu_pytorch_tanh",
            parallel_residual=True, lm_head_bias=True)

    @classmethod
    def from_hf(cls, hf_config: dict, weights: MutableMapping[str, torch.Tensor], *args, **kwargs):
        weights = renamed_weights(weights, kwargs.get("serving", False), _renamed)
        return super().from_hf(hf_config, weights, *args, **kwargs)
