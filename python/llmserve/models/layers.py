"""Layers shared by every decoder family: RMSNorm, rotary embedding, fused QKV projection,
fused gate|up SiLU MLP, the paged-attention call, and the linear that reads GGUF-quantized
weights in few-token steps.

Shapes use T for the flat tokens of a step (sequences are concatenated, no padding), H for the
hidden size, and `heads x head_dim` for attention. Weights are fused at load time (one GEMM for
Q, K and V; one for gate and up) because on CPU each extra GEMM and op dispatch costs real time
(see BENCH.md).
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from llmserve import _core
from llmserve.loaders.checkpoint import PackedQuant
from llmserve.worker.attention import AttentionMetadata, paged_attention
from llmserve.worker.threads import (BF16_TILE_ROWS, GEMM_ROW_MULTIPLE, QUANT_MAX_TOKENS, bf16_tile_rows,
                                    in_prompt_step, in_runner_step, kernel_threads, pads_small_gemms,
                                    quantized_step_allowed)


class RMSNorm(nn.Module):
    """RMSNorm that always accumulates in float32, then casts back. Llama's convention (a
    weight of the model's dtype): the normalized activations are cast to the input dtype before
    the weight multiply. Gemma's (a float32 weight, its 1 + w: llama.fuse_hf_weights): the
    weight multiplies in float32, then the product is cast."""

    # The fused layer ops' provider (llmserve.kernels, or kernels.reference in tests), set by the
    # model's `set_fused_ops`: one kernel for the rows it serves (2-D and contiguous).
    fused: Any = None

    def __init__(self, dim: int | tuple[int, ...], eps: float):
        super().__init__()
        self.shape = (dim,) if isinstance(dim, int) else tuple(dim)
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(self.shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None and x.dim() == 2 and x.is_contiguous():
            out = torch.empty_like(x)
            self.fused.rms_norm(out, x, self.weight, self.eps)
            return out
        if x.dtype == torch.float32:
            # NOTE: one fused op on the fp32 path; batch-1 decode is bound by op dispatch.
            return F.rms_norm(x, self.shape, self.weight, self.eps)
        if self.weight.dtype == torch.float32:
            return F.rms_norm(x.float(), self.shape, self.weight, self.eps).to(x.dtype)
        normed = F.rms_norm(x.float(), self.shape, None, self.eps)
        return normed.to(x.dtype) * self.weight


class LayerNorm(nn.Module):
    """LayerNorm: StarCoder2's (a bias, computed in the input's dtype as torch's is) or
    Cohere's (`bias` False, `fp32`: computed and scaled in float32, a float32 weight, then cast
    once)."""

    def __init__(self, dim: int, eps: float, bias: bool = True, fp32: bool = False):
        super().__init__()
        self.shape, self.eps, self.fp32 = (dim,), eps, fp32
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp32 and x.dtype != torch.float32:
            return F.layer_norm(x.float(), self.shape, self.weight, self.bias, self.eps).to(x.dtype)
        return F.layer_norm(x, self.shape, self.weight, self.bias, self.eps)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1's frequency-dependent rescaling of the rotary frequencies."""
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = old_len / low, old_len / high
    # long wavelengths are slowed down by `factor`, short ones kept, the band between blended
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_mid, blended, out)


def _yarn_inv_freq(inv_freq: torch.Tensor, theta: float, scaling: dict,
                   max_positions: int) -> tuple[torch.Tensor, float]:
    """YaRN (Qwen3's and OLMo 3's long-context RoPE, as transformers computes it): frequencies
    that turn fewer than `beta_slow` times over the original context are slowed down by
    `factor`, those that turn more than `beta_fast` times kept, a linear ramp over the dims
    between; cos and sin are scaled by the attention factor (0.1 ln(factor) + 1 unless given,
    DeepSeek's mscale ratio when both mscales are). Returns (inv_freq, attention factor)."""
    # (without one, the original context is max_position_embeddings, as transformers fills it)
    original = float(scaling.get("original_max_position_embeddings") or max_positions)
    factor = float(scaling.get("factor") or max_positions / original)

    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        both = scaling.get("mscale") and scaling.get("mscale_all_dim")
        attention = mscale(scaling["mscale"]) / mscale(scaling["mscale_all_dim"]) if both else mscale()
    fast, slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)
    dim = 2 * inv_freq.numel()

    def dim_of(rotations: float) -> float:
        # the dim whose frequency turns `rotations` times over the original context
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / ((high - low) or 0.001)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp), float(attention)


