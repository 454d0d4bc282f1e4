"""Behaviour that needs a full batch, on one server with --max-num-seqs 1 --max-waiting 4:
`priority` really schedules, a full queue answers 503 + Retry-After, idle streams get
keep-alive comments; plus the access log (`user`) and /metrics counters moving.

A long request (ignore_eos, hundreds of tokens) holds the only batch slot; the test closes
it when done, which aborts it on the server.
"""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import pytest

from server import ServerProcess
from tiny import build_tiny_llama

# (long enough to hold the slot on a slow machine: a test releases it after a few steps)
LONG = {"model": "tiny", "prompt": "Hold the slot", "max_tokens": 4000, "ignore_eos": True, "priority": 0}


@pytest.fixture(scope="module")
def one_slot(tmp_path_factory):
    model = build_tiny_llama(tmp_path_factory.mktemp("tiny-4k"), max_position_embeddings=4096)
    server = ServerProcess(str(model), "--served-model-name", "tiny", "--served-model-name", "tiny-b",
                           "--num-kv-blocks", "320", "--max-num-seqs", "1", "--max-waiting", "4",
                           "--sse-keep-alive", "0.2", env={"LLMSERVE_LOG_LEVEL": "INFO"})
    yield server
    server.stop()


def _load(server) -> dict:
    return httpx.get(server.url + "/load", timeout=60).json()


async def _until(pred, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def _wait_load(server, key: str, value: int):
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
        deadline = time.monotonic() + 30
        while (await c.get("/load")).json()[key] != value:
            assert time.monotonic() < deadline, f"{key} never reached {value}"
            await asyncio.sleep(0.02)


async def _hold_slot(c: httpx.AsyncClient, server) -> asyncio.Task:
    """Start the long request (streamed, so cancelling it aborts it) and wait till it runs."""
    async def run():
        async with c.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
            async for _ in r.aiter_bytes():
                pass

    task = asyncio.ensure_future(run())
    await _wait_load(server, "running", 1)
    return task


async def _release(task: asyncio.Task) -> None:
    assert not task.done(), "the long request ended before the test released it"
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass


def _wait_idle(server):
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        load = _load(server)
        if load["running"] == 0 and load["waiting"] == 0 and load["requests"] == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"server never went idle: {_load(server)}")


def test_priority_lower_value_starts_first(one_slot):
    order: list[str] = []

    async def short(c, name, priority):
        r = await c.post("/v1/completions", json={"model": "tiny", "prompt": name, "max_tokens": 4,
                                                  "ignore_eos": True, "priority": priority})
        assert r.status_code == 200, r.text
        order.append(name)

    async def main():
        async with httpx.AsyncClient(base_url=one_slot.url, timeout=120) as c:
            hold = await _hold_slot(c, one_slot)
            low = asyncio.ensure_future(short(c, "low", 10))
            await _wait_load(one_slot, "waiting", 1)
            high = asyncio.ensure_future(short(c, "high", 5))
            await _wait_load(one_slot, "waiting", 2)
            await _release(hold)
            await asyncio.gather(low, high)

    asyncio.run(main())
    _wait_idle(one_slot)
    assert order == ["high", "low"]


