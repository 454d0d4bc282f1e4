"""Model registry: families register themselves by HF `architectures[0]`; `build_model` looks
them up. There is no central dispatch table: adding a family means adding one module that uses
`@register(...)` and importing it from `llmserve.models`.

A family whose config.json names its shape otherwise than Llama's (GPT-2's `n_embd`, `n_layer`,
...) registers `llama_keys`: a function giving the Llama-named keys its config means
(`hidden_size`, `num_hidden_layers`, `num_attention_heads`, `num_key_value_heads`,
`intermediate_size`, `max_position_embeddings`, ...). `normalize_config` adds them before
anything reads the config (engine/build.py, `build_model`), so the engine's sizing and
the shared decoder read one vocabulary.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch

_REGISTRY: dict[str, type] = {}
LlamaKeys = Callable[[dict], dict]
_LLAMA_KEYS: dict[str, LlamaKeys] = {}


class CausalLM(Protocol):
    """What the runner needs from a model."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    # Few-token CPU steps read GGUF-quantized blocks (the Rust GEMV) for some linears.
    quantized: bool

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn,
                kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """input_ids/positions [T] int64 -> final-normed hidden [T, H]."""

    def compute_logits(self, hidden: torch.Tensor, sampling: bool = False) -> torch.Tensor:
        """hidden [R, H] -> float32 logits [R, V]; `sampling`: rows that sample tokens (not
        prompt logprobs), which a model may compute as its decode steps do."""


def register(*architectures: str, llama_keys: LlamaKeys | None = None) -> Callable[[type], type]:
    """Class decorator: the model class for `architectures`; `llama_keys(hf_config)` (optional)
    -> the Llama-named keys that config means (`normalize_config`)."""
    def deco(cls: type) -> type:
        for arch in architectures:
            if arch in _REGISTRY and _REGISTRY[arch] is not cls:
                raise ValueError(f"architecture {arch!r} registered twice")
            _REGISTRY[arch] = cls
            if llama_keys is not None:
                _LLAMA_KEYS[arch] = llama_keys
        return cls
    return deco


def normalize_config(hf_config: dict) -> dict:
    """`hf_config` with the Llama-named keys its family's `llama_keys` gives (they win over
    keys of those names already there); the same dict when the family registered none. A
    normalized config normalizes to itself, so applying it twice is harmless."""
    _import_families()
    archs = hf_config.get("architectures") or []
    keys = _LLAMA_KEYS.get(archs[0]) if archs else None
    return hf_config if keys is None else {**hf_config, **keys(hf_config)}


def supported_architectures() -> list[str]:
    _import_families()
    return sorted(_REGISTRY)


def _import_families() -> None:
    # Importing the package imports every family module, which registers it.
    import llmserve.models  # noqa: F401


def build_model(hf_config: dict, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                device: torch.device | str, *, quantized: dict | None = None,
                serving: bool = False, gguf: bool = False) -> CausalLM:
    """Build the model for `hf_config["architectures"][0]` and load HF-named `weights`
    (`hf_config` normalized first: `normalize_config`).

    `quantized`: a GGUF checkpoint's Q8_0/Q4_0/Q4_1 blocks by HF name (`Checkpoint.quantized`:
    the file's, or converted from its K-quant/Q5 blocks); few-token float32 CPU steps then read
    them instead of fp32.
    `serving`: the model is for a ModelRunner and takes the tensors over: `weights` and
    `quantized` are emptied as it loads (LlamaForCausalLM.from_hf says what else it drops).
    `gguf`: the weights are a GGUF file's (from_hf: bf16 copies of linears without blocks)."""
    _import_families()
    archs = hf_config.get("architectures") or []
    if not archs:
        raise ValueError("config.json has no `architectures`; cannot pick a model family")
    cls = _REGISTRY.get(archs[0])
    if cls is None:
        raise ValueError(f"unsupported architecture {archs[0]!r}; supported: {sorted(_REGISTRY)}")
    return cls.from_hf(normalize_config(hf_config), weights, dtype, torch.device(device), quantized=quantized,
                       serving=serving, gguf=gguf)