class RotaryEmbedding:
    """Rotary position embedding with HF's rotate-half layout (pairs are (i, i + d/2)).

    cos/sin tables are precomputed in float32 and grown on demand; the model looks them up once
    per forward (`cos_sin`) and every layer reuses them (`apply`).
    """

    def __init__(self, head_dim: int, theta: float, scaling: dict | None, max_positions: int,
                 device: torch.device):
        self.head_dim = head_dim
        self.device = device
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        # LongRoPE (Phi-3.5, Phi-4-mini): positions from `long_from` on rotate with the long
        # factors, the ones before with the short; cos and sin are multiplied by `mscale`.
        self.long_inv_freq: torch.Tensor | None = None
        self.long_from, self.mscale = 0, 1.0
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif rope_type == "linear":
            inv_freq = inv_freq / float(scaling["factor"])
        elif rope_type == "yarn":
            inv_freq, self.mscale = _yarn_inv_freq(inv_freq, theta, scaling, max_positions)
        elif rope_type == "longrope":
            short, long = (torch.tensor(scaling[k], dtype=torch.float64) for k in ("short_factor", "long_factor"))
            if short.shape != inv_freq.shape or long.shape != inv_freq.shape:
                raise ValueError(f"longrope factors must have {inv_freq.numel()} values (rotary dims / 2)")
            self.long_inv_freq = inv_freq / long
            inv_freq = inv_freq / short
            self.long_from = int(scaling["original_max_position_embeddings"])
            self.mscale = float(scaling["attention_factor"])
        elif rope_type not in ("default", None):
            raise ValueError(f"unsupported rope_scaling type {rope_type!r}")
        self.inv_freq = inv_freq
        self.checked = True      # cos_sin grows the tables for larger positions (see reserve)
        self._build(max(max_positions, 1))

    def _build(self, n: int) -> None:
        positions = torch.arange(n, dtype=torch.float64)
        freqs = torch.outer(positions, self.inv_freq)
        if self.long_inv_freq is not None and n > self.long_from:
            freqs[self.long_from:] = torch.outer(positions[self.long_from:], self.long_inv_freq)
        self.cos = (freqs.cos() * self.mscale).float().to(self.device)   # [n, head_dim / 2]
        self.sin = (freqs.sin() * self.mscale).float().to(self.device)

    def reserve(self, n: int) -> None:
        """Tables for positions [0, n), and no more checks: the caller promises that no
        position reaches n (the scheduler plans none past max_model_len).

        NOTE: the check reads the largest position back from the device: on a GPU, a host
        sync in every forward (a step queued ahead would wait for the one running), and none
        may happen while a CUDA graph is captured."""
        if self.cos.shape[0] < n:
            self._build(n)
        self.checked = False

    def cos_sin(self, positions: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, 1, head_dim / 2] (broadcast over heads)."""
        if self.checked and positions.numel():
            self._grow_for(int(positions.max()))
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        return cos.to(dtype), sin.to(dtype)

    def cos_sin_host(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`cos_sin` as numpy rows [T, head_dim / 2] of CPU float32 tables, for the Rust decode
        path (a numpy gather costs a few microseconds where torch's indexing costs ~0.1 ms
        right after a step's weights streamed through the caches)."""
        if self.checked and len(positions):
            self._grow_for(int(positions.max()))
        return self.cos.numpy()[positions], self.sin.numpy()[positions]

    def _grow_for(self, top: int) -> None:
        """Tables that reach position `top` (twice as far, when they must grow)."""
        if top >= self.cos.shape[0]:
            self._build(2 * top + 1)

    @staticmethod
    def apply_in_place(rows: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor,
                       fused: Any = None) -> bool:
        """`apply` in place on the first `heads` heads of rows [T, W] (a fused qkv output: q and
        k heads first) with the fused ops' kernel when `fused` is given (RMSNorm.fused; a
        contiguous tensor), else with the Rust kernel, where it serves (a CPU float32 contiguous
        tensor outside autograd); False: neither does, and the caller runs `apply`. Both give
        `apply`'s bits (the same products and sums, rounded alike), in one call where torch
        runs eight ops.

        NOTE: in a prompt step each layer's weights stream through the caches, and a torch op
        then costs ~50 us (models/cpu_decoder.py): 30 layers' RoPE was ~240 of them."""
        if fused is not None and rows.dim() == 2 and rows.is_contiguous():
            t = rows.shape[0]
            fused.rotary_embedding(rows, heads, cos.reshape(t, -1), sin.reshape(t, -1))
            return True
        if (_rope_rows is None or rows.device.type != "cpu" or rows.dtype != torch.float32
                or cos.dtype != torch.float32 or rows.dim() != 2 or not rows.is_contiguous()
                or rows.requires_grad):
            return False
        t, half = rows.shape[0], cos.shape[-1]
        _rope_rows(rows.numpy(), heads, 2 * half, np.ascontiguousarray(cos.numpy().reshape(t, half)),
                   np.ascontiguousarray(sin.numpy().reshape(t, half)))
        return True

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim] -> rotated copy:
        (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)."""
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


_rope_rows = getattr(_core, "rope_rows", None)   # None: an extension built before it


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           quant: PackedQuant | None, row_invariant: bool = False,
           bf16_weight: torch.Tensor | None = None, threads: int | None = None) -> torch.Tensor:
    """x [T, in] -> [T, out]: the quantized GEMV (rust/kernels/src/quant/) in float32 CPU
    decode steps of generated tokens (worker/threads.py says which) when `quant` holds the
    weight's blocks; in the runner's other steps, a bfloat16 matmul on `bf16_weight` when
    there is one (a GGUF model on a CPU with native bf16, see `Linear.bf16_weight`), and in any
    float32 [T, in] call when a serving model released the fp32 weight (`quantize_linear`;
    other inputs are then refused); a weight released with blocks and no bf16 copy (an MoE
    expert's) runs the GEMV in every decode step and the float32 of its blocks in prompt steps;
    else F.linear on the model's own weight (`_dense_linear`: row-stable in steps with prompt
    tokens).

    `row_invariant` (--batch-invariant): each output row is bit-identical whatever T is and
    wherever the row sits. BLAS picks its blocking and reduction order from M, so a row's sums
    change with the batch; the quantized GEMV computes each row alone, so it runs in chunks of
    QUANT_MAX_TOKENS for any T, and without blocks F.linear runs one row at a time.
    `threads`: the quantized GEMV's threads (None: the engine's, `kernel_threads`)."""
    quant_ok = quant_serves(x, quant)
    if row_invariant and x.dim() == 2:
        if quant_ok:
            return torch.cat([quant_linear(x[i:i + QUANT_MAX_TOKENS], bias, quant, threads)
                              for i in range(0, x.shape[0], QUANT_MAX_TOKENS)])
        return torch.cat([F.linear(x[i:i + 1], weight, bias) for i in range(x.shape[0])])
    if quant_ok and quantized_step_allowed(x.shape[0]):
        return quant_linear(x, bias, quant, threads)
    if (bf16_weight is not None and x.dim() == 2 and x.dtype == torch.float32
            and (in_runner_step() or weight.is_meta)):   # (meta: a serving model released it)
        return _bf16_linear(x, bf16_weight, bias)
    if weight.is_meta and quant_ok:
        # A weight kept as its blocks alone (an MoE expert's): decode steps of any size run the
        # GEMV (an expert's share of a step's rows is small, and a generated token then computes
        # the same whatever the batch); prompt steps the float32 of its blocks, made for the call,
        # the weight the model would otherwise hold.
        if not in_prompt_step():
            return quant_linear(x, bias, quant, threads)
        return _dense_linear(x, dequantized(quant), bias)
    if weight.is_meta:   # (F.linear would return uninitialized memory, silently)
        raise ValueError(f"this linear's float32 weight was released (a model built for serving): it takes "
                         f"float32 [T, in] CPU inputs only, not {x.dtype} {list(x.shape)}")
    return _dense_linear(x, weight, bias)


def _bf16_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear in bfloat16, float32 in and out, so that in steps with prompt tokens each row's
    bits do not depend on the others (worker/threads.py says why): on CPUs with AMX in calls of
    exactly `bf16_tile_rows()` rows, the last padded with zeros; elsewhere in one call, a lone
    row padded to two (oneDNN computes a row the same for any M >= 2, but M = 1 takes a GEMV
    whose sums differ)."""
    n = x.shape[0]
    tile = bf16_tile_rows() if pads_small_gemms() else 0
    if tile:
        padded = _padded_bf16(x, n + -n % tile)
        if padded.shape[0] == tile:
            out = _bf16_mm(padded, weight)[:n].float()
        else:
            out = torch.cat([_bf16_mm(rows, weight) for rows in padded.split(tile)])[:n].float()
    elif n == 1:
        out = _bf16_mm(_padded_bf16(x, 2), weight)[:1].float()
    else:
        out = _bf16_mm(x.to(torch.bfloat16), weight).float()
    return out if bias is None else out.add_(bias)


