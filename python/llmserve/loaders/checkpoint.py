"""The Checkpoint a loader hands to the rest of llmserve, and the one error loaders raise.

A Checkpoint is everything the server needs from a model on disk, already read: the HF
config (for GGUF files, an equivalent one built from the metadata), the weights under Hugging
Face parameter names, where the tokenizer comes from (a tokenizer.json path or the GGUF
vocabulary), the chat template sources (resolution happens in the Rust router), the special
tokens and generation_config.json. Nothing downstream opens model files again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from llmserve import _core


class LoadError(Exception):
    """A model could not be loaded; the message says what is wrong and what to do about it."""


# ggml block formats llmserve's quantized GEMV reads (rust/kernels/src/quant/): type id ->
# (name, bytes per block of 32 weights), as the gguf package lists them.
QUANT_FORMATS: dict[int, tuple[str, int]] = {
    int(t): (t.name, GGML_QUANT_SIZES[t][1]) for t in (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1,
                                                       GGMLQuantizationType.Q8_0)}


@dataclass(frozen=True)
class QuantTensor:
    """A linear weight kept in its GGUF block format, next to its dequantized copy.

    `data` holds the raw blocks row by row (uint8 [rows, cols / 32 * block bytes]); rows are
    independent in these formats, so row permutations and concatenations of fused weights
    apply to whole rows of bytes.
    """

    data: np.ndarray   # uint8 [rows, bytes per row], C-contiguous
    ggml_type: int     # key of QUANT_FORMATS
    rows: int          # torch's [out, in] shape of the weight
    cols: int

    def __post_init__(self) -> None:
        if self.ggml_type not in QUANT_FORMATS:
            raise ValueError(f"ggml type {self.ggml_type} is not one of {sorted(QUANT_FORMATS)}")
        row_bytes = self.cols // 32 * QUANT_FORMATS[self.ggml_type][1]
        if self.cols % 32 or self.data.dtype != np.uint8 or self.data.shape != (self.rows, row_bytes):
            raise ValueError(f"{QUANT_FORMATS[self.ggml_type][0]} [{self.rows}, {self.cols}] needs "
                             f"uint8 [{self.rows}, {row_bytes}], got {self.data.dtype} {self.data.shape}")

    @staticmethod
    def concat(parts: "list[QuantTensor]") -> "QuantTensor | None":
        """Rows of `parts` stacked (a fused weight); None when their formats or widths differ."""
        first = parts[0]
        if any(p.ggml_type != first.ggml_type or p.cols != first.cols for p in parts):
            return None
        data = np.ascontiguousarray(np.concatenate([p.data for p in parts], axis=0))
        return QuantTensor(data, first.ggml_type, sum(p.rows for p in parts), first.cols)

    def pack(self) -> "PackedQuant":
        """These blocks in the layout the quantized GEMV reads (`_core.quant_pack`)."""
        return PackedQuant(_core.quant_pack(self.data, self.ggml_type), self.ggml_type,
                           self.rows, self.cols)


@dataclass(frozen=True)
class PackedQuant:
    """A linear weight's GGUF blocks regrouped eight rows at a time, the layout of the
    quantized GEMV (rust/kernels/src/quant/pack.rs): the same bytes as the blocks (plus zero
    rows up to a multiple of 8), so a model holds one copy. Made once, when a model attaches
    its quantized weights (`QuantTensor.pack`); rows are no longer contiguous here, so fusing
    and permuting happen on QuantTensor first."""

    data: np.ndarray   # uint8 [ceil(rows / 8), cols / 32 * 8 * bytes per block]
    ggml_type: int
    rows: int
    cols: int


_V = TypeVar("_V")


class LazyTensor(Protocol):
    """A float32 tensor a loader can make on demand (a GGUF tensor, dequantized)."""

    shape: tuple[int, ...]

    def make(self) -> torch.Tensor:
        """The whole tensor, made anew."""

    def rows(self, index: np.ndarray) -> torch.Tensor:
        """Rows `index` of a matrix ([len(index), cols]), made without the others (a 3-D
        tensor's rows: those of the matrix its first two dims flatten into)."""


class _LazyMap(Mapping[str, _V]):
    """Names -> values made when read from their sources. Membership, `len` and iteration make
    nothing (Mapping's own `__contains__` and `==` would make every value); `pop(name)` makes
    the value and forgets the name, so a build that pops each one as it converts it holds one
    of them at a time."""

    def __init__(self, sources: dict) -> None:
        self._sources = dict(sources)

    def _make(self, source) -> _V:
        raise NotImplementedError

    def __getitem__(self, name: str) -> _V:
        return self._make(self._sources[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self._sources)

    def __len__(self) -> int:
        return len(self._sources)

    def __contains__(self, name: object) -> bool:
        return name in self._sources

    __eq__ = object.__eq__
    __hash__ = None  # type: ignore[assignment]

    def pop(self, name: str, *default):
        if name not in self._sources and default:
            return default[0]
        return self._make(self._sources.pop(name))


class LazyWeights(_LazyMap[torch.Tensor]):
    """HF-named weights made when read (a GGUF file's, dequantized on demand): `weights[name]`
    makes the tensor anew each time, and `pop` lets a build hold one at a time instead of the
    whole model in float32 beside the model's own copy. `shape` and `sample` read without
    making a tensor whole."""

    def __init__(self, sources: dict[str, LazyTensor]) -> None:
        super().__init__(sources)

    def _make(self, source: LazyTensor) -> torch.Tensor:
        return source.make()

    def copy(self) -> "LazyWeights":
        return LazyWeights(self._sources)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._sources[name].shape)

    def sample(self, name: str, index: np.ndarray) -> torch.Tensor:
        """The values at flat (row-major) positions `index`, made from the rows they lie in."""
        src = self._sources[name]
        if len(src.shape) < 2:
            return src.make().reshape(-1)[torch.from_numpy(index)]
        cols = src.shape[-1]
        rows, inverse = np.unique(index // cols, return_inverse=True)
        return src.rows(rows)[torch.from_numpy(inverse), torch.from_numpy(index % cols)]


class LazyBlocks(_LazyMap[QuantTensor]):
    """HF-named GGUF blocks (`Checkpoint.quantized`), each a QuantTensor or made when read: a
    GGUF file's converted ones (gguf_convert.py) are converted linear by linear as a model is
    built, not all at once at load."""

    def __init__(self, sources: "dict[str, QuantTensor | Callable[[], QuantTensor]]") -> None:
        super().__init__(sources)

    def _make(self, source) -> QuantTensor:
        return source if isinstance(source, QuantTensor) else source()


def weight_shape(weights: Mapping[str, torch.Tensor], name: str) -> tuple[int, ...]:
    """The shape of `weights[name]`, without making a lazy one."""
    return weights.shape(name) if isinstance(weights, LazyWeights) else tuple(weights[name].shape)


@dataclass(frozen=True)
class Checkpoint:
    name: str                          # default served model name
    hf_config: dict                    # config.json (GGUF: an equivalent HF config)
    # HF parameter names; GGUF: LazyWeights, dequantized to float32 when read, Q/K un-permuted
    weights: Mapping[str, torch.Tensor]
    tokenizer_json: str | None         # path of tokenizer.json (HF folders; any model with --tokenizer)
    gguf_vocab: dict | None            # GgufVocab (rust/router tokenizer.rs) as a dict (GGUF files);
                                       # the tokenizer unless tokenizer_json is set
    template_sources: dict             # TemplateSources (rust/router template/mod.rs) as a dict
    # Every special token a chat template sees by name (transformers' special_tokens_map, with
    # a model's own such as image_token): bos_token and eos_token, unk_token, pad_token, ...
    special_tokens: dict
    eos_token_ids: list[int]
    generation_config: dict = field(default_factory=dict)
    # GGUF linear weights in Q8_0/Q4_0/Q4_1 (as the file holds them, or converted from its
    # other block types: gguf_convert.py), by HF name, Q/K rows un-permuted like `weights`,
    # whose values are these blocks' values; read by the quantized GEMV of few-token steps.
    # A dict or a LazyBlocks (GGUF).
    quantized: Mapping[str, QuantTensor] = field(default_factory=dict)
    # The block conversions made for `quantized` ("Q4_K->Q4_1 x84", sorted); they change the
    # weights served, so the system fingerprint counts them (engine/build.py).
    conversions: tuple[str, ...] = ()
    # How the folder's sentence-transformers files (modules.json, 1_Pooling/config.json) say
    # its embeddings are made: {"pooling": "last" | "mean" | <another mode>, "normalize": bool,
    # "unsupported": why they cannot be served as said}; empty without those files.
    sentence_transformers: dict = field(default_factory=dict)

    def __repr__(self) -> str:
        # The default repr would print every tensor; this is what a log line wants.
        n_params = sum(int(np.prod(weight_shape(self.weights, n))) for n in self.weights)
        arch = (self.hf_config.get("architectures") or ["?"])[0]
        return (
            f"Checkpoint(name={self.name!r}, arch={arch}, tensors={len(self.weights)}, "
            f"params={n_params}, tokenizer={'gguf' if self.gguf_vocab else self.tokenizer_json!r})"
        )


def empty_template_sources() -> dict:
    """TemplateSources with every slot empty; loaders fill the slots their format has."""
    return {"cli": None, "folder_jinja": None, "folder_named": {}, "tokenizer_config": None,
            "tokenizer_config_file": None, "gguf": None}
