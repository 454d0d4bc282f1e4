"""Quantized decode: the GEMV alone (GB/s of weights read) and SmolLM2 single-stream decode
tok/s with `quantized_decode` on vs off, measured in the same run (BENCH.md).

    python benches/quant_decode.py [--threads 2] [--tokens 128] [--repeats 3] [--skip-decode]
                                   [--baseline OTHER/_core.abi3.so]

Part 1 times `_core.quant_matmul` on SmolLM2's layer shapes (random weights quantized with
gguf: fused QKV, o, gate|up, down in Q4_1; the tied LM head in Q8_0) against torch's fp32
F.linear on the same shapes, and sums them into the GEMV time of one decode token (30 layers
+ LM head). Those calls repeat one matrix, which then sits in cache; the "from memory" line
times what a real step does: the 30 layers' linears in order, each layer its own copy of
the weights (66 MB in all, far past the caches), so every byte comes from DRAM. `--baseline` loads another build of the extension (e.g. a copy of the .so from
before a kernel change) and times its `quant_matmul` on the same inputs, interleaved with
this build's, so old and new are compared in one run. The kernels are all timed before any
torch call: torch's OpenMP threads keep spinning after each op and would steal the cores.
Part 2 builds two offline LLMs from the default GGUF, one per setting, and alternates them:
one prompt, `--tokens` output tokens with ignore_eos; the figure is output tokens /
(end-to-end time - time of a 1-token request), i.e. decode only.
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


LAYERS = 30   # SmolLM2-135M: every shape but the LM head runs once per layer per token


def _median_time(fn, repeats: int, inner: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times)


def _load_baseline(path: str):
    """Another build of the extension, loaded beside this one (its init function is
    PyInit__core, so the module must be called `_core`; a different file is a separate copy)."""
    import importlib.machinery
    import importlib.util

    loader = importlib.machinery.ExtensionFileLoader("_core", path)
    spec = importlib.util.spec_from_file_location("_core", path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def bench_gemv(threads: int, repeats: int, baseline: str | None) -> None:
    rng = np.random.default_rng(0)
    modules = {"new": _core}
    if baseline:
        modules["old"] = _load_baseline(baseline)
    kernels = {label: m.quant_matmul for label, m in modules.items()}
    cases = []
    for name, rows, cols, qtype in SHAPES:
        w = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
        raw = np.ascontiguousarray(quantize(w, qtype))
        for tokens in (1, 4):
            x = rng.standard_normal((tokens, cols)).astype(np.float32)
            cases.append((name, rows, cols, qtype, tokens, w, raw, x))

    # the kernels first, each case's variants interleaved repeat by repeat
    times: dict[tuple[str, int, str], list[float]] = {}
    inner_of = {}
    for name, rows, cols, qtype, tokens, w, raw, x in cases:
        inner_of[name] = inner = max(3, int(2e8 // w.nbytes))
        out = np.empty((tokens, rows), np.float32)
        # builds since quant_pack read their own layout; older ones the raw blocks
        weights = {label: m.quant_pack(raw, int(qtype)) if hasattr(m, "quant_pack") else raw
                   for label, m in modules.items()}
        for _ in range(repeats):
            for label, kernel in kernels.items():
                t = _median_time(lambda: kernel(out, x, weights[label], int(qtype), rows, cols,
                                                threads), 1, inner)
                times.setdefault((name, tokens, label), []).append(t)
    cold = _from_memory(modules, cases, threads, repeats)
    fp32 = {}
    with torch.inference_mode():
        for name, rows, cols, qtype, tokens, w, raw, x in cases:
            xt, wt = torch.from_numpy(x), torch.from_numpy(w)
            fp32[name, tokens] = _median_time(lambda: F.linear(xt, wt), repeats, inner_of[name])

    labels = list(kernels)
    print(f"GEMV, {threads} threads, median of {repeats} (us per call; GB/s of weight bytes read)")
    head = f"{'shape':>8} {'T':>2}" + "".join(f" {k + ' us':>9} {k + ' GB/s':>9}" for k in labels)
    head += f" {'fp32 us':>9}" + (" new/old" if baseline else "")
    print(head)
    per_token: dict[tuple[str, int], float] = {}
    for name, rows, cols, qtype, tokens, w, raw, x in cases:
        med = {k: statistics.median(times[name, tokens, k]) for k in labels}
        line = f"{name:>8} {tokens:>2}"
        per_step = 1 if name == "lm_head" else LAYERS
        for k in labels:
            line += f" {med[k] * 1e6:9.1f} {raw.nbytes / med[k] / 1e9:9.1f}"
            per_token[k, tokens] = per_token.get((k, tokens), 0.0) + med[k] * per_step
        line += f" {fp32[name, tokens] * 1e6:9.1f}"
        if baseline:
            line += f" {med['old'] / med['new']:6.2f}x"
        print(line, flush=True)
    total_bytes = sum(raw.nbytes * (1 if name == "lm_head" else LAYERS)
                      for name, _, _, _, tokens, _, raw, _ in cases if tokens == 1)
    for tokens in (1, 4):
        parts = [f"{k} {per_token[k, tokens] * 1e3:6.2f} ms "
                 f"({total_bytes / per_token[k, tokens] / 1e9:4.1f} GB/s)" for k in labels]
        print(f"one decode step of SmolLM2 (30 layers + LM head), T={tokens}: " + ", ".join(parts))
    layer_bytes = sum(raw.nbytes for name, _, _, _, tokens, _, raw, _ in cases
                      if tokens == 1 and name != "lm_head") * LAYERS
    for tokens in (1, 4):
        parts = [f"{k} {cold[k, tokens] * 1e3:6.2f} ms ({layer_bytes / cold[k, tokens] / 1e9:4.1f} GB/s)"
                 for k in labels]
        line = f"the 30 layers' linears from memory, T={tokens}: " + ", ".join(parts)
        if baseline:
            line += f", new/old {cold['old', tokens] / cold['new', tokens]:.2f}x"
        print(line)


def _from_memory(modules, cases, threads: int, repeats: int) -> dict[tuple[str, int], float]:
    """Seconds for the 30 layers' linears of one step, each layer with its own weights."""
    layer_cases = [c for c in cases if c[0] != "lm_head"]
    result = {}
    for tokens in (1, 4):
        calls = {label: [] for label in modules}
        for name, rows, cols, qtype, t, w, raw, x in layer_cases:
            if t != tokens:
                continue
            out = np.empty((tokens, rows), np.float32)
            for label, m in modules.items():
                for _ in range(LAYERS):
                    weights = m.quant_pack(raw, int(qtype)) if hasattr(m, "quant_pack") else raw.copy()
                    calls[label].append((m.quant_matmul, out, x, weights, int(qtype), rows, cols))
        # in a step's order: layer by layer, each layer's linears in turn
        per_shape = len(calls["new"]) // LAYERS
        for label in modules:
            calls[label] = [calls[label][s * LAYERS + layer] for layer in range(LAYERS) for s in range(per_shape)]
        times: dict[str, list[float]] = {label: [] for label in modules}
        for _ in range(repeats):
            for label, todo in calls.items():
                def step():
                    for kernel, out, x, weights, qtype, rows, cols in todo:
                        kernel(out, x, weights, qtype, rows, cols, threads)
                times[label].append(_median_time(step, 5, 4))
        for label in modules:
            result[label, tokens] = statistics.median(times[label])
    return result


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
    ap.add_argument("--baseline", help="another build's _core.abi3.so to time beside this one")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    bench_gemv(args.threads, args.repeats, args.baseline)
    if not args.skip_decode:
        bench_decode(args.threads, args.tokens, args.repeats)


if __name__ == "__main__":
    main()
