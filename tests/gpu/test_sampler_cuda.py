"""The sampler on CUDA logits: every path that does not draw random numbers gives the CPU's
tokens and logprobs; random rows sample only tokens their filters allow, and a seed gives the
same tokens run after run (on the GPU's own generator)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _plans import Row, sampling_plan

from llmserve.worker.sampler import Sampler, SamplingBatch

pytestmark = pytest.mark.gpu


def sample(logits: torch.Tensor, rows: list[Row], device: str, seed: int = 0):
    batch = SamplingBatch.from_plan(sampling_plan(rows))
    return Sampler(seed=seed).sample(logits.clone().to(device), batch)


def rand_logits(r: int, v: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(r, v, generator=torch.Generator().manual_seed(seed)) * 3


def test_deterministic_paths_match_the_cpu():
    logits = rand_logits(8, 1000)
    hist = list(range(0, 40, 3))
    rows = [Row(), Row(num_logprobs=5), Row(logit_bias={7: 100.0}), Row(bans=[int(logits[3].argmax())]),
            Row(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4, prompt=hist[:5],
                output=hist[5:]),
            Row(temperature=1.0, top_k=1, num_logprobs=3), Row(temperature=0.7, top_p=0.0),
            Row(num_logprobs=0)]
    cpu = sample(logits, rows, "cpu")
    gpu = sample(logits, rows, "cuda")
    np.testing.assert_array_equal(gpu.tokens, cpu.tokens)
    np.testing.assert_allclose(gpu.logprobs, cpu.logprobs, atol=1e-5)
    np.testing.assert_array_equal(gpu.top_ids, cpu.top_ids)
    np.testing.assert_allclose(gpu.top_logprobs, cpu.top_logprobs, atol=1e-5)


def test_random_rows_respect_their_filters_on_the_gpu():
    logits = rand_logits(64, 500, seed=1)
    top5 = logits.topk(5, dim=-1).indices.numpy()
    out = sample(logits, [Row(temperature=1.0, top_k=5)] * 64, "cuda").tokens
    assert all(t in top5[i] for i, t in enumerate(out))
    # top_p: the set is the smallest top mass above p, computed on the CPU as a reference
    probs = torch.softmax(logits, -1)
    srt = probs.sort(-1, descending=True)
    keep = (srt.values.cumsum(-1) - srt.values) <= 0.6
    out = sample(logits, [Row(temperature=1.0, top_p=0.6)] * 64, "cuda").tokens
    for i, t in enumerate(out):
        assert t in srt.indices[i][keep[i]].numpy()
    # min_p, and a flat row that needs the radix select of top_p
    flat = torch.zeros(4, 50_000)
    out = sample(flat, [Row(temperature=1.0, top_p=0.5)] * 4, "cuda").tokens
    assert ((0 <= out) & (out < 50_000)).all()
    out = sample(logits, [Row(temperature=1.0, min_p=0.5)] * 64, "cuda").tokens
    for i, t in enumerate(out):
        assert probs[i, t] >= 0.5 * probs[i].max()


def test_seeds_repeat_on_the_gpu():
    logits = rand_logits(16, 300, seed=2)
    rows = [Row(temperature=1.0, seed=s, gen_index=3) for s in range(16)]
    a = sample(logits, rows, "cuda").tokens
    b = sample(logits[torch.arange(15, -1, -1)], rows[::-1], "cuda", seed=9).tokens
    np.testing.assert_array_equal(a, b[::-1])
    # unseeded rows follow the sampler's own seed
    plain = [Row(temperature=1.0)] * 16
    np.testing.assert_array_equal(sample(logits, plain, "cuda", seed=4).tokens,
                                  sample(logits, plain, "cuda", seed=4).tokens)
