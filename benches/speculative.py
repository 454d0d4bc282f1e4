"""N-gram speculative decoding (--speculative-config) on CPU: output tokens per second with
and without drafts, side by side, through the offline engine on the default model.

    python benches/speculative.py [--drafts 0 2 4 6] [--repeats 3] [--threads 2]

Workloads, each a batch of requests run to completion (greedy unless said):
- `copy`: one chat that repeats a ~110-token block of code it is given (output that copies its
  input: where prompt lookup pays), 100 tokens;
- `story`: one chat that writes a story, sampled (temperature 0.8, a seed), 128 tokens with
  `ignore_eos`: output that seldom repeats itself (the cost of trying);
- `copy x4`: four `copy` chats at once (drafts share a step's 24 tokens with the others);
- `predicted`, `edited`: the `copy` chat with a `prediction` (OpenAI's Predicted Outputs) of
  its answer, exactly and with a few edits (drafts from the prediction come with or without
  --speculative-config: compare them with `copy` at 0 drafts);
- `json`: one chat whose answer a JSON schema constrains, an array of six {name, age} objects
  (a grammar masks each draft row after the drafts before it), 120 tokens.
Per setting the median of the repeats' tok/s and the ratio to no drafts measured in the same
run; the acceptance rate is confirmed / proposed drafts, and `tok/step` the output tokens a
sequence's step gave (1 + confirmed drafts per step with drafts). Engines are built one after
the other in this process; nothing else runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from llmserve.engine.offline import LLM

CODE = ("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
        "def mul(a, b):\n    return a * b\n\ndef div(a, b):\n    return a / b\n\n"
        "def mod(a, b):\n    return a % b\n")
COPY = [{"role": "user", "content": "Repeat this code exactly:\n\n" + CODE}]
PEOPLE = {"type": "array", "minItems": 6, "maxItems": 6, "items": {
    "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"], "additionalProperties": False}}


def _run(llm: LLM, workload: str) -> tuple[int, float]:
    """(output tokens, seconds) of one round of `workload`."""
    t = time.perf_counter()
    if workload == "copy":
        results = [llm.chat(COPY, {"max_tokens": 100, "temperature": 0})]
    elif workload == "copy x4":
        results = llm.chat([COPY] * 4, {"max_tokens": 100, "temperature": 0})
    elif workload in ("predicted", "edited"):
        answer = "```python\n" + CODE + "```"
        if workload == "edited":
            answer = answer.replace("a - b", "b - a").replace("def mul", "def times").replace("a % b", "a % 7")
        results = [llm.chat(COPY, {"max_tokens": 100, "temperature": 0,
                                   "prediction": {"type": "content", "content": answer}})]
    elif workload == "json":
        ask = [{"role": "user", "content": "List six people with their name and age as JSON."}]
        results = [llm.chat(ask, {"max_tokens": 120, "temperature": 0, "response_format": {
            "type": "json_schema", "json_schema": {"name": "people", "schema": PEOPLE}}})]
    else:
        story = [{"role": "user", "content": "Write a short story about a dragon who learns to cook."}]
        results = [llm.chat(story, {"max_tokens": 128, "temperature": 0.8, "seed": 7, "ignore_eos": True})]
    seconds = time.perf_counter() - t
    return sum(r.usage["completion_tokens"] for r in results), seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafts", type=int, nargs="+", default=[0, 2, 4, 6],
                    help="num_speculative_tokens to compare (0: no speculation)")
    ap.add_argument("--lookup", type=int, nargs=2, default=[1, 3], metavar=("MIN", "MAX"),
                    help="prompt_lookup_min and prompt_lookup_max")
    ap.add_argument("--workloads", nargs="+", default=["copy", "story", "copy x4"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    workloads = args.workloads
    rows: dict[tuple[str, int], tuple[float, float, float]] = {}
    for k in args.drafts:
        options = {} if k == 0 else {"speculative_config": json.dumps(
            {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": args.lookup[0],
             "prompt_lookup_max": args.lookup[1]})}
        if args.threads:
            options["threads"] = args.threads
        # (no prefix cache: each round computes its prompt as the first one did)
        llm = LLM(None, max_model_len=1024, enable_prefix_caching=False, **options)
        core = llm.engine.core
        for workload in workloads:
            _run(llm, workload)        # warm-up
            before = core.stats()
            rates = []
            for _ in range(args.repeats):
                tokens, seconds = _run(llm, workload)
                rates.append(tokens / seconds)
            after = core.stats()
            drafts = after["spec_draft_tokens"] - before["spec_draft_tokens"]
            accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
            steps = after["spec_drafts"] - before["spec_drafts"]
            rows[(workload, k)] = (statistics.median(rates), accepted / drafts if drafts else 0.0,
                                   1 + accepted / steps if steps else 1.0)
        del llm, core
    print(f"{'workload':10} {'drafts':>6} {'tok/s':>8} {'vs 0':>6} {'accepted':>9} {'tok/step':>8}")
    for workload in workloads:
        base = rows[(workload, args.drafts[0])][0]
        for k in args.drafts:
            rate, acc, per_step = rows[(workload, k)]
            print(f"{workload:10} {k:6d} {rate:8.1f} {rate / base:6.2f} {acc:9.0%} {per_step:8.2f}")


if __name__ == "__main__":
    main()
