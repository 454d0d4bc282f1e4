"""Which CPU steps read GGUF blocks, and how the engine's CPU threads are shared between torch
and llmserve's Rust kernels.

A step reads a quantized model's GGUF blocks (the quantized GEMV, and the whole-layer Rust
decoder of models/cpu_decoder.py) only when it is a decode step of generated tokens: at most
QUANT_MAX_TOKENS sequences, each computing the one token it sampled last. Prompt tokens always
run the fp32 path, however few: a prompt's numerics must not depend on how much of it the
prefix cache held (a cache hit leaves a short tail that would otherwise take the quantized
path, and the same greedy request would answer differently on its second run).

The Rust kernels (quantized GEMV, paged decode attention) run on their own persistent
thread pool (rust/kernels/src/pool.rs). torch's OpenMP workers spin for a while after every
parallel op, so when a step interleaves many small torch ops with kernel calls, the two
pools' workers fight for the same cores: on 2 cores, SmolLM2 single-stream decode with
2 torch threads and 2 kernel threads ran several times slower than with 1 and 1.

So few-token CPU steps (at most QUANT_MAX_TOKENS tokens, where the quantized GEMV carries
the linears) run torch single-threaded and give the kernels all the engine's threads:
`benches/quant_decode.py` measures the effect. Larger steps keep torch at full width (its
fp32 GEMMs dominate) and the attention kernel shares the cores with it.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

# Steps of at most this many tokens (decode) read a linear's GGUF blocks when it has them:
# they are bound by reading weights (BENCH.md), and Q4_1 is ~6x smaller than fp32. Larger
# steps are bound by compute, where MKL's fp32 GEMM on the dequantized copy wins.
QUANT_MAX_TOKENS = 8

# The engine's CPU thread count (torch's at startup); None until a ModelRunner is built.
_engine_threads: int | None = None

# Whether the running step may read GGUF blocks (set by the runner for each step); None
# outside a runner's step: a linear called alone then decides by its token count.
_quantized_step: bool | None = None


def is_generated_decode(plan) -> bool:
    """Whether every token of `plan` is its sequence's only new token and was sampled by an
    earlier step (not a prompt token), and there are at most QUANT_MAX_TOKENS of them."""
    n = len(plan.input_ids)
    gen = plan.gen_index
    return (0 < n <= QUANT_MAX_TOKENS and len(plan.query_start_loc) == n + 1
            and len(plan.logits_indices) == n and len(gen) == n and int(min(gen)) >= 1)


def quantized_step_allowed(num_tokens: int) -> bool:
    """Whether a linear over `num_tokens` rows may read its GGUF blocks in the current step."""
    if _quantized_step is None:
        return num_tokens <= QUANT_MAX_TOKENS
    return _quantized_step and num_tokens <= QUANT_MAX_TOKENS


def set_engine_threads(n: int) -> None:
    global _engine_threads
    _engine_threads = max(1, n)


def kernel_threads() -> int:
    """Threads a Rust kernel call may use: the engine's count, even while torch runs on one."""
    return _engine_threads or torch.get_num_threads()


@contextmanager
def quantized_step(active: bool) -> Iterator[None]:
    """Runs one step: with `active`, its linears read GGUF blocks and torch runs on one thread
    (the kernels get the engine's threads); without, everything takes the fp32 path."""
    global _quantized_step
    before_step, before_threads = _quantized_step, torch.get_num_threads()
    _quantized_step = active
    if active and before_threads > 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        _quantized_step = before_step
        if torch.get_num_threads() != before_threads:
            torch.set_num_threads(before_threads)
