"""The CPU grammar-mask kernel (`_core.apply_token_bitmask`, taken by the sampler's
`apply_token_bitmask` on CPU float32 logits) against the torch path (`apply_token_bitmask_torch`,
the GPU path) and a per-token numpy reference: identical logits on random inputs, every shape
edge (V not a multiple of 32, mask narrower / wider than V, no rows), and the argument checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llmserve import _core
from llmserve.worker import sampler
from llmserve.worker.sampler import apply_token_bitmask, apply_token_bitmask_torch

torch.set_num_threads(1)


def _reference(logits: np.ndarray, rows: np.ndarray, bitmask: np.ndarray) -> np.ndarray:
    """Token t of mask row i is allowed iff t < W * 32 and bit t % 32 of word t / 32 is set."""
    out = logits.copy()
    vocab = out.shape[1]
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little").astype(bool)  # [Rm, W*32]
    allowed = np.zeros((len(rows), vocab), dtype=bool)
    n = min(vocab, bits.shape[1])
    allowed[:, :n] = bits[:, :n]
    for i, row in enumerate(rows):
        out[row, ~allowed[i]] = -np.inf
    return out


def _words(rng: np.random.Generator, shape: tuple[int, int], kind: str) -> np.ndarray:
    if kind == "ones":
        return np.full(shape, -1, dtype=np.int32)
    if kind == "zeros":
        return np.zeros(shape, dtype=np.int32)
    words = rng.integers(-2**31, 2**31, size=shape, dtype=np.int64).astype(np.int32)
    if kind == "mixed":     # all-ones, all-zero and random words side by side (each kernel path)
        pick = rng.integers(0, 3, size=shape)
        words = np.where(pick == 0, -1, np.where(pick == 1, 0, words)).astype(np.int32)
    return words


def _case(seed: int, num_rows: int, vocab: int, words: int, num_masked: int, kind: str):
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((num_rows, vocab)).astype(np.float32)
    rows = rng.permutation(num_rows)[:num_masked].astype(np.int64)
    return torch.from_numpy(logits), torch.from_numpy(rows), torch.from_numpy(_words(rng, (num_masked, words), kind))


SHAPES = [
    # (num_rows, vocab, words): W = ceil(V / 32), narrower (padded model vocab), wider, zero
    (4, 1, 1), (4, 31, 1), (4, 32, 1), (4, 33, 2), (5, 70, 3), (3, 70, 2), (3, 64, 4),
    (6, 1000, 32), (2, 40, 1), (3, 100, 0), (8, 49152, 1536), (4, 49155, 1537),
]


@pytest.mark.parametrize("num_rows,vocab,words", SHAPES)
@pytest.mark.parametrize("kind", ["random", "mixed", "ones", "zeros"])
def test_kernel_and_torch_paths_agree_with_the_reference(num_rows, vocab, words, kind):
    assert sampler._cpu_bitmask is not None, "the extension lacks apply_token_bitmask: rebuild it"
    for seed, num_masked in enumerate({0, 1, num_rows // 2, num_rows}):
        logits, rows, bits = _case(seed * 1000 + vocab, num_rows, vocab, words, num_masked, kind)
        want = _reference(logits.numpy(), rows.numpy(), bits.numpy())
        by_torch = logits.clone()
        apply_token_bitmask_torch(by_torch, rows, bits)
        by_sampler = logits.clone()
        apply_token_bitmask(by_sampler, rows, bits)            # dispatches to the kernel
        by_kernel = logits.numpy().copy()
        _core.apply_token_bitmask(by_kernel, rows.numpy(), bits.numpy())
        np.testing.assert_array_equal(by_torch.numpy(), want)
        np.testing.assert_array_equal(by_sampler.numpy(), want)
        np.testing.assert_array_equal(by_kernel, want)


def test_repeated_rows_with_the_same_mask_agree():
    # The Core lists each row once; a repeat with the same mask must not change the result.
    logits, _, _ = _case(7, 4, 70, 3, 0, "random")
    rows = torch.tensor([2, 0, 2])
    bits = torch.from_numpy(_words(np.random.default_rng(8), (1, 3), "random")).repeat(3, 1)
    by_torch, by_kernel = logits.clone(), logits.clone()
    apply_token_bitmask_torch(by_torch, rows, bits)
    apply_token_bitmask(by_kernel, rows, bits)
    assert torch.equal(by_torch, by_kernel)


def test_the_sampler_writes_through_to_the_tensor():
    logits = torch.zeros(2, 64)
    apply_token_bitmask(logits, torch.tensor([1]), torch.tensor([[0, 1 << 5]], dtype=torch.int32))
    assert torch.equal(logits[0], torch.zeros(64))
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [37]


def test_non_contiguous_or_other_dtype_logits_take_the_torch_path():
    logits, rows, bits = _case(3, 6, 70, 3, 3, "random")
    want = _reference(logits.numpy(), rows.numpy(), bits.numpy())
    wide = torch.zeros(6, 140)
    wide[:, ::2] = logits                          # a strided view of the same values
    view = wide[:, ::2]
    apply_token_bitmask(view, rows, bits)
    np.testing.assert_array_equal(view.numpy(), want)
    as64 = logits.double()
    apply_token_bitmask(as64, rows, bits)
    np.testing.assert_array_equal(as64.numpy(), want.astype(np.float64))


@pytest.mark.parametrize("rows,bits,message", [
    ([0, 3], np.zeros((2, 3), np.int32), r"rows\[1\] = 3 is outside 0\.\.3"),
    ([-1], np.zeros((1, 3), np.int32), r"rows\[0\] = -1 is outside 0\.\.3"),
    ([0, 1], np.zeros((1, 3), np.int32), "one row per entry of rows"),
])
def test_bad_arguments_raise_and_write_nothing(rows, bits, message):
    logits = np.random.default_rng(0).standard_normal((3, 70)).astype(np.float32)
    before = logits.copy()
    with pytest.raises(ValueError, match=message):
        _core.apply_token_bitmask(logits, np.array(rows, np.int64), bits)
    np.testing.assert_array_equal(logits, before)


def test_non_contiguous_and_read_only_logits_are_refused():
    bits = np.zeros((1, 3), np.int32)
    rows = np.array([0], np.int64)
    strided = np.zeros((3, 140), np.float32)[:, ::2]
    with pytest.raises(ValueError, match="logits must be C-contiguous"):
        _core.apply_token_bitmask(strided, rows, bits)
    frozen = np.zeros((3, 70), np.float32)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="logits must be writeable"):
        _core.apply_token_bitmask(frozen, rows, bits)
    assert not frozen.any()
