"""Micro-benchmark of the paged-attention decode kernel on a CUDA GPU (BENCH.md: >= 65% of HBM
bandwidth at batch x context >= 64 x 1k).

    python benches/kernel_bench.py               # table on stdout
    python benches/kernel_bench.py --json out.json
    python benches/kernel_bench.py --step-config target/gpu-carry/smollm2-shape/config.json
                                                 # + whole decode steps, CUDA graphs vs eager

Bytes counted: the K and V rows each sequence reads (seq_len x kv_heads x head_dim x 2 tensors
x 2 bytes); queries, outputs and block tables are noise beside them. Each timed call runs after
an L2 flush (the H200's L2 is 60 MB, more than some cases' KV), timed alone with CUDA events;
a figure is the median of the calls. The reference ceiling is measured in the same run: a
device-to-device copy (bytes read + written), next to the datasheet's 4.8 TB/s. Also timed for
scale: the torch path this kernel replaces (gather the blocks, SDPA with a padding mask). Each
case also sweeps split-K counts (0 = none, 2 ... 128) and reports the fastest, next to the one
`choose_num_splits` picks. The cases marked `table` > ctx give every sequence a block table as
wide as a server's (`--max-model-len` tokens) around a shorter context: what a CUDA-graph step
passes the kernel.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from llmserve import kernels  # noqa: E402
from tiny import random_llama_weights  # noqa: E402

PEAK_TBS = 4.8
BS = 16
# (name, kv_heads, query heads per kv head, head_dim): SmolLM2-135M and a Llama-3-8B layer
SHAPES = [("smollm2-135m", 3, 3, 64), ("llama3-8b", 8, 4, 128)]
# (batch, context, block-table width in tokens: 0 = the context's own)
CASES = [(64, 1024, 0), (1, 1024, 0), (256, 1024, 0), (1, 8192, 0), (64, 4096, 0),
         (64, 1024, 8192), (1, 1024, 32768), (8, 2048, 32768)]


def timed(fn, reps: int, flush: torch.Tensor) -> float:
    """Median seconds of `reps` calls of fn, each after an L2 flush, timed alone."""
    times = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def copy_bandwidth(flush: torch.Tensor) -> float:
    src = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    t = timed(lambda: dst.copy_(src), 10, flush)
    return 2 * src.numel() / t / 1e12


def make_case(batch: int, ctx: int, kvh: int, group: int, d: int, dtype=torch.bfloat16, table: int = 0):
    """`table`: the block tables' width in tokens (0: the context's own); columns past the
    context hold block 0, as a server's padded tables do."""
    blocks_per_seq = -(-ctx // BS)
    num_blocks = batch * blocks_per_seq + 1
    k = torch.randn(num_blocks, BS, kvh, d, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    # shuffled blocks: a real cache after some churn is not laid out in order
    perm = torch.randperm(num_blocks - 1, device="cuda").to(torch.int32) + 1
    used = perm[:batch * blocks_per_seq].view(batch, blocks_per_seq)
    width = max(blocks_per_seq, -(-table // BS))
    tables = torch.zeros(batch, width, dtype=torch.int32, device="cuda")
    tables[:, :blocks_per_seq] = used
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, kvh * group, d, device="cuda", dtype=dtype)
    return q, k, v, tables, lens


def torch_path(q, k, v, tables, lens, scale):
    """The CPU path's decode on the GPU: gather every sequence's blocks, one masked SDPA."""
    b, w = tables.shape
    kvh, d = k.shape[2], k.shape[3]
    kg = k.index_select(0, tables.reshape(-1).long()).view(b, w * BS, kvh, d).transpose(1, 2)
    vg = v.index_select(0, tables.reshape(-1).long()).view(b, w * BS, kvh, d).transpose(1, 2)
    mask = (torch.arange(w * BS, device=q.device)[None, :] < lens[:, None])[:, None, None, :]
    return F.scaled_dot_product_attention(q.unsqueeze(2), kg, vg, attn_mask=mask, scale=scale,
                                          enable_gqa=True).squeeze(2)


def random_weights(cfg: dict, dtype=torch.bfloat16, device: str = "cuda") -> dict[str, torch.Tensor]:
    """HF-named random weights for a Llama-family config (the step figures do not depend on
    the values)."""
    def r(*shape):
        return (torch.randn(shape, device=device) * 0.02).to(dtype)

    h, v = cfg["hidden_size"], cfg["vocab_size"]
    top = {"model.embed_tokens.weight": r(v, h), "model.norm.weight": 1 + r(h)}
    if not cfg.get("tie_word_embeddings", False):
        top["lm_head.weight"] = r(v, h)
    return random_llama_weights(cfg, r, top)


def step_bench(config_path: str, steps: int = 40) -> list[dict]:
    """Whole decode steps (`CudaModelRunner.execute`: forward, logits, greedy sampling, the
    host sync) of a model with this config.json, prompts of ~1,000 tokens, graphs vs eager,
    each with the torch layers and with the fused layer ops (LLMSERVE_FUSED_OPS).
    BENCH.md: a batch-1 step of SmolLM2-135M <= 1.3 ms with CUDA graphs."""
    import time

    import numpy as np

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from _plans import Paged

    from llmserve.models import build_model
    from llmserve.worker.cuda_graphs import CudaModelRunner

    cfg = json.loads(Path(config_path).read_text())
    model = build_model(cfg, random_weights(cfg), torch.bfloat16, torch.device("cuda"))
    rng = np.random.default_rng(0)
    rows = []
    for batch in (1, 64):
        for graphs, fused in ((True, False), (True, True), (False, False), (False, True)):
            num_blocks = batch * (1000 + steps + 16) // BS + 8
            runner = CudaModelRunner(model, num_blocks, BS, torch.bfloat16, "cuda", max_num_seqs=batch,
                                     max_model_len=2048, cuda_graphs=graphs, capture_sizes=[batch],
                                     fused_ops=fused)
            paged = Paged(num_blocks, BS)
            for s in range(batch):
                paged.add(s, rng.integers(0, cfg["vocab_size"], 1000 - s % 16).tolist())
            runner.execute(paged.step({s: len(paged.seqs[s].tokens) for s in range(batch)}))
            times = []
            for _ in range(steps):
                for s in range(batch):
                    paged.append(s, int(rng.integers(0, cfg["vocab_size"])))
                plan = paged.step({s: 1 for s in range(batch)})
                t = time.perf_counter()
                runner.execute(plan)
                times.append(time.perf_counter() - t)
            step = statistics.median(times[5:])
            # what ran, not what was asked for: a failed capture falls back to eager steps
            replayed = runner.graphs.use_graphs
            if graphs and not replayed:
                print(f"decode step  batch {batch:3d}: CUDA graph capture FAILED, timed eagerly", flush=True)
            rows.append(dict(batch=batch, graphs=replayed, fused=runner.fused_ops, step_ms=step * 1e3,
                             tok_s=batch / step))
            print(f"decode step  batch {batch:3d}  {'graphs' if replayed else 'eager ':6}  "
                  f"{'fused' if runner.fused_ops else 'torch'}  {step * 1e3:7.3f} ms  {batch / step:9.0f} tok/s",
                  flush=True)
            del runner
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--step-config", help="also time whole decode steps of a model with this config.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("kernel_bench: needs a CUDA device")
    kernels.load()
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    copy_tbs = copy_bandwidth(flush)
    print(f"{torch.cuda.get_device_name()}: measured copy {copy_tbs:.2f} TB/s (datasheet {PEAK_TBS} TB/s)")
    rows = []
    header = (f"{'shape':14} {'batch':>5} {'ctx':>5} {'table':>6} {'split':>5} {'us':>8} {'TB/s':>6} {'%peak':>6} "
              f"{'%copy':>6} {'torch us':>9}   {'best split':>10} {'us':>8} {'%peak':>6}   {'pipelined us':>12} "
              f"{'%peak':>6}")
    print(header)
    for name, kvh, group, d in SHAPES:
        for batch, ctx, table in CASES:
            q, k, v, tables, lens = make_case(batch, ctx, kvh, group, d, table=table)
            out = torch.empty_like(q)
            scale = d ** -0.5
            splits = kernels.choose_num_splits(batch, kvh, tables.shape[1] * BS)

            def run():
                kernels.paged_attention_decode(out, q, k, v, tables, lens, scale, splits)

            for _ in range(3):
                run()
            t = timed(run, args.reps, flush)
            # split counts around the chosen one, to see what choose_num_splits misses
            sweep = {}
            for n in [0, *(n for n in (2, 4, 8, 16, 32, 64, 128) if n * 64 < ctx)]:
                def run_n(n=n):
                    kernels.paged_attention_decode(out, q, k, v, tables, lens, scale, n)
                run_n()
                sweep[n] = timed(run_n, max(5, args.reps // 3), flush)
            best = min(sweep, key=sweep.get)
            # the software-pipelined kernel (LLMSERVE_DECODE_PIPELINE) at the chosen split
            def run_pipe():
                kernels.paged_attention_decode(out, q, k, v, tables, lens, scale, splits, True)
            run_pipe()
            t_pipe = timed(run_pipe, args.reps, flush)
            t_torch = float("nan")
            if batch * ctx <= 64 * 4096 and not table:   # (it gathers the whole table)
                t_torch = timed(lambda: torch_path(q, k, v, tables, lens, scale), max(5, args.reps // 3), flush)
            nbytes = batch * ctx * kvh * d * 2 * q.element_size()
            tbs = nbytes / t / 1e12
            best_pct = 100 * nbytes / sweep[best] / 1e12 / PEAK_TBS
            row = dict(shape=name, batch=batch, ctx=ctx, table=tables.shape[1] * BS, splits=splits, us=t * 1e6,
                       tbs=tbs, pct_peak=100 * tbs / PEAK_TBS, pct_copy=100 * tbs / copy_tbs, torch_us=t_torch * 1e6,
                       best_splits=best, best_us=sweep[best] * 1e6, best_pct_peak=best_pct,
                       sweep_us={str(k): v * 1e6 for k, v in sweep.items()}, pipelined_us=t_pipe * 1e6,
                       pipelined_pct_peak=100 * nbytes / t_pipe / 1e12 / PEAK_TBS)
            rows.append(row)
            print(f"{name:14} {batch:5d} {ctx:5d} {row['table']:6d} {splits:5d} {t * 1e6:8.1f} {tbs:6.2f} "
                  f"{row['pct_peak']:6.1f} {row['pct_copy']:6.1f} {t_torch * 1e6:9.1f}   {best:10d} "
                  f"{sweep[best] * 1e6:8.1f} {best_pct:6.1f}"
                  f"   {t_pipe * 1e6:12.1f} {row['pipelined_pct_peak']:6.1f}",
                  flush=True)
            del q, k, v, tables, lens, out
            torch.cuda.empty_cache()
    goal = [r for r in rows if r["batch"] * r["ctx"] >= 64 * 1024]
    worst = min(r["pct_peak"] for r in goal)
    print(f"goal (BENCH.md): >= 65% of HBM peak at batch x ctx >= 64 x 1k; worst such case: {worst:.1f}%")
    def write(steps: list[dict]) -> None:
        if args.json:
            Path(args.json).write_text(json.dumps(dict(copy_tbs=copy_tbs, rows=rows, steps=steps), indent=1))

    write([])       # (first without the steps: a run cut by its time limit keeps the kernel rows)
    if args.step_config:
        write(step_bench(args.step_config))


if __name__ == "__main__":
    main()
