"""Micro-benchmarks of the Rust core through its Python bindings (no model).

    python benches/core_bench.py

- `prepare`: Router.prepare of a chat request whose rendered prompt is ~1,000 tokens
  (parse, validate, render SmolLM2's template, tokenize, budget), default model tokenizer;
  then, alternating in one loop, a 6-turn chat request and the Anthropic Messages request that
  means it (with a tool call and its result): what the Messages translation adds.
- `step`: Core.schedule() + Core.commit() with 256 running sequences (what the engine
  thread pays per step outside the model), including the numpy hand-over.
Medians of many repeats; machines here are noisy, so read them as orders of magnitude.
"""

from __future__ import annotations

import json
import statistics
import time

import numpy as np
import orjson

from llmserve._core import Core, Router
from llmserve.loaders import load_checkpoint


def timeit(fn, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def default_router(max_model_len: int = 4096) -> tuple[Router, list[int]]:
    ck = load_checkpoint(None)
    config = {"served_model_names": ["m"], "max_model_len": max_model_len, "special_tokens": ck.special_tokens,
              "eos_token_ids": ck.eos_token_ids}
    router = Router(None, json.dumps(ck.gguf_vocab), json.dumps(ck.template_sources), json.dumps(config))
    return router, ck.eos_token_ids


def bench_prepare(router: Router) -> None:
    words = "the quick brown fox jumps over the lazy dog while numbers 1234 and café 東京 pass by "
    text = words * 40
    body = orjson.dumps({"model": "m", "max_tokens": 16,
                         "messages": [{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": text}]})
    tokens = router.prepare("chat", body).prompt_tokens
    t = timeit(lambda: router.prepare("chat", body), 200)
    print(f"prepare: {tokens}-token chat request: {t * 1e6:.0f} us median")

    # the same conversation as chat messages and as Anthropic Messages blocks
    call = {"id": "t1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}
    # (Messages requires `tools` beside tool_use blocks; both requests declare the same one)
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    chat = orjson.dumps({"model": "m", "max_tokens": 16, "tools": [
        {"type": "function", "function": {"name": "get_weather", "parameters": schema}}], "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": text},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "t1", "name": "get_weather", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny."}, {"role": "user", "content": "Thanks."}]})
    messages = orjson.dumps({"model": "m", "max_tokens": 16, "system": "Be brief.", "tools": [
        {"name": "get_weather", "input_schema": schema}], "messages": [
        {"role": "user", "content": text},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                          {"type": "tool_use", "id": "t1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]},
        {"role": "assistant", "content": "It is sunny."}, {"role": "user", "content": "Thanks."}]})
    assert router.prepare("messages", messages).prompt_token_ids == router.prepare("chat", chat).prompt_token_ids
    times: dict[str, list[float]] = {"chat": [], "messages": []}
    for _ in range(200):
        for endpoint, body in (("chat", chat), ("messages", messages)):
            t0 = time.perf_counter()
            router.prepare(endpoint, body)
            times[endpoint].append(time.perf_counter() - t0)
    c, m = statistics.median(times["chat"]), statistics.median(times["messages"])
    print(f"prepare: the same conversation as chat {c * 1e6:.0f} us, as Anthropic Messages {m * 1e6:.0f} us "
          f"median ({m / c:.2f}x)")


def bench_step(router: Router, eos: list[int], seqs: int = 256) -> None:
    core = Core(router, json.dumps({"num_blocks": 4096, "block_size": 16, "max_num_seqs": seqs,
                                    "max_num_batched_tokens": 65536, "max_model_len": 4096}))
    vocab = router.vocab_size
    for i in range(seqs):
        core.add(router.prepare("completion", orjson.dumps(
            {"model": "m", "prompt": f"request {i} " + "word " * 120, "max_tokens": 3000,
             "ignore_eos": True, "temperature": 0.7})))
    rng = np.random.default_rng(0)

    def one_step():
        plan = core.schedule()
        rows = plan.num_rows
        tokens = rng.integers(100, vocab - 1, rows, dtype=np.int64)
        core.commit(tokens, np.zeros(rows, np.float32), np.zeros((rows, 0), np.int64),
                    np.zeros((rows, 0), np.float32))

    for _ in range(3):  # prefill the prompts
        one_step()
    t = timeit(one_step, 300)
    print(f"step: schedule() + commit() with {seqs} running sequences: {t * 1e6:.0f} us median")


if __name__ == "__main__":
    r, eos_ids = default_router()
    bench_prepare(r)
    bench_step(r, eos_ids)