def test_full_queue_is_503_with_retry_after(one_slot):
    async def main():
        async with httpx.AsyncClient(base_url=one_slot.url, timeout=120) as c:
            hold = await _hold_slot(c, one_slot)
            waiters = [asyncio.ensure_future(c.post("/v1/completions", json={
                "model": "tiny", "prompt": f"wait {i}", "max_tokens": 2})) for i in range(4)]
            await _wait_load(one_slot, "waiting", 4)
            r = await c.post("/v1/chat/completions", json={
                "model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
            assert r.status_code == 503
            assert int(r.headers["retry-after"]) >= 1
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert (err["type"], err["code"]) == ("service_unavailable_error", "service_unavailable")
            await _release(hold)
            done = await asyncio.gather(*waiters)
            assert [w.status_code for w in done] == [200] * 4

    asyncio.run(main())
    _wait_idle(one_slot)


def test_a_burst_fills_the_free_slots_and_the_queue(one_slot):
    """Requests that arrive together, before a step starts any of them, wait for the free slot
    as well as in the queue: on an idle server 1 + 4 of them are taken, not 4."""
    async def main():
        async with httpx.AsyncClient(base_url=one_slot.url, timeout=120) as c:
            burst = [c.post("/v1/completions", json={"model": "tiny", "prompt": f"burst {i}", "max_tokens": 2})
                     for i in range(5)]
            done = await asyncio.gather(*burst)
            assert [r.status_code for r in done] == [200] * 5, [r.text for r in done]

    asyncio.run(main())
    _wait_idle(one_slot)


def test_the_queue_counts_sequences_not_requests(one_slot):
    """--max-waiting 4 counts every prompt and sampled choice waiting beyond the free slot: a
    request that alone needs more than both (5) is a 400 naming the field, one that needs more
    than the room left is a 503 (and holds that room for its retry), and a greedy n (run once)
    needs one."""
    def completion(c, **fields):
        return c.post("/v1/completions", json={"model": "tiny", "max_tokens": 2, **fields})

    async def main():
        async with httpx.AsyncClient(base_url=one_slot.url, timeout=120) as c:
            too_many = [await completion(c, prompt=["a", "b", "c", "d", "e", "f"]),
                        await completion(c, prompt="a", n=6, temperature=1.0),
                        # fewer prompts would not help: n is the one to lower
                        await completion(c, prompt=["a", "b"], n=6, temperature=1.0),
                        # the candidates best_of samples are what the client chose
                        await completion(c, prompt="a", best_of=6, temperature=1.0)]
            for r, param in zip(too_many, ["prompt", "n", "n", "best_of"]):
                assert r.status_code == 400, r.text
                err = r.json()["error"]
                assert (err["param"], err["code"]) == (param, "invalid_value")
                assert "sequences" in err["message"] and "--max-waiting" in err["message"]
            # an embeddings input waits as one sequence too: the field to shorten is `input`
            r = await c.post("/v1/embeddings", json={"model": "tiny", "input": ["a", "b", "c", "d", "e", "f"]})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert (err["param"], err["code"]) == ("input", "invalid_value")
            assert "6 inputs" in err["message"] and "--max-waiting" in err["message"]
            # and so does each text of a rerank (the query's included)
            r = await c.post("/rerank", json={"model": "tiny", "query": "q", "documents": ["a", "b", "c", "d", "e"]})
            assert r.status_code == 400 and r.json()["error"]["param"] == "documents", r.text
            hold = await _hold_slot(c, one_slot)
            first = asyncio.ensure_future(completion(c, prompt="one", n=3, temperature=0))
            await _wait_load(one_slot, "waiting", 1)
            second = asyncio.ensure_future(completion(c, prompt="two", n=2, temperature=1.0, seed=1))
            await _wait_load(one_slot, "waiting", 3)
            # /metrics counts what /load counts (requests the engine thread has yet to take in too)
            assert _scrape(one_slot)["llmserve:num_requests_waiting"] == 3
            r = await completion(c, prompt=["x", "y"])
            assert r.status_code == 503, r.text
            # the place it lacked one of is held for its retry: a smaller request leaves it
            # free (else single requests would take each place as it frees, and it would never run)
            r = await completion(c, prompt="z")
            assert r.status_code == 503 and "held for a larger request" in r.json()["error"]["message"], r.text
            await _release(hold)
            done = await asyncio.gather(first, second)
            assert [w.status_code for w in done] == [200] * 2
            assert [len(w.json()["choices"]) for w in done] == [3, 2]
            r = await completion(c, prompt=["x", "y"])
            assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
            r = await completion(c, prompt="z")
            assert r.status_code == 200, r.text

    asyncio.run(main())
    _wait_idle(one_slot)


def test_keep_alive_comments_on_a_waiting_stream(one_slot):
    async def main():
        async with httpx.AsyncClient(base_url=one_slot.url, timeout=120) as c:
            hold = await _hold_slot(c, one_slot)
            lines: list[str] = []
            async with c.stream("POST", "/v1/chat/completions", json={
                    "model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 3,
                    "stream": True, "ignore_eos": True}) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    lines.append(line)
                    if line.startswith(":") and lines.count(line) == 2:
                        await _release(hold)  # two comments seen: let the stream run
            comments = [ln for ln in lines if ln.startswith(":")]
            data = [ln for ln in lines if ln.startswith("data: ")]
            assert len(comments) >= 2
            assert lines.index(comments[0]) < lines.index(data[0])
            assert data[-1] == "data: [DONE]"

    asyncio.run(main())
    _wait_idle(one_slot)


def test_user_is_in_the_access_log(one_slot):
    r = httpx.post(one_slot.url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
        "user": "alice-4711"})
    assert r.status_code == 200
    assert "user" not in r.headers.get("llmserve-ignored-fields", "")
    deadline = time.monotonic() + 30
    while "alice-4711" not in one_slot.logs():
        assert time.monotonic() < deadline, one_slot.logs()
        time.sleep(0.05)
    line = next(ln for ln in one_slot.logs().splitlines() if "alice-4711" in ln)
    assert "POST /v1/chat/completions" in line and " 200 " in line


def test_clients_cannot_forge_access_log_lines(one_slot):
    """The path arrives percent-decoded: `%0a` in it, or in `user`, is written escaped, so no
    client starts a line of its own in the log (without a key, too)."""
    httpx.get(one_slot.url + "/health%0aFORGED-7311%1b[2K")
    httpx.post(one_slot.url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1,
        "user": "bob\nFORGED-7312"})
    deadline = time.monotonic() + 30
    while "FORGED-7312" not in one_slot.logs():
        assert time.monotonic() < deadline, one_slot.logs()
        time.sleep(0.05)
    lines = one_slot.logs().splitlines()
    assert not [ln for ln in lines if ln.startswith("FORGED")], lines[-5:]
    assert any("/health\\nFORGED-7311\\u001b[2K" in ln for ln in lines), lines[-5:]
    # nor end a quoted field early
    httpx.get(one_slot.url + '/v1/models/x%22%20200%200.1ms%20FORGED-7313')
    while "FORGED-7313" not in one_slot.logs():
        assert time.monotonic() < deadline + 5, one_slot.logs()
        time.sleep(0.05)
    line = next(ln for ln in one_slot.logs().splitlines() if "FORGED-7313" in ln)
    assert '"GET /v1/models/x\\" 200 0.1ms FORGED-7313" 404 ' in line, line


