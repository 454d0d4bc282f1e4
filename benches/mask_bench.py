"""Cost of grammar-constrained decoding per step, at 64 constrained sequences.

    python benches/mask_bench.py [--seqs 64] [--steps 20] [--device auto] [--format json_schema]

Runs the real engine pieces (default SmolLM2-135M model, Router, Core, ModelRunner) over
decode steps of `--seqs` concurrent chat requests, twice: unconstrained, then each with a
`response_format`: `--format json_schema` (the default), or `structural_tag` (free text in
which `<function=` opens a tag of JSON: the model writes text, so this is a lazy lexeme's
mask per token). Reports per step (medians):
- `schedule`: Core.schedule(); the constrained run includes computing every row's token
  mask (llguidance), so the difference is the mask computation;
- `execute`: ModelRunner.execute(plan) (forward + sampling; the constrained run includes
  the sampler's bitmask apply);
- `commit`: Core.commit() (the constrained run includes each matcher consuming its token);
- the mask work's share of the whole step;
- the sampler's bitmask apply alone on [seqs, V] random masks: the path CPU logits take
  (the Rust kernel `_core.apply_token_bitmask`) and the torch path (what CUDA logits take).
"""

from __future__ import annotations

import argparse
import statistics
import time

import orjson
import torch

from llmserve.config import CacheConfig, Config, DeviceConfig, ModelConfig, SchedulerConfig
from llmserve.engine.build import build_engine
from llmserve.worker.sampler import apply_token_bitmask, apply_token_bitmask_torch

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "year": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "summary": {"type": "string"},
    },
    "required": ["title", "year", "tags", "summary"],
}


TAG = {"type": "structural_tag", "triggers": ["<function="], "structures": [
    {"begin": "<function=describe_film>", "schema": SCHEMA, "end": "</function>"}]}


def run(engine, model: str, seqs: int, steps: int, response_format: dict | None) -> dict[str, float]:
    core, router, runner = engine.core, engine.router, engine.runner
    for i in range(seqs):
        body = {"model": model, "max_tokens": 400, "temperature": 0.8, "seed": i,
                "messages": [{"role": "user", "content": f"Describe film number {i} as JSON."}]}
        if response_format:
            body["response_format"] = response_format
        core.add(router.prepare("chat", orjson.dumps(body)))
    times: dict[str, list[float]] = {"schedule": [], "execute": [], "commit": [], "rows": [], "masked": []}
    done = 0
    while done < steps:
        t0 = time.perf_counter()
        plan = core.schedule()
        t1 = time.perf_counter()
        if plan is None:
            break
        out = runner.execute(plan)
        t2 = time.perf_counter()
        core.commit(out.tokens, out.logprobs, out.top_ids, out.top_logprobs)
        t3 = time.perf_counter()
        # Measure only decode steps with every sequence sampling (prefill steps differ).
        if plan.num_rows == seqs and plan.num_tokens == seqs:
            times["schedule"].append(t1 - t0)
            times["execute"].append(t2 - t1)
            times["commit"].append(t3 - t2)
            times["rows"].append(plan.num_rows)
            times["masked"].append(len(plan.mask_rows))
            done += 1
    for handle in range(1, 10**6):   # drop what is left
        if not core.abort(handle) and not core.has_work():
            break
    return {k: statistics.median(v) for k, v in times.items() if v}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--format", choices=["json_schema", "structural_tag"], default="json_schema")
    args = ap.parse_args()
    response_format = {"type": "json_schema", "json_schema": {"name": "film", "schema": SCHEMA}}
    if args.format == "structural_tag":
        response_format = TAG
    torch.set_num_threads(max(1, torch.get_num_threads()))
    cfg = Config(model=ModelConfig(max_model_len=1024), cache=CacheConfig(kv_cache_memory="512MiB"),
                 scheduler=SchedulerConfig(max_num_seqs=args.seqs, max_num_batched_tokens=8192),
                 device=DeviceConfig(device=args.device))
    engine = build_engine(cfg)
    model = engine.model_name
    base = run(engine, model, args.seqs, args.steps, None)
    cons = run(engine, model, args.seqs, args.steps, response_format)

    # The sampler's share alone: the mask applied to [seqs, V] logits, both paths.
    vocab = engine.router.vocab_size
    rows = torch.arange(args.seqs)
    bits = torch.randint(-2**31, 2**31 - 1, (args.seqs, (vocab + 31) // 32), dtype=torch.int32)

    def time_apply(fn) -> float:
        logits = torch.randn(args.seqs, vocab)
        samples = []
        for _ in range(50):
            t0 = time.perf_counter()
            fn(logits, rows, bits)
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples)

    apply = time_apply(apply_token_bitmask)
    apply_torch = time_apply(apply_token_bitmask_torch)

    def total(r): return r["schedule"] + r["execute"] + r["commit"]
    print(f"device {engine.device}, {args.seqs} sequences, vocab {vocab}, {args.steps} decode steps (medians)")
    for name, r in (("unconstrained", base), (args.format, cons)):
        print(f"  {name:14s} schedule {r['schedule'] * 1e3:7.2f} ms  execute {r['execute'] * 1e3:7.2f} ms  "
              f"commit {r['commit'] * 1e3:6.2f} ms  step {total(r) * 1e3:7.2f} ms  masked rows {r['masked']:.0f}")
    mask = cons["schedule"] - base["schedule"]
    consume = cons["commit"] - base["commit"]
    print(f"  mask computation (Core.schedule delta): {mask * 1e3:.2f} ms/step "
          f"= {mask / total(cons) * 100:.1f}% of a constrained step ({mask / args.seqs * 1e6:.0f} us/sequence)")
    print(f"  matcher consume (Core.commit delta):    {consume * 1e3:.2f} ms/step")
    print(f"  sampler bitmask apply [{args.seqs}, {vocab}]: {apply * 1e3:.2f} ms/step "
          f"= {apply / total(cons) * 100:.1f}% of a constrained step "
          f"(torch path: {apply_torch * 1e3:.2f} ms)")


if __name__ == "__main__":
    main()
