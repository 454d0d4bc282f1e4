"""Short prompts sent while a long one prefills: when each short one answers its first token,
with the long prompt taking all of each step's token budget (`--long-prefill-token-threshold
0`, the default) and with it capped per step, measured side by side in one run.

    python benches/prompt_share.py [--long 6000] [--short 5] [--every 1.0] [--caps 0 256]

One engine per cap (default model, CPU, 2 threads); each run sends one completion of `--long`
random token ids, then `--short` completions of 20 tokens, one every `--every` seconds, each
asking for 2 output tokens (streamed, to time the first). Prints, per cap, the short prompts'
median and worst time to first token and the long prompt's time to its first token.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import orjson

from llmserve import AsyncEngine
from llmserve.engine.offline import make_config


async def first_token(engine: AsyncEngine, prompt: list[int], sent: float) -> float:
    body = orjson.dumps({"model": engine.router.served_model_names[0], "prompt": prompt, "max_tokens": 2,
                         "stream": True, "ignore_eos": True})
    stream = await engine.submit("completion", body)
    async with stream:
        async for chunk in stream:
            if b'"text"' in chunk:
                return time.perf_counter() - sent
    raise RuntimeError("no token came")


async def run(cap: int, args: argparse.Namespace) -> tuple[list[float], float]:
    engine = AsyncEngine(make_config(None, threads=2, long_prefill_token_threshold=cap, enable_prefix_caching=False))
    await engine.start()
    rng = random.Random(0)
    try:
        long_sent = time.perf_counter()
        long = asyncio.create_task(first_token(engine, [rng.randrange(100, 40000) for _ in range(args.long)], long_sent))
        shorts = []
        for _ in range(args.short):
            await asyncio.sleep(args.every)
            prompt = [rng.randrange(100, 40000) for _ in range(20)]
            shorts.append(asyncio.create_task(first_token(engine, prompt, time.perf_counter())))
        return list(await asyncio.gather(*shorts)), await long
    finally:
        await engine.drain()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--long", type=int, default=6000)
    ap.add_argument("--short", type=int, default=5)
    ap.add_argument("--every", type=float, default=1.0)
    ap.add_argument("--caps", type=int, nargs="+", default=[0, 256])
    args = ap.parse_args()
    print(f"{'cap':>6} {'short TTFT median':>18} {'short TTFT max':>15} {'long TTFT':>10}")
    for cap in args.caps:
        shorts, long = asyncio.run(run(cap, args))
        print(f"{cap:>6} {statistics.median(shorts):>17.2f}s {max(shorts):>14.2f}s {long:>9.2f}s")


if __name__ == "__main__":
    main()
