"""How the engine's CPU threads are shared between torch and llmserve's Rust kernels.

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


def set_engine_threads(n: int) -> None:
    global _engine_threads
    _engine_threads = max(1, n)


def kernel_threads() -> int:
    """Threads a Rust kernel call may use: the engine's count, even while torch runs on one."""
    return _engine_threads or torch.get_num_threads()


@contextmanager
def torch_on_one_thread(active: bool) -> Iterator[None]:
    """Runs the block with torch single-threaded (when `active`), restoring its count after."""
    if not active or torch.get_num_threads() == 1:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
