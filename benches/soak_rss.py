"""Soak: does a long-running server's memory level off? Rounds of mixed traffic, the
server's resident memory after each.

    python benches/soak_rss.py --rounds 30                   # starts a server (2 threads)
    python benches/soak_rss.py --rounds 30 --threads 1

Each round sends the same kind of traffic with fresh random text: chat and completions,
streamed and not, prompts of 5 to ~1,500 words, max_tokens 1-48, n 1-3, and one request
in eight abandoned mid-stream. After each round (the server idle again) it prints the
server's RSS, its high-water mark (VmHWM) and the KV blocks in use (which must be 0).
A server whose allocator reuses its memory shows RSS rising over the first rounds and then
flat; steady growth round after round is a leak. The first rounds' growth is mostly the KV
cache: it is allocated untouched (2 GiB by default), and its pages become resident as blocks
are first written.

Measured (2 cores, AMX CPU, --threads 1, 16 rounds of 32 requests): 1,145 MiB when ready,
1,984 / 2,784 / 3,273 MiB after rounds 1-3, then 3,273 MiB through round 16 (before the serving
build dropped the unread fp32 layer weights, f46b391: 1,634 when ready, flat at 3,772).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_load import WORDS  # noqa: E402


def memory_kib(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of a process, in KiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0])
    return fields["VmRSS"], fields["VmHWM"]


def request(rng: random.Random, model: str) -> tuple[str, dict]:
    text = " ".join(rng.choice(WORDS) for _ in range(int(rng.triangular(5, 1500, 60))))
    body: dict = {"model": model, "max_tokens": rng.randint(1, 48), "n": rng.choice((1, 1, 2, 3)),
                  "temperature": rng.choice((0, 0.8)), "stream": rng.random() < 0.5}
    if rng.random() < 0.5:
        return "/v1/completions", {**body, "prompt": text}
    return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": text}]}


async def send(client: httpx.AsyncClient, route: str, body: dict, abandon: bool) -> bool:
    if not body["stream"]:
        return (await client.post(route, json=body)).status_code == 200
    async with client.stream("POST", route, json=body) as r:
        async for line in r.aiter_lines():
            if abandon and line.startswith("data: "):
                return True  # leaving the block closes the connection mid-stream
    return r.status_code == 200


async def round_(url: str, model: str, rng: random.Random, count: int, concurrency: int) -> int:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=None) as client:
        async def one() -> bool:
            route, body = request(rng, model)
            async with sem:
                return await send(client, route, body, abandon=rng.random() < 1 / 8)

        results = await asyncio.gather(*(one() for _ in range(count)))
    return sum(not ok for ok in results)


def idle_load(url: str) -> dict:
    """/load once the server has settled (aborted streams are reaped at the next step)."""
    for _ in range(40):
        load = httpx.get(url + "/load").json()
        if load.get("running", 0) == 0 and load.get("waiting", 0) == 0:
            return load
        time.sleep(0.25)
    return load


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--requests", type=int, default=32, help="requests per round")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None, help="engine threads (default: all cores)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from server import ServerProcess

    server = ServerProcess(None, "--max-model-len", "2048", "--threads", str(args.threads or os.cpu_count() or 1))
    rng = random.Random(args.seed)
    try:
        model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        rss0, _ = memory_kib(server.proc.pid)
        print(f"ready: RSS {rss0 / 1024:.0f} MiB")
        print("round  seconds  failed  RSS MiB  HWM MiB  kv_blocks_used")
        for i in range(1, args.rounds + 1):
            start = time.perf_counter()
            failed = asyncio.run(round_(server.url, model, rng, args.requests, args.concurrency))
            took = time.perf_counter() - start
            load = idle_load(server.url)
            rss, hwm = memory_kib(server.proc.pid)
            print(f"{i:5d}  {took:7.1f}  {failed:6d}  {rss / 1024:7.0f}  {hwm / 1024:7.0f}  "
                  f"{load.get('kv_blocks_used')}", flush=True)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