def _scrape(server) -> dict[str, float]:
    """Samples by name and labels; every sample must carry the served model's name (as vLLM's
    do, for dashboards that select on it), which is then left out of the key."""
    text = httpx.get(server.url + "/metrics", timeout=60).text
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(llmserve:[^\s{]+)(\{[^}]*\})?\s+(\S+)$", line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            assert labels.pop("model_name", None) == "tiny", line
            key = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
            out[m.group(1) + (f"{{{key}}}" if key else "")] = float(m.group(3))
    return out


def _sum(metrics: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in metrics.items() if k.startswith(prefix))


def test_metrics_names_and_counters_move(one_slot):
    _wait_idle(one_slot)
    before = _scrape(one_slot)
    for name in ("llmserve:num_requests_running", "llmserve:num_requests_waiting", "llmserve:kv_cache_usage_perc",
                 "llmserve:time_to_first_token_seconds_count", "llmserve:time_per_output_token_seconds_count",
                 "llmserve:e2e_request_latency_seconds_count", "llmserve:prompt_tokens_total",
                 "llmserve:generation_tokens_total"):
        assert name in before, name
    r = httpx.post(one_slot.url + "/v1/completions", timeout=60, json={"model": "tiny", "prompt": "count me",
                                                           "max_tokens": 7, "ignore_eos": True}).json()
    deadline = time.monotonic() + 30
    while _sum(_scrape(one_slot), "llmserve:request_success_total") == _sum(before, "llmserve:request_success_total"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    after = _scrape(one_slot)
    assert _sum(after, "llmserve:request_success_total") - _sum(before, "llmserve:request_success_total") == 1
    # labelled by finish reason, as vLLM's vllm:request_success_total
    length = 'llmserve:request_success_total{finished_reason="length"}'
    assert after[length] - before.get(length, 0.0) == 1
    assert after["llmserve:prompt_tokens_total"] - before["llmserve:prompt_tokens_total"] == r["usage"]["prompt_tokens"]
    assert after["llmserve:generation_tokens_total"] - before["llmserve:generation_tokens_total"] == 7
    # vLLM's request_params_* histograms: n and the resolved max_tokens of each request
    assert after["llmserve:request_params_n_count"] - before.get("llmserve:request_params_n_count", 0.0) == 1
    assert (after["llmserve:request_params_max_tokens_sum"]
            - before.get("llmserve:request_params_max_tokens_sum", 0.0)) == 7
    # vLLM's prefix-cache hit rate is hits / queries, both in prompt tokens
    queries = "llmserve:prefix_cache_queries_total"
    assert _sum(after, queries) - _sum(before, queries) == r["usage"]["prompt_tokens"]
    assert "llmserve:prefix_cache_hits_total" in after
    # vLLM's iteration_tokens_total: per step, the tokens generated and the prompts whose first
    # token came, so over a request they sum to its prompt and completion tokens
    assert (after["llmserve:iteration_tokens_total_sum"] - before.get("llmserve:iteration_tokens_total_sum", 0.0)
            == r["usage"]["prompt_tokens"] + 7)
    longest = "llmserve:request_max_num_generation_tokens_sum"
    assert after[longest] - before.get(longest, 0.0) == 7
    info = [k for k in after if k.startswith("llmserve:cache_config_info{")]
    assert len(info) == 1 and 'block_size="' in info[0] and 'num_gpu_blocks="320"' in info[0], info
    for h in ("time_to_first_token_seconds", "request_time_per_output_token_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
              "request_inference_time_seconds"):
        assert after[f"llmserve:{h}_count"] - before[f"llmserve:{h}_count"] == 1, h

    def spent(h: str) -> float:
        return after[f"llmserve:{h}_sum"] - before[f"llmserve:{h}_sum"]
    # vLLM's phases: queue then inference make up the whole request, prefill then decode the
    # inference, and TTFT is queue then prefill
    assert spent("request_queue_time_seconds") > 0
    assert abs(spent("request_queue_time_seconds") + spent("request_inference_time_seconds")
               - spent("e2e_request_latency_seconds")) < 1e-6
    assert abs(spent("request_prefill_time_seconds") + spent("request_decode_time_seconds")
               - spent("request_inference_time_seconds")) < 1e-6
    assert abs(spent("request_queue_time_seconds") + spent("request_prefill_time_seconds")
               - spent("time_to_first_token_seconds")) < 1e-6
    # one gap between each pair of successive outputs: 6 after the first of 7 tokens
    # time_per_output_token_seconds is vLLM's older name for the same per-gap series
    for itl in ("llmserve:inter_token_latency_seconds", "llmserve:time_per_output_token_seconds"):
        assert after[itl + "_count"] - before.get(itl + "_count", 0.0) == 6, itl
        assert after[itl + "_sum"] - before.get(itl + "_sum", 0.0) == pytest.approx(
            spent("request_decode_time_seconds"), abs=0.5), itl
    assert after["llmserve:num_requests_running"] == 0 and after["llmserve:num_requests_waiting"] == 0


def test_generated_tokens_count_every_choice(one_slot):
    """`generation_tokens` adds what usage reports: n choices of greedy n > 1 count n times,
    though the engine computes them once (sampled n > 1 runs n sequences)."""
    key = "llmserve:generation_tokens_total"
    for temperature in (0.0, 1.0):
        _wait_idle(one_slot)
        scraped = _scrape(one_slot)
        before = scraped[key]
        longest_before = scraped.get("llmserve:request_max_num_generation_tokens_sum", 0.0)
        r = httpx.post(one_slot.url + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "count me", "max_tokens": 4, "ignore_eos": True, "n": 3,
            "temperature": temperature, "seed": 1}).json()
        assert r["usage"]["completion_tokens"] == 12
        _wait_idle(one_slot)
        after = _scrape(one_slot)
        assert after[key] - before == 12, temperature
        # vLLM's request_max_num_generation_tokens: the longest choice, not the sum
        longest = "llmserve:request_max_num_generation_tokens_sum"
        assert after[longest] - longest_before == 4, temperature
        # vLLM runs each choice as a request of its own: three successes, three prompts
        # processed, three observations of four tokens
        success = 'llmserve:request_success_total{finished_reason="length"}'
        assert after[success] - scraped.get(success, 0.0) == 3, temperature
        prompts = "llmserve:prompt_tokens_total"
        assert after[prompts] - scraped[prompts] == 3 * r["usage"]["prompt_tokens"], temperature
        per_request = "llmserve:request_generation_tokens"
        assert after[per_request + "_count"] - scraped.get(per_request + "_count", 0.0) == 3
        assert after[per_request + "_sum"] - scraped.get(per_request + "_sum", 0.0) == 12


