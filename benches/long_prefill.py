"""Long prompts on CPU: how long a fresh prompt of N tokens takes to prefill (one output token)
through the offline engine on the default model, and how much of it is attention.

    python benches/long_prefill.py [--lengths 1000 2000 4000 8000] [--repeats 1]

Each prompt is N random token ids (new each time, so nothing comes from the prefix cache).
Prompt rows go through the Rust paged kernel one token per row (worker/attention.py: a prompt
computes the same however it is split into steps), which reads a prompt's blocks once for up
to 16 consecutive tokens (rust/kernels/src/decode.rs, `attend_rows`). For scale, the same
layer's attention as one torch SDPA call over the whole prompt (causal, GQA; the math llmserve
does not use for prompts, since its bits depend on the split) is timed in the same run.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from llmserve.engine.offline import LLM


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1000, 2000, 4000, 8000])
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()

    import llmserve.worker.attention as attention
    spent = {"s": 0.0}
    inner = attention.paged_attention

    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            spent["s"] += time.perf_counter() - t

    for module in list(sys.modules.values()):
        if getattr(module, "paged_attention", None) is inner:
            module.paged_attention = timed

    llm = LLM()
    layers, heads, kv_heads, d = 30, 9, 3, 64      # SmolLM2-135M
    print(f"load average {os.getloadavg()[0]:.2f}, torch threads {torch.get_num_threads()}")
    print("tokens | prefill s | tok/s | attention s (share) | SDPA x 30 layers s")
    for n in args.lengths:
        walls, attn = [], []
        for _ in range(args.repeats):
            ids = [random.randrange(100, 40000) for _ in range(n)]
            spent["s"] = 0.0
            t = time.perf_counter()
            llm.generate([ids], {"max_tokens": 1})
            walls.append(time.perf_counter() - t)
            attn.append(spent["s"])
        q, k, v = torch.randn(1, heads, n, d), torch.randn(1, kv_heads, n, d), torch.randn(1, kv_heads, n, d)
        t = time.perf_counter()
        for _ in range(layers):
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        sdpa = time.perf_counter() - t
        wall, a = statistics.median(walls), statistics.median(attn)
        print(f"{n} | {wall:.2f} | {n / wall:.0f} | {a:.2f} ({a / wall:.0%}) | {sdpa:.2f}", flush=True)


if __name__ == "__main__":
    main()
