"""gguf_convert: GGUF block types rewritten into the ones the quantized GEMV reads, checked
against the gguf package's own dequantizers (the independent reference) on random blocks with
edge values; and a GGUF model of those types loaded and built with blocks on its linears.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as GT
from gguf.quants import dequantize

from llmserve.loaders import load_checkpoint
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


# --- a GGUF model of these types ---------------------------------------------------------

# Per layer, Q4_K_M's mix: Q4_K q/k/o/gate/up, Q6_K v and down; layer 1's v is F16 (its q/k/v
# then keep the file's values, no blocks); a Q6_K tied embedding.
TYPES = {"q_proj": GT.Q4_K, "k_proj": GT.Q4_K, "v_proj": GT.Q6_K, "o_proj": GT.Q5_K,
         "gate_proj": GT.Q4_K, "up_proj": GT.Q4_K, "down_proj": GT.Q6_K, "embed_tokens": GT.Q6_K}


def _kquant_file(tmp_path):
    from test_loaders import write_gguf
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=128,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)).eval()
    rng = np.random.default_rng(4)

    def blocks(hf: str, data: np.ndarray):
        if hf == "model.layers.1.self_attn.v_proj.weight":
            return data.astype(np.float16), GT.F16
        qtype = TYPES[hf.split(".")[-2]]
        rows, cols = data.shape
        return random_blocks(qtype, rows * cols // 256, rng, 2e-4).reshape(rows, -1), qtype

    path = tmp_path / "tiny.Q4_K_M.gguf"
    write_gguf(path, model, blocks=blocks)
    return path


def test_kquant_model_has_blocks_on_its_linears(tmp_path):
    from test_loaders import gguf_file_values

    from llmserve.models import build_model

    path = _kquant_file(tmp_path)
    plain = load_checkpoint(str(path))                          # the file's own values
    ck = load_checkpoint(str(path), quantized_decode=True)
    want_types = {"layers.0.attn.qkv": gc.Q8_0, "layers.0.attn.o_proj": gc.Q8_0,   # (mixed; Q5_K)
                  "layers.0.mlp.gate_up": gc.Q4_1, "layers.0.mlp.down": gc.Q8_0,
                  "layers.1.attn.qkv": None, "layers.1.attn.o_proj": gc.Q8_0,
                  "layers.1.mlp.gate_up": gc.Q4_1, "layers.1.mlp.down": gc.Q8_0}
    assert len(plain.quantized) == 0
    no_blocks = {f"model.layers.1.self_attn.{p}_proj.weight" for p in "qkv"}
    assert set(ck.quantized) == {n for n in plain.weights if n.endswith("_proj.weight")} - no_blocks | {
        "model.embed_tokens.weight"}

    for name, file in gguf_file_values(path, {".q_proj.": 4, ".k_proj.": 2}):
        assert torch.equal(plain.weights[name], file), name
        if name not in ck.quantized:
            assert torch.equal(ck.weights[name], file), name   # (F16 group, norms)
            continue
        # one set of weights: the served values are the converted blocks', near the file's
        w = ck.weights[name]
        q = ck.quantized[name]
        assert torch.equal(w, torch.from_numpy(dequantize(q.data, GT(q.ggml_type))).reshape(w.shape)), name
        assert (w - file).abs().max() <= file.abs().max() / 127, name
        index = np.arange(0, w.numel(), 97)
        assert torch.equal(ck.weights.sample(name, index), w.reshape(-1)[torch.from_numpy(index)]), name

    ck = load_checkpoint(str(path), quantized_decode=True)
    model = build_model(ck.hf_config, ck.weights, torch.float32, "cpu", quantized=ck.quantized, serving=True)
    assert len(ck.weights) == len(ck.quantized) == 0
    for name, want in want_types.items():
        q = model.get_submodule(name).quant
        assert (q.ggml_type if q is not None else None) == want, name
    assert model.lm_quant is not None and model.lm_quant.ggml_type == gc.Q8_0
    # the embedding the model looks tokens up in is the LM head's blocks' values too
    emb = load_checkpoint(str(path), quantized_decode=True).quantized["model.embed_tokens.weight"]
    assert torch.equal(model.embed_tokens.weight,
                       torch.from_numpy(dequantize(emb.data, GT.Q8_0)).reshape(64, 256))


def test_conversions_count_in_the_fingerprint(tmp_path, monkeypatch):
    """Q5_0 -> Q8_0 is exact, so the weights (and their samples) are the file's; what changes is
    that the GEMV computes the linears: the conversions are named among the fingerprint's
    numerics, and only when they are made (not with --no-quantized-decode)."""
    import llmserve.engine.build as build
    from llmserve.config import Config, DeviceConfig, ModelConfig
    from test_loaders import tiny_llama, write_gguf

    path = tmp_path / "tiny.Q5_0.gguf"
    write_gguf(path, tiny_llama(tie=True), quant="Q5_0")
    ck, plain = load_checkpoint(str(path), quantized_decode=True), load_checkpoint(str(path))
    assert ck.conversions == ("Q5_0->Q8_0 x15",) and plain.conversions == ()   # 2 layers x 7 + head
    for name in plain.weights:
        assert torch.equal(ck.weights[name], plain.weights[name]), name
    numerics: list[tuple] = []
    real = build.system_fingerprint
    monkeypatch.setattr(build, "system_fingerprint", lambda *a: numerics.append(a[1:]) or real(*a))
    for on in (True, False):
        build.build_engine(Config(model=ModelConfig(model=str(path), quantized_decode=on),
                                  device=DeviceConfig(threads=1)))
    assert numerics[0][-1] == "Q5_0->Q8_0 x15" and "Q5_0->Q8_0 x15" not in numerics[1]
