"""GGUF files: metadata -> an equivalent HF config, tensors -> dequantized HF-named weights.

Owns three translations, each checked against transformers' own GGUF loading by
tests/parity/test_gguf_vs_transformers.py:

- names: llama.cpp's `blk.N.attn_q.weight` style -> HF's `model.layers.N.self_attn.q_proj.weight`;
  an absent `output.weight` means the LM head is tied to `token_embd`.
- layout: GGUF lists dims innermost first (ne0 = input features), so the reader's numpy rows
  already are torch's [out, in]; we reshape to the reversed GGUF shape to say so explicitly.
- the Q/K row permutation: llama.cpp's converter reorders the rows of q_proj/k_proj of
  llama-arch models from HF's rotate-half RoPE layout (pairs (i, i + d/2)) to adjacent pairs
  (2i, 2i + 1). HF-style models would then rotate the wrong pairs and the output is silent
  garbage, so we undo it here (llama and smollm3 files). qwen2/qwen3 and gemma* files are
  written unpermuted (NEOX RoPE).
- Gemma's norms: llama.cpp writes the scale 1 + w where the HF checkpoint holds w, so 1 is
  taken off again (as transformers' GGUF loader does); the model adds it back in float32.
- experts (`qwen2moe`, `qwen3moe`, and `llama` files with `llama.expert_count`: Mixtral):
  llama.cpp stacks each layer's experts as ffn_gate_exps / ffn_up_exps [E, I, H] and
  ffn_down_exps [E, H, I] (torch order); they become transformers 5's stacked names, gate and
  up joined as `mlp.experts.gate_up_proj` [E, 2I, H] (gate first), which models/moe.py loads
  for every MoE family. What llama.cpp hard-codes and no key says is read its way:
  Qwen3-MoE's top-k weights renormalized, Qwen2-MoE's not (Mixtral's always are); a layer
  without a router is a dense one (`mlp_only_layers`).

Every tensor type the file holds is dequantized to float32 (Q8_0/Q4_0/Q4_1 by our Rust
kernels, the others with gguf's `dequantize`) when the model build reads it
(`Checkpoint.weights` is a LazyWeights), so a load never holds the whole model in float32 at
once. Linear weights in Q8_0/Q4_0/Q4_1 are also kept as their raw blocks (`Checkpoint.quantized`,
rows un-permuted the same way) for the quantized GEMV of few-token decode steps; an MoE layer's
stacked experts too (gate|up as one matrix, expert after expert: `_gate_up_blocks`), which a
served model computes with the GEMV in every step, holding no float32 copy of them. Loaded for
that GEMV (`quantized_decode`), linears in K-quant and Q5 types get blocks converted to those
types (gguf_convert.py: Q4_K -> Q4_1, the others and mixed fused groups -> Q8_0), converted
linear by linear as the model is built, and their weights are the converted blocks' values:
one set of weights for every step. F16, BF16, F32 and IQ types keep the file's values.
"""

from __future__ import annotations

import functools
import logging
import re
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES

from .. import _core
from .checkpoint import (QUANT_FORMATS, Checkpoint, LazyBlocks, LazyWeights, LoadError, QuantTensor,
                         empty_template_sources)
from .gguf_convert import convert, group_target, type_name
from .gguf_header import read_gguf

# GGUF general.architecture -> (HF architecture, HF model_type, Q/K rows permuted by llama.cpp)
_ARCHS: dict[str, tuple[str, str, bool]] = {
    "llama": ("LlamaForCausalLM", "llama", True),
    "smollm3": ("SmolLM3ForCausalLM", "smollm3", True),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", False),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", False),
    "gemma": ("GemmaForCausalLM", "gemma", False),
    "gemma2": ("Gemma2ForCausalLM", "gemma2", False),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text", False),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe", False),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe", False),
}
_SANDWICH_ARCHS = ("gemma2", "gemma3")
# a `llama` file with experts (llama.expert_count > 0): Mixtral's layers, Q/K rows permuted
_MIXTRAL = ("MixtralForCausalLM", "mixtral", True)
_MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 2 and 3's sandwich norms: llama.cpp's names for them, and its ffn_norm is the MLP's
# input norm.
_GEMMA_BLOCK_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# MoE layers (names without `.weight`: transformers 5's stacked expert parameters). llama.cpp's
# gate and up experts both go into gate_up_proj (load_gguf joins them: _GgufGateUp).
_MOE_NAMES = {
    "ffn_gate_inp": "mlp.gate.weight",
    "ffn_gate_exps": "mlp.experts.gate_up_proj",
    "ffn_up_exps": "mlp.experts.gate_up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate.weight",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp": "mlp.shared_expert.down_proj.weight",
}
_GATE_UP = ".mlp.experts.gate_up_proj"
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
# (llama.cpp's first Mixtral files, before the experts were stacked: blk.N.ffn_gate.E.weight)
_PER_EXPERT_RE = re.compile(r"^blk\.\d+\.ffn_(gate|up|down)\.\d+\.weight$")
_GLOBAL_RE = re.compile(r"^(\w+)\.(weight|bias)$")


