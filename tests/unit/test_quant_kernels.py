"""The quantized GEMV (`_core.quant_matmul`, rust/kernels quant.rs) and its use in the model.

- the kernel against gguf's own `dequantize` + a float64 matmul, every format, 1-9 tokens;
- bad input is a ValueError, never a crash;
- a model's linears take the quantized path for steps of <= 8 fp32 CPU tokens, fp32 above;
- the SmolLM2 GGUF: raw blocks kept by the loader (Q/K rows un-permuted) dequantize to exactly
  the fp32 weights, and greedy output with `quantized_decode` on equals it off.
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


def _run(raw: np.ndarray, qtype: GT, x: np.ndarray, threads: int = 1) -> np.ndarray:
    rows, cols = raw.shape[0], x.shape[1]
    out = np.full((x.shape[0], rows), np.nan, np.float32)
    _core.quant_matmul(out, x, raw, int(qtype), rows, cols, threads)
    return out


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
@pytest.mark.parametrize("tokens", [1, 2, 3, 4, 9])
@pytest.mark.parametrize("rows,cols", [(1, 32), (37, 96), (193, 576)])
def test_kernel_matches_gguf_dequantize_then_matmul(qtype, tokens, rows, cols):
    rng = np.random.default_rng(rows * 100 + tokens)
    raw = _blocks(rng, qtype, rows, cols)
    x = rng.standard_normal((tokens, cols)).astype(np.float32)
    w = dequantize(raw, qtype).astype(np.float64)
    want = x.astype(np.float64) @ w.T
    scale = np.abs(x).astype(np.float64) @ np.abs(w).T
    got = _run(raw, qtype, x, threads=2)
    np.testing.assert_array_less(np.abs(got - want), 1e-5 * scale + 1e-6)


def test_thread_count_does_not_change_bits():
    rng = np.random.default_rng(0)
    raw = _blocks(rng, GT.Q4_1, 4001, 64)   # > 32 KiB a thread, so it does split
    x = rng.standard_normal((3, 64)).astype(np.float32)
    one = _run(raw, GT.Q4_1, x, 1)
    for threads in (2, 5):
        np.testing.assert_array_equal(one, _run(raw, GT.Q4_1, x, threads))


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
    x = np.ones((2, 64), np.float32)
    out = np.zeros((2, 5), np.float32)
    q4_1 = int(GT.Q4_1)
    cases = [
        (out, x, raw, int(GT.Q5_0), 5, 64, 1),  # a format the kernel does not read
        (out, x, raw, q4_1, 5, 48, 1),          # cols not a multiple of 32
        (out, x, raw, q4_1, 6, 64, 1),          # rows disagree with w_raw
        (out, x, raw, int(GT.Q8_0), 5, 64, 1),  # bytes per row of another format
        (out, np.ones((2, 32), np.float32), raw, q4_1, 5, 64, 1),
        (np.zeros((3, 5), np.float32), x, raw, q4_1, 5, 64, 1),
        (out, np.ones((2, 128), np.float32)[:, ::2], raw, q4_1, 5, 64, 1),  # not contiguous
        (out, x, raw, q4_1, 5, 64, 0),
    ]
    frozen = out.copy()
    frozen.flags.writeable = False
    cases.append((frozen, x, raw, q4_1, 5, 64, 1))  # read-only out
    for args in cases:
        with pytest.raises(ValueError, match="quant_matmul"):
            _core.quant_matmul(*args)
    with pytest.raises(TypeError):
        _core.quant_matmul(out, x.astype(np.float64), raw, q4_1, 5, 64, 1)
    _core.quant_matmul(out, x, raw, q4_1, 5, 64, 1)
    assert np.isfinite(out).all()


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
    lin.quant = QuantTensor(raw, int(GT.Q4_0), 40, 64)
    deq = torch.from_numpy(dequantize(raw, GT.Q4_0))
    with torch.inference_mode():
        for tokens, weight in ((1, deq), (QUANT_MAX_TOKENS, deq), (QUANT_MAX_TOKENS + 1, lin.weight)):
            x = torch.randn(tokens, 64)
            want = x.double() @ weight.double().T + lin.bias.double()
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


def _greedy(quantized_decode: bool, prompts: list[str], n: int) -> list[str]:
    from llmserve import LLM

    llm = LLM(None, max_model_len=512, num_kv_blocks=64, quantized_decode=quantized_decode)
    results = llm.generate(prompts, {"max_tokens": n, "min_tokens": n, "temperature": 0})
    assert all(r.usage["completion_tokens"] == n for r in results)
    return [r.text for r in results]


def test_smollm2_greedy_output_equals_fp32_path():
    prompts = ["The capital of France is", "def fibonacci(n):",
               "Once upon a time, in a small village,", "List three colors:"]
    assert _greedy(True, prompts, 32) == _greedy(False, prompts, 32)


def test_model_uses_quantized_blocks_on_cpu_fp32_only(smollm2):
    from llmserve.models import build_model

    ck = smollm2
    model = build_model(ck.hf_config, ck.weights, torch.float32, "cpu", quantized=ck.quantized)
    assert model.lm_quant is not None and model.lm_quant.ggml_type == int(GT.Q8_0)
    qkv = model.layers[0].attn.qkv.quant
    assert (qkv.rows, qkv.cols) == tuple(model.layers[0].attn.qkv.weight.shape) == (960, 576)
    assert model.layers[5].mlp.gate_up.quant.rows == 2 * 1536
    # logits of one token through both paths agree closely (summation order differs)
    h = torch.randn(1, 576)
    with torch.inference_mode():
        quant_logits = model.compute_logits(h)
        fp32_logits = torch.nn.functional.linear(h, model.embed_tokens.weight)
    torch.testing.assert_close(quant_logits, fp32_logits, rtol=1e-4, atol=1e-4)
    plain = build_model(ck.hf_config, ck.weights, torch.float32, "cpu")
    assert plain.lm_quant is None and plain.layers[0].attn.qkv.quant is None
