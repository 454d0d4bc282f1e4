"""The matmuls of one SmolLM2-135M step (30 layers x qkv, o, gate|up, down; then the LM head)
in float32 (MKL) and in bfloat16 (oneDNN), side by side for several row counts.

    python benches/bf16_gemm.py [--threads 2] [--repeats 5]

This is what `worker/threads.py: native_bf16` rests on: on a CPU with AVX512_BF16 or AMX the
bf16 layer matmuls are ~2x faster; without them torch emulates bf16 and they are slower.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

H, I, Q, LAYERS, VOCAB = 576, 1536, 960, 30, 49152


def step_time(rows: int, weights: list[torch.Tensor], dtype: torch.dtype, repeats: int) -> float:
    xs = {k: torch.randn(rows, k) for k in (H, I)}

    def once() -> None:
        for w in weights:
            F.linear(xs[w.shape[1]].to(dtype), w).float()

    once()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        once()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shapes = [(Q, H), (H, H), (2 * I, H), (H, I)] * LAYERS
    layer32 = [torch.randn(s) * 0.02 for s in shapes]
    layer16 = [w.bfloat16() for w in layer32]
    head32 = [torch.randn(VOCAB, H) * 0.02]
    print(f"threads {args.threads}; ms per step, median of {args.repeats}")
    for rows in (8, 16, 32, 64, 128):
        a = step_time(rows, layer32, torch.float32, args.repeats)
        b = step_time(rows, layer16, torch.bfloat16, args.repeats)
        head = step_time(rows, head32, torch.float32, args.repeats)
        print(f"rows {rows:4d}  layers fp32 {a:7.1f}  bf16 {b:7.1f}  ({a / b:4.2f}x)  "
              f"LM head fp32 {head:6.1f}", flush=True)


if __name__ == "__main__":
    main()