def test_each_choice_counts_by_its_own_finish_reason(one_slot):
    """A completions list of two prompts, n=2: four sequences, each counted with the way it
    ended and its own prompt's tokens (mixed finish reasons: tests/unit/test_core.py and
    test_metrics.py)."""
    _wait_idle(one_slot)
    before = _scrape(one_slot)
    prompts = ["count me", "and me too please"]
    r = httpx.post(one_slot.url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": prompts, "max_tokens": 3, "n": 2, "temperature": 1, "seed": 7}).json()
    assert len(r["choices"]) == 4
    reasons = [c["finish_reason"] for c in sorted(r["choices"], key=lambda c: c["index"])]
    _wait_idle(one_slot)
    after = _scrape(one_slot)
    got = {k: after[k] - before.get(k, 0.0) for k in after if k.startswith("llmserve:request_success_total")}
    want = {f'llmserve:request_success_total{{finished_reason="{f}"}}': reasons.count(f) for f in set(reasons)}
    assert {k: v for k, v in got.items() if v} == want
    lens = [len(httpx.post(one_slot.url + "/tokenize", json={"model": "tiny", "prompt": p}, timeout=60).json()["tokens"])
            for p in prompts]
    key = "llmserve:request_prompt_tokens"
    assert after[key + "_count"] - before.get(key + "_count", 0.0) == 4
    assert after[key + "_sum"] - before.get(key + "_sum", 0.0) == 2 * sum(lens)
    # the parameters, as vLLM observes them: once per prompt
    assert after["llmserve:request_params_n_count"] - before.get("llmserve:request_params_n_count", 0.0) == 2


def test_models_lists_every_alias_with_max_model_len(one_slot):
    body = httpx.get(one_slot.url + "/v1/models").json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["tiny", "tiny-b"]
    for m in body["data"]:
        assert m["object"] == "model" and m["max_model_len"] == 4096
    one = httpx.get(one_slot.url + "/v1/models/tiny-b").json()
    assert one["id"] == "tiny-b" and one["max_model_len"] == 4096
