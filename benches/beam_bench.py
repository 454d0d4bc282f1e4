"""Beam search inside the engine vs. vLLM's way of running it, side by side in one process.

    python benches/beam_bench.py [--width 4] [--tokens 48] [--repeats 3] [--threads 2]

On the default model (SmolLM2-135M, offline API, one request at a time):
- `beam`: one request with `use_beam_search` (the engine forks and releases the beams, their
  sequences sharing KV blocks; one step per token for all beams);
- `frontend loop`: the same search as vLLM's frontend runs it (and as
  tests/e2e/test_beam_search.py checks it against): every step, one `max_tokens: 1` request
  per beam with `2 * width` top logprobs, all of a step's in one batch (the prefix cache
  holds each beam's earlier tokens);
- `sampled`: `n = width` sampled choices of the same length, the floor for `width`
  sequences of that many tokens.
Every run ignores EOS so all produce `--tokens` tokens per beam. Medians of `--repeats`,
alternated. The first two return the same beams when their logits agree (on the tiny fp32 model
of the tests they do exactly; on the default GGUF model the loop's prompt steps and the
engine's decode steps round differently, so a long search can part ways: said, not failed).
"""

from __future__ import annotations

import argparse
import statistics
import time

from llmserve.engine.offline import LLM

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def frontend_loop(llm: LLM, prompt: list[int], width: int, tokens: int) -> list[list[int]]:
    """vLLM's search with `ignore_eos` (no beam ends early): the best `width` outputs."""
    live: list[tuple[list[int], float]] = [([], 0.0)]
    params = {"max_tokens": 1, "temperature": 0, "logprobs": 2 * width, "ignore_eos": True,
              "return_tokens_as_token_ids": True}
    for _ in range(tokens):
        results = llm.generate([prompt + out for out, _ in live], params)
        candidates = []
        for (out, cum), r in zip(live, results):
            top = r.body["choices"][0]["logprobs"]["top_logprobs"][0]
            for name, lp in top.items():
                candidates.append((out + [int(name.removeprefix("token_id:"))], cum + lp))
        candidates.sort(key=lambda c: -c[1])
        live = candidates[:width]
    # (every beam has the same length: the final ranking is by cumulative logprob)
    return [out for out, _ in live]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    llm = LLM(None, threads=args.threads)
    prompt = prompt_ids(llm)
    beam_params = {"max_tokens": args.tokens, "n": args.width, "use_beam_search": True, "ignore_eos": True,
                   "length_penalty": 0.0, "return_token_ids": True}
    sampled_params = {"max_tokens": args.tokens, "n": args.width, "temperature": 1.0, "seed": 0, "ignore_eos": True}
    times: dict[str, list[float]] = {"beam": [], "frontend loop": [], "sampled": []}
    for _ in range(args.repeats):
        t = time.perf_counter()
        beams = [c["token_ids"] for c in llm.generate([prompt], beam_params)[0].body["choices"]]
        times["beam"].append(time.perf_counter() - t)
        t = time.perf_counter()
        loop = frontend_loop(llm, prompt, args.width, args.tokens)
        times["frontend loop"].append(time.perf_counter() - t)
        t = time.perf_counter()
        llm.generate([prompt], sampled_params)
        times["sampled"].append(time.perf_counter() - t)
        if beams[0] != loop[0]:
            # (the loop runs each step's tokens as prompt tokens, the engine as decode steps: on a
            # GGUF model those read different weights, quantized blocks vs bf16/fp32, README)
            print("note: the two searches' best beams differ (their logits differ in rounding)")
    base = statistics.median(times["beam"])
    print(f"width {args.width}, {args.tokens} tokens per beam, prompt {len(prompt)} tokens, "
          f"{args.threads} threads, medians of {args.repeats}")
    for name, samples in times.items():
        m = statistics.median(samples)
        print(f"  {name:14s} {m:7.2f} s  ({m / base:.2f}x beam)")


def prompt_ids(llm: LLM) -> list[int]:
    """The prompt's token ids, as a completion would see them."""
    body = llm.generate([PROMPT], {"max_tokens": 1, "echo": True, "return_token_ids": True})[0].body
    return body["choices"][0]["prompt_token_ids"]


if __name__ == "__main__":
    main()
