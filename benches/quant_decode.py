"""Quantized decode: the GEMV alone (GB/s of weights read) and SmolLM2 single-stream decode
tok/s with `quantized_decode` on vs off, measured in the same run (BENCH.md).

    python benches/quant_decode.py [--threads 2] [--tokens 128] [--repeats 3] [--skip-decode]

Part 1 times `_core.quant_matmul` on SmolLM2's layer shapes (random weights quantized with
gguf: fused QKV, o, gate|up, down in Q4_1; the tied LM head in Q8_0) against torch's fp32
F.linear on the same shapes. Part 2 builds two offline LLMs from the default GGUF, one per
setting, and alternates them: one prompt, `--tokens` output tokens with ignore_eos; the
figure is output tokens / (end-to-end time - time of a 1-token request), i.e. decode only.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as GT
from gguf.quants import quantize

from llmserve import _core

# (name, rows, cols, format): SmolLM2-135M's linears, fused as the model runs them
SHAPES = [("qkv", 960, 576, GT.Q4_1), ("o_proj", 576, 576, GT.Q4_1),
          ("gate_up", 3072, 576, GT.Q4_1), ("down", 576, 1536, GT.Q4_1),
          ("lm_head", 49152, 576, GT.Q8_0)]


def _median_time(fn, repeats: int, inner: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times)


def bench_gemv(threads: int, repeats: int) -> None:
    rng = np.random.default_rng(0)
    print(f"GEMV, {threads} threads, median of {repeats} (us per call; GB/s of weight bytes read)")
    print(f"{'shape':>8} {'T':>2} {'quant us':>9} {'quant GB/s':>10} {'fp32 us':>9} {'fp32 GB/s':>9} {'speedup':>7}")
    for name, rows, cols, qtype in SHAPES:
        w = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
        raw = np.ascontiguousarray(quantize(w, qtype))
        wt = torch.from_numpy(w)
        inner = max(3, int(2e8 // w.nbytes))
        for tokens in (1, 4):
            x = torch.randn(tokens, cols)
            out = torch.empty(tokens, rows)
            xn, on = x.numpy(), out.numpy()
            tq = _median_time(lambda: _core.quant_matmul(on, xn, raw, int(qtype), rows, cols, threads),
                              repeats, inner)
            with torch.inference_mode():
                tf = _median_time(lambda: F.linear(x, wt), repeats, inner)
            print(f"{name:>8} {tokens:>2} {tq * 1e6:9.1f} {raw.nbytes / tq / 1e9:10.1f} "
                  f"{tf * 1e6:9.1f} {w.nbytes / tf / 1e9:9.1f} {tf / tq:6.2f}x", flush=True)


def bench_decode(threads: int, tokens: int, repeats: int) -> None:
    from llmserve import LLM

    prompt = "Write a short story about a lighthouse keeper who finds a message in a bottle."
    llms = {}
    for on in (True, False):
        llms[on] = LLM(None, max_model_len=1024, num_kv_blocks=80, threads=threads,
                       enable_prefix_caching=False, quantized_decode=on)
    params = {"max_tokens": tokens, "ignore_eos": True, "temperature": 0}

    def run(on: bool, n: int) -> float:
        t0 = time.perf_counter()
        (r,) = llms[on].generate(prompt, {**params, "max_tokens": n})
        assert r.usage["completion_tokens"] == n
        return time.perf_counter() - t0

    rates: dict[bool, list[float]] = {True: [], False: []}
    for on in (True, False):
        run(on, 8)   # warm-up
    for _ in range(repeats):
        for on in (True, False):   # alternate, so both see the same machine load
            first = run(on, 1)
            total = run(on, tokens)
            rates[on].append((tokens - 1) / (total - first))
    q, f = statistics.median(rates[True]), statistics.median(rates[False])
    print(f"single-stream decode, {tokens} tokens, torch threads {threads}, median of {repeats}:")
    print(f"  quantized_decode on : {q:6.1f} tok/s  {[round(r, 1) for r in rates[True]]}")
    print(f"  quantized_decode off: {f:6.1f} tok/s  {[round(r, 1) for r in rates[False]]}")
    print(f"  ratio on/off: {q / f:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-decode", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    bench_gemv(args.threads, args.repeats)
    if not args.skip_decode:
        bench_decode(args.threads, args.tokens, args.repeats)


if __name__ == "__main__":
    main()
