"""Decode steps of a GGUF model serving LoRA adapters, with base-model and adapter rows in the
same step: run in two parts (the base rows on the Rust layers, the adapter rows on the torch
layers; worker/runner.py ModelRunner._parts) against one step on the torch layers (what such
steps ran before, which moved the base rows' bits), beside steps of base rows alone and of
adapter rows alone. The default model (SmolLM2-135M Q4_1/Q8_0) with one random rank-16 adapter
on all seven projections, decode steps at ~256 cached tokens, half the rows through the
adapter; medians of 9 runs, alternating.

    python benches/lora_mixed_decode.py [threads]

Measured (2 cores, AVX512-BF16 CPU, nothing else running, 2 threads), in parts / one torch step:
1.11x at batch 2 (25.1 vs 22.6 ms; base rows alone 5.8 ms), 1.08x at 4, 1.04x at 8, 0.98x at 16,
1.03x at 24: the base rows' Rust step costs little beside the adapter rows' torch step.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, "tests")
from _plans import decode_plan  # noqa: E402
from tiny import write_peft_adapter  # noqa: E402

from llmserve.engine.build import build_engine  # noqa: E402
from llmserve.engine.offline import make_config  # noqa: E402

THREADS = int(sys.argv[1]) if len(sys.argv) > 1 else 2
CTX, BATCHES = 256, (2, 4, 8, 16, 24)
SMOL = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
            num_key_value_heads=3, head_dim=64, vocab_size=49152)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

with tempfile.TemporaryDirectory() as tmp:
    write_peft_adapter(Path(tmp) / "a", SMOL, TARGETS, r=16, alpha=16.0)
    engine = build_engine(make_config(None, threads=THREADS, lora_modules=[f"a={tmp}/a"], num_kv_blocks=600))
runner = engine.runner
for t in (*runner.kv_cache.key, *runner.kv_cache.value):
    t.normal_()
split = runner._rust_decode
KINDS = {"base": (lambda n: [0] * n, split), "adapter": (lambda n: [1] * n, split),
         "mixed, in parts": (lambda n: [i % 2 for i in range(n)], split),
         "mixed, one torch step": (lambda n: [i % 2 for i in range(n)], lambda: False)}
print(f"SmolLM2-135M (default GGUF), {THREADS} threads, rank-16 adapter, {CTX} cached tokens")
for batch in BATCHES:
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    for rep in range(10):
        for kind, (ids, rust) in KINDS.items():
            runner._rust_decode = rust
            plan = decode_plan(batch, CTX, runner.block_size, SMOL["vocab_size"], rep, ids(batch))
            t0 = time.perf_counter()
            runner.execute(plan)
            if rep:   # (the first is a warm-up)
                times[kind].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    parts = med["mixed, in parts"] / med["mixed, one torch step"]
    print(f"batch {batch:2d}: " + ", ".join(f"{k} {v * 1e3:6.1f} ms" for k, v in med.items())
          + f"; in parts / one step {parts:.2f}x", flush=True)
