"""GPT-NeoX (`GPTNeoXForCausalLM`: the Pythia suite, GPT-NeoX-20B, and models trained with its
code): the Llama decoder with LayerNorms that have a bias, RoPE on the leading `rotary_pct` of
each head (a quarter by default), biases on the attention's linears (`attention_bias`), an
ungated GELU MLP with biases (exact GELU in Pythia, the tanh approximation in 20B's
`gelu_fast`), an untied LM head (`embed_out`), and with `use_parallel_residual` (the default)
the attention and the MLP each reading their own norm of the layer's input, both added to it
(llama.DecoderConfig's `parallel_mlp_norm`).

Its config names RoPE's base and part `rotary_emb_base` and `rotary_pct` (transformers 5 moves
them into `rope_parameters`); its fused `query_key_value` holds each head's q, k and v rows
together ([heads, 3, head_dim] rows), which are regrouped at load into the q|k|v the shared
decoder's `qkv_proj` takes. No grouped-query attention: as many K/V heads as heads."""

from __future__ import annotations

import torch

from llmserve.models.llama import DecoderConfig, LlamaForCausalLM, renamed_weights
from llmserve.models.registry import register

# The checkpoint's names -> the shared decoder's (StarCoder2's `c_fc`/`c_proj` for the MLP).
RENAMES = (("gpt_neox.embed_in.", "model.embed_tokens."), ("gpt_neox.final_layer_norm.", "model.norm."),
           ("gpt_neox.layers.", "model.layers."), ("embed_out.", "lm_head."),
           (".attention.query_key_value.", ".self_attn.qkv_proj."), (".attention.dense.", ".self_attn.o_proj."),
           (".mlp.dense_h_to_4h.", ".mlp.c_fc."), (".mlp.dense_4h_to_h.", ".mlp.c_proj."))
# Causal-mask buffers older checkpoints saved in each layer: nothing to load.
BUFFERS = (".attention.bias", ".attention.masked_bias")
# hidden_act -> the shared MLP's (the tanh approximations: the same function, to rounding).
ACTIVATIONS = {"gelu": "gelu", "gelu_fast": "gelu_pytorch_tanh", "gelu_new": "gelu_pytorch_tanh",
               "gelu_pytorch_tanh": "gelu_pytorch_tanh"}


def llama_keys(cfg: dict) -> dict:
    """The Llama-named keys a GPT-NeoX config means (registry.normalize_config)."""
    keys = {"num_key_value_heads": cfg["num_attention_heads"]}
    if cfg.get("rotary_emb_base") is not None:
        keys["rope_theta"] = cfg["rotary_emb_base"]
    if cfg.get("rotary_pct") is not None:
        keys["partial_rotary_factor"] = cfg["rotary_pct"]
    return keys


def _qkv_rows(t: torch.Tensor, heads: int) -> torch.Tensor:
    """query_key_value's weight [heads * 3 * d, H] (or bias) -> q|k|v rows [3 * heads * d, H]."""
    return t.reshape(heads, 3, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def _renamed(name: str) -> str:
    for theirs, ours in RENAMES:
        name = name.replace(theirs, ours)
    return name


@register("GPTNeoXForCausalLM", llama_keys=llama_keys)
class GPTNeoXForCausalLM(LlamaForCausalLM):
    @classmethod
    def parse_config(cls, hf_config: dict) -> DecoderConfig:
        act = hf_config.get("hidden_act") or "gelu"
        if act not in ACTIVATIONS:
            raise ValueError(f"GPT-NeoX's hidden_act {act!r} is not supported ({', '.join(ACTIVATIONS)})")
        bias = bool(hf_config.get("attention_bias", True))
        return DecoderConfig.from_hf(
            hf_config, partial_rotary_default=0.25, rms_norm_eps=hf_config.get("layer_norm_eps", 1e-5),
            qkv_bias=bias, o_bias=bias, layer_norm=True, plain_mlp=True, hidden_act=ACTIVATIONS[act],
            parallel_residual=bool(hf_config.get("use_parallel_residual", True)), parallel_mlp_norm=True)

    @classmethod
    def from_hf(cls, hf_config: dict, weights: dict[str, torch.Tensor], *args, **kwargs):
        heads = hf_config["num_attention_heads"]

        def regrouped(name: str, t: torch.Tensor) -> torch.Tensor:
            return _qkv_rows(t, heads) if ".query_key_value." in name else t

        weights = renamed_weights(weights, kwargs.get("serving", False), _renamed, regrouped, BUFFERS)
        return super().from_hf(hf_config, weights, *args, **kwargs)
