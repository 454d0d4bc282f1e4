"""What a narrow KV cache (--kv-cache-dtype) does to the answers and to speed, on the default
model (or --model), offline through `LLM`, each cache type against `auto` in one run.

    python benches/kv_cache_dtype.py [--model M] [--prompts 24] [--max-tokens 96] [--batch 64]

Answers: greedy chat answers to `--prompts` different questions (temperature 0, `ignore_eos`
off), per type: how many are identical to `auto`'s, the mean share of each answer's text
before the first difference, and the mean negative log-likelihood per token of the questions
with `auto`'s answers (vLLM's `prompt_logprobs`): how much less likely the narrow cache finds
the same text. (A tiny model's greedy answer splits at the first near-tie of its two best
tokens, which any rounding can flip; the likelihood shows how far the model itself moved.) Speed: `--batch` requests of 128 generated tokens at once
(`ignore_eos`), output tok/s, the types alternating over `--repeats` rounds; the median is
reported with its ratio to `auto`'s. The load average is printed: other processes skew it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

from llmserve.engine.offline import LLM  # noqa: E402

TYPES = ("auto", "bfloat16", "fp8_e4m3", "fp8_e5m2")
TOPICS = ("the moon", "bread", "rivers", "a violin", "winter", "bees", "the ocean", "a library",
          "volcanoes", "chess", "trains", "coffee", "glaciers", "owls", "gardens", "lightning",
          "the desert", "maps", "clocks", "salt", "forests", "bridges", "comets", "tea")


def shared_prefix(a: str, b: str) -> float:
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return n / max(len(a), len(b), 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    questions = [[{"role": "user", "content": f"Write a few sentences about {TOPICS[i % len(TOPICS)]}"
                                                f"{'.' if i < len(TOPICS) else ', for a child.'}"}]
                 for i in range(args.prompts)]
    loads = [f"Tell me a long story about {TOPICS[i % len(TOPICS)]} number {i}." for i in range(args.batch)]
    llms = {t: LLM(args.model, kv_cache_dtype=t, max_num_seqs=args.batch) for t in TYPES}

    answers = {t: [r.text for r in llm.chat(questions, {"temperature": 0, "max_tokens": args.max_tokens})]
               for t, llm in llms.items()}
    # how likely each type finds the same texts (questions with auto's answers), token by token
    texts = [f"{q[0]['content']}\n{a}" for q, a in zip(questions, answers["auto"])]
    nll = {}
    for t, llm in llms.items():
        rows = [r.body["choices"][0]["prompt_logprobs"]
                for r in llm.generate(texts, {"max_tokens": 1, "prompt_logprobs": 0, "temperature": 0})]
        logprobs = [next(iter(p.values()))["logprob"] for row in rows for p in row if p]
        nll[t] = -statistics.mean(logprobs)
    speed: dict[str, list[float]] = {t: [] for t in TYPES}
    for _ in range(args.repeats):
        for t, llm in llms.items():
            start = time.perf_counter()
            results = llm.generate(loads, {"max_tokens": 128, "temperature": 0, "ignore_eos": True})
            tokens = sum(r.body["usage"]["completion_tokens"] for r in results)
            speed[t].append(tokens / (time.perf_counter() - start))

    print(f"load average {os.getloadavg()[0]:.2f}; {args.prompts} greedy answers of up to {args.max_tokens} "
          f"tokens; {args.batch} x 128 tokens for speed, median of {args.repeats}")
    print(f"{'kv-cache-dtype':>15} {'same answer':>12} {'shared prefix':>14} {'nll/token':>10} "
          f"{'out tok/s':>10} {'vs auto':>8}")
    base = statistics.median(speed["auto"])
    for t in TYPES:
        same = sum(a == b for a, b in zip(answers[t], answers["auto"]))
        prefix = statistics.mean(shared_prefix(a, b) for a, b in zip(answers[t], answers["auto"]))
        med = statistics.median(speed[t])
        print(f"{t:>15} {same:>7}/{args.prompts:<4} {prefix:>14.2f} {nll[t]:>10.4f} {med:>10.1f} {med / base:>8.2f}")


if __name__ == "__main__":
    main()
