"""Where a CUDA step's time goes: `CudaModelRunner.execute` of a model with this config.json
(random bf16 weights), timed on the host and profiled on the GPU (torch.profiler).

    python benches/step_profile.py target/gpu-carry/smollm2-shape/config.json
    python benches/step_profile.py CONFIG --device cpu --small    # a smoke run, reference ops

Steps profiled:
- decode at batch 1 and 256 (~500 cached tokens each), with CUDA graphs and eagerly, each
  without and with the fused layer ops (LLMSERVE_FUSED_OPS: csrc/layer_ops.cu);
- a mixed step, as serving under load runs nearly all of them: 64 decode rows and one new
  512-token prompt, eagerly, as piecewise graphs (LLMSERVE_PIECEWISE_GRAPHS), as those with
  the fused ops, and as those with varlen prefill attention too;
- one prefill step of 32 fresh ~1,024-token prompts (what a `load-gpu` burst asks for), with
  each prefill attention (cuda_attention.py: one SDPA per prompt, or one varlen_attn call),
  and with one SDPA per prompt and the fused ops.
For each: the host's wall time per step (launch to tokens on the host) next to the GPU's
kernel time per step, then the kernels that took the most GPU time. A wall time far above the
kernel time is host work (Python, launches, syncs) that the GPU waits for. Decode steps also
run one step ahead, as the engine runs them, with the GPU's idle time per step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "python"), str(ROOT / "tests"), str(ROOT / "benches")]

from _plans import Paged  # noqa: E402
from kernel_bench import random_weights  # noqa: E402

from llmserve.models import build_model  # noqa: E402
from llmserve.worker.cuda_graphs import CudaModelRunner  # noqa: E402

BS = 16


def report(name: str, prof, walls: list[float], steps: int, rows: int, cuda: bool) -> None:
    events = prof.key_averages()
    kernel_us = sum(e.self_device_time_total for e in events) / steps if cuda else float("nan")
    print(f"== {name}: wall {statistics.median(walls) * 1e3:.3f} ms/step (median of {len(walls)}), "
          f"GPU kernels {kernel_us / 1e3:.3f} ms/step", flush=True)
    if rows:
        key = "self_device_time_total" if cuda else "self_cpu_time_total"
        print(events.table(sort_by=key, row_limit=rows, max_name_column_width=70), flush=True)


def gpu_idle_us(prof, steps: int) -> float:
    """GPU time per step with no kernel running, between the first kernel's start and the last
    one's end (BENCH.md: the gap between steps <= 200 us; this counts the gaps inside a step
    too, so it bounds that gap from above)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    if not spans:
        return float("nan")
    busy, (lo, hi) = 0.0, spans[0]
    for start, end in spans[1:]:
        if start > hi:
            busy, lo = busy + hi - lo, start
        hi = max(hi, end)
    busy += hi - lo
    return (max(e for _, e in spans) - spans[0][0] - busy) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny batches and prompts (smoke run)")
    ap.add_argument("--rows", type=int, default=12, help="kernels listed per profile")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    ops = None
    if not cuda:
        from llmserve.kernels import reference as ops
    cfg = json.loads(Path(args.config).read_text())
    model = build_model(cfg, random_weights(cfg, device=args.device), torch.bfloat16, torch.device(args.device))
    rng = np.random.default_rng(0)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    ctx, batches, prompt, prompts = (40, (1, 4), 64, 4) if args.small else (500, (1, 256), 1024, 32)

    def runner_for(batch: int, blocks: int, graphs: bool, prefill: str = "sdpa",
                   fused: bool = False) -> CudaModelRunner:
        return CudaModelRunner(model, blocks, BS, torch.bfloat16, args.device, max_num_seqs=batch,
                               max_model_len=2048, cuda_graphs=graphs and cuda, capture_sizes=[batch], ops=ops,
                               prefill_attention=prefill, fused_ops=fused)

    for batch in batches:
        for graphs, fused in [(g, f) for g in ((True, False) if cuda else (False,)) for f in (False, True)]:
            blocks = batch * (ctx + 64) // BS + 8
            runner, paged = runner_for(batch, blocks, graphs, fused=fused), Paged(blocks, BS)
            for s in range(batch):
                paged.add(s, rng.integers(0, cfg["vocab_size"], ctx).tolist())
            for i in range(0, batch, 32):
                runner.execute(paged.step({s: ctx for s in range(i, min(i + 32, batch))}))

            def step():
                for s in range(batch):
                    paged.append(s, int(rng.integers(0, cfg["vocab_size"])))
                return paged.step({s: 1 for s in range(batch)})

            for _ in range(5):
                runner.execute(step())
            walls = []
            with profile(activities=acts) as prof:
                for _ in range(10):
                    plan = step()
                    t = time.perf_counter()
                    runner.execute(plan)
                    walls.append(time.perf_counter() - t)
            graphs_ran = cuda and graphs and runner.graphs.use_graphs
            name = f"decode batch {batch} {'graphs' if graphs_ran else 'eager'}{', fused ops' if fused else ''}"
            report(name, prof, walls, 10, args.rows if not graphs_ran or batch > 1 else 0, cuda)
            # As the engine runs with --async-scheduling: step k + 1 launched (queued behind step
            # k) before step k's tokens are read back, so the GPU should never wait for the host.
            with profile(activities=acts) as prof:
                t = time.perf_counter()
                running = runner.launch(step())
                for _ in range(10):
                    queued = runner.launch(step(), running)
                    running.result()
                    running = queued
                running.result()
                wall = (time.perf_counter() - t) / 11
            print(f"   one step ahead: wall {wall * 1e3:.3f} ms/step, GPU idle {gpu_idle_us(prof, 11):.0f} us/step "
                  f"(BENCH.md: <= 200 us between steps)", flush=True)
            del runner
            if cuda:
                torch.cuda.empty_cache()

    dec, chunk = (4, 32) if args.small else (64, 512)
    for fused, piecewise, prefill in ((False, False, "sdpa"), (False, True, "sdpa"), (True, True, "sdpa"),
                                      (True, True, "varlen")):
        blocks = (dec * (ctx + 32) + 16 * (chunk + BS)) // BS + 8
        runner = CudaModelRunner(model, blocks, BS, torch.bfloat16, args.device, max_num_seqs=dec + 1,
                                 max_model_len=2048, cuda_graphs=cuda, capture_sizes=[dec], ops=ops,
                                 fused_ops=fused, piecewise=piecewise, piece_sizes=[dec + chunk],
                                 prefill_attention=prefill)
        paged, walls = Paged(blocks, BS), []
        for s in range(dec):
            paged.add(s, rng.integers(0, cfg["vocab_size"], ctx).tolist())
        for i in range(0, dec, 32):
            runner.execute(paged.step({s: ctx for s in range(i, min(i + 32, dec))}))

        def mixed(new: int):
            for s in range(dec):
                paged.append(s, int(rng.integers(0, cfg["vocab_size"])))
            paged.add(new, rng.integers(0, cfg["vocab_size"], chunk).tolist())
            return paged.step({**{s: 1 for s in range(dec)}, new: chunk})

        for i in range(3):
            runner.execute(mixed(dec + i))
        with profile(activities=acts) as prof:
            for i in range(10):
                plan = mixed(dec + 3 + i)
                t = time.perf_counter()
                runner.execute(plan)
                walls.append(time.perf_counter() - t)
        pieces = runner.pieces
        how = "eager" if pieces is None else "piecewise graphs" if pieces.use_graphs else "piecewise buffers, eager"
        report(f"mixed step {dec} decode + {chunk}-token prompt, {how}{', fused ops' if fused else ''}, {prefill}", prof,
               walls, 10, args.rows if how == "eager" and not fused else 0, cuda)
        del runner
        if cuda:
            torch.cuda.empty_cache()

    blocks = prompts * (prompt + 16) // BS + 8
    for mode, fused in (("sdpa", False), ("varlen", False), ("sdpa", True)):
        runner, walls = runner_for(prompts, blocks, False, mode, fused), []
        for rep in range(3):
            paged = Paged(blocks, BS)
            for s in range(prompts):
                paged.add(s, rng.integers(0, cfg["vocab_size"], prompt).tolist())
            plan = paged.step({s: prompt for s in range(prompts)})
            if rep < 2:     # warm-up, then the profiled step
                runner.execute(plan)
                continue
            with profile(activities=acts) as prof:
                t = time.perf_counter()
                runner.execute(plan)
                walls.append(time.perf_counter() - t)
        report(f"prefill {prompts} x {prompt} tokens, {mode}{', fused ops' if fused else ''}", prof, walls, 1,
               args.rows, cuda)
        del runner


if __name__ == "__main__":
    main()