def _bf16_mm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, in] bf16 @ weight^T: on oneDNN's prepacked form (`pack_bf16`) when the weight is in
    it, else F.linear (which reorders the weight into that form on every call)."""
    if weight.layout == torch._mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
    return F.linear(x, weight)


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 [out, in] CPU weight in oneDNN's prepacked layout, for `_bf16_mm`; the weight as it
    is where torch lacks the ops or the packed product is not the same bits as F.linear's
    (checked here on random tiles of BF16_TILE_ROWS rows and of 2).

    NOTE: F.linear on a plain bf16 weight has oneDNN reorder it into its blocked layout on
    every call; with the weight from memory (a prompt step reads every layer once) that made
    SmolLM2's layer matmuls of 64 rows ~1.6x slower (2.23 vs 1.38 ms a layer, 2 threads;
    measured the same bits at M = 64 with 1, 2 and 4 threads and at M of 25-128 with 2; the
    tests check 1, 2, 5, 64 and 130)."""
    ops = torch.ops.mkldnn
    if (weight.device.type != "cpu" or weight.dtype != torch.bfloat16
            or not (hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise"))):
        return weight
    shape = tuple(weight.shape)
    try:
        packed = ops._reorder_linear_weight(weight, BF16_TILE_ROWS)
        # (which kernel computes depends on the shape, not on the values: checked once a shape,
        # ~0.4 s of SmolLM2's start-up when every weight was checked)
        if shape not in _packed_same_bits:
            g = torch.Generator().manual_seed(0)
            xs = [torch.randn(rows, shape[1], generator=g).to(torch.bfloat16) for rows in (BF16_TILE_ROWS, 2)]
            _packed_same_bits[shape] = all(torch.equal(_bf16_mm(x, packed), F.linear(x, weight)) for x in xs)
    except RuntimeError:
        return weight
    return packed if _packed_same_bits[shape] else weight


# pack_bf16's verdicts, by weight shape
_packed_same_bits: dict[tuple[int, ...], bool] = {}


class _PadBuffers(threading.local):
    """Each engine thread's bf16 input buffers for `_bf16_linear`, one per column count."""

    def __init__(self) -> None:
        self.bufs: dict[int, torch.Tensor] = {}
        self.written: dict[int, int] = {}   # how many leading rows of each may be non-zero


_pad_buffers = _PadBuffers()


def _padded_bf16(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x [n, k] float32 as bfloat16 in the first n rows of a reused [rows, k] buffer whose other
    rows are zero: one conversion op per call in place of a cast, a zeros and a cat.

    NOTE: measured in a prompt step of SmolLM2 on CPU (2 threads): a torch op costs ~50 us
    there (each layer's weights stream through the caches and evict torch's code and data),
    and a prompt step ran ~8 of them around each of its 120 matmuls."""
    n, k = x.shape
    p = _pad_buffers
    buf = p.bufs.get(k)
    if buf is None or buf.shape[0] < rows or buf.device != x.device:
        # (a normal tensor even when made in inference mode: a call outside it may reuse it)
        with torch.inference_mode(False):
            buf = p.bufs[k] = torch.zeros(rows, k, dtype=torch.bfloat16, device=x.device)
        p.written[k] = 0
    if p.written[k] > n:
        buf[n:p.written[k]].zero_()
    buf[:n].copy_(x)
    p.written[k] = n
    return buf[:rows]


def _dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear; in steps with prompt tokens on a CPU, and in the decode steps the quantized GEMV
    takes (an LM head without blocks, LoRA deltas: `pads_small_gemms`), each row's sums do not
    depend on how many rows the step had (worker/threads.py says why that matters): a float32
    matmul runs padded with zero rows to a multiple of GEMM_ROW_MULTIPLE rows, a bfloat16 one
    (`--dtype bfloat16`) as `_bf16_linear` runs a GGUF model's (a prompt whose prefix is cached
    computes its last token alone, and M = 1 takes a GEMV whose sums differ)."""
    n = x.shape[0] if x.dim() == 2 else 0
    if n and x.device.type == "cpu" and pads_small_gemms():
        extra = -n % GEMM_ROW_MULTIPLE
        if extra and x.dtype == torch.float32:
            padded = torch.cat((x, x.new_zeros(extra, x.shape[1])))
            return F.linear(padded, weight, bias)[:n]
        if x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16:
            return _bf16_linear(x, weight, bias).to(torch.bfloat16)
    return F.linear(x, weight, bias)


def quant_serves(x: torch.Tensor, quant: PackedQuant | None) -> bool:
    """Whether `quant_linear` can compute x [T, in] with `quant` (CPU float32 rows)."""
    return quant is not None and x.dim() == 2 and x.dtype == torch.float32 and x.device.type == "cpu"


def dequantized(quant: PackedQuant) -> torch.Tensor:
    """The float32 [rows, cols] weight `quant`'s blocks hold (the values the loader gives it)."""
    out = np.empty((quant.rows, quant.cols), dtype=np.float32)
    _core.dequantize_packed(out, quant.data, quant.ggml_type, kernel_threads())
    return torch.from_numpy(out)


def quant_linear(x: torch.Tensor, bias: torch.Tensor | None, quant: PackedQuant,
                 threads: int | None = None) -> torch.Tensor:
    # (numpy allocates the output: a torch op right after the weights streamed through the
    # caches costs ~0.1 ms, models/cpu_decoder.py)
    out = np.empty((x.shape[0], quant.rows), dtype=np.float32)
    _core.quant_matmul(out, x.contiguous().numpy(), quant.data, quant.ggml_type,
                       quant.rows, quant.cols, threads or kernel_threads())
    return torch.from_numpy(out) if bias is None else torch.from_numpy(out).add_(bias)


class Linear(nn.Linear):
    """nn.Linear that may also hold its weight as GGUF blocks (`quant`, set after loading)."""

    quant: PackedQuant | None = None
    batch_invariant: bool = False    # set by the model's set_batch_invariant
    # A bfloat16 copy of the weight for steps the quantized GEMV does not take (prompts, big
    # decode batches), in oneDNN's prepacked layout where `pack_bf16` vouches for it: set with
    # `quant` on CPUs with native bf16 (worker/threads.py: native_bf16), where it computes
    # those steps' matmuls ~2x faster than fp32. Its rounding (inputs and outputs to 8
    # significant bits, fp32 accumulation) is of the order of the int8 activations the
    # quantized GEMV already uses, and far below the GGUF weights' own quantization error.
    bf16_weight: torch.Tensor | None = None
    # LoRA adapters targeting this linear (models/lora.py: attach); None: none, and the only
    # cost a model without adapters pays here is this test.
    lora = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.bias, self.quant, self.batch_invariant, self.bf16_weight)
        return y if self.lora is None else self.lora.add(x, y, self.batch_invariant)


class QKVLinear(Linear):
    """Q, K and V projections fused into one GEMM: output [T, (heads + 2 kv_heads) * head_dim]."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool):
        super().__init__(hidden, (num_heads + 2 * num_kv_heads) * head_dim, bias=bias)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim


class GateUpMLP(nn.Module):
    """Gated MLP with gate and up fused into one GEMM: down(act(gate(x)) * up(x)), act SiLU
    (SwiGLU) or, for Gemma, tanh-approximated GELU (`gelu_pytorch_tanh`, GeGLU)."""

    fused: Any = None   # the fused layer ops (RMSNorm.fused): SwiGLU's product in one kernel

    def __init__(self, hidden: int, intermediate: int, act: str = "silu"):
        super().__init__()
        if act not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"unsupported MLP activation {act!r} (silu or gelu_pytorch_tanh)")
        self.intermediate = intermediate
        self.gelu = act == "gelu_pytorch_tanh"
        self.gate_up = Linear(hidden, 2 * intermediate, bias=False)
        self.down = Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up(x)
        if self.fused is not None and not self.gelu and gate_up.dim() == 2:
            out = gate_up.new_empty(gate_up.shape[0], self.intermediate)
            self.fused.silu_and_mul(out, gate_up)
            return self.down(out)
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down((F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)) * up)


class PlainMLP(nn.Module):
    """Ungated MLP with biases (StarCoder2's c_fc and c_proj): proj(act(fc(x))), act the
    tanh-approximated GELU (`gelu_pytorch_tanh`) or the exact one (`gelu`: Pythia's)."""

    def __init__(self, hidden: int, intermediate: int, act: str):
        super().__init__()
        if act not in ("gelu_pytorch_tanh", "gelu"):
            raise ValueError(f"unsupported MLP activation {act!r} (gelu_pytorch_tanh or gelu)")
        self.approximate = "tanh" if act == "gelu_pytorch_tanh" else "none"
        self.fc = Linear(hidden, intermediate, bias=True)
        self.proj = Linear(intermediate, hidden, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate=self.approximate))


# An expert given at least this many rows of a step runs its quantized GEMV on the kernel pool.
EXPERT_POOL_ROWS = 32


class MoEMLP(nn.Module):
    """Sparse mixture-of-experts MLP (Mixtral, Qwen2/Qwen3-MoE, OLMoE, GraniteMoE). A router
    scores the experts; each token takes its `top_k` (softmax over all experts in float32, then
    the top k, renormalized to sum to 1 with `norm_topk_prob`; GraniteMoE's `softmax_topk`: a
    softmax over the top k scores alone, the same weights rounded once less). Each expert is a
    SwiGLU MLP, and a token's output is its experts' outputs weighted by their probabilities
    (rounded to the model's dtype), added in expert order. Qwen2-MoE adds a shared expert to
    every token, weighted by the sigmoid of its own gate (`shared_intermediate` > 0).

    Each expert computes the rows routed to it as one GEMM through `linear`, so a row's sums do
    not depend on the rest of the step where the dense layers' do not (and row by row with
    --batch-invariant); the accumulation order is the expert order whatever the batch.

    `quant` ("gate_up" / "down" -> each expert's packed GGUF blocks; llama.quantize_experts):
    the experts' rows run the quantized GEMV where a linear's would (few-token decode steps);
    once a served model released their float32 stacks (a GGUF MoE model then holds its experts
    as the file's blocks only), they run it in every decode step, and prompt steps compute each
    expert's float32 from its blocks, the values it would have held (`layers.linear`)."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, norm_topk_prob: bool,
                 shared_intermediate: int = 0, softmax_topk: bool = False):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be between 1 and the {num_experts} experts")
        self.intermediate, self.num_experts, self.top_k = intermediate, num_experts, top_k
        self.norm_topk_prob, self.softmax_topk = norm_topk_prob, softmax_topk
        self.router = Linear(hidden, num_experts, bias=False)
        # each expert's gate|up [2I, H] and down [H, I], stacked
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden), requires_grad=False)
        self.down = nn.Parameter(torch.empty(num_experts, hidden, intermediate), requires_grad=False)
        self.shared = GateUpMLP(hidden, shared_intermediate) if shared_intermediate else None
        self.shared_gate = Linear(hidden, 1, bias=False) if shared_intermediate else None
        self.batch_invariant = False    # set by the model's set_batch_invariant
        self.quant: dict[str, list[PackedQuant]] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        scores = self.router(x)
        if self.softmax_topk:
            top, experts = scores.float().topk(self.top_k, dim=-1)
            weights = torch.softmax(top, dim=-1)
        else:
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
            weights, experts = probs.topk(self.top_k, dim=-1)      # [T, k]
            if self.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype).view(-1)
        flat = experts.view(-1)
        order = flat.argsort(stable=True)                          # (token, slot) pairs by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if not n:
                continue
            pairs = order[start:start + n]
            start += n
            rows = pairs // self.top_k
            # NOTE: an expert's few rows run its GEMV on one thread: between such short calls
            # the kernel pool's other worker spins (rust/kernels/src/pool.rs), which on this
            # machine class made a 16-sequence decode step of 32 experts ~3x slower than one
            # thread (benches/moe_gguf_step.py).
            threads = 1 if n < EXPERT_POOL_ROWS else None
            gate, up = linear(x[rows], self.gate_up[e], None, self._quant("gate_up", e), self.batch_invariant,
                              threads=threads).split(self.intermediate, -1)
            y = linear(F.silu(gate) * up, self.down[e], None, self._quant("down", e), self.batch_invariant,
                       threads=threads)
            out.index_add_(0, rows, y * weights[pairs, None])
        if self.shared is not None:
            out = out + _rowwise_sigmoid(self.shared_gate(x)) * self.shared(x)
        return out


    def _quant(self, which: str, expert: int) -> PackedQuant | None:
        packed = self.quant.get(which)
        return packed[expert] if packed else None


def _rowwise_sigmoid(g: torch.Tensor) -> torch.Tensor:
    """sigmoid of g [T, 1], each row's the same whatever T is. A CPU elementwise kernel computes
    whole vectors with its vector code and the leftover elements with its scalar code, which
    rounds differently; a column of T gates would put each row in one or the other by T. Each
    row is computed in a vector of its own (64 lanes: whole vectors at any SIMD width)."""
    return torch.sigmoid(g.expand(-1, 64).contiguous())[:, :1]


class PagedAttention(nn.Module):
    """Writes this step's K/V into the paged cache and attends over each sequence's context."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, *, scale: float | None = None,
                 window: int = 0, softcap: float = 0.0):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.window = window            # > 0: sliding-window attention over that many keys
        self.softcap = softcap          # > 0: scores soft-capped (Gemma 2)
        self.batch_invariant = False    # set by the model's set_batch_invariant

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn: AttentionMetadata,
                kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """q [T, heads, head_dim], k/v [T, kv_heads, head_dim] -> [T, heads * head_dim]."""
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], attn, self.scale,
                              batch_invariant=self.batch_invariant, window=self.window, softcap=self.softcap)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
