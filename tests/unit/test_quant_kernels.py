"""The quantized GEMV (`_core.quant_matmul`, rust/kernels/src/quant/) and its use in the model.

The kernel rounds each token's activations to int8 blocks of 32 (scale max|x| / 127, round half
to even; llama.cpp's q8 activation blocks) and multiplies them with the weights' integers, so
its result is the dequantized weights times the *rounded* x, not exactly the fp32 matmul.

- the kernel against gguf's own `dequantize` + a float64 matmul with x rounded the same way
  (tight), and with x as it is (within the most that rounding can move it), every format,
  1-9 tokens;
- bad input is a ValueError, never a crash;
- a model's linears take the quantized path for steps of <= QUANT_MAX_TOKENS fp32 CPU tokens, fp32 above;
- the SmolLM2 GGUF: raw blocks kept by the loader (Q/K rows un-permuted) dequantize to exactly
  the fp32 weights, and decoding with `quantized_decode` on stays close to it off.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GT
from gguf.quants import dequantize, quantize

from llmserve import _core
from llmserve.loaders import QuantTensor
from llmserve.models.layers import QUANT_MAX_TOKENS, Linear

FORMATS = [GT.Q8_0, GT.Q4_0, GT.Q4_1]


def _blocks(rng: np.random.Generator, qtype: GT, rows: int, cols: int) -> np.ndarray:
    # Rows with a per-row offset exercise Q4_1's min and Q4_0's asymmetric range.
    w = rng.standard_normal((rows, cols)).astype(np.float32) + rng.standard_normal((rows, 1)).astype(np.float32)
    return np.ascontiguousarray(quantize(w, qtype))


def _round_x(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [T, K] as the kernel rounds it, in float64 (exact), and each value's block scale d.
    The same float32 operations as the kernel: d = max|x| / 127, q = rint(x * (127 / max|x|))."""
    b = x.astype(np.float32).reshape(x.shape[0], -1, 32)
    amax = np.abs(b).max(axis=2, keepdims=True)
    d = amax / np.float32(127)
    inv = np.float32(127) / np.where(amax > 0, amax, np.float32(1))
    inv = np.where(amax > 0, inv, np.float32(0)).astype(np.float32)
    q = np.rint(b * inv)
    assert np.abs(q).max() <= 127
    xq = q.astype(np.float64) * d.astype(np.float64)
    return xq.reshape(x.shape), np.broadcast_to(d, b.shape).reshape(x.shape).astype(np.float64)


def _check_against_references(got: np.ndarray, x: np.ndarray, w: np.ndarray) -> None:
    """`got` (x @ w.T from the kernel) against float64 references: tight against the rounded
    x (only f32 rounding of the per-block sums apart), and against x itself within the bound
    |x - d q| <= d / 2 that rounding allows."""
    w = w.astype(np.float64)
    xq, d = _round_x(x)
    mag = np.abs(xq) @ np.abs(w).T
    tight = 1e-5 * mag + 1e-6
    np.testing.assert_array_less(np.abs(got - xq @ w.T), tight)
    rounding = (d / 2) @ np.abs(w).T
    np.testing.assert_array_less(np.abs(got - x.astype(np.float64) @ w.T), rounding + tight)


def _run(raw: np.ndarray, qtype: GT, x: np.ndarray, threads: int = 1) -> np.ndarray:
    rows, cols = raw.shape[0], x.shape[1]
    out = np.full((x.shape[0], rows), np.nan, np.float32)
    _core.quant_matmul(out, x, _core.quant_pack(raw, int(qtype)), int(qtype), rows, cols, threads)
    return out


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
@pytest.mark.parametrize("tokens", [1, 2, 3, 4, 9])
@pytest.mark.parametrize("rows,cols", [(1, 32), (37, 96), (193, 576)])
def test_kernel_matches_gguf_dequantize_then_matmul(qtype, tokens, rows, cols):
    rng = np.random.default_rng(rows * 100 + tokens)
    raw = _blocks(rng, qtype, rows, cols)
    x = rng.standard_normal((tokens, cols)).astype(np.float32)
    x[0, :32] *= 1e-3            # blocks of very different scales within one token
    if cols > 32:
        x[-1, 32:64] = 0.0       # an all-zero block (scale 0)
    _check_against_references(_run(raw, qtype, x, threads=2), x, dequantize(raw, qtype))