def hf_name(gguf_name: str, arch: str = "llama") -> str:
    """The HF parameter name of a GGUF tensor name in a file of `arch`; LoadError for a tensor
    we cannot place."""
    m = _BLOCK_RE.match(gguf_name)
    names = {**_BLOCK_NAMES, **_GEMMA_BLOCK_NAMES} if arch in _SANDWICH_ARCHS else _BLOCK_NAMES
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"
    if m and m.group(2) in _MOE_NAMES and m.group(3) == "weight":
        return f"model.layers.{m.group(1)}.{_MOE_NAMES[m.group(2)]}"
    m = _GLOBAL_RE.match(gguf_name)
    if m and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    if gguf_name == "rope_freqs.weight":
        # Llama 3.1-style frequency scaling: its parameters are not in the metadata, only the
        # resulting factors, and an HF config cannot carry those.
        raise LoadError(
            "this GGUF uses Llama 3 RoPE frequency scaling (rope_freqs), which llmserve does not "
            "support from GGUF; load the model's Hugging Face folder instead"
        )
    if _PER_EXPERT_RE.match(gguf_name):
        raise LoadError(f"GGUF tensor {gguf_name!r} is one expert's, as llama.cpp wrote MoE files before it "
                        "stacked them (ffn_gate_exps); llmserve reads stacked experts only: convert the model "
                        "again with a current llama.cpp")
    raise LoadError(f"unexpected tensor {gguf_name!r} in GGUF file; llmserve cannot place it")


