"""StarCoder2 (`Starcoder2ForCausalLM`: starcoder2-3b, -7b, -15b and their instruct tunes): the
Llama decoder with LayerNorms that have a bias, an ungated GELU MLP with biases (c_fc, c_proj),
biases on q/k/v and o (`use_bias`), and Mistral's sliding window when the config sets one
(llama.DecoderConfig's `layer_norm`, `plain_mlp`). Its vocabulary has StarCoder's FIM tokens,
so completions' `suffix` is served (rust/router/src/fim.rs)."""

from __future__ import annotations

from llmserve.models.llama import DecoderConfig, LlamaForCausalLM
from llmserve.models.registry import register


@register("Starcoder2ForCausalLM")
class Starcoder2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def parse_config(cls, hf_config: dict) -> DecoderConfig:
        act = hf_config.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_new"):   # (the same function)
            raise ValueError(f"StarCoder2's hidden_act {act!r} is not supported (gelu_pytorch_tanh)")
        bias = bool(hf_config.get("use_bias", True))
        if not bias:
            raise ValueError("StarCoder2 without biases (use_bias: false) is not supported")
        window = hf_config.get("sliding_window")
        windows = (int(window),) * hf_config["num_hidden_layers"] if window else ()
        return DecoderConfig.from_hf(hf_config, rms_norm_eps=hf_config.get("norm_epsilon", 1e-5), qkv_bias=True,
                                     o_bias=True, layer_norm=True, plain_mlp=True,
                                     hidden_act="gelu_pytorch_tanh", layer_windows=windows)