def test_rounding_error_is_small_relative_to_the_fp32_result():
    # What the int8 activations cost against the fp32 product, per output row (norm over 256
    # outputs). For Gaussian x a block's scale is d ~ 2.5 sigma / 127, the rounding error is
    # uniform in +-d/2 (RMS d / sqrt(12) ~ 0.6% of sigma), and a dot product of uncorrelated
    # vectors keeps that relative error: ~0.6%, more when the weights share an offset.
    rng = np.random.default_rng(4)
    for qtype in FORMATS:
        raw = _blocks(rng, qtype, 256, 576)
        w = dequantize(raw, qtype).astype(np.float64)
        x = rng.standard_normal((4, 576)).astype(np.float32)
        got = _run(raw, qtype, x, threads=2)
        want = x.astype(np.float64) @ w.T
        rel = np.linalg.norm(got - want, axis=1) / np.linalg.norm(want, axis=1)
        assert 1e-3 < rel.mean() < 1e-2 and rel.max() < 1.5e-2, (qtype.name, rel)


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_thread_count_does_not_change_bits(qtype):
    rng = np.random.default_rng(0)
    raw = _blocks(rng, qtype, 4001, 64)   # > 32 KiB a thread, so it does split
    x = rng.standard_normal((3, 64)).astype(np.float32)
    one = _run(raw, qtype, x, 1)
    for threads in (2, 5):
        np.testing.assert_array_equal(one, _run(raw, qtype, x, threads))


def test_kernel_threads_work_in_a_forked_child():
    # The kernels' worker pool lives in the parent; a forked child (multiprocessing's default
    # on Linux) must get its own workers instead of waiting for threads it does not have.
    import os
    import time

    rng = np.random.default_rng(1)
    raw = _blocks(rng, GT.Q4_1, 4001, 64)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    want = _run(raw, GT.Q4_1, x, 2)    # the parent's pool exists now
    pid = os.fork()
    if pid == 0:
        ok = np.array_equal(_run(raw, GT.Q4_1, x, 2), want)
        os._exit(0 if ok else 1)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    raise AssertionError("the forked child's kernel call hung")


def test_bad_input_is_value_error():
    rng = np.random.default_rng(1)
    raw = _blocks(rng, GT.Q4_1, 5, 64)          # [5, 40]
    packed = _core.quant_pack(raw, int(GT.Q4_1))
    assert packed.shape == (1, 8 * 40)          # one group of 8 rows, 3 of them padding
    x = np.ones((2, 64), np.float32)
    out = np.zeros((2, 5), np.float32)
    q4_1 = int(GT.Q4_1)
    cases = [
        (out, x, packed, int(GT.Q5_0), 5, 64, 1),  # a format the kernel does not read
        (out, x, packed, q4_1, 5, 48, 1),          # cols not a multiple of 32
        (out, x, packed, q4_1, 9, 64, 1),          # rows disagree with w_packed
        (out, x, raw, q4_1, 5, 64, 1),             # raw blocks, not packed
        (out, x, packed, int(GT.Q8_0), 5, 64, 1),  # bytes per row of another format
        (out, np.ones((2, 32), np.float32), packed, q4_1, 5, 64, 1),
        (np.zeros((3, 5), np.float32), x, packed, q4_1, 5, 64, 1),
        (out, np.ones((2, 128), np.float32)[:, ::2], packed, q4_1, 5, 64, 1),  # not contiguous
        (out, x, packed, q4_1, 5, 64, 0),
    ]
    frozen = out.copy()
    frozen.flags.writeable = False
    cases.append((frozen, x, packed, q4_1, 5, 64, 1))  # read-only out
    for args in cases:
        with pytest.raises(ValueError, match="quant_matmul"):
            _core.quant_matmul(*args)
    with pytest.raises(TypeError):
        _core.quant_matmul(out, x.astype(np.float64), packed, q4_1, 5, 64, 1)
    for bad_pack in ((raw, int(GT.Q5_0)), (raw[:, :30], q4_1), (raw[:, ::2], q4_1)):
        with pytest.raises(ValueError, match="quant_pack"):
            _core.quant_pack(*bad_pack)
    _core.quant_matmul(out, x, packed, q4_1, 5, 64, 1)
    assert np.isfinite(out).all()


