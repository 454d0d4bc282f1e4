"""CPU decode attention: the Rust paged kernel (rust/kernels) vs the torch gather + SDPA path,
in one run, on a SmolLM2-135M-shaped random model (fp32, 30 layers, 9 heads / 3 kv heads,
head_dim 64, block 16).

    python benches/cpu_decode_attention.py [--threads 2] [--batch 64] [--ctx 256] [--repeats 7]

Three ways: the torch path, the kernel on 1 thread, the kernel on `--threads` threads (the
default: torch's thread count, see attention.py's CPU_DECODE_THREADS). Reports, each way, the median (and
min) of `--repeats`:
- a whole decode step through ModelRunner.execute (batch x ~ctx cached tokens, greedy);
- attention alone: the 30 layers' `paged_attention` calls of that step (KV write included),
  on the runner's real caches.
The ways alternate within each repeat so that machine noise hits both alike (BENCH.md:
report ratios from the same run). The load average is printed: other processes skew figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "python"))

from _plans import Plan, Row, sampling_columns  # noqa: E402

from llmserve.models import build_model  # noqa: E402
from llmserve.worker import ModelRunner, attention  # noqa: E402
from llmserve.worker.attention import AttentionMetadata, paged_attention  # noqa: E402

H, I, D, HEADS, KVH, LAYERS, VOCAB, BS = 576, 1536, 64, 9, 3, 30, 49152, 16


def smollm2_random() -> torch.nn.Module:
    cfg = dict(architectures=["LlamaForCausalLM"], vocab_size=VOCAB, hidden_size=H,
               intermediate_size=I, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
               num_key_value_heads=KVH, rms_norm_eps=1e-5, max_position_embeddings=8192,
               rope_theta=100000.0, tie_word_embeddings=True)
    g = torch.Generator().manual_seed(0)

    def r(*s):
        return torch.randn(s, generator=g) * 0.02

    w = {"model.embed_tokens.weight": r(VOCAB, H), "model.norm.weight": torch.ones(H)}
    for layer in range(LAYERS):
        p = f"model.layers.{layer}."
        w.update({p + "self_attn.q_proj.weight": r(HEADS * D, H),
                  p + "self_attn.k_proj.weight": r(KVH * D, H),
                  p + "self_attn.v_proj.weight": r(KVH * D, H),
                  p + "self_attn.o_proj.weight": r(H, HEADS * D),
                  p + "mlp.gate_proj.weight": r(I, H), p + "mlp.up_proj.weight": r(I, H),
                  p + "mlp.down_proj.weight": r(H, I),
                  p + "input_layernorm.weight": torch.ones(H),
                  p + "post_attention_layernorm.weight": torch.ones(H)})
    return build_model(cfg, w, torch.float32, "cpu")


def decode_plan(batch: int, ctx: int) -> Plan:
    """Every sequence decodes its token `ctx` (ctx cached before it); blocks interleaved
    across sequences, as after a while of continuous batching."""
    nblk = (ctx + BS) // BS
    tables = (1 + np.arange(batch * nblk, dtype=np.int32).reshape(nblk, batch).T).copy()
    slots = tables[:, ctx // BS].astype(np.int64) * BS + ctx % BS
    return Plan(input_ids=np.random.default_rng(0).integers(0, VOCAB, batch),
                positions=np.full(batch, ctx, np.int64),
                query_start_loc=np.arange(batch + 1, dtype=np.int32),
                seq_lens=np.full(batch, ctx + 1, np.int32), block_tables=tables,
                slot_mapping=slots, copy_src=np.zeros(0, np.int64),
                copy_dst=np.zeros(0, np.int64), logits_indices=np.arange(batch, dtype=np.int64),
                **sampling_columns([Row()] * batch))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if attention._cpu_decode is None:
        sys.exit("llmserve._core has no paged_decode_attention: rebuild the extension")

    model = smollm2_random()
    plan = decode_plan(a.batch, a.ctx)
    nblk = (a.ctx + BS) // BS
    runner = ModelRunner(model, a.batch * nblk + 1, BS, torch.float32, "cpu", seed=0)
    for t in (*runner.kv_cache.key, *runner.kv_cache.value):
        t.normal_()

    meta = AttentionMetadata.build(plan.query_start_loc, plan.seq_lens, plan.block_tables,
                                   torch.from_numpy(plan.slot_mapping), BS, torch.device("cpu"),
                                   runner.workspace)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(a.batch, HEADS, D, generator=g)
    k = torch.randn(a.batch, KVH, D, generator=g)
    v = torch.randn(a.batch, KVH, D, generator=g)

    def step() -> None:
        runner.execute(plan)

    def attention_only() -> None:
        with torch.inference_mode():
            for kc, vc in zip(runner.kv_cache.key, runner.kv_cache.value):
                paged_attention(q, k, v, kc, vc, meta, D ** -0.5)

    # (label, kernel on, kernel threads)
    modes = [("torch", False, None), ("kernel x1", True, 1)]
    if a.threads > 1:
        modes.append((f"kernel x{a.threads}", True, a.threads))
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(a.repeats + 1):                  # the first round warms up, not counted
        for name, fn in (("step", step), ("attention", attention_only)):
            for label, on, threads in modes:
                attention.USE_CPU_DECODE_KERNEL, attention.CPU_DECODE_THREADS = on, threads
                t0 = time.perf_counter()
                fn()
                times.setdefault((name, label), []).append(time.perf_counter() - t0)
    attention.USE_CPU_DECODE_KERNEL, attention.CPU_DECODE_THREADS = True, None

    print(f"batch {a.batch}, {a.ctx} cached tokens, torch threads {a.threads}, "
          f"load average {os.getloadavg()[0]:.1f}; ms, median (min) of {a.repeats}")
    med = {key: statistics.median(ts[1:]) * 1e3 for key, ts in times.items()}
    kv_bytes = LAYERS * a.batch * (a.ctx + 1) * KVH * D * 4 * 2
    for label, _, _ in modes:
        step_ms, attn_ms = med[("step", label)], med[("attention", label)]
        print(f"  {label:10s} step {step_ms:7.1f} ({min(times[('step', label)][1:]) * 1e3:6.1f})"
              f"  attention {attn_ms:6.1f} ({min(times[('attention', label)][1:]) * 1e3:6.1f})"
              f"  share {attn_ms / step_ms:4.0%}"
              f"  step speedup {med[('step', 'torch')] / step_ms:.2f}x"
              f"  attention speedup {med[('attention', 'torch')] / attn_ms:.2f}x"
              f"  K/V {kv_bytes / attn_ms / 1e6:5.1f} GB/s")

if __name__ == "__main__":
    main()
