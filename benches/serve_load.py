"""Serving load generator: what `vllm bench serve` reports, for the workloads of BENCH.md.

    python benches/serve_load.py --workload load --concurrency 1 16 64          # starts a server
    python benches/serve_load.py --url http://127.0.0.1:8000 --workload single  # uses yours
    python benches/serve_load.py --workload offline --num-prompts 64            # LLM.generate

Streams completions with `include_usage` and `ignore_eos` (fixed output lengths); output
tokens are counted from `usage`. Prompts differ from each other (prefix caching would
otherwise flatter the numbers). Before the measured requests, `--warmup N` (default 8) short
requests of other prompts run untimed, over HTTP or offline alike, so a figure is the
engine's steady state rather than its first allocations (`--warmup 0` measures a cold start). Prints request throughput, output and total token
throughput, and TTFT / TPOT / ITL / E2EL as mean, median and p99.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
from pathlib import Path

import httpx
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

WORDS = ("time person year way day thing man world life hand part child eye woman place work week "
         "case point government company number group problem fact river mountain ocean city music "
         "garden window light story answer science history market language energy").split()

WORKLOADS = {
    # name: (prompt words, output tokens, default number of requests)
    "single": (24, 256, 3),
    "prefill": (750, 1, 3),
    "load": (96, 128, 64),
    # BENCH.md's GPU `load`: ~1,024-token prompts (1,019 words with SmolLM2's tokenizer), 128 out
    "load-gpu": (1019, 128, 1000),
}


def prompts(n: int, words: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"Request {i}: " + " ".join(rng.choice(WORDS) for _ in range(words)) for i in range(n)]


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def summarize(name: str, results: list[dict], wall: float) -> dict:
    ok = [r for r in results if r["ok"]]
    out_tokens = sum(r["completion_tokens"] for r in ok)
    in_tokens = sum(r["prompt_tokens"] for r in ok)
    row = {"workload": name, "requests": len(ok), "failed": len(results) - len(ok),
           "req_s": len(ok) / wall, "out_tok_s": out_tokens / wall,
           "total_tok_s": (in_tokens + out_tokens) / wall}
    metrics = {"ttft": [r["ttft"] for r in ok],
               "tpot": [r["tpot"] for r in ok if r["tpot"] is not None],
               "itl": [x for r in ok for x in r["itl"]],
               "e2el": [r["e2el"] for r in ok]}
    for key, vals in metrics.items():
        row[f"{key}_mean_ms"] = statistics.fmean(vals) * 1000 if vals else float("nan")
        row[f"{key}_p50_ms"] = pct(vals, 50) * 1000
        row[f"{key}_p99_ms"] = pct(vals, 99) * 1000
    return row


async def one_request(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = last = None
    itl: list[float] = []
    usage = None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return {"ok": False}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            chunk = orjson.loads(line[6:])
            # NOTE: llama-server sends usage on its last content chunk, we (as OpenAI) on a
            # chunk of its own with no choices
            if chunk.get("usage"):
                usage = chunk["usage"]
            if not chunk.get("choices"):
                continue
            if first is None:
                first = now
            else:
                itl.append(now - last)
            last = now
    end = time.perf_counter()
    if usage is None or first is None:
        return {"ok": False}
    n = usage["completion_tokens"]
    return {"ok": True, "ttft": first - start, "e2el": end - start, "itl": itl,
            "tpot": (end - start - (first - start)) / (n - 1) if n > 1 else None,
            "completion_tokens": n, "prompt_tokens": usage["prompt_tokens"]}


async def run_http(url: str, model: str, texts: list[str], max_tokens: int, concurrency: int) -> tuple:
    sem = asyncio.Semaphore(concurrency)
    # NOTE: a new connection per request. llama-server (cpp-httplib: keep-alive timeout 5 s)
    # sometimes closed a kept-alive connection as the next request went out on it, which
    # failed with "Server disconnected without sending a response" and lost side_by_side.py
    # rounds; on 127.0.0.1 a connection costs well under a millisecond.
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
        async def bounded(p):
            async with sem:
                return await one_request(client, model, p, max_tokens)

        start = time.perf_counter()
        results = await asyncio.gather(*(bounded(p) for p in texts))
        return results, time.perf_counter() - start


def generated_tokens(url: str) -> float | None:
    """The server's own count of generated tokens (/metrics), None where it has none: beside
    the client's figures it says whether the client or the server set the pace."""
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("llmserve:generation_tokens_total")]
    return sum(values) if values else None


def warmup_texts(n: int, words: int) -> list[str]:
    """Prompts for the untimed warm-up: none shares a prefix block with the measured ones
    (another seed, and "Warm-up" where those say "Request")."""
    return [t.replace("Request", "Warm-up", 1) for t in prompts(n, words, seed=1)]


WARMUP_TOKENS = 8


def run_offline(model: str | None, texts: list[str], max_tokens: int, threads: int | None,
                warmup: list[str] = ()) -> dict:
    from llmserve import LLM

    llm = LLM(model, threads=threads, max_model_len=2048, kv_cache_memory="1GiB")
    if warmup:
        llm.generate(list(warmup), {"max_tokens": WARMUP_TOKENS, "ignore_eos": True, "temperature": 0})
    start = time.perf_counter()
    results = llm.generate(texts, {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0})
    wall = time.perf_counter() - start
    out = sum(r.usage["completion_tokens"] for r in results)
    inp = sum(r.usage["prompt_tokens"] for r in results)
    return {"workload": "offline", "requests": len(results), "req_s": len(results) / wall,
            "out_tok_s": out / wall, "total_tok_s": (out + inp) / wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="an already running server (default: start one)")
    ap.add_argument("--model", default=None, help="model for the started server (default model)")
    ap.add_argument("--served-name", default=None)
    ap.add_argument("--workload", choices=[*WORKLOADS, "offline"], default="load")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1])
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None, help="engine threads (default: all cores)")
    ap.add_argument("--warmup", type=int, default=8, help="untimed short requests first (0: a cold start)")
    args = ap.parse_args()

    words, max_tokens, default_n = WORKLOADS.get(args.workload, WORKLOADS["load"])
    n = args.num_prompts or default_n
    texts = prompts(n, words)
    if args.workload == "offline":
        warmup = warmup_texts(args.warmup, words)
        print(orjson.dumps(run_offline(args.model, texts, max_tokens, args.threads, warmup),
                           option=orjson.OPT_INDENT_2).decode())
        return

    server = None
    url = args.url
    if url is None:
        from server import ServerProcess

        # NOTE: ServerProcess pins tests' servers to one thread; a benchmark measures the
        # server as users run it, on every core (the load generator mostly waits).
        extra = ["--threads", str(args.threads or os.cpu_count() or 1)]
        server = ServerProcess(args.model, "--max-model-len", "2048", "--kv-cache-memory", "1GiB",
                               "--max-num-seqs", str(max(args.concurrency)), *extra)
        url = server.url
    try:
        model = args.served_name or httpx.get(url + "/v1/models").json()["data"][0]["id"]
        if args.warmup:
            asyncio.run(run_http(url, model, warmup_texts(args.warmup, words), WARMUP_TOKENS, args.warmup))
        for c in args.concurrency:
            before = generated_tokens(url)
            results, wall = asyncio.run(run_http(url, model, texts, max_tokens, c))
            row = summarize(f"{args.workload}@c{c}", results, wall)
            after = generated_tokens(url)
            if before is not None and after is not None:
                row["server_gen_tok_s"] = (after - before) / wall
            print(orjson.dumps(row, option=orjson.OPT_INDENT_2).decode(), flush=True)
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
