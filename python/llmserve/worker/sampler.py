"""Sampling: one vectorized float32 pass over the R rows of a step.

Order (vLLM's): logprobs of the RAW logits -> grammar masks (constrained rows only) -> logit_bias and min_tokens bans -> repetition /
presence / frequency penalties -> greedy rows take the argmax; the others: temperature ->
min_p -> top_k -> top_p -> exponential race (argmax(probs / Exponential(1) noise)).

NOTE: logprobs stay those of the raw logits, also on grammar-constrained rows: they say what
the model believed, not what the grammar allowed (vLLM does the same).

Devices: `logits` may live on the GPU; the SamplingBatch columns stay on the CPU. Which rows
take which path is decided from those CPU columns, so finding them never waits for the GPU;
only index and parameter vectors travel to the logits' device, and the results come back
once at the end (on CPU every move is a no-op). Every copy to the device goes through
`to_device` (pinned, non_blocking): a copy that waits would wait for the forward queued
before it, and `sample_on_device` would no longer return while the GPU works (the engine
plans the next step meanwhile).

Cost rules: grammar masks touch only the Rm constrained rows (on CPU one Rust pass over the
packed words; on GPU one unpack, one masked_fill);
bias is a flat index_put_ (cost ~ nnz); only penalized rows get a [Rp, V] count
tensor; top_p never sorts the vocabulary (top candidates, else a radix select);
Python loops run only over seeded rows (each row's draw is seeded from (seed, gen_index),
so a seeded row's tokens do not depend on the rest of the batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

_MASK64 = (1 << 64) - 1
# top_p first looks for its set among this many top candidates (cheap for peaked rows).
_TOP_P_WINDOW = 128


@dataclass(frozen=True)
class SampleOutput:
    tokens: np.ndarray          # int64 [R]
    logprobs: np.ndarray        # float32 [R]: raw logprob of the chosen token (0.0 where not asked)
    top_ids: np.ndarray         # int64 [R, K], K = max(num_logprobs) (0 if none), sorted by logprob
    top_logprobs: np.ndarray    # float32 [R, K]
    # The Plan's prompt-logprob entries (None when it listed none): the raw logprob of each
    # entry's target prompt token [P], and the top alternatives [P, Kp] (ids -1 past an
    # entry's own k), sorted by logprob.
    prompt_logprobs: np.ndarray | None = None       # float32 [P]
    prompt_top_ids: np.ndarray | None = None        # int64 [P, Kp]
    prompt_top_logprobs: np.ndarray | None = None   # float32 [P, Kp]
    prompt_ranks: np.ndarray | None = None          # int64 [P]: 1 + tokens likelier than the target
    # The Plan's pooling entries (None when it listed none): the final hidden state of each
    # listed position, for the embedding of the request that owns it.
    pooled: np.ndarray | None = None                # float32 [Q, H]

    @staticmethod
    def empty() -> "SampleOutput":
        return SampleOutput(np.zeros(0, np.int64), np.zeros(0, np.float32),
                            np.zeros((0, 0), np.int64), np.zeros((0, 0), np.float32))


@dataclass
class DeviceSample:
    """A step's samples where the sampler left them (`Sampler.sample_on_device`): the
    chosen tokens [R], and for the rows in `wants` (on the host) the chosen tokens' raw
    logprobs and the top `k`. `done` instead when there is nothing to copy.

    On an accelerator `start_copy()` queues their copy to pinned host memory and records an
    event: `to_host()` then waits for this step alone, not for steps queued after it."""

    done: SampleOutput | None
    tokens: torch.Tensor | None = None
    wants: torch.Tensor | None = None
    chosen: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_values: torch.Tensor | None = None
    num_rows: int = 0
    k: int = 0
    _host: dict | None = None            # pinned host copies, by field name
    _copied: Any = None                  # the event they are complete at

    def start_copy(self) -> None:
        """Queue the copies to the host (no-op on CPU, or when nothing is left to copy)."""
        if self.done is not None or self.tokens.device.type == "cpu":
            return
        self._host = {}
        for name in ("tokens", "chosen", "top_ids", "top_values"):
            t = getattr(self, name)
            if t is not None:
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                self._host[name] = host.copy_(t, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()

    def to_host(self) -> SampleOutput:
        """Wait for the samples and copy them to the host (numpy)."""
        if self.done is not None:
            return self.done
        if self._copied is not None:
            self._copied.synchronize()
        host = self._host or {}
        tokens, chosen, top_ids_t, top_values = (host.get(n, getattr(self, n))
                                                 for n in ("tokens", "chosen", "top_ids", "top_values"))
        tokens = tokens.cpu().numpy().astype(np.int64, copy=False)
        chosen_lp = np.zeros(self.num_rows, np.float32)
        top_ids = np.zeros((self.num_rows, self.k), np.int64)
        top_lp = np.zeros((self.num_rows, self.k), np.float32)
        if chosen is not None:
            rows = self.wants.numpy()
            chosen_lp[rows] = chosen.cpu().numpy()
            if top_ids_t is not None:
                top_ids[rows, :top_ids_t.shape[1]] = top_ids_t.cpu().numpy()
                top_lp[rows, :top_values.shape[1]] = top_values.cpu().numpy()
        self.done = SampleOutput(tokens, chosen_lp, top_ids, top_lp)
        return self.done


@dataclass(frozen=True)
class SamplingBatch:
    """The Plan's per-row sampling columns as tensors (same names, see ARCHITECTURE.md)."""

    temperature: torch.Tensor        # f32 [R]
    top_p: torch.Tensor              # f32 [R]
    top_k: torch.Tensor              # i64 [R], 0 = off
    min_p: torch.Tensor              # f32 [R]
    presence_penalty: torch.Tensor   # f32 [R]
    frequency_penalty: torch.Tensor  # f32 [R]
    repetition_penalty: torch.Tensor # f32 [R]
    seeds: torch.Tensor              # i64 [R], -1 unseeded
    gen_index: torch.Tensor          # i64 [R]
    num_logprobs: torch.Tensor       # i64 [R], -1 none
    bias_offsets: torch.Tensor       # i64 [R + 1]
    bias_token_ids: torch.Tensor     # i64 [nnz]
    bias_values: torch.Tensor        # f32 [nnz]
    hist_offsets: torch.Tensor       # i64 [R + 1]
    hist_tokens: torch.Tensor        # i64 [nh]
    hist_prompt_lens: torch.Tensor   # i64 [R]
    mask_rows: torch.Tensor          # i64 [Rm]: the grammar-constrained rows
    token_bitmask: torch.Tensor      # i32 [Rm, ceil(V/32)]: allowed tokens, bit t%32 of word t/32

    @classmethod
    def from_plan(cls, plan) -> "SamplingBatch":
        f32, i64 = torch.float32, torch.int64
        spec = dict(temperature=f32, top_p=f32, top_k=i64, min_p=f32, presence_penalty=f32,
                    frequency_penalty=f32, repetition_penalty=f32, seeds=i64, gen_index=i64,
                    num_logprobs=i64, bias_offsets=i64, bias_token_ids=i64, bias_values=f32,
                    hist_offsets=i64, hist_tokens=i64, hist_prompt_lens=i64)
        cols = {name: as_tensor(getattr(plan, name), dt) for name, dt in spec.items()}
        # Plans without the grammar columns (test doubles) constrain nothing.
        rows = getattr(plan, "mask_rows", None)
        bits = getattr(plan, "token_bitmask", None)
        cols["mask_rows"] = as_tensor(rows, i64) if rows is not None else torch.zeros(0, dtype=i64)
        cols["token_bitmask"] = (as_tensor(bits, torch.int32) if bits is not None
                                 else torch.zeros((0, 0), dtype=torch.int32))
        return cls(**cols)


