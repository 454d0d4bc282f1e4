"""--batch-invariant at the kernel, layer, model and sampler level: a row's result is
bit-identical whatever else is in the step (how many rows, its position, how its prompt is
chunked). The end-to-end version over HTTP is tests/e2e/test_batch_invariant.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as GT
from gguf.quants import quantize

from _plans import Paged, Row, sampling_plan
from test_runner import BLOCK, CONFIG, NUM_BLOCKS, tiny_weights

from llmserve import _core
from llmserve.loaders import QuantTensor
from llmserve.loaders.checkpoint import PackedQuant
from llmserve.models import build_model
from llmserve.models.layers import linear
from llmserve.worker import ModelRunner
from llmserve.worker.sampler import Sampler, SamplingBatch

torch.set_num_threads(1)


def _quant(qtype: GT, rows: int, cols: int, seed: int = 0) -> PackedQuant:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)).astype(np.float32) + 0.3
    return QuantTensor(np.ascontiguousarray(quantize(w, qtype)), int(qtype), rows, cols).pack()


@pytest.mark.parametrize("qtype", [GT.Q8_0, GT.Q4_0, GT.Q4_1], ids=lambda t: t.name)
def test_quant_matmul_row_does_not_depend_on_token_count(qtype):
    rows, cols = 67, 256
    packed = _quant(qtype, rows, cols).data
    x = np.random.default_rng(1).standard_normal((8, cols)).astype(np.float32)
    for threads in (1, 2):
        full = np.empty((8, rows), np.float32)
        _core.quant_matmul(full, x, packed, int(qtype), rows, cols, threads)
        for t in range(1, 9):
            part = np.empty((t, rows), np.float32)
            _core.quant_matmul(part, np.ascontiguousarray(x[8 - t:]), packed, int(qtype), rows, cols,
                               threads)
            np.testing.assert_array_equal(part, full[8 - t:])   # bitwise, any row position


@pytest.mark.parametrize("with_quant", [True, False], ids=["quant", "fp32"])
def test_row_invariant_linear_matches_the_row_alone(with_quant):
    rows, cols = 67, 256
    quant = _quant(GT.Q4_1, rows, cols)
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(rows, cols, generator=g)
    bias = torch.randn(rows, generator=g)
    x = torch.randn(37, cols, generator=g)
    q = quant if with_quant else None
    full = linear(x, weight, bias, q, row_invariant=True)
    assert full.shape == (37, rows)
    for i in (0, 3, 8, 9, 36):
        assert torch.equal(full[i], linear(x[i:i + 1], weight, bias, q, row_invariant=True)[0])
    ref = linear(x[:8], weight, bias, q) if with_quant else F.linear(x, weight, bias)
    # same math as the normal path, only the summation order differs
    torch.testing.assert_close(full[:len(ref)], ref, rtol=1e-4, atol=1e-4)


def _runner() -> ModelRunner:
    model = build_model(CONFIG, tiny_weights(), torch.float32, "cpu")
    model.set_batch_invariant(True)
    return ModelRunner(model, NUM_BLOCKS, BLOCK, torch.float32, "cpu", seed=0)


def _rows_of(plan, hidden: torch.Tensor, seq_index: int) -> torch.Tensor:
    qsl = plan.query_start_loc
    return hidden[int(qsl[seq_index]):int(qsl[seq_index + 1])].clone()


PROMPT = [5, 9, 1, 3, 3, 7, 11, 2, 40, 17, 8, 8, 30]


def test_model_rows_do_not_depend_on_batch_or_chunking():
    # alone: the whole prompt in one step, then two decode steps
    runner, paged = _runner(), Paged(NUM_BLOCKS, BLOCK)
    paged.add(0, PROMPT)
    with torch.inference_mode():
        plan = paged.step({0: len(PROMPT)})
        alone = [_rows_of(plan, runner.run_model(plan), 0)]
        for tok in (21, 22):
            paged.append(0, tok)
            plan = paged.step({0: 1})
            alone.append(_rows_of(plan, runner.run_model(plan), 0))
    alone = torch.cat(alone)

    # busy: other sequences before it, its prompt chunked 5 + 8, decodes in other rows
    runner, paged = _runner(), Paged(NUM_BLOCKS, BLOCK)
    paged.add(1, [4, 4, 2, 9, 50, 51, 3])
    paged.add(2, [6, 1])
    paged.add(0, PROMPT)
    paged.add(3, list(range(10, 30)))
    with torch.inference_mode():
        busy = []
        plan = paged.step({1: 7, 2: 2, 0: 5})
        busy.append(_rows_of(plan, runner.run_model(plan), 2))
        plan = paged.step({0: 8, 3: 11})
        busy.append(_rows_of(plan, runner.run_model(plan), 0))
        for sid in (1, 2):
            paged.append(sid, 3)
        paged.append(0, 21)
        plan = paged.step({2: 1, 3: 9, 1: 1, 0: 1})
        busy.append(_rows_of(plan, runner.run_model(plan), 3))
        paged.append(0, 22)
        paged.append(2, 3)
        plan = paged.step({2: 1, 0: 1})
        hidden = runner.run_model(plan)
        busy.append(_rows_of(plan, hidden, 1))
        # the LM head too: its row among others equals the row alone
        logits = runner.model.compute_logits(hidden)
        assert torch.equal(logits[1], runner.model.compute_logits(hidden[1:2])[0])
    busy = torch.cat(busy)
    assert torch.equal(busy, alone)


def test_sampler_rows_do_not_depend_on_the_batch():
    v = 300
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(16, v, generator=g) * 3
    rows = [Row(temperature=0.0, num_logprobs=5) if i % 3 == 0 else
            Row(temperature=1.0, top_p=0.9, top_k=40 if i % 2 else 0, min_p=0.01 * (i % 4),
                seed=100 + i, gen_index=i, num_logprobs=3 if i % 2 else -1)
            for i in range(16)]

    def sample(idx: list[int]):
        batch = SamplingBatch.from_plan(sampling_plan([rows[i] for i in idx]))
        return Sampler(seed=0).sample(logits[idx].clone(), batch)

    full = sample(list(range(16)))
    for i in range(16):
        for idx, pos in (([i], 0), ([(i + 5) % 16, 15 - i if 15 - i != i else (i + 1) % 16, i], 2)):
            out = sample(idx)
            if rows[i].temperature == 0.0 or rows[i].seed >= 0:
                assert out.tokens[pos] == full.tokens[i]
                assert out.logprobs[pos] == full.logprobs[i]
            k = rows[i].num_logprobs
            if k > 0:
                np.testing.assert_array_equal(out.top_ids[pos, :k], full.top_ids[i, :k])
                np.testing.assert_array_equal(out.top_logprobs[pos, :k], full.top_logprobs[i, :k])


def test_unsupported_setups_fail_at_startup():
    from llmserve.engine.build import _check_batch_invariant

    _check_batch_invariant(torch.device("cpu"), torch.float32)
    with pytest.raises(RuntimeError, match="--batch-invariant needs --device cpu and --dtype float32"):
        _check_batch_invariant(torch.device("cpu"), torch.bfloat16)
    with pytest.raises(RuntimeError, match="--batch-invariant needs"):
        _check_batch_invariant(torch.device("cuda"), torch.float32)
