"""What an embedding costs beside the prompt step it rides on, default model, in process.

    python benches/embed_bench.py [--inputs 64] [--words 40] [--threads 2]

Side by side in one process, alternating rounds (the machines here are noisy):
- `embed`: LLM.embed of N inputs (last-token pooling, then mean pooling);
- `prompt`: LLM.generate of the same N inputs with `max_tokens: 1` (the same prompt steps,
  one sampled token each, no pooling).
Prints the median seconds of each and the ratio embed / prompt: what pooling, the hidden-state
hand-over and the body cost on top of the forward. Each round uses fresh texts, so the prefix
cache serves none of them.
"""

from __future__ import annotations

import argparse
import statistics
import time

from llmserve import LLM


def texts(round_: int, n: int, words: int) -> list[str]:
    return [f"Round {round_} input {i}: " + " ".join(f"word{(i * 7 + j) % 97}" for j in range(words))
            for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--inputs", type=int, default=64)
    ap.add_argument("--words", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    llms = {p: LLM(None, pooling=p, threads=args.threads) for p in ("last", "mean")}
    times: dict[str, list[float]] = {"embed last": [], "embed mean": [], "prompt": []}
    for r in range(args.rounds + 1):
        for name in times:
            batch = texts(r * 10 + len(name), args.inputs, args.words)
            t0 = time.perf_counter()
            if name == "prompt":
                llms["last"].generate(batch, {"max_tokens": 1, "temperature": 0})
            else:
                llms[name.split()[1]].embed(batch)
            if r:   # round 0 warms up
                times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["prompt"])
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:11s} {med:7.3f} s  ({args.inputs / med:6.1f} inputs/s)  x{med / base:.2f} of prompt")


if __name__ == "__main__":
    main()
