"""GGUF block types the quantized GEMV does not read, rewritten at load into ones it does.

The quantized GEMV (rust/kernels/src/quant/) reads Q8_0, Q4_0 and Q4_1 blocks of 32 weights.
The GGUF files people download are mostly K-quants (Q4_K_M mixes Q4_K, Q6_K and, in rows
whose width is no multiple of 256, Q5_0), which would otherwise run as bfloat16 copies at a
third of the speed. So a linear's blocks are converted, 32 weights at a time:

- Q4_K -> Q4_1: a Q4_K sub-block of 32 is w = d*sc*q - dmin*m (q 0..15, 6-bit sc and m),
  which is Q4_1 with d' = f16(d*sc) and m' = f16(-dmin*m). The nibbles are kept; only the
  f16 rounding of d' and m' moves a weight, by at most 15*|d'|*2^-11 + |m'|*2^-11 (d'/2^-11:
  half an f16 ulp, relative), a few hundredths of the Q4 step d' on real files.
- Q5_0, Q4_0 -> Q8_0: exact (q - 16, q - 8 with the same d).
- Q6_K, Q5_K, Q5_1, Q4_1, Q4_K, Q3_K, Q2_K -> Q8_0: requantized from the decoded values,
  d = max|w| / 127 (rounded up to f16) and q = round-half-even(w / d): each weight moves by at
  most d/2 ~ max|w|/254 of its 32-block. That is ~0.07 of a Q6_K step on average on real
  weights, but a Q6_K half-block of 16 whose scale is far below its neighbour's shares the
  neighbour's d, so its weights may move by a few of their own steps (audit 69: up to 2.3, in
  0.01% of weights); the coarser types move less.

The weights a converted model computes with are those blocks' values in every step (the
loader dequantizes the converted blocks, not the file's), so prompt and decode steps agree.
Conversion is row-local (blocks never straddle rows), so it commutes with taking or permuting
rows. Our own decoding of each layout; gguf.quants' dequantizers are the reference the unit
tests check it against (tests/unit/test_gguf_convert.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

_T = GGMLQuantizationType
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = int(_T.Q4_0), int(_T.Q4_1), int(_T.Q5_0), int(_T.Q5_1), int(_T.Q8_0)
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = int(_T.Q2_K), int(_T.Q3_K), int(_T.Q4_K), int(_T.Q5_K), int(_T.Q6_K)

# ggml type -> the type its blocks become alone (a type the GEMV reads maps to itself), and
# (weights, bytes) of one of its blocks.
TARGET: dict[int, int] = {Q4_0: Q4_0, Q4_1: Q4_1, Q8_0: Q8_0, Q4_K: Q4_1, Q5_0: Q8_0, Q5_1: Q8_0,
                          Q5_K: Q8_0, Q6_K: Q8_0, Q2_K: Q8_0, Q3_K: Q8_0}
_BLOCK: dict[int, tuple[int, int]] = {t: GGML_QUANT_SIZES[_T(t)] for t in TARGET}
_CHUNK = 1 << 20   # weights converted at a time (bounds the float32 temporaries to a few MB)


def type_name(ggml_type: int) -> str:
    return _T(ggml_type).name if ggml_type in TARGET else str(ggml_type)


def group_target(types: Sequence[int]) -> int | None:
    """The one type the blocks of weights fused into one linear (each of `types`) become: their
    common TARGET, Q8_0 when those differ (every type here converts to it), None when one of
    them converts to nothing (F16, BF16, IQ*: the linear keeps its float weights)."""
    if any(t not in TARGET for t in types):
        return None
    targets = {TARGET[t] for t in types}
    return targets.pop() if len(targets) == 1 else Q8_0


def convert(data: np.ndarray, src: int, dst: int) -> np.ndarray:
    """Rows of `src` blocks (uint8 [rows, bytes per row]) as `dst` blocks (uint8 [rows, cols / 32
    * dst block bytes]); `dst` is TARGET[src] or Q8_0. ValueError when a scale does not fit
    f16 (values beyond ~8e6, which no trained weight has)."""
    if dst not in (TARGET.get(src), Q8_0):
        raise ValueError(f"{type_name(src)} blocks do not convert to {type_name(dst)}")
    src_weights, src_bytes = _BLOCK[src]
    rows = data.shape[0]
    cols = data.shape[1] // src_bytes * src_weights
    if src == dst:
        return data
    out = np.empty((rows, cols // 32 * _BLOCK[dst][1]), dtype=np.uint8)
    step = max(1, _CHUNK // max(cols, 1))
    for r in range(0, rows, step):
        blocks = np.ascontiguousarray(data[r:r + step]).reshape(-1, src_bytes)
        if dst == Q4_1:
            new = _q4_k_to_q4_1(blocks)
        elif src in (Q4_0, Q5_0):
            new = _q8_0_exact(blocks, src)
        else:
            new = _requantize_q8_0(_values(blocks, src))
        out[r:r + step] = new.reshape(-1, out.shape[1])
    return out


def _f16(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        h = x.astype(np.float16)
    if not np.isfinite(h).all():
        raise ValueError("a block scale exceeds float16 (weights beyond ~8e6): these blocks cannot be "
                         "converted; serve the file with --no-quantized-decode")
    return h


def _scale(blocks: np.ndarray, at: int) -> np.ndarray:
    """The f16 at byte `at` of each block, as float32 [n, 1]."""
    return blocks[:, at:at + 2].copy().view(np.float16).astype(np.float32)


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of eight 6-bit scales and mins -> (sc, m), uint8 [n, 8] each.
    Bytes 0-3 hold sc 0-3 in their low six bits, bytes 4-7 m 0-3; sc/m 4-7 take their low
    four bits from the nibbles of bytes 8-11 and their top two from the spare top bits of
    bytes 0-3 (sc) and 4-7 (m)."""
    a, b, c = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = np.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], axis=1)
    m = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=1)
    return sc, m


