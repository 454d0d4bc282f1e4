"""Where a single-stream decode token's time goes, on the default model (or another).

    GOMP_SPINCOUNT=100000 python benches/decode_phases.py [--model M] [--threads 2] [--tokens 256] [--repeats 3]

(`llmserve run` sets that GOMP_SPINCOUNT itself; an offline process must set it before torch
loads, see README.)

Runs `--repeats` requests of `--tokens` output tokens (ignore_eos, greedy) through the offline
`LLM`, one at a time, after one warm-up request, with each phase of a step wrapped in a
timer. Prints the wall time per token and each phase's mean per call. Phases nest:
`execute` (the whole model step) holds `run_model` (the forward, which holds `decoder`, the
Rust layer stack of few-token decode steps, and `attn_meta`), `logits` (the LM head),
`sampling_batch` and `sample`; `step` is the engine's whole step, `execute` and `commit` (the
Core's side) included, so what `step` holds beyond those two is the Core's `schedule` and the
loop. The wrappers cost a few microseconds per call. BENCH.md's `single` workload is the same
request served over HTTP.
"""

from __future__ import annotations

import argparse
import collections
import functools
import time

from llmserve import LLM
from llmserve.engine import loop
from llmserve.models import cpu_decoder, llama
from llmserve.worker import attention, runner, sampler

TOTAL: dict[str, float] = collections.defaultdict(float)
CALLS: collections.Counter = collections.Counter()


def timed(owner, name: str, label: str) -> None:
    """Replace owner.name with a wrapper that adds its time to TOTAL[label]."""
    inner = getattr(owner, name)

    @functools.wraps(inner)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            TOTAL[label] += time.perf_counter() - start
            CALLS[label] += 1

    setattr(owner, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    timed(runner.ModelRunner, "execute", "execute")
    timed(runner.ModelRunner, "run_model", "run_model")
    timed(cpu_decoder.CpuDecodePath, "forward", "decoder")
    timed(attention.AttentionMetadata, "build", "attn_meta")
    timed(llama.LlamaForCausalLM, "compute_logits", "logits")
    timed(sampler.SamplingBatch, "from_plan", "sampling_batch")
    timed(sampler.Sampler, "sample_on_device", "sample")
    timed(loop, "commit", "commit")
    timed(loop, "step", "step")

    llm = LLM(args.model, threads=args.threads)
    params = {"max_tokens": args.tokens, "ignore_eos": True, "temperature": 0}
    llm.generate("Warm-up: time person year way day thing man world", params)
    TOTAL.clear()
    CALLS.clear()
    start = time.perf_counter()
    for i in range(args.repeats):
        llm.generate(f"Request {i}: time person year way day thing man world life hand part child", params)
    wall = time.perf_counter() - start
    tokens = args.repeats * args.tokens
    print(f"{tokens / wall:.1f} tok/s, {wall / tokens * 1000:.2f} ms per token (wall)")
    for label in ("step", "execute", "run_model", "decoder", "attn_meta", "logits", "sampling_batch",
                  "sample", "commit"):
        if CALLS[label]:
            print(f"  {label:15s} {TOTAL[label] / CALLS[label] * 1000:7.3f} ms x {CALLS[label]}")


if __name__ == "__main__":
    main()