def test_packed_layout_regroups_the_same_bytes():
    """quant_pack moves bytes and adds zero rows up to a multiple of 8, nothing else: each
    group's 8 scales come first, then (Q4_1) its 8 mins, then 4-byte runs of each row's
    integers (rust/kernels/src/quant/pack.rs)."""
    rng = np.random.default_rng(6)
    for qtype, head in ((GT.Q8_0, 2), (GT.Q4_0, 2), (GT.Q4_1, 4)):
        raw = _blocks(rng, qtype, 11, 64)
        bb = raw.shape[1] // 2
        packed = _core.quant_pack(raw, int(qtype))
        assert packed.shape == (2, 8 * 2 * bb)
        padding = np.zeros(packed.size - raw.size, np.uint8)
        np.testing.assert_array_equal(np.sort(packed.ravel()),
                                      np.sort(np.concatenate([raw.ravel(), padding])))
        rec = packed[1, 8 * bb:]                 # group 1 (rows 8..11), block 1
        row = raw[9, bb:]                        # row 9 is lane 1 of group 1
        np.testing.assert_array_equal(rec[2:4], row[:2])             # its scale
        ints = row[head:]
        chunks = rec[8 * head:].reshape(-1, 8, 4)                  # [chunk, lane, 4 bytes]
        np.testing.assert_array_equal(chunks[:, 1].ravel(), ints)
        assert not chunks[:, 3:].any()                              # rows 11..16: padding


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_dequantize_gives_gguf_s_float32_values_exactly(qtype):
    """The loader dequantizes these formats in Rust: the same bits as the gguf package
    (special scales included: 0, a subnormal, inf and nan halves)."""
    rng = np.random.default_rng(7)
    raw = _blocks(rng, qtype, 37, 96)
    bb = raw.shape[1] // 3
    for i, half in enumerate((0x0000, 0x0001, 0x7C00, 0x7E00, 0x8400)):   # the block scale d
        raw[i, :2] = np.frombuffer(np.uint16(half).tobytes(), np.uint8)
        raw[i, bb:bb + 2] = raw[i, :2]
    out = np.full((37, 96), np.nan, np.float32)
    _core.dequantize(out, raw, int(qtype))
    with np.errstate(invalid="ignore"):   # inf * 0
        want = dequantize(raw, qtype).astype(np.float32)
    np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32))
    with pytest.raises(ValueError, match="dequantize"):
        _core.dequantize(np.zeros((37, 64), np.float32), raw, int(qtype))
    with pytest.raises(ValueError, match="dequantize"):
        _core.dequantize(out, raw, int(GT.Q5_0))


def test_quant_tensor_checks_and_concat():
    rng = np.random.default_rng(2)
    a = QuantTensor(_blocks(rng, GT.Q4_1, 3, 64), int(GT.Q4_1), 3, 64)
    b = QuantTensor(_blocks(rng, GT.Q4_1, 2, 64), int(GT.Q4_1), 2, 64)
    c = QuantTensor(_blocks(rng, GT.Q8_0, 2, 64), int(GT.Q8_0), 2, 64)
    ab = QuantTensor.concat([a, b])
    assert (ab.rows, ab.cols) == (5, 64) and ab.data.flags.c_contiguous
    np.testing.assert_array_equal(ab.data[3:], b.data)
    assert QuantTensor.concat([a, c]) is None          # mixed formats: no fused blocks
    with pytest.raises(ValueError):
        QuantTensor(a.data, int(GT.Q4_1), 3, 96)


def test_linear_takes_quantized_path_only_for_few_tokens():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((40, 64)).astype(np.float32)
    raw = np.ascontiguousarray(quantize(w, GT.Q4_0))
    lin = Linear(64, 40, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.from_numpy(w))   # unquantized: differs visibly from the blocks
        lin.bias.copy_(torch.arange(40.0))
    lin.quant = QuantTensor(raw, int(GT.Q4_0), 40, 64).pack()
    deq = torch.from_numpy(dequantize(raw, GT.Q4_0))
    with torch.inference_mode():
        for tokens, weight in ((1, deq), (QUANT_MAX_TOKENS, deq), (QUANT_MAX_TOKENS + 1, lin.weight)):
            x = torch.randn(tokens, 64)
            # the kernel's steps see x rounded to int8 blocks; F.linear's see x as it is
            xr = torch.from_numpy(_round_x(x.numpy())[0]) if weight is deq else x.double()
            want = xr @ weight.double().T + lin.bias.double()
            torch.testing.assert_close(lin(x).double(), want, rtol=1e-5, atol=1e-4)
        # bf16 steps never use the kernel
        x = torch.randn(2, 64, dtype=torch.bfloat16)
        assert lin.to(torch.bfloat16)(x).dtype == torch.bfloat16


# --- the real GGUF ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2():
    from llmserve.loaders import load_checkpoint

    return load_checkpoint(None)


def test_loader_keeps_raw_blocks_matching_the_weights(smollm2):
    ck = smollm2
    q = ck.quantized
    # every linear of SmolLM2 plus the tied embedding; norms are F32 and never kept
    assert len(q) == 30 * 7 + 1
    assert q["model.embed_tokens.weight"].ggml_type == int(GT.Q8_0)
    assert q["model.layers.0.mlp.down_proj.weight"].ggml_type == int(GT.Q4_1)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.7.self_attn.k_proj.weight",
                 "model.layers.3.self_attn.v_proj.weight", "model.layers.29.mlp.gate_proj.weight"):
        t = q[name]
        deq = dequantize(t.data, GT(t.ggml_type))
        # Q/K: rows of the blocks were un-permuted exactly as the dequantized weights
        np.testing.assert_array_equal(deq, ck.weights[name].numpy(), err_msg=name)


