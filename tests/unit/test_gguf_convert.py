"""gguf_convert: GGUF block types rewritten into the ones the quantized GEMV reads, checked
against the gguf package's own dequantizers (the independent reference) on random blocks with
edge values.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as GT
from gguf.quants import dequantize

from llmserve.loaders import gguf_convert as gc

torch.set_num_threads(1)

BYTES = {GT.Q4_0: 18, GT.Q4_1: 20, GT.Q5_0: 22, GT.Q5_1: 24, GT.Q8_0: 34, GT.Q2_K: 84, GT.Q3_K: 110,
         GT.Q4_K: 144, GT.Q5_K: 176, GT.Q6_K: 210}
WEIGHTS = {t: 256 if t.name.endswith("_K") else 32 for t in BYTES}


def _f16(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float16).view(np.uint8).reshape(-1, 2)


def random_blocks(qtype: GT, n: int, rng: np.random.Generator, scale: float = 1e-3) -> np.ndarray:
    """n blocks of `qtype` (uint8 [n, bytes]): random quants, f16 scales of real files' size
    (weights of ~0.05), and edge values in the first blocks: scales 0, every 6-bit sc/m at 63
    or 0, Q6_K scales of -128 and 127, negative d."""
    b = rng.integers(0, 256, size=(n, BYTES[qtype]), dtype=np.uint8)

    def put(at: int, lo: float, hi: float) -> None:
        b[:, at:at + 2] = _f16(rng.uniform(lo, hi, n) * scale)

    t = qtype
    if t in (GT.Q4_0, GT.Q5_0, GT.Q8_0):
        put(0, -8, 8)
        b[0, 0:2] = 0                                     # d = 0
    elif t in (GT.Q4_1, GT.Q5_1):
        put(0, 0, 8), put(2, -60, 60)
        b[0, 0:4] = 0                                     # d = m = 0
        b[1, 0:2] = 0                                     # d = 0: every weight m
    elif t in (GT.Q4_K, GT.Q5_K):
        put(0, 0, 0.3), put(2, 0, 0.3)
        b[0, 0:4] = 0                                     # d = dmin = 0
        b[1, 4:16] = 0xFF                                 # sc = m = 63 everywhere
        b[2, 4:16] = 0                                    # sc = m = 0: an all-zero block
        b[3, 4:16] = 0x0F                                 # sc 4-7, m 0-3 at 15; others 0
        b[4, 2:4] = 0                                     # dmin = 0: Q4_K is Q4_0-like
    elif t == GT.Q6_K:
        put(208, -0.3, 0.3)
        b[0, 208:210] = 0                                 # d = 0
        b[1, 192:208] = np.array([-128, 127] * 8, dtype=np.int8).view(np.uint8)
        b[2, 192:208] = 0                                 # every scale 0
    elif t == GT.Q2_K:
        put(80, 0, 0.3), put(82, 0, 0.3)
        b[0, 80:84] = 0
    elif t == GT.Q3_K:
        put(108, -0.3, 0.3)
        b[0, 108:110] = 0
    return b


def _scales(blocks: np.ndarray, at: int) -> np.ndarray:
    return blocks[:, at:at + 2].copy().view(np.float16).astype(np.float32)


@pytest.mark.parametrize("src", [GT.Q5_0, GT.Q4_0])
def test_q5_0_and_q4_0_become_q8_0_exactly(src):
    rng = np.random.default_rng(0)
    data = random_blocks(src, 8 * 40, rng).reshape(8, -1)   # 8 rows of 40 blocks
    out = gc.convert(data, int(src), gc.Q8_0)
    assert out.shape == (8, 40 * 34)
    np.testing.assert_array_equal(dequantize(out, GT.Q8_0), dequantize(data, src))


def test_q4_k_becomes_q4_1_within_the_f16_rounding_of_its_scales():
    """w = d*sc*q - dmin*m is Q4_1 with d' = f16(d*sc), m' = f16(-dmin*m): each weight moves by
    at most half an f16 ulp of m' plus 15 of d' (relative 2^-11; 2^-25 absolute where subnormal)."""
    rng = np.random.default_rng(1)
    data = random_blocks(GT.Q4_K, 4 * 64, rng).reshape(4, -1)
    out = gc.convert(data, gc.Q4_K, gc.Q4_1)
    assert out.shape == (4, 64 * 8 * 20)
    got = dequantize(out, GT.Q4_1).reshape(-1, 32)
    want = dequantize(data, GT.Q4_K).reshape(-1, 32)
    blocks = out.reshape(-1, 20)
    d, m = _scales(blocks, 0), _scales(blocks, 2)
    bound = (15 * np.abs(d) + np.abs(m)) * 2.0**-11 + 16 * 2.0**-25
    assert (np.abs(got - want) <= bound).all()
    # the edge blocks: zeros stay zeros, sc = m = 63 converts like any other
    assert not got[:8].any() and not got[16:24].any()
    # the nibbles themselves are kept: with the converted scales, the values are exact
    q = np.concatenate([blocks[:, 4:20] & 15, blocks[:, 4:20] >> 4], axis=1)
    np.testing.assert_array_equal(got, d * q + m)


@pytest.mark.parametrize("src", [GT.Q6_K, GT.Q5_K, GT.Q5_1, GT.Q4_1, GT.Q4_K, GT.Q3_K, GT.Q2_K])
def test_requantized_to_q8_0_within_half_its_step(src):
    """d = max|w| / 127 rounded up to f16, q = round-half-even(w / d): every weight within d/2,
    no |q| above 127, and d at most one f16 ulp over max|w| / 127."""
    rng = np.random.default_rng(2)
    blocks_per_row = 2 if WEIGHTS[src] == 256 else 16
    data = random_blocks(src, 16 * blocks_per_row, rng).reshape(16, -1)
    out = gc.convert(data, int(src), gc.Q8_0)
    got = dequantize(out, GT.Q8_0).reshape(-1, 32)
    want = dequantize(data, src).astype(np.float32).reshape(-1, 32)
    blocks = out.reshape(-1, 34)
    d = _scales(blocks, 0)
    assert (np.abs(got - want) <= d / 2 * (1 + 2**-20)).all()
    amax = np.abs(want).max(axis=1, keepdims=True)
    assert (d * 127 >= amax).all() and (d <= amax / 127 * (1 + 2**-10) + 2**-24).all()
    assert (blocks[:, 2:].view(np.int8) != -128).all()
    zero = amax[:, 0] == 0
    assert zero.any() and not got[zero].any() and not blocks[zero].any()   # (scale 0 blocks)


def test_own_decoders_equal_ggufs():
    rng = np.random.default_rng(3)
    for src in (GT.Q4_1, GT.Q5_1, GT.Q4_K, GT.Q5_K, GT.Q6_K):
        blocks = random_blocks(src, 64, rng)
        np.testing.assert_array_equal(gc._values(blocks, int(src)).reshape(-1),
                                      dequantize(blocks, src).reshape(-1), err_msg=src.name)


def test_round_half_to_even_and_overflow():
    w = np.zeros((1, 32), dtype=np.float32)
    w[0, 0], w[0, 1], w[0, 2] = 127.0, 2.5, -0.5   # d = 1: 2.5 -> 2, -0.5 -> -0
    out = gc._requantize_q8_0(w)
    assert _scales(out, 0)[0, 0] == 1.0
    assert out[0, 2:5].view(np.int8).tolist() == [127, 2, 0]
    with pytest.raises(ValueError, match="float16"):
        gc._requantize_q8_0(np.full((1, 32), 1e7, dtype=np.float32))


def test_group_targets():
    assert gc.group_target([gc.Q4_K, gc.Q4_K]) == gc.Q4_1
    assert gc.group_target([gc.Q4_K, gc.Q4_K, gc.Q6_K]) == gc.Q8_0   # Q4_K_M's q, k, v
    assert gc.group_target([gc.Q5_0]) == gc.Q8_0
    assert gc.group_target([gc.Q4_1, gc.Q8_0]) == gc.Q8_0
    assert gc.group_target([gc.Q4_0]) == gc.Q4_0
    assert gc.group_target([gc.Q4_K, 1]) is None                       # an F16 part
    assert gc.group_target([int(GT.IQ4_XS)]) is None