def plain_greedy(plan) -> bool:
    """Whether every row of the Plan takes the argmax of its raw logits: greedy, no logprobs,
    no grammar mask, no logit_bias or min_tokens ban, no penalty history (a row without
    penalties sends none)."""
    rows = getattr(plan, "mask_rows", None)
    return (not np.any(np.asarray(plan.temperature) > 0) and not np.any(np.asarray(plan.num_logprobs) >= 0)
            and len(plan.bias_token_ids) == 0 and len(plan.hist_tokens) == 0
            and (rows is None or len(rows) == 0))


def as_tensor(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A numpy column as a CPU tensor of `dtype`, zero-copy when it already has that dtype.
    Read-only arrays (the Rust Plan's) are copied: torch refuses to alias them silently."""
    array = np.asarray(array)
    if array.flags.writeable and array.flags.c_contiguous:
        t = torch.from_numpy(array)
    else:
        t = torch.tensor(array)
    return t if t.dtype == dtype else t.to(dtype)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`, queued without waiting for the device (a no-op on the CPU)."""
    return pinned_for(t, device).to(device, non_blocking=True)


def pinned_for(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor in pinned memory when it is bound for a CUDA device (else `t`), so a
    non_blocking copy from it does not wait.

    NOTE: from pageable memory the driver stages the copy and may wait for the stream first,
    so a step queued ahead would stall behind the one running. `pin_memory()` takes its
    buffer from torch's caching host allocator, which does not reuse it before the copy has
    run."""
    return t.pin_memory() if t.device.type == "cpu" and device.type == "cuda" else t


try:
    from llmserve._core import apply_token_bitmask as _cpu_bitmask
except ImportError:     # an extension built before the kernel existed: torch path only
    _cpu_bitmask = None

# The 32 single-bit words as int32 (bit 31 is int32's sign bit).
_BIT_WORDS = torch.tensor([1 << b if b < 31 else -(1 << 31) for b in range(32)], dtype=torch.int32)


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Sets the logits of tokens a grammar forbids to -inf, in place.

    logits [R, V]; rows i64 [Rm] (distinct, in 0..R); bitmask i32 [Rm, W] (bit t % 32 of word
    t / 32 allows token t). Columns past W * 32 (a model vocabulary padded beyond the
    tokenizer's) are forbidden; bits past V are ignored.

    CPU float32 contiguous logits go to the Rust kernel (`_core.apply_token_bitmask`, in place
    through a shared numpy view: ~0.4 ms at 64 x 49152 random masks, the torch path ~9 ms);
    anything else (CUDA) takes the torch path, which the tests keep as the kernel's oracle."""
    if rows.numel() == 0:
        return
    if (_cpu_bitmask is not None and logits.device.type == "cpu" and logits.dtype == torch.float32
            and logits.is_contiguous() and not logits.requires_grad):
        _cpu_bitmask(logits.numpy(),
                     np.ascontiguousarray(rows.cpu().numpy(), dtype=np.int64),
                     np.ascontiguousarray(bitmask.cpu().numpy(), dtype=np.int32))
        return
    apply_token_bitmask_torch(logits, rows, bitmask)


def apply_token_bitmask_torch(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """apply_token_bitmask in torch ops on logits' device (the GPU path, and the CPU oracle).

    One int32 AND against the 32 bit words and one compare give the forbidden mask [Rm, V]
    (no shifted int copy, no separate negation); the gathered rows are filled in place and
    copied back. On CPU the masked_fill_ is most of its ~8.5 ms at 64 x 49152 (it was ~9.7)."""
    if rows.numel() == 0:
        return
    vocab = logits.shape[1]
    device = logits.device
    bitmask = to_device(bitmask.to(torch.int32), device)
    rows = to_device(rows, device)
    words = to_device(_BIT_WORDS, device)
    forbidden = ((bitmask.unsqueeze(-1) & words) == 0).flatten(1)   # [Rm, W*32]
    if forbidden.shape[1] >= vocab:
        forbidden = forbidden[:, :vocab]
    else:
        pad = torch.ones(forbidden.shape[0], vocab - forbidden.shape[1], dtype=torch.bool, device=device)
        forbidden = torch.cat([forbidden, pad], dim=1)
    logits.index_copy_(0, rows, logits.index_select(0, rows).masked_fill_(forbidden, float("-inf")))


def _row_of_each(offsets: torch.Tensor) -> torch.Tensor:
    """CSR offsets [R + 1] (CPU) -> the row index of every entry [nnz] (CPU)."""
    counts = offsets[1:] - offsets[:-1]
    return torch.repeat_interleave(torch.arange(counts.numel()), counts)


def _mix_seed(seed: int, gen_index: int) -> int:
    """(seed, gen_index) -> a well-spread 63-bit generator seed (splitmix64 finalizer)."""
    z = (seed * 0x9E3779B97F4A7C15 + gen_index + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


class Sampler:
    def __init__(self, seed: int | None = None):
        """seed: the shared generator of unseeded rows (the engine passes `--seed`). None draws
        it from torch's global RNG, so `torch.manual_seed(...)` before building a runner
        without a seed also fixes its unseeded sampling."""
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,)))
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed)
        self._device_generators: dict[torch.device, torch.Generator] = {}
        # one generator per device for the seeded rows, re-seeded for each row it draws
        self._seeded_generators: dict[torch.device, torch.Generator] = {}

    def generator_on(self, device: torch.device) -> torch.Generator:
        """The shared generator of unseeded rows for logits on `device` (the CPU one, or one
        per accelerator seeded alike)."""
        if device.type == "cpu":
            return self.generator
        g = self._device_generators.get(device)
        if g is None:
            g = self._device_generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return g

    def sample_plan(self, logits: torch.Tensor, plan) -> "DeviceSample":
        """`sample_on_device` with the Plan's columns. CPU logits whose rows are all
        `plain_greedy` take numpy's argmax instead: the same first-maximum rule as torch's (NaN
        counts as the maximum in both), without building the tensor columns.

        NOTE: measured in a batch-1 decode step of SmolLM2 on CPU: the columns and the torch
        pass cost ~0.7 ms of a ~12 ms token, numpy's argmax ~0.05 ms. The weights stream
        through the caches just before, and a torch op's first call after that costs ~50-300
        us, numpy's a few."""
        if logits.device.type == "cpu" and plain_greedy(plan):
            tokens = logits.numpy().argmax(axis=-1).astype(np.int64, copy=False)
            rows = len(tokens)
            return DeviceSample(SampleOutput(tokens, np.zeros(rows, np.float32), np.zeros((rows, 0), np.int64),
                                             np.zeros((rows, 0), np.float32)))
        return self.sample_on_device(logits, SamplingBatch.from_plan(plan))

    def sample(self, logits: torch.Tensor, b: SamplingBatch) -> SampleOutput:
        """logits float32 [R, V] on any device (raw model output; modified in place) ->
        SampleOutput (numpy, on the host)."""
        return self.sample_on_device(logits, b).to_host()

    def sample_on_device(self, logits: torch.Tensor, b: SamplingBatch) -> "DeviceSample":
        """`sample` up to the copy to the host: on an accelerator the work is queued, and
        `DeviceSample.to_host()` waits for it."""
        num_rows, vocab = logits.shape
        if num_rows == 0:
            return DeviceSample(SampleOutput.empty())
        dev = logits.device
        wants = torch.nonzero(b.num_logprobs >= 0).squeeze(1)
        wants_dev = to_device(wants, dev)
        raw_logprobs = torch.log_softmax(logits[wants_dev], dim=-1) if wants.numel() else None

        apply_token_bitmask(logits, b.mask_rows, b.token_bitmask)
        self._apply_bias(logits, b)
        self._apply_penalties(logits, b)
        tokens = logits.argmax(dim=-1)
        random_rows = torch.nonzero(b.temperature > 0).squeeze(1)
        if random_rows.numel():
            tokens[to_device(random_rows, dev)] = self._sample_random(logits, b, random_rows)

        k = max(int(b.num_logprobs.max()), 0)
        chosen = top_ids = top_values = None
        if raw_logprobs is not None:
            chosen = raw_logprobs.gather(1, tokens[wants_dev].unsqueeze(1)).squeeze(1)
            if k:
                top_values, top_ids = raw_logprobs.topk(min(k, vocab), dim=-1)   # sorted, largest first
        sample = DeviceSample(None, tokens, wants, chosen, top_ids, top_values, num_rows, k)
        sample.start_copy()
        return sample

    @staticmethod
    def _apply_bias(logits: torch.Tensor, b: SamplingBatch) -> None:
        """logit_bias and min_tokens bans (-inf) from the CSR columns: O(nnz)."""
        if b.bias_token_ids.numel() == 0:
            return
        dev = logits.device
        rows = _row_of_each(b.bias_offsets)
        logits.index_put_((to_device(rows, dev), to_device(b.bias_token_ids, dev)),
                          to_device(b.bias_values, dev), accumulate=True)

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, b: SamplingBatch) -> None:
        """Repetition penalty over prompt + output tokens (HF/vLLM: divide positive logits,
        multiply negative ones); presence and frequency penalties over output tokens only."""
        if b.hist_tokens.numel() == 0:
            return
        hist_lens = b.hist_offsets[1:] - b.hist_offsets[:-1]
        pen_rows = torch.nonzero(hist_lens > 0).squeeze(1)                # [Rp]
        compact = torch.cumsum(hist_lens > 0, 0) - 1                      # row -> index in Rp
        row = _row_of_each(b.hist_offsets)                                # [nh]
        pos_in_row = torch.arange(row.numel()) - b.hist_offsets[row]
        is_output = pos_in_row >= b.hist_prompt_lens[row]
        prow = compact[row]

        dev = logits.device
        num_pen, vocab = pen_rows.numel(), logits.shape[1]
        hist = to_device(b.hist_tokens, dev)
        seen = torch.zeros(num_pen, vocab, dtype=torch.bool, device=dev)
        seen[to_device(prow, dev), hist] = True
        counts = torch.zeros(num_pen, vocab, dtype=torch.float32, device=dev)
        counts.index_put_((to_device(prow[is_output], dev), to_device(b.hist_tokens[is_output], dev)),
                          torch.ones(int(is_output.sum()), device=dev), accumulate=True)

        pen_rows_dev = to_device(pen_rows, dev)
        sub = logits[pen_rows_dev]
        rep = to_device(b.repetition_penalty[pen_rows].unsqueeze(1), dev)
        # NOTE: a tiny penalty can push a positive logit past float32's range: keep it finite
        # (the largest float), so the row never holds +inf, which softmax turns into NaN.
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        sub.clamp_(max=torch.finfo(torch.float32).max)
        sub -= to_device(b.frequency_penalty[pen_rows].unsqueeze(1), dev) * counts
        sub -= to_device(b.presence_penalty[pen_rows].unsqueeze(1), dev) * (counts > 0).float()
        logits[pen_rows_dev] = sub

    def _sample_random(self, logits: torch.Tensor, b: SamplingBatch,
                       rows: torch.Tensor) -> torch.Tensor:
        """logits [R, V] (processed) -> sampled ids [Rs] (on logits' device) for `rows` (CPU,
        temperature > 0). Greedy tokens are already taken, so `logits` is reused as scratch."""
        dev = logits.device
        x = logits if rows.numel() == logits.shape[0] else logits[to_device(rows, dev)]
        temp = to_device(b.temperature[rows].unsqueeze(1), dev)
        # Weights exp((x - max) / T): the row's probabilities up to a constant factor, which
        # neither min_p / top_k nor the race needs. NOTE: shifting by the max first keeps tiny
        # temperatures finite in float32 (the best token's weight is exactly 1, bans exactly 0).
        w = x.sub_(x.max(dim=-1, keepdim=True).values).div_(temp).exp_()

        min_p = b.min_p[rows]
        if bool((min_p > 0).any()):
            # max weight is 1: p / p_max = w
            w.masked_fill_(w < to_device(min_p.unsqueeze(1), dev), 0.0)

        top_k = b.top_k[rows]
        k_rows = torch.nonzero((top_k > 0) & (top_k < w.shape[1])).squeeze(1)
        if k_rows.numel():
            ks = top_k[k_rows]
            k_rows = to_device(k_rows, dev)
            sub = w[k_rows]
            kth_index = to_device((ks - 1).unsqueeze(1), dev)
            kth = sub.topk(int(ks.max()), dim=-1).values.gather(1, kth_index)
            w[k_rows] = sub.masked_fill_(sub < kth, 0.0)

        top_p = b.top_p[rows]
        p_rows = torch.nonzero(top_p < 1.0).squeeze(1)
        if p_rows.numel():
            p_rows_dev = to_device(p_rows, dev)
            w[p_rows_dev] = _top_p_filter(w[p_rows_dev], to_device(top_p[p_rows], dev))

        noise = self._exponential_noise(w.shape, b.seeds[rows], b.gen_index[rows], dev)
        return w.div_(noise).argmax(dim=-1)

    def _exponential_noise(self, shape: torch.Size, seeds: torch.Tensor,
                           gen_index: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Exponential(1) noise [Rs, V] on `device`: unseeded rows from the shared generator,
        each seeded row from a generator seeded by (seed, gen_index). (A seed gives other
        tokens on a GPU than on the CPU: the generators differ; each is the same run to run.)"""
        # NOTE: -log(u) with u uniform in [0, 1) is Exponential(1) and ~2x cheaper on CPU than
        # exponential_(); u == 0 gives +inf noise, which only makes that token lose.
        u = torch.empty(shape, device=device)
        seeded = torch.nonzero(seeds >= 0).squeeze(1)
        if seeded.numel() < shape[0]:
            u.uniform_(generator=self.generator_on(device))
        if seeded.numel():
            gen = self._seeded_generators.get(device)
            if gen is None:
                gen = self._seeded_generators[device] = torch.Generator(device=device)
            for i, seed, g in zip(seeded.tolist(), seeds[seeded].tolist(), gen_index[seeded].tolist()):
                # NOTE: re-seeding is safe while earlier draws are queued: a CUDA kernel takes
                # its generator's seed and offset by value when it is launched
                u[i].uniform_(generator=gen.manual_seed(_mix_seed(seed, g)))
        return u.log_().neg_()


def _top_p_filter(w: torch.Tensor, top_p: torch.Tensor, sync_free: bool | None = None) -> torch.Tensor:
    """Zero all but the smallest set of most likely tokens whose probability mass exceeds top_p
    (over what survived top_k / min_p; ties at the boundary are kept); top_p == 0 keeps only
    the most likely token. w [Rp, V] non-negative weights; returns them filtered (in place).

    No vocabulary sort: the set is first looked for among the top candidates (enough for a
    peaked distribution); rows whose candidates hold too little mass use a radix select.
    `sync_free` (default: on an accelerator) runs the radix select on every row and keeps it
    where needed, instead of asking the device which rows need it: that question is a host
    sync, and a sync per step would stall a step queued ahead."""
    if sync_free is None:
        sync_free = w.device.type != "cpu"
    probs = w / w.sum(dim=-1, keepdim=True)
    n = min(_TOP_P_WINDOW, probs.shape[1])
    cand = probs.topk(n, dim=-1).values                           # sorted, largest first
    mass_before = cand.cumsum(dim=-1) - cand
    p = top_p.unsqueeze(1)
    last_kept = (mass_before <= p).sum(dim=-1, keepdim=True) - 1    # the first always survives
    threshold = cand.gather(1, last_kept)
    if n < probs.shape[1]:
        beyond = mass_before[:, -1:] + cand[:, -1:] <= p            # [Rp, 1] window too small
        if sync_free:
            threshold = torch.where(beyond, _radix_threshold(probs, top_p), threshold)
        else:
            flat = torch.nonzero(beyond.squeeze(1)).squeeze(1)
            if flat.numel():
                threshold[flat] = _radix_threshold(probs[flat], top_p[flat])
    return w.masked_fill_(probs < threshold, 0.0)


def _radix_threshold(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The smallest kept probability per row [R, 1], exactly, in O(V) per row without sorting.

    Non-negative float32 values order like their int32 bit patterns. A histogram of the mass
    over the high 16 bits finds the bucket holding the boundary; a second one over the low 16
    bits of that bucket's tokens pins the boundary value."""
    bits = probs.view(torch.int32)
    p = top_p.unsqueeze(1)
    high = bits >> 16                                             # 0 .. 2^15 - 1 (sign bit is 0)
    b_high, mass_above = _boundary_bucket(high, 1 << 15, probs, p, None)
    in_bucket = probs.masked_fill(high != b_high, 0.0)
    b_low, _ = _boundary_bucket(bits & 0xFFFF, 1 << 16, in_bucket, p, mass_above)
    return ((b_high << 16) | b_low).to(torch.int32).view(torch.float32)


def _boundary_bucket(keys: torch.Tensor, num_bins: int, probs: torch.Tensor, p: torch.Tensor,
                     base: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the bucket (key value) holding the last kept token, and the mass in the buckets
    above it plus `base`; both [R, 1]."""
    rows, dev = probs.shape[0], probs.device
    # bins in descending key order, so a forward cumsum is the mass at or above each bucket
    top_bin = torch.arange(rows, device=dev).unsqueeze(1) * num_bins + (num_bins - 1)
    hist = torch.zeros(rows * num_bins, device=dev).index_add_(0, (top_bin - keys).flatten(),
                                                               probs.flatten())
    at_or_above = hist.view(rows, num_bins).cumsum(dim=1)
    if base is not None:
        at_or_above += base
    # like the candidate window: the first bin whose cumulative mass exceeds p holds the last
    # kept token (it cannot be empty: its mass moved the sum past p)
    n = (at_or_above <= p).sum(dim=1, keepdim=True).clamp_(max=num_bins - 1)
    above = torch.where(n > 0, at_or_above.gather(1, (n - 1).clamp_(min=0)),
                        base if base is not None else torch.zeros_like(p))
    return (num_bins - 1) - n, above
