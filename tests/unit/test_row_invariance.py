"""A prompt computes bit-identically however it is split into steps (worker/threads.py): the
second run of a request finds the prompt's start in the prefix cache and computes only the
tail, and CONTRACT promises the same tokens run after run. Checked on a quantized tiny model
through ModelRunner.execute (prompt steps in fp32, decode steps on the int8 GEMV), and the
BLAS property it rests on."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as GT
from gguf.quants import quantize

from _plans import Paged, Row
from test_cpu_decoder import quantized_model

import llmserve.models.layers as layers
import llmserve.models.llama as llama
import llmserve.worker.threads as threads
from llmserve.loaders import QuantTensor
from llmserve.worker import ModelRunner
from llmserve.worker.threads import GEMM_ROW_MULTIPLE, QUANT_MAX_TOKENS, cpu_step, native_bf16, reproducible_blas

torch.set_num_threads(1)


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_blas_computes_gemm_rows_independently_of_m(threads):
    """MKL's fp32 GEMM in the mode llmserve sets: row r of x @ w^T is the same bits for any M
    that is a multiple of GEMM_ROW_MULTIPLE, wherever the row sits. If this fails, the
    installed BLAS breaks the premise of worker/threads.py, and a warm prefix cache can change
    answers. (MKL's default mode failed it on an AVX512 CPU with AMX.)"""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)
        for rows, cols in ((960, 576), (576, 1536), (1000, 64)):
            w = torch.randn(rows, cols, generator=g)
            x = torch.randn(320, cols, generator=g)
            whole = F.linear(x, w)
            for start in (0, 1, 16, 37):
                for n in range(GEMM_ROW_MULTIPLE, 64, GEMM_ROW_MULTIPLE):
                    part = F.linear(x[start:start + n], w)
                    assert torch.equal(part, whole[start:start + n]), (rows, cols, start, n)
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not native_bf16(), reason="bf16 matmuls run only on CPUs with native bf16")
@pytest.mark.parametrize("threads", [1, 2, 4])
def test_bf16_gemm_computes_rows_independently_of_m(threads):
    """oneDNN's bf16 GEMM as a step with prompt tokens runs it (layers._bf16_linear: one call,
    a lone row padded to two; with AMX, calls of a fixed number of rows): row r of x @ w^T is
    the same bits for any M and wherever the row sits. Checks the property of the installed
    oneDNN through the function that relies on it."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)
        with cpu_step(prompt_tokens=True, quantized=False):
            for rows, cols in ((960, 576), (576, 1536), (3072, 576), (1000, 64)):
                w = torch.randn(rows, cols, generator=g).bfloat16()
                x = torch.randn(700, cols, generator=g)
                whole = layers._bf16_linear(x, w, None)
                for start in (0, 1, 16, 37):
                    for n in (*range(1, 40), 64, 127, 300, 663):
                        assert torch.equal(layers._bf16_linear(x[start:start + n], w, None),
                                           whole[start:start + n]), (rows, cols, start, n)
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="torch has no MKL")
def test_mkl_runs_in_its_strict_reproducible_mode():
    """Importing llmserve sets MKL_CBWR before MKL first computes (conftest imports it first)."""
    assert reproducible_blas() is True


def test_mkl_not_in_strict_mode_is_reported(monkeypatch, caplog):
    """A process whose MKL computed before llmserve set MKL_CBWR (or that sets another mode)
    is warned, once."""
    monkeypatch.setattr(threads, "_mkl_cbwr_get", lambda: lambda _which: 10)  # the AVX2 branch, not strict
    threads._warn_not_strict.cache_clear()
    with caplog.at_level("WARNING", logger=threads.log.name):
        assert reproducible_blas() is False
        assert reproducible_blas() is False
    assert [r.message.startswith("MKL is not in its strict reproducible mode") for r in caplog.records] == [True]
    threads._warn_not_strict.cache_clear()


PROMPT = [(7 * i + 3) % 90 + 1 for i in range(29)]
SPLITS = [[29], [16, 13], [4, 4, 21], [28, 1], [5, 2, 9, 13]]


def _run(model, split: list[int], decode_steps: int = 4):
    """Logprobs (top 5) of the prompt's sampled token and of `decode_steps` greedy tokens after
    it, and the K cache, with the prompt computed in steps of `split` tokens."""
    runner = ModelRunner(model, 64, 4, torch.float32, "cpu", seed=0)
    paged = Paged(64, 4)
    paged.add(0, PROMPT)
    for n in split:
        out = runner.execute(paged.step({0: n}, rows={0: Row(num_logprobs=5)}))
    tokens, lps = [int(out.tokens[0])], [out.top_logprobs[0].copy()]
    for i in range(1, decode_steps + 1):
        paged.append(0, tokens[-1])
        out = runner.execute(paged.step({0: 1}, rows={0: Row(num_logprobs=5, gen_index=i)}))
        tokens.append(int(out.tokens[0]))
        lps.append(out.top_logprobs[0].copy())
    return tokens, lps, [k.clone() for k in runner.kv_cache.key]


@pytest.mark.parametrize("bf16", [False, pytest.param(True, marks=pytest.mark.skipif(
    not native_bf16(), reason="bf16 matmuls run only on CPUs with native bf16"))])
@pytest.mark.parametrize("family,threads", [("llama", 1), ("llama", 2), ("qwen3", 2)])
def test_a_prompt_computes_the_same_however_it_is_split(family, threads, bf16, monkeypatch):
    """Prompt steps in fp32 (padded GEMMs) or, with native bf16, in bf16."""
    monkeypatch.setattr(llama, "native_bf16", lambda: bf16)
    model = quantized_model(family)
    assert (model.layers[0].attn.qkv.bf16_weight is not None) == bf16
    _assert_splits_agree(model, threads)


def _assert_splits_agree(model, threads: int) -> None:
    """Every split of SPLITS gives the first one's tokens, logprobs and K cache, bit for bit,
    with `threads` torch threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        tokens, lps, cache = _run(model, SPLITS[0])
        for split in SPLITS[1:]:
            t, l, c = _run(model, split)
            assert t == tokens, split
            for a, b in zip(l, lps):
                np.testing.assert_array_equal(a, b, err_msg=str(split))
            for a, b in zip(c, cache):
                assert torch.equal(a, b), split
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not native_bf16(), reason="bf16 runs fast only on CPUs with native bf16")
def test_a_bf16_models_prompt_matmuls_compute_rows_independently_of_m():
    """`--dtype bfloat16` on a CPU: in steps with prompt tokens its matmuls run as a GGUF model's
    bf16 ones (layers._bf16_linear), so a prompt whose prefix is cached, which computes its last
    token alone, gets the bits the whole prompt gave it (audit 69: the answer changed). Plain
    F.linear gives M = 1 other bits at some shapes, SmolLM2's 1536-wide ones among them."""
    g = torch.Generator().manual_seed(0)
    with cpu_step(prompt_tokens=True, quantized=False):
        for rows, cols in ((1536, 576), (960, 576), (576, 1536), (8192, 576)):
            w = (torch.randn(rows, cols, generator=g) * 0.3).bfloat16()
            b = torch.randn(rows, generator=g).bfloat16()
            x = torch.randn(40, cols, generator=g).bfloat16()
            whole = layers.linear(x, w, b, None)
            assert whole.dtype == torch.bfloat16
            for start, n in ((39, 1), (0, 1), (5, 2), (10, 29), (3, 37)):
                part = layers.linear(x[start:start + n], w, b, None)
                assert torch.equal(part, whole[start:start + n]), (rows, cols, start, n)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_quantized_decode_steps_float_matmuls_compute_rows_independently_of_m(threads):
    """The float matmuls of a decode step the quantized GEMV takes (a LoRA adapter's delta, an
    LM head without GGUF blocks) compute each row as they would alone, so a generated token
    does not change when other sequences decode beside it (audit C: an adapter's answer moved
    when a second request for it arrived). MKL computes a lone row as a GEMV, whose sums
    differ from any GEMM's at every one of these shapes: the rows are padded."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    try:
        with cpu_step(prompt_tokens=False, quantized=True):
            for rows, cols in ((16, 576), (1536, 16), (576, 64), (49152, 576)):
                w = torch.randn(rows, cols, generator=g)
                x = torch.randn(QUANT_MAX_TOKENS, cols, generator=g)
                whole = layers.linear(x, w, None, None)
                for start, n in ((0, 1), (23, 1), (5, 2), (2, 7), (0, 24)):
                    part = layers.linear(x[start:start + n], w, None, None)
                    assert torch.equal(part, whole[start:start + n]), (rows, cols, start, n)
    finally:
        torch.set_num_threads(before)


def test_a_prompt_steps_sampled_row_reads_the_lm_heads_blocks(monkeypatch):
    """The token a prompt step samples takes its logits from the LM head's GGUF blocks, as
    every later token does (a row alone, so the split cannot move it); prompt logprobs
    (compute_logits without `sampling`) keep the fp32 head in such steps."""
    model = quantized_model("llama")
    embed = model.embed_tokens.weight
    blocks = np.ascontiguousarray(quantize(embed.numpy(), GT.Q8_0))
    model.attach_head(QuantTensor(blocks, int(GT.Q8_0), *embed.shape), native_bf16())
    calls = []
    real = llama.quant_linear

    def spy(x, bias, quant):
        calls.append((quant is model.lm_quant, x.shape[0]))
        return real(x, bias, quant)

    monkeypatch.setattr(llama, "quant_linear", spy)
    runner = ModelRunner(model, 64, 4, torch.float32, "cpu", seed=0)
    paged = Paged(64, 4)
    paged.add(0, PROMPT)
    runner.execute(paged.step({0: len(PROMPT)}, rows={0: Row()}))
    assert calls == [(True, 1)]
    h = torch.randn(3, model.config.hidden_size)
    # (the fp32 head as a step with prompt tokens runs it: padded to GEMM_ROW_MULTIPLE rows;
    # BLAS may sum 3 rows otherwise, as this AMD EPYC's does)
    padded = torch.cat((h, h.new_zeros(-3 % GEMM_ROW_MULTIPLE, h.shape[1])))
    fp32 = F.linear(padded, model.embed_tokens.weight)[:3]
    with cpu_step(prompt_tokens=True, quantized=False):
        assert torch.equal(model.compute_logits(h), fp32)
        sampled = model.compute_logits(h, sampling=True)
        # however many rows sample in the step (past QUANT_MAX_TOKENS too), each row alone
        many = torch.randn(QUANT_MAX_TOKENS + 6, model.config.hidden_size)
        together = model.compute_logits(many, sampling=True)
        for i in (0, 7, QUANT_MAX_TOKENS + 5):
            assert torch.equal(together[i], model.compute_logits(many[i:i + 1], sampling=True)[0]), i
    assert not torch.equal(sampled, fp32) and (sampled - fp32).abs().max() < 0.05 * fp32.abs().max()


def _moe_model():
    """A Qwen2-MoE-shaped random model (experts, a gated shared expert, a dense layer) wide
    enough that BLAS sums change with M where nothing pads them."""
    from llmserve.models import build_model

    cfg = dict(architectures=["Qwen2MoeForCausalLM"], vocab_size=96, hidden_size=256, intermediate_size=512,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
               num_experts=8, num_experts_per_tok=3, moe_intermediate_size=384, shared_expert_intermediate_size=320,
               mlp_only_layers=[1], norm_topk_prob=False)
    g = torch.Generator().manual_seed(0)
    h, nh, nkv, d = 256, 4, 2, 64
    w = {"model.embed_tokens.weight": torch.randn(96, h, generator=g), "model.norm.weight": torch.ones(h),
         "lm_head.weight": torch.randn(96, h, generator=g) * 0.1}
    for layer in range(2):
        p, a, m = f"model.layers.{layer}.", f"model.layers.{layer}.self_attn.", f"model.layers.{layer}.mlp."
        shapes = {a + "q_proj.weight": (nh * d, h), a + "k_proj.weight": (nkv * d, h), a + "v_proj.weight": (nkv * d, h),
                  a + "q_proj.bias": (nh * d,), a + "k_proj.bias": (nkv * d,), a + "v_proj.bias": (nkv * d,),
                  a + "o_proj.weight": (h, nh * d)}
        if layer == 0:
            shapes.update({m + "gate.weight": (8, h), m + "shared_expert_gate.weight": (1, h),
                           m + "shared_expert.gate_proj.weight": (320, h), m + "shared_expert.up_proj.weight": (320, h),
                           m + "shared_expert.down_proj.weight": (h, 320)})
            for e in range(8):
                x = f"{m}experts.{e}."
                shapes.update({x + "gate_proj.weight": (384, h), x + "up_proj.weight": (384, h),
                               x + "down_proj.weight": (h, 384)})
        else:
            shapes.update({m + "gate_proj.weight": (512, h), m + "up_proj.weight": (512, h),
                           m + "down_proj.weight": (h, 512)})
        w.update({k: torch.randn(s, generator=g) * 0.1 for k, s in shapes.items()})
        w.update({p + "input_layernorm.weight": torch.ones(h), p + "post_attention_layernorm.weight": torch.ones(h)})
    return build_model(cfg, w, torch.float32, "cpu")


@pytest.mark.parametrize("threads", [1, 2])
def test_a_moe_prompt_computes_the_same_however_it_is_split(threads):
    """Each expert's GEMM takes the rows routed to it through `layers.linear`, as the dense ones
    do, and a token's 3 expert outputs add in expert order whatever the step holds (an order
    set by the step, such as the busiest expert first, fails this)."""
    _assert_splits_agree(_moe_model(), threads)