def _nibbles(qs: np.ndarray, groups: int) -> np.ndarray:
    """`groups` runs of 32 bytes -> uint8 [n, 2 * groups, 32]: each run's low nibbles are one
    sub-block of 32, its high nibbles the next (the K-quants' order)."""
    x = qs.reshape(qs.shape[0], groups, 1, 32)
    return np.concatenate([x & 15, x >> 4], axis=2).reshape(qs.shape[0], 2 * groups, 32)


def _q4_k_to_q4_1(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    sc, m = _k_scales(blocks[:, 4:16])
    out = np.empty((n, 8, 20), dtype=np.uint8)
    out[:, :, 0:2] = _f16(_scale(blocks, 0) * sc).view(np.uint8).reshape(n, 8, 2)
    out[:, :, 2:4] = _f16(-(_scale(blocks, 2) * m)).view(np.uint8).reshape(n, 8, 2)
    q = _nibbles(blocks[:, 16:144], 4)
    out[:, :, 4:20] = q[:, :, :16] | (q[:, :, 16:] << 4)   # Q4_1: weight j low, j + 16 high
    return out.reshape(n * 8, 20)


def _q_5bit(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's 5-bit values uint8 [n, 32]: weight j's low nibble is qs[j] (j < 16) or
    qs[j - 16] >> 4, its fifth bit bit j of the little-endian uint32 qh."""
    low = np.concatenate([qs & 15, qs >> 4], axis=1)
    return low | (np.unpackbits(qh, axis=1, bitorder="little") << 4)


def _q8_0_exact(blocks: np.ndarray, src: int) -> np.ndarray:
    n = blocks.shape[0]
    if src == Q5_0:
        q = _q_5bit(blocks[:, 2:6], blocks[:, 6:22]).astype(np.int8) - 16
    else:   # Q4_0
        q = np.concatenate([blocks[:, 2:18] & 15, blocks[:, 2:18] >> 4], axis=1).astype(np.int8) - 8
    out = np.empty((n, 34), dtype=np.uint8)
    out[:, 0:2] = blocks[:, 0:2]
    out[:, 2:] = q.view(np.uint8)
    return out


def _values(blocks: np.ndarray, src: int) -> np.ndarray:
    """The float32 weights of `src` blocks, [n weights / 32, 32], as gguf.quants computes them."""
    n = blocks.shape[0]
    if src == Q4_1:
        q = np.concatenate([blocks[:, 4:20] & 15, blocks[:, 4:20] >> 4], axis=1)
        return _scale(blocks, 0) * q + _scale(blocks, 2)
    if src == Q5_1:
        return _scale(blocks, 0) * _q_5bit(blocks[:, 4:8], blocks[:, 8:24]) + _scale(blocks, 2)
    if src in (Q4_K, Q5_K):
        sc, m = _k_scales(blocks[:, 4:16])
        d = (_scale(blocks, 0) * sc)[:, :, None]       # [n, 8, 1]
        dm = (_scale(blocks, 2) * m)[:, :, None]
        if src == Q4_K:
            q = _nibbles(blocks[:, 16:144], 4)
        else:   # Q5_K: bit j of qh[k] is the fifth bit of sub-block j's weight k
            high = np.unpackbits(blocks[:, 16:48, None], axis=2, bitorder="little")   # [n, 32, 8]
            q = _nibbles(blocks[:, 48:176], 4) | (high.transpose(0, 2, 1) << 4)
        return (d * q - dm).reshape(n * 8, 32)
    if src == Q6_K:
        # Two halves of 128 weights; in half h, run t (0..3) of 32 takes its low nibbles from
        # ql[64h + 32(t % 2):] (low nibble for t < 2, high for t >= 2) and its top two bits
        # from bits 2t..2t+1 of qh[32h:]; 16 int8 scales, one per 16 weights.
        ql = blocks[:, 0:128].reshape(n, 2, 1, 64)
        low = np.concatenate([ql & 15, ql >> 4], axis=2).reshape(n, 2, 4, 32)
        qh = blocks[:, 128:192].reshape(n, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1)
        q = (low | ((qh & 3) << 4)).astype(np.int8) - 32                 # [n, 2, 4, 32]
        scales = blocks[:, 192:208].view(np.int8).astype(np.float32)     # [n, 16]
        d = (_scale(blocks, 208) * scales).reshape(n, 16, 1)
        return (d * q.reshape(n, 16, 16)).reshape(n * 8, 32)
    from gguf.constants import GGMLQuantizationType   # Q2_K, Q3_K: rare enough for gguf's decoder
    from gguf.quants import dequantize

    return dequantize(blocks, GGMLQuantizationType(src)).astype(np.float32, copy=False).reshape(-1, 32)


def _requantize_q8_0(w: np.ndarray) -> np.ndarray:
    """float32 [n, 32] -> Q8_0 blocks uint8 [n, 34]: d = the f16 nearest above max|w| / 127,
    q = rint(w / d) (half to even), so |q| <= 127 needs no clipping and every weight moves by
    at most d/2. (NOTE: rounding d up, not to nearest, matters where d is f16-subnormal, below
    2^-14: there the nearest f16 can be far below max|w| / 127 and would clip the largest.)"""
    x = np.abs(w).max(axis=1, keepdims=True) / np.float32(127)
    d16 = _f16(x)
    d16 = np.where(d16.astype(np.float32) < x, np.nextafter(d16, np.float16(np.inf)), d16)
    d = _f16(d16).astype(np.float32)
    q = np.rint(np.divide(w, d, out=np.zeros_like(w), where=d != 0))
    out = np.empty((w.shape[0], 34), dtype=np.uint8)
    out[:, 0:2] = d16.view(np.uint8)
    out[:, 2:] = np.clip(q, -127, 127).astype(np.int8).view(np.uint8)
    return out
