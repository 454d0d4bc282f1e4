"""Sampler: greedy, bias/bans, penalties, temperature/top-k/top-p/min-p, seeds, logprobs."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from _plans import Row, sampling_plan

from llmserve.worker.sampler import Sampler, SamplingBatch, _top_p_filter, plain_greedy

torch.set_num_threads(1)


def run(logits: torch.Tensor, rows: list[Row], sampler: Sampler | None = None):
    sampler = sampler or Sampler(seed=0)
    return sampler.sample(logits.clone(), SamplingBatch.from_plan(sampling_plan(rows)))


def rand_logits(r: int, v: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(r, v, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    logits = rand_logits(5, 50)
    out = run(logits, [Row() for _ in range(5)])
    assert out.tokens.dtype == np.int64
    np.testing.assert_array_equal(out.tokens, logits.argmax(-1).numpy())


def test_plain_greedy_rows_take_the_numpy_argmax_with_the_same_answer():
    """Sampler.sample_plan's host path (every row plain greedy) answers what the torch pass
    does, ties (the first maximum) and NaN rows included; any other row in the step sends
    the whole step through the torch pass."""
    logits = rand_logits(6, 300, seed=4)
    logits[1, [5, 9]] = 50.0              # a tie: the first wins
    logits[2, 17] = float("nan")          # NaN counts as the maximum
    logits[3, [20, 40]] = float("nan")
    logits[4] = float("-inf")
    plan = sampling_plan([Row() for _ in range(6)])
    assert plain_greedy(plan)
    fast = Sampler(seed=0).sample_plan(logits.clone(), plan).to_host()
    slow = run(logits, [Row() for _ in range(6)])
    np.testing.assert_array_equal(fast.tokens, slow.tokens)
    assert fast.tokens.dtype == np.int64 and list(fast.tokens[1:4]) == [5, 17, 20]
    for a, b in ((fast.logprobs, slow.logprobs), (fast.top_ids, slow.top_ids),
                 (fast.top_logprobs, slow.top_logprobs)):
        assert a.shape == b.shape and a.dtype == b.dtype and (a == b).all()
    for other in (Row(temperature=0.5), Row(num_logprobs=0), Row(logit_bias={3: 1.0}), Row(bans=[2]),
                  Row(presence_penalty=0.5, output=[1]), Row(repetition_penalty=1.2, prompt=[4])):
        assert not plain_greedy(sampling_plan([Row(), other])), other
    masked = sampling_plan([Row(), Row()])
    masked.mask_rows = np.array([1], np.int64)      # a grammar-constrained row
    masked.token_bitmask = np.full((1, 10), -1, np.int32)
    assert not plain_greedy(masked)


def test_logit_bias_bans_and_forces():
    logits = rand_logits(2, 50)
    best = logits.argmax(-1)
    out = run(logits, [Row(logit_bias={int(best[0]): -100.0}), Row(logit_bias={7: 100.0})])
    assert out.tokens[0] != best[0]
    assert out.tokens[0] == logits[0].topk(2).indices[1]
    assert out.tokens[1] == 7
    # forcing also holds when sampling
    many = run(rand_logits(64, 50), [Row(temperature=1.0, logit_bias={7: 100.0})] * 64)
    assert (many.tokens == 7).all()


def test_min_tokens_bans_are_never_sampled():
    logits = torch.zeros(256, 10)
    logits[:, 3] = 5.0          # the most likely token, banned (an eos under min_tokens)
    out = run(logits, [Row(temperature=1.0, bans=[3, 4])] * 256)
    assert not np.isin(out.tokens, [3, 4]).any()
    greedy = run(logits[:1], [Row(bans=[3])])
    assert greedy.tokens[0] != 3


def test_top_k_1_and_top_p_0_equal_greedy():
    logits = rand_logits(32, 100, seed=1)
    greedy = logits.argmax(-1).numpy()
    for row in (Row(temperature=1.5, top_k=1), Row(temperature=1.5, top_p=0.0)):
        for seed in range(3):
            out = run(logits, [row] * 32, Sampler(seed=seed))
            np.testing.assert_array_equal(out.tokens, greedy)


def test_tiny_temperature_is_finite_and_greedy():
    logits = rand_logits(8, 100, seed=2)
    out = run(logits, [Row(temperature=1e-30)] * 8)
    np.testing.assert_array_equal(out.tokens, logits.argmax(-1).numpy())


def _frequencies(tokens: np.ndarray, v: int) -> np.ndarray:
    return np.bincount(tokens, minlength=v) / len(tokens)


PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])


def test_temperature_1_samples_the_softmax_distribution():
    n = 20000
    out = run(PROBS.log().expand(n, 4), [Row(temperature=1.0)] * n)
    np.testing.assert_allclose(_frequencies(out.tokens, 4), PROBS.numpy(), atol=0.015)


def test_min_p_drops_tokens_below_fraction_of_max():
    n = 20000
    out = run(PROBS.log().expand(n, 4), [Row(temperature=1.0, min_p=0.2)] * n)  # keeps p >= 0.1
    freq = _frequencies(out.tokens, 4)
    assert freq[3] == 0
    np.testing.assert_allclose(freq[:3], (PROBS[:3] / PROBS[:3].sum()).numpy(), atol=0.015)


def test_top_p_keeps_smallest_set_reaching_p():
    n = 20000
    out = run(PROBS.log().expand(n, 4), [Row(temperature=1.0, top_p=0.7)] * n)  # keeps {0, 1}
    freq = _frequencies(out.tokens, 4)
    np.testing.assert_allclose(freq, [0.5 / 0.8, 0.3 / 0.8, 0, 0], atol=0.015)


def test_top_p_on_a_flat_vocabulary_beyond_the_candidate_window():
    v = 3000
    logits = (-torch.arange(v, dtype=torch.float32) * 1e-4).expand(256, v)
    out = run(logits, [Row(temperature=1.0, top_p=0.5)] * 256)
    probs = torch.softmax(logits[0], -1)
    cutoff = int(((probs.cumsum(0) - probs) <= 0.5).sum())   # tokens 0..cutoff-1 survive
    assert cutoff > 1024
    assert (out.tokens < cutoff).all()
    assert (out.tokens >= 1024).any()    # the survivors past the first candidates are reachable


@pytest.mark.parametrize("sync_free", [False, True])
@pytest.mark.parametrize("scale", [0.1, 1.0, 3.0, 10.0])
def test_top_p_kept_sets_equal_a_full_sort(scale, sync_free):
    """The candidate window and the radix select agree with the sort-based definition, both
    ways of choosing the rows that need the select (the accelerator's runs it on every row)."""
    g = torch.Generator().manual_seed(int(scale * 10))
    probs = torch.softmax(torch.randn(16, 5000, generator=g) * scale, -1)
    top_p = torch.rand(16, generator=g) * 0.99
    top_p[0] = 0.0
    kept = _top_p_filter(probs.clone(), top_p, sync_free) > 0
    ordered = probs.sort(-1, descending=True).values
    mass_before = ordered.cumsum(-1) - ordered
    count = (mass_before <= top_p[:, None]).sum(-1, keepdim=True)
    expect = probs >= ordered.gather(1, count - 1)
    assert torch.equal(kept, expect)
    assert kept[0].sum() == 1


def test_top_k_restricts_to_k_best():
    logits = rand_logits(1, 100, seed=3)
    best5 = set(logits[0].topk(5).indices.tolist())
    out = run(logits.expand(500, 100), [Row(temperature=2.0, top_k=5)] * 500)
    assert set(out.tokens.tolist()) <= best5
    assert len(set(out.tokens.tolist())) > 1


def test_penalties_match_direct_formula():
    v = 20
    logits = rand_logits(3, v, seed=4)
    rows = [
        Row(repetition_penalty=1.5, prompt=[1, 2, 2], output=[3, 5, 5]),
        Row(),  # not penalized: untouched
        Row(presence_penalty=0.7, frequency_penalty=0.3, repetition_penalty=1.2,
            prompt=[4, 9], output=[9, 9, 11]),
    ]
    got = logits.clone()
    Sampler._apply_penalties(got, SamplingBatch.from_plan(sampling_plan(rows)))
    expect = logits.clone()
    for i, r in enumerate(rows):
        counts = np.bincount(r.output, minlength=v)
        for t in range(v):
            x = expect[i, t].item()
            if t in set(r.prompt) | set(r.output):
                x = x / r.repetition_penalty if x > 0 else x * r.repetition_penalty
            x -= r.frequency_penalty * counts[t] + r.presence_penalty * (counts[t] > 0)
            expect[i, t] = x
    torch.testing.assert_close(got, expect)
    assert not torch.equal(got[0], logits[0]) and torch.equal(got[1], logits[1])


def test_a_tiny_repetition_penalty_stays_finite():
    """The smallest penalty the router takes (float32's smallest normal) divides a positive
    logit past float32's range: it stays the largest float, so sampling sees no inf or NaN
    and still picks among the seen tokens."""
    logits = torch.tensor([[30.0, 25.0, 5.0, -1.0]] * 2)
    rows = [Row(repetition_penalty=torch.finfo(torch.float32).tiny, prompt=[2], output=[1]),
            Row(repetition_penalty=torch.finfo(torch.float32).tiny, prompt=[2], output=[1],
                temperature=1.0, seed=3)]
    got = logits.clone()
    Sampler._apply_penalties(got, SamplingBatch.from_plan(sampling_plan(rows)))
    assert torch.isfinite(got).all()
    out = run(logits, rows)
    assert set(out.tokens.tolist()) <= {1, 2}


def test_presence_penalty_steers_greedy_away_from_repeats():
    logits = torch.tensor([[3.0, 2.5, 0.0]])
    out = run(logits, [Row(presence_penalty=2.0, prompt=[2], output=[0])])
    assert out.tokens[0] == 1


def _seeded_sequence(seed: int, steps: int, others: list[Row], position: int, v: int = 1000):
    tokens = []
    for step in range(steps):
        row = Row(temperature=1.0, seed=seed, gen_index=step)
        rows = others[:position] + [row] + others[position:]
        logits = rand_logits(len(rows), v, seed=100 + step) * 0.1
        # the seeded row sees the same logits whatever else is in the batch
        logits[position] = rand_logits(1, v, seed=step)[0] * 0.1
        out = run(logits, rows, Sampler(seed=step * 7 + len(rows)))
        tokens.append(int(out.tokens[position]))
    return tokens


def test_seeded_rows_are_reproducible_and_batch_independent():
    alone = _seeded_sequence(42, 6, [], 0)
    others = [Row(temperature=1.0), Row(temperature=0.7, seed=7), Row(), Row(temperature=1.0)]
    crowded = _seeded_sequence(42, 6, others, 2)
    assert alone == crowded
    assert alone == _seeded_sequence(42, 6, [], 0)
    assert alone != _seeded_sequence(43, 6, [], 0)


def test_unseeded_rows_follow_the_engine_seed():
    logits = rand_logits(16, 500) * 0.1
    a = run(logits, [Row(temperature=1.0)] * 16, Sampler(seed=5)).tokens
    b = run(logits, [Row(temperature=1.0)] * 16, Sampler(seed=5)).tokens
    c = run(logits, [Row(temperature=1.0)] * 16, Sampler(seed=6)).tokens
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_logprobs_are_raw_log_softmax_with_sorted_top_k():
    logits = rand_logits(3, 30, seed=5)
    rows = [Row(num_logprobs=2, logit_bias={0: 50.0}), Row(), Row(num_logprobs=4, temperature=1.0)]
    out = run(logits, rows)
    raw = torch.log_softmax(logits, -1)
    assert out.top_ids.shape == (3, 4) and out.top_logprobs.shape == (3, 4)
    assert out.tokens[0] == 0   # chosen with the bias, logprob from the raw logits
    assert out.logprobs[0] == pytest.approx(raw[0, 0].item(), abs=1e-5)
    assert out.logprobs[2] == pytest.approx(raw[2, out.tokens[2]].item(), abs=1e-5)
    for i in (0, 2):
        top = raw[i].topk(4)
        np.testing.assert_array_equal(out.top_ids[i], top.indices.numpy())
        np.testing.assert_allclose(out.top_logprobs[i], top.values.numpy(), atol=1e-5)
        assert (np.diff(out.top_logprobs[i]) <= 0).all()
    assert (out.top_ids[1] == 0).all() and out.logprobs[1] == 0.0


def test_no_logprobs_requested_gives_zero_width():
    out = run(rand_logits(2, 10), [Row(), Row()])
    assert out.top_ids.shape == (2, 0) and out.top_logprobs.shape == (2, 0)
