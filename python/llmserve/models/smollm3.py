"""SmolLM3: the Llama decoder without RoPE in some layers ("NoPE"): `no_rope_layers` holds one
flag per layer, 1 where q and k are rotated, 0 where they are not; without it, every
`no_rope_layer_interval`-th layer (default 4: layers 3, 7, ...) has none. No sliding window."""

from __future__ import annotations

from llmserve.models.llama import DecoderConfig, LlamaForCausalLM
from llmserve.models.registry import register


def nope_layers(hf_config: dict) -> frozenset[int]:
    """The indexes of the layers without RoPE, as transformers' SmolLM3Config reads them."""
    n = hf_config["num_hidden_layers"]
    flags = hf_config.get("no_rope_layers")
    if flags is None:
        interval = hf_config.get("no_rope_layer_interval") or 4
        return frozenset(i for i in range(n) if (i + 1) % interval == 0)
    if len(flags) != n:
        raise ValueError(f"no_rope_layers has {len(flags)} entries for {n} layers")
    return frozenset(i for i, rotated in enumerate(flags) if not rotated)


@register("SmolLM3ForCausalLM")
class SmolLM3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def parse_config(cls, hf_config: dict) -> DecoderConfig:
        if hf_config.get("use_sliding_window"):
            raise ValueError("SmolLM3 sliding-window attention is not supported")
        return DecoderConfig.from_hf(hf_config, nope_layers=nope_layers(hf_config))