def _greedy(quantized_decode: bool, prompts: list[str], n: int) -> list[dict]:
    """Each prompt's `logprobs` (tokens, token_logprobs, top_logprobs of 5) over n greedy tokens."""
    from llmserve import LLM

    llm = LLM(None, max_model_len=512, num_kv_blocks=64, quantized_decode=quantized_decode)
    results = llm.generate(prompts, {"max_tokens": n, "min_tokens": n, "temperature": 0, "logprobs": 5})
    assert all(r.usage["completion_tokens"] == n for r in results)
    return [r.body["choices"][0]["logprobs"] for r in results]


def test_smollm2_greedy_decoding_stays_close_to_fp32_path():
    # The quantized path rounds activations to int8 (as llama.cpp does), so its logits differ
    # from the fp32 path's (the same dequantized weights) a little, and greedy output may flip
    # where the fp32 path's top two tokens are nearly tied; once flipped, the texts go separate
    # ways, so equal texts are not a property to test. Measured on these prompts over several
    # runs (AVX2; torch layers or the whole-layer Rust decoder around the GEMV, 1-2 threads):
    # the first 15 to 32 tokens agree; before the flip, top-5 logprobs differ by a median of
    # 0.04-0.06, chosen tokens' by at most 0.29, likely (logprob > -3) alternatives' by at most
    # 0.36; flips happen at fp32 margins of 0.01-0.29. (About a third of it comes from the Q8_0
    # LM head, the rest from the layers.) On an AVX512-BF16 host without AMX (bf16 prompt
    # matmuls in one call) one likely alternative moved by 0.53 ("\n" at -2.94, 13 tokens
    # into the first prompt), the rest by at most 0.24. The bounds below leave room over
    # those; the kernel tests above pin the arithmetic itself exactly.
    prompts = ["The capital of France is", "def fibonacci(n):",
               "Once upon a time, in a small village,", "List three colors:"]
    n = 32
    quant, fp32 = _greedy(True, prompts, n), _greedy(False, prompts, n)
    for p, q, f in zip(prompts, quant, fp32):
        same = next((i for i in range(n) if q["tokens"][i] != f["tokens"][i]), n)
        assert same >= 8, (p, same, q["tokens"][same], f["tokens"][same])
        diffs = []
        for i in range(same):   # the same context: the logprobs both list agree
            assert abs(q["token_logprobs"][i] - f["token_logprobs"][i]) < 0.5, (p, i)
            for tok, lp in f["top_logprobs"][i].items():
                if tok in q["top_logprobs"][i]:
                    diffs.append(abs(q["top_logprobs"][i][tok] - lp))
                    assert lp < -3 or diffs[-1] < 0.75, (p, i, tok, lp, diffs[-1])
        assert np.median(diffs) < 0.1, (p, np.median(diffs))
        if same < n:            # a flip only between near-tied tokens
            f_top, q_top = f["top_logprobs"][same], q["top_logprobs"][same]
            f_tok, q_tok = f["tokens"][same], q["tokens"][same]
            assert q_tok in f_top and f["token_logprobs"][same] - f_top[q_tok] < 0.5, (p, same, f_top)
            assert f_tok in q_top and q["token_logprobs"][same] - q_top[f_tok] < 0.5, (p, same, q_top)


def test_model_uses_quantized_blocks_on_cpu_fp32_only(smollm2):
    from llmserve.models import build_model

    ck = smollm2
    model = build_model(ck.hf_config, ck.weights, torch.float32, "cpu", quantized=ck.quantized)
    assert model.lm_quant is not None and model.lm_quant.ggml_type == int(GT.Q8_0)
    qkv = model.layers[0].attn.qkv.quant
    assert (qkv.rows, qkv.cols) == tuple(model.layers[0].attn.qkv.weight.shape) == (960, 576)
    assert model.layers[5].mlp.gate_up.quant.rows == 2 * 1536
    # logits of one token through the Q8_0 LM head: the dequantized weights times h rounded to
    # int8 blocks (up to f32 summation order), and close to the fp32 logits (Gaussian h: ~0.6%
    # relative error, see test_rounding_error_is_small_relative_to_the_fp32_result)
    h = torch.randn(1, 576, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        quant_logits = model.compute_logits(h)
        fp32_logits = torch.nn.functional.linear(h, model.embed_tokens.weight)
    _check_against_references(quant_logits.numpy(), h.numpy(), model.embed_tokens.weight.numpy())
    rel = (quant_logits - fp32_logits).norm() / fp32_logits.norm()
    assert rel < 1.5e-2, rel
    plain = build_model(ck.hf_config, ck.weights, torch.float32, "cpu")
    assert plain.lm_quant is None and plain.layers[0].attn.qkv.quant is None