def _check_qk_rows(rows: int, n_heads: int) -> None:
    if rows % (2 * n_heads):
        raise LoadError(f"Q/K tensor with {rows} rows does not split into {n_heads} heads of even size")


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (rows: n_heads * head_dim; works for biases too).

    The converter views each head's rows as [2, head_dim/2] and transposes to [head_dim/2, 2],
    interleaving the two rotate-half halves; the inverse views [head_dim/2, 2] and transposes back.
    """
    rows = w.shape[0]
    _check_qk_rows(rows, n_heads)
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


class _Meta:
    """Access to a GGUF file's key-value metadata (gguf_header.read_gguf's dict)."""

    def __init__(self, values: dict) -> None:
        self._values = values

    def get(self, key: str, default=None):
        return self._values.get(key, default)

    def require(self, key: str):
        if key not in self._values:
            raise LoadError(f"GGUF metadata lacks {key!r}")
        return self._values[key]


def _int_scalar(meta: _Meta, key: str, default=None) -> int | None:
    v = meta.get(key, default)
    if isinstance(v, list):
        # Some files store per-layer head counts; uniform lists are fine, others are not ours.
        if len(set(v)) != 1:
            raise LoadError(f"GGUF {key} varies per layer ({v}); llmserve does not support that")
        v = v[0]
    return None if v is None else int(v)


def _decimal(value: float) -> float:
    """GGUF stores float32; 7 significant digits recover the decimal the HF config had (1e-05)."""
    return float(f"{float(value):.7g}")


def _family(meta: _Meta, arch: str) -> tuple[str, str, bool]:
    """(HF architecture, HF model_type, Q/K rows permuted) of a file of `arch`."""
    if arch == "llama" and (_int_scalar(meta, "llama.expert_count") or 0) > 0:
        return _MIXTRAL
    return _ARCHS[arch]


def _hf_config(meta: _Meta, arch: str, vocab_size: int, tied: bool, vocab: dict,
               shapes: dict[str, tuple[int, ...]]) -> dict:
    """The HF config of a file of `arch`; `shapes`: each GGUF tensor's torch shape."""
    hf_arch, model_type, _ = _family(meta, arch)
    hidden = int(meta.require(f"{arch}.embedding_length"))
    n_heads = _int_scalar(meta, f"{arch}.attention.head_count")
    n_kv = _int_scalar(meta, f"{arch}.attention.head_count_kv", n_heads)
    if n_heads is None:
        raise LoadError(f"GGUF metadata lacks {arch}.attention.head_count")
    head_dim = _int_scalar(meta, f"{arch}.attention.key_length", hidden // n_heads)
    rope_dim = _int_scalar(meta, f"{arch}.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise LoadError(f"GGUF rotates {rope_dim} of {head_dim} head dims; partial RoPE is not supported")
    rope_theta = _decimal(meta.get(f"{arch}.rope.freq_base", 10000.0))
    config = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(meta.require(f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(meta.require(f"{arch}.block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _decimal(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": rope_theta,
        "max_position_embeddings": int(meta.get(f"{arch}.context_length", 2048)),
        "vocab_size": vocab_size,
        "tie_word_embeddings": tied,
        "bos_token_id": vocab.get("bos_token_id"),
        "eos_token_id": vocab.get("eos_token_id"),
        "pad_token_id": vocab.get("pad_token_id"),
        "torch_dtype": "float32",
    }
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        config["rope_scaling"] = _rope_scaling(meta, arch, scaling)
    if model_type in ("llama", "smollm3", "mixtral"):
        config.update(attention_bias=False, mlp_bias=False)
    if model_type == "smollm3":
        # NOTE: no GGUF key says which layers skip RoPE: llama.cpp hard-codes every fourth, as
        # transformers' default interval does.
        config.update(no_rope_layer_interval=4, use_sliding_window=False, sliding_window=None)
    if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral"):
        config.update(use_sliding_window=False, sliding_window=None)
    if model_type in _MOE_TYPES:
        config.update(_moe_config(meta, arch, model_type, config, shapes))
    if model_type == "gemma":
        config.update(hidden_act="gelu_pytorch_tanh", attention_bias=False)
    if model_type == "gemma2":
        config.update(_gemma2_config(meta, config))
    if model_type == "gemma3_text":
        config.update(_gemma3_config(meta, config))
    return config


def _moe_config(meta: _Meta, arch: str, model_type: str, config: dict, shapes: dict[str, tuple[int, ...]]) -> dict:
    """The experts' keys of a MoE file, read as llama.cpp reads them. Sizes llama.cpp defaults
    when a key is absent are read from the tensors instead (the only size it then accepts)."""
    experts = _int_scalar(meta, f"{arch}.expert_count")
    used = _int_scalar(meta, f"{arch}.expert_used_count")
    if not experts or not used:
        raise LoadError(f"GGUF metadata lacks {arch}.expert_count or {arch}.expert_used_count")
    layers = range(config["num_hidden_layers"])

    def size(key: str, tensor: str) -> int:   # (else the rows of a layer's gate tensor `tensor`)
        n = _int_scalar(meta, f"{arch}.{key}")
        found = next((shapes[name] for i in layers if (name := f"blk.{i}.{tensor}.weight") in shapes), None)
        if not n and found is None:
            raise LoadError(f"GGUF metadata lacks {arch}.{key} and the file has no {tensor} tensor")
        return n or found[-2]

    if model_type == "mixtral":
        # (llama.cpp's llama layers size the experts by feed_forward_length: intermediate_size)
        if _int_scalar(meta, "llama.expert_shared_feed_forward_length"):
            raise LoadError("this llama GGUF has shared experts (llama.expert_shared_feed_forward_length); "
                            "llmserve reads Mixtral-style llama MoE files only")
        return {"num_local_experts": experts, "num_experts_per_tok": used}
    moe = {
        "num_experts": experts,
        "num_experts_per_tok": used,
        "moe_intermediate_size": size("expert_feed_forward_length", "ffn_gate_exps"),
        # NOTE: llama.cpp hard-codes the renormalization (Qwen3-MoE's releases set it; transformers'
        # GGUF loader defaults it so too) and reads no expert_weights_norm key for these archs.
        "norm_topk_prob": model_type == "qwen3_moe",
        # (llama.cpp makes every layer sparse; a layer written without a router is a dense one)
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in layers if f"blk.{i}.ffn_gate_inp.weight" not in shapes],
    }
    if model_type == "qwen2_moe":
        moe["shared_expert_intermediate_size"] = size("expert_shared_feed_forward_length", "ffn_gate_shexp")
    return moe


def _rope_scaling(meta: _Meta, arch: str, kind: str) -> dict:
    """The HF `rope_scaling` of a file's `rope.scaling.*` keys: linear, or YaRN as llama.cpp's
    converter writes it (factor, original context, the betas where given). The keys that
    reshape YaRN's attention factor in llama.cpp's own way are refused, not guessed at."""
    key = f"{arch}.rope.scaling."
    factor = float(meta.require(key + "factor"))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind != "yarn":
        raise LoadError(f"GGUF RoPE scaling {kind!r} is not supported (linear and yarn are)")
    if unread := [k for k in ("attn_factor", "yarn_attn_factor", "yarn_log_multiplier", "yarn_ext_factor")
                  if meta.get(key + k) is not None]:
        raise LoadError(f"GGUF YaRN keys {', '.join(key + k for k in unread)} are not supported; "
                        "load the model's Hugging Face folder instead")
    scaling: dict = {"rope_type": "yarn", "factor": factor}
    original = _int_scalar(meta, key + "original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = original
    for ours, theirs in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
        if meta.get(key + theirs) is not None:
            scaling[ours] = _decimal(meta.get(key + theirs))
    return scaling


def _gemma_layers(meta: _Meta, config: dict, arch: str, sliding: list[bool], layers_27b: int) -> dict:
    """What Gemma 2 and 3 files share, read as llama.cpp reads them: the sliding window (of the
    layers in `sliding`), GeGLU, and q . k scaled by the file's attention.scale if it has one,
    else head_dim^-0.5, but for the 27B model (told by its layer count) (hidden / heads)^-0.5."""
    window = _int_scalar(meta, f"{arch}.attention.sliding_window")
    if window is None:
        raise LoadError(f"GGUF metadata lacks {arch}.attention.sliding_window")
    scale = meta.get(f"{arch}.attention.scale")
    if scale is not None:
        scalar = float(scale) ** -2
    elif config["num_hidden_layers"] == layers_27b:
        scalar = config["hidden_size"] / config["num_attention_heads"]
    else:
        scalar = config["head_dim"]
    return {
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": window,
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "query_pre_attn_scalar": int(scalar) if float(scalar).is_integer() else _decimal(scalar),
        "attention_bias": False,
    }


def _gemma2_config(meta: _Meta, config: dict) -> dict:
    """Gemma 2's keys: every other layer slides, from the first; soft caps of 50 and 30 where no
    key says otherwise (llama.cpp's defaults)."""
    sliding = [i % 2 == 0 for i in range(config["num_hidden_layers"])]
    return {
        **_gemma_layers(meta, config, "gemma2", sliding, 46),
        "attn_logit_softcapping": _decimal(meta.get("gemma2.attn_logit_softcapping", 50.0)),
        "final_logit_softcapping": _decimal(meta.get("gemma2.final_logit_softcapping", 30.0)),
    }


def _gemma3_config(meta: _Meta, config: dict) -> dict:
    """Gemma 3's keys: what no key says is what llama.cpp hard-codes (a full-attention layer
    every sixth, the local layers' RoPE base of 10000)."""
    n = config["num_hidden_layers"]
    pattern = meta.get("gemma3.attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):   # (newer files: whether each layer is a sliding one)
        if len(pattern) != n:
            raise LoadError(f"GGUF gemma3.attention.sliding_window_pattern has {len(pattern)} entries for {n} layers")
        sliding = [bool(p) for p in pattern]
    else:
        sliding = [(i + 1) % int(pattern) != 0 for i in range(n)]
    return {
        **_gemma_layers(meta, config, "gemma3", sliding, 62),
        "rope_local_base_freq": _decimal(meta.get("gemma3.rope.freq_base_swa", 10000.0)),
    }


def _vocab(meta: _Meta) -> dict:
    """GgufVocab (rust/router tokenizer.rs) from the `tokenizer.ggml.*` metadata."""
    model = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if model is None or not tokens:
        raise LoadError("GGUF file has no tokenizer (tokenizer.ggml.model / tokens missing)")
    vocab = {
        "model": model,
        "arch": meta.get("general.architecture"),   # (Gemma's sentencepiece differs: tokenizer.rs)
        "pre": meta.get("tokenizer.ggml.pre"),
        "tokens": tokens,
        "merges": meta.get("tokenizer.ggml.merges", []),
        "token_types": [int(t) for t in meta.get("tokenizer.ggml.token_type", [])],
        "bos_token_id": _int_scalar(meta, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _int_scalar(meta, "tokenizer.ggml.eos_token_id"),
        "unk_token_id": _int_scalar(meta, "tokenizer.ggml.unknown_token_id"),
        "pad_token_id": _int_scalar(meta, "tokenizer.ggml.padding_token_id"),
        # NOTE: llama.cpp's default when the key is absent: sentencepiece ("llama") vocabularies
        # add BOS, byte-level BPE ones do not.
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", model == "llama")),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
    }
    scores = meta.get("tokenizer.ggml.scores")
    if scores is not None:
        vocab["scores"] = [float(s) for s in scores]
    return vocab


class _GgufWeight:
    """One GGUF tensor as the float32 HF weight it stands for (a LazyTensor): dequantized, and
    for llama-arch Q/K rows un-permuted, each time it is made; with a `target`, the values of
    its blocks converted to that type (gguf_convert.py), which the model's linear gets too."""

    def __init__(self, tensor, heads: int | None, target: int | None = None, offset: float = 0.0,
                 shape: tuple[int, ...] | None = None) -> None:
        self.tensor = tensor
        self.heads = heads   # un-permute Q/K rows over this many heads; None: rows as stored
        self.target = target
        self.offset = offset   # taken off a vector's values (Gemma's norms: 1)
        # GGUF shape is innermost-first; torch wants it reversed ([out, in] for matrices).
        # `shape`: the same values shaped otherwise (Qwen2-MoE's 1-D shared expert gate: [1, H]).
        self.shape = shape or tuple(int(d) for d in reversed(tensor.shape.tolist()))
        self._blocks: QuantTensor | None = None   # converted by make(), until take_blocks()

    def make(self) -> torch.Tensor:
        if len(self.shape) == 1:
            w = torch.from_numpy(_dequantize(np.asarray(self.tensor.data), int(self.tensor.tensor_type),
                                             self.shape[-1]).reshape(self.shape))
            w = w if not self.offset else w - self.offset
            return w if self.heads is None else unpermute_qk(w, self.heads)
        if len(self.shape) > 2 and self.target is None:   # (stacked experts: their rows, as one matrix)
            return self.rows(None).reshape(self.shape)
        if self.target is None:
            return self.rows(None)
        # (kept for take_blocks: a build makes a linear's weight, then takes its blocks)
        self._blocks = self._blocks or self._converted(None)
        return torch.from_numpy(_dequantize(self._blocks.data, self.target, self.shape[-1])).reshape(self.shape)

    def rows(self, index: np.ndarray | None) -> torch.Tensor:
        """Rows `index` of the matrix (None: all of them; a 3-D tensor's rows run over its first
        two dims), dequantized from those rows of the file alone: no GGUF type's blocks
        straddle rows, so a Q/K row is read from the row llama.cpp permuted it to."""
        if self.target is not None:
            return torch.from_numpy(_dequantize(self._converted(index).data, self.target, self.shape[-1]))
        data = self._file_rows(index)
        return torch.from_numpy(_dequantize(data, int(self.tensor.tensor_type), self.shape[-1]))

    def take_blocks(self) -> QuantTensor:
        """The converted blocks of the whole matrix: those make() kept (then dropped), else
        converted now."""
        q, self._blocks = self._blocks, None
        return q if q is not None else self._converted(None)

    def _file_rows(self, index: np.ndarray | None) -> np.ndarray:
        rows = int(np.prod(self.shape[:-1]))
        data = np.asarray(self.tensor.data).reshape(rows, -1)   # raw values or blocks
        if self.heads is not None:
            stored = unpermute_qk(torch.arange(self.shape[0]), self.heads).numpy()
            index = stored if index is None else stored[index]
        return data if index is None else data[index]

    def _converted(self, index: np.ndarray | None) -> QuantTensor:
        data = convert(self._file_rows(index), int(self.tensor.tensor_type), self.target)
        return QuantTensor(np.ascontiguousarray(data), self.target, data.shape[0], self.shape[-1])


class _GgufGateUp:
    """An MoE layer's gate and up experts (ffn_gate_exps, ffn_up_exps: [E, I, H] each) as the one
    gate|up [E, 2I, H] of transformers 5's `experts.gate_up_proj` (a LazyTensor; its rows run
    over the first two dims, as _GgufWeight's)."""

    def __init__(self, gate: _GgufWeight, up: _GgufWeight) -> None:
        if gate.shape != up.shape or len(gate.shape) != 3:
            raise LoadError(f"GGUF experts {gate.tensor.name!r} {list(gate.shape)} and {up.tensor.name!r} "
                            f"{list(up.shape)} are not two [experts, rows, cols] tensors of one shape")
        self.gate, self.up = gate, up
        e, i, h = gate.shape
        self.shape = (e, 2 * i, h)

    def make(self) -> torch.Tensor:
        i = self.gate.shape[1]
        out = torch.empty(self.shape)
        out[:, :i] = self.gate.make()
        out[:, i:] = self.up.make()
        return out

    def rows(self, index: np.ndarray) -> torch.Tensor:
        i = self.gate.shape[1]
        expert, row = np.divmod(index, 2 * i)
        up = row >= i
        out = torch.empty((len(index), self.shape[-1]))
        for part, mine in ((self.gate, ~up), (self.up, up)):
            if mine.any():
                out[torch.from_numpy(mine)] = part.rows(expert[mine] * i + row[mine] % i)
        return out


def _gate_up_blocks(experts: _GgufGateUp, gate: QuantTensor | None, up: QuantTensor | None) -> QuantTensor:
    """The blocks of gate|up [E, 2I, H] as the rows of one matrix, expert after expert (each
    expert's gate rows, then its up rows), from the file's blocks (`gate`, `up`; None: the
    converted ones its weights were made from). Both are of their group's one type."""
    g = gate if gate is not None else experts.gate.take_blocks()
    u = up if up is not None else experts.up.take_blocks()
    e, i2, h = experts.shape
    data = np.concatenate([g.data.reshape(e, i2 // 2, -1), u.data.reshape(e, i2 // 2, -1)], axis=1)
    return QuantTensor(np.ascontiguousarray(data.reshape(e * i2, -1)), g.ggml_type, e * i2, h)


def _dequantize(data: np.ndarray, ggml_type: int, cols: int) -> np.ndarray:
    """Raw values or blocks (rows of them when 2-D) -> float32 (2-D: [rows, cols])."""
    if ggml_type in QUANT_FORMATS and data.ndim == 2:
        # The formats the quantized GEMV reads: Rust computes the same float32 values as the
        # gguf package, ~10x faster (most of a GGUF model's load time otherwise).
        out = np.empty((data.shape[0], cols), dtype=np.float32)
        _core.dequantize(out, np.ascontiguousarray(data), ggml_type)
        return out
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    arr = dequantize(data, GGMLQuantizationType(ggml_type))
    if arr.dtype != np.float32 or not arr.flags.writeable:
        arr = arr.astype(np.float32)  # F32 tensors come back as read-only views of the mmap
    return arr if data.ndim != 2 else arr.reshape(data.shape[0], cols)


def _check_dequantizable(tensor) -> None:
    """LoadError, before anything is built, naming a tensor of a type the gguf package cannot
    dequantize (Q8_K, Q8_1 and newer ones: intermediate types no model file should hold)."""
    from gguf.quants import dequantize

    block, size = GGML_QUANT_SIZES[tensor.tensor_type]
    if int(tensor.tensor_type) in QUANT_FORMATS or block == 1:
        return   # (our own kernels dequantize these; plain numbers are cast)
    try:
        dequantize(np.zeros((1, size), dtype=np.uint8), tensor.tensor_type)   # (one block)
    except NotImplementedError:
        import gguf

        raise LoadError(f"GGUF tensor {tensor.name!r} is {tensor.tensor_type.name}, a type llmserve cannot "
                        f"dequantize (gguf {getattr(gguf, '__version__', '?')})") from None


def _raw_blocks(tensor) -> QuantTensor | None:
    """A matrix's raw blocks when its format is one the quantized GEMV reads, else None."""
    ggml_type = int(tensor.tensor_type)
    if ggml_type not in QUANT_FORMATS or len(tensor.shape) != (3 if "_exps." in tensor.name else 2):
        return None
    cols, *outer = (int(d) for d in tensor.shape.tolist())   # innermost first
    rows = int(np.prod(outer))   # (stacked experts: every expert's rows, expert after expert)
    # NOTE: the reader's [rows, bytes per row] uint8 view of the file's read-only mmap, kept
    # as it is: the model packs it into a copy of its own (QuantTensor.pack), so a load holds
    # the blocks once in memory, not twice. The checkpoint pins the file while it lives.
    data = np.asarray(tensor.data).reshape(rows, -1)
    return QuantTensor(data, ggml_type, rows, cols)


def _unpermute_raw(q: QuantTensor, n_heads: int) -> QuantTensor:
    # Blocks never straddle rows, so undoing the permutation on whole rows of bytes matches
    # undoing it on the dequantized rows. (A copy: torch takes no read-only array.)
    rows = unpermute_qk(torch.from_numpy(q.data.copy()), n_heads).numpy()
    return QuantTensor(rows, q.ggml_type, q.rows, q.cols)


# Layer linears, and those fused into one (models/llama.py quantized_parts), whose blocks must
# then be of one type.
_LINEARS = {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"}
_FUSED = {"attn_q": "attn_qkv", "attn_k": "attn_qkv", "attn_v": "attn_qkv",
          "ffn_gate": "ffn_gate_up", "ffn_up": "ffn_gate_up"}
# An MoE layer's stacked experts, and the group each is served in (gate and up fused).
_EXPERTS = {"ffn_gate_exps": "ffn_gate_up_exps", "ffn_up_exps": "ffn_gate_up_exps", "ffn_down_exps": "ffn_down_exps"}


def block_targets(tensors, tied: bool) -> dict[str, int]:
    """GGUF name -> the block type each linear weight (the LM head: `output`, or `token_embd`
    when tied) is served in: its group's `gguf_convert.group_target`, so that the parts of a
    fused linear share one type (Q4_K_M's Q4_K q/k with a Q6_K v all become Q8_0). Absent: a
    weight whose group has a part of a type that converts to nothing (F16, IQ*, ...)."""
    groups: dict[str, list] = {}
    for t in tensors:
        m = _BLOCK_RE.match(t.name)
        if m and m.group(3) == "weight" and m.group(2) in _LINEARS:
            key = f"blk.{m.group(1)}.{_FUSED.get(m.group(2), m.group(2))}"
        elif m and m.group(3) == "weight" and m.group(2) in _EXPERTS:
            key = f"blk.{m.group(1)}.{_EXPERTS[m.group(2)]}"
        elif t.name == "output.weight" or (tied and t.name == "token_embd.weight"):
            key = t.name
        else:
            continue
        groups.setdefault(key, []).append(t)
    targets = {}
    for parts in groups.values():
        target = group_target([int(t.tensor_type) for t in parts])
        # (experts: [E, I, H], each expert's rows computed as a linear of its own)
        if target is not None and all(len(t.shape) == (3 if "_exps." in t.name else 2) for t in parts):
            targets.update((t.name, target) for t in parts)
    return targets


def load_gguf(path: Path, name: str, log: logging.Logger, quantized_decode: bool = False) -> Checkpoint:
    """The GGUF file at `path` as a Checkpoint. `quantized_decode`: the model will run the
    quantized GEMV (build.py: --quantized-decode, float32 on a CPU), so linears in block types
    it does not read get blocks converted into ones it does (`block_targets`), and their
    weights are those blocks' values; else every weight is the file's own values."""
    t0 = time.perf_counter()
    try:
        values, tensors = read_gguf(path)
    except Exception as e:  # bad files raise bare ValueErrors/struct errors (ours and gguf's)
        raise LoadError(f"{path} is not a readable GGUF file: {e}") from e
    meta = _Meta(values)
    arch = meta.get("general.architecture")
    if arch not in _ARCHS:
        raise LoadError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(sorted(_ARCHS))})"
        )
    vocab = _vocab(meta)
    # Config and names first: a file we cannot serve fails before the slow dequantization.
    names = {t.name: hf_name(t.name, arch) for t in tensors}
    embd = next((t for t in tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise LoadError(f"GGUF file {path} has no token_embd tensor")
    tied = "output.weight" not in names
    vocab_size = _int_scalar(meta, f"{arch}.vocab_size") or int(embd.shape[-1])
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in tensors}
    config = _hf_config(meta, arch, vocab_size, tied, vocab, shapes)
    t1 = time.perf_counter()
    log.info("GGUF %s: %s, %d tensors, metadata read in %.2f s", path.name, arch, len(tensors), t1 - t0)

    types = Counter(t.tensor_type.name for t in tensors)
    for tensor in {t.tensor_type: t for t in tensors}.values():   # (one of each type)
        _check_dequantizable(tensor)
    permuted = _family(meta, arch)[2]
    targets = block_targets(tensors, tied) if quantized_decode else {}
    lazy: dict[str, _GgufWeight | _GgufGateUp] = {}
    gate_up: dict[str, dict[str, _GgufWeight]] = {}   # HF name -> {"gate" | "up": its part}
    quantized: dict[str, QuantTensor | Callable[[], QuantTensor]] = {}
    blocks: dict[str, dict[str, QuantTensor | None]] = {}   # experts' gate and up blocks (None: converted)
    conversions: Counter = Counter()
    for tensor in tensors:
        key = names[tensor.name]
        source, target = int(tensor.tensor_type), targets.get(tensor.name)
        converts = target is not None and target != source
        raw = None if converts else _raw_blocks(tensor)
        heads = None
        if permuted and ".self_attn.q_proj." in key:
            heads = config["num_attention_heads"]
        elif permuted and ".self_attn.k_proj." in key:
            heads = config["num_key_value_heads"]
        if heads is not None:
            _check_qk_rows(int(tensor.shape[-1]), heads)   # (GGUF dims run innermost first)
            raw = None if raw is None else _unpermute_raw(raw, heads)
        offset = 1.0 if arch.startswith("gemma") and key.endswith("norm.weight") else 0.0
        # (llama.cpp writes Qwen2-MoE's shared expert gate [1, H] as a vector)
        shape = (1, int(tensor.shape[0])) if key.endswith(".shared_expert_gate.weight") else None
        weight = _GgufWeight(tensor, heads, target if converts else None, offset, shape)
        if key.endswith(_GATE_UP):
            gate_up.setdefault(key, {})["gate" if ".ffn_gate_exps." in tensor.name else "up"] = weight
            if target is not None:
                blocks.setdefault(key, {})["gate" if ".ffn_gate_exps." in tensor.name else "up"] = raw
                if converts:
                    conversions[f"{type_name(source)}->{type_name(target)}"] += 1
            continue
        lazy[key] = weight
        if converts:
            quantized[key] = lazy[key].take_blocks   # (converted as the model is built)
            conversions[f"{type_name(source)}->{type_name(target)}"] += 1
        elif raw is not None:
            quantized[key] = raw
    for key, parts in gate_up.items():
        if len(parts) != 2:
            layer = key.split(".")[2]
            raise LoadError(f"GGUF layer {layer} has ffn_{next(iter(parts))}_exps but no ffn_"
                            f"{'up' if 'gate' in parts else 'gate'}_exps")
        lazy[key] = _GgufGateUp(parts["gate"], parts["up"])
        if len(blocks.get(key, ())) == 2:
            quantized[key] = functools.partial(_gate_up_blocks, lazy[key], blocks[key]["gate"], blocks[key]["up"])
    log.info("GGUF %s: %d tensors (%s), dequantized to float32 as the model is built",
             path.name, len(lazy), ", ".join(f"{k} x{v}" for k, v in sorted(types.items())))
    converted = tuple(f"{k} x{v}" for k, v in sorted(conversions.items()))
    if converted:
        log.info("GGUF %s: blocks for the quantized GEMV converted from the file's (%s)",
                 path.name, ", ".join(converted))

    tokens = vocab["tokens"]

    def token(i: int | None) -> str | None:
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    eos_ids = [i for i in (vocab["eos_token_id"],) if i is not None]
    # End-of-turn / end-of-message tokens (Llama 3's <|eot_id|>, <|eom_id|>) end a chat reply
    # even when the file's EOS is the end-of-text token.
    extras = [_int_scalar(meta, key) for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")]
    if arch.startswith("gemma") and "<end_of_turn>" in tokens:
        # (Gemma's files name no EOT; llama.cpp finds its <end_of_turn> by name, and Gemma's
        # generation_config ends on it too)
        extras.append(tokens.index("<end_of_turn>"))
    for extra in extras:
        if extra is not None and extra not in eos_ids:
            eos_ids.append(extra)

    sources = empty_template_sources()
    sources["gguf"] = meta.get("tokenizer.chat_template")
    log.info("GGUF %s loaded in %.2f s", path.name, time.perf_counter() - t0)
    return Checkpoint(
        name=name,
        hf_config=config,
        weights=LazyWeights(lazy),
        tokenizer_json=None,
        gguf_vocab=vocab,
        template_sources=sources,
        special_tokens={name: text for name in ("bos_token", "eos_token", "unk_token", "pad_token")
                        if (text := token(vocab[f"{name}_id"])) is not None},
        eos_token_ids=eos_ids,
        generation_config={},
        quantized=LazyBlocks(quantized),
        conversions=converted,
    )
