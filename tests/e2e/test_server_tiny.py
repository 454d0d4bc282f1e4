"""End to end over HTTP on a tiny random model: the official `openai` SDK and raw HTTP.

Assertions are about structure and accounting (ids, indices, finish reasons, usage),
never about generated wording: the model is random.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import openai
import pytest


@pytest.fixture(scope="module")
def client(tiny_server):
    with openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def _tokenize(server, text: str) -> list[int]:
    r = httpx.post(server.url + "/tokenize", json={"model": "tiny", "prompt": text})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_chat_non_streamed(client, tiny_server):
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=8,
        extra_body={"ignore_eos": True},
    )
    assert r.id.startswith("chatcmpl-")
    assert r.object == "chat.completion"
    assert r.model == "tiny"
    assert len(r.choices) == 1
    choice = r.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.finish_reason == "length"
    assert r.usage.completion_tokens == 8
    rendered = httpx.post(tiny_server.url + "/v1/chat/completions/render", json={
        "model": "tiny", "messages": [{"role": "user", "content": "Hello"}]}).json()
    assert r.usage.prompt_tokens == len(rendered["prompt_token_ids"])
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8


def test_alias_is_echoed(client):
    r = client.chat.completions.create(model="tiny-alias", messages=[{"role": "user", "content": "x"}],
                                       max_tokens=2)
    assert r.model == "tiny-alias"


def test_chat_stream_shape_and_usage(client):
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi there"}], max_tokens=10,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    ids = {c.id for c in chunks}
    assert len(ids) == 1
    assert len({c.created for c in chunks}) == 1
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_stream_equals_non_stream_greedy(client):
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "Tell me"}], max_tokens=12,
                  temperature=0, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs)
             if c.choices]
    assert "".join(parts) == whole


def test_completions_list_of_prompts_and_token_ids(client, tiny_server):
    ids = _tokenize(tiny_server, "The quick brown fox")
    r = client.completions.create(model="tiny", prompt=["Hello world", "Numbers: 1 2"], max_tokens=4,
                                  n=2, temperature=0.8, extra_body={"ignore_eos": True})
    assert r.object == "text_completion"
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert all(c.finish_reason == "length" for c in r.choices)
    expected_prompt = len(_tokenize(tiny_server, "Hello world")) + len(_tokenize(tiny_server, "Numbers: 1 2"))
    assert r.usage.prompt_tokens == expected_prompt
    assert r.usage.completion_tokens == 16
    r2 = client.completions.create(model="tiny", prompt=ids, max_tokens=3, extra_body={"ignore_eos": True})
    assert r2.usage.prompt_tokens == len(ids) and r2.usage.completion_tokens == 3


def test_greedy_n_returns_identical_choices(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], n=3,
                                       temperature=0, max_tokens=6, extra_body={"ignore_eos": True})
    texts = {c.message.content for c in r.choices}
    assert len(r.choices) == 3 and len(texts) == 1
    assert r.usage.completion_tokens == 18


def test_seed_reproducible(client):
    kwargs = dict(model="tiny", prompt="Once upon", max_tokens=10, temperature=1.0, seed=1234,
                  extra_body={"ignore_eos": True})
    a = client.completions.create(**kwargs).choices[0].text
    b = client.completions.create(**kwargs).choices[0].text
    assert a == b
    # every one of the 64 bits counts: seeds that differ only in the top one differ
    texts = {client.completions.create(**{**kwargs, "seed": seed}).choices[0].text for seed in (0, 2**63)}
    assert len(texts) == 2


def test_system_fingerprint_names_the_setup(client, tiny_server, monkeypatch):
    """OpenAI's `system_fingerprint`, in every body and chunk: the same for every response of
    a server, and another for other weights or numerics (build, device, dtype, compute paths,
    threads: engine/build.py)."""
    import torch

    from llmserve.engine.build import system_fingerprint

    kwargs = dict(model="tiny", max_tokens=3, temperature=0)
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **kwargs)
    done = client.completions.create(prompt="Once", **kwargs)
    chunks = list(client.completions.create(prompt="Once", stream=True, **kwargs))
    prints = {chat.system_fingerprint, done.system_fingerprint, *(c.system_fingerprint for c in chunks)}
    assert len(prints) == 1 and re.fullmatch(r"fp_[0-9a-f]{10}", prints.pop())
    w = {"a": torch.arange(1000.0).reshape(10, 100)}
    base = system_fingerprint(w, "cpu", torch.float32)
    assert system_fingerprint({"a": w["a"].clone()}, "cpu", torch.float32) == base
    w2 = {"a": w["a"].clone()}
    w2["a"][0, 0] = 7.0
    assert system_fingerprint(w2, "cpu", torch.float32) != base
    assert system_fingerprint(w, "cpu", torch.bfloat16) != base
    # a kernel change that moves output bits bumps the revision (rust/kernels/src/lib.rs)
    monkeypatch.setattr("llmserve.engine.build.numerics_revision", 10**6)
    assert system_fingerprint(w, "cpu", torch.float32) != base


def test_logprobs_shapes(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                       logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 3
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
    c = client.completions.create(model="tiny", prompt="Hello", max_tokens=3, logprobs=2,
                                  extra_body={"ignore_eos": True})
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 3


def test_models_list_and_get(client, tiny_server):
    models = client.models.list()
    names = [m.id for m in models.data]
    assert names == ["tiny", "tiny-alias"]
    raw = httpx.get(tiny_server.url + "/v1/models").json()
    assert all(m["max_model_len"] == 512 for m in raw["data"])
    assert client.models.retrieve("tiny-alias").id == "tiny-alias"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    # (vLLM's routes that load and unload LoRA adapters are closed unless the server opens them)
    # (whatever the method: a 405 would say they were there)
    for route in ("load_lora_adapter", "unload_lora_adapter"):
        r = httpx.post(f"{tiny_server.url}/v1/{route}", json={"lora_name": "x", "lora_path": "/tmp"})
        assert r.status_code == 404 and "--allow-runtime-lora-updating" in r.json()["error"]["message"], r.text
        r = httpx.get(f"{tiny_server.url}/v1/{route}")
        assert r.status_code == 404 and "--allow-runtime-lora-updating" in r.json()["error"]["message"], r.text


def test_tokenize_detokenize_round_trip(tiny_server):
    ids = _tokenize(tiny_server, "Hello, world!")
    r = httpx.post(tiny_server.url + "/detokenize", json={"model": "tiny", "tokens": ids})
    assert r.json()["prompt"] == "Hello, world!"
    r = httpx.post(tiny_server.url + "/tokenize", json={"model": "tiny", "prompt": "Hello"}).json()
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 512


def test_unknown_model_is_404_on_generation_routes(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="tiny:lora", messages=[{"role": "user", "content": "x"}])
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x")


def test_context_length_exceeded(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="Hello world", max_tokens=600)
    assert e.value.body["code"] == "context_length_exceeded"
    assert "512" in e.value.body["message"]


def test_bad_values_name_their_param(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], temperature=3)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                       stream_options={"include_usage": True})
    assert e.value.body["param"].startswith("stream_options")


def test_malformed_json_and_error_shape(tiny_server):
    r = httpx.post(tiny_server.url + "/v1/chat/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_body_too_large_is_413(tiny_server):
    r = httpx.post(tiny_server.url + "/v1/completions", content=b"x" * (9 * 1024 * 1024))
    assert r.status_code == 413
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_client_gone_mid_body_is_not_a_server_error(tiny_server):
    import socket

    logged = tiny_server.logs(whole=True).count("Traceback")
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", tiny_server.port)) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 500\r\n\r\n{\"model\": \"tiny\"")
    r = httpx.post(tiny_server.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1},
                   timeout=60)
    assert r.status_code == 200
    time.sleep(0.5)
    assert tiny_server.logs(whole=True).count("Traceback") == logged, tiny_server.logs()[-2000:]


def test_ignored_fields_header(tiny_server):
    r = httpx.post(tiny_server.url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
        "metadata": {"a": "b"}, "frobnicate": 1, "user": "alice", "service_tier": "flex"})
    assert r.status_code == 200
    ignored = r.headers["llmserve-ignored-fields"]
    # (`metadata` without `store: true` has nothing to go with; `user` is logged)
    assert {f.strip() for f in ignored.split(",")} == {"metadata", "frobnicate", "service_tier"}
    assert "llmserve-chat-template" in r.headers


def test_health_ready_load_version_metrics(tiny_server):
    assert httpx.get(tiny_server.url + "/health").status_code == 200
    assert httpx.get(tiny_server.url + "/ready").status_code == 200
    version = httpx.get(tiny_server.url + "/version").json()
    assert version["version"] and version["core"]
    # build info: the compiled core's profile, target and compiler (the commit when built in git)
    build = version["build"]
    assert build["profile"] in ("release", "debug") and build["target"] and build["rustc"].startswith("rustc ")
    text = httpx.get(tiny_server.url + "/metrics", headers={"accept-encoding": "identity"}).text
    for name in ("llmserve:num_requests_running", "llmserve:num_requests_waiting",
                 "llmserve:kv_cache_usage_perc", "llmserve:time_to_first_token_seconds",
                 "llmserve:time_per_output_token_seconds", "llmserve:e2e_request_latency_seconds",
                 "llmserve:prompt_tokens_total", "llmserve:generation_tokens_total"):
        assert name in text, name
    # gzip when the scraper asks (Prometheus does), plain text otherwise
    zipped = httpx.get(tiny_server.url + "/metrics", headers={"accept-encoding": "gzip"})
    assert zipped.headers["content-encoding"] == "gzip" and "llmserve:num_requests_running" in zipped.text
    plain = httpx.get(tiny_server.url + "/metrics", headers={"accept-encoding": "identity"})
    assert "content-encoding" not in plain.headers


def _load(server) -> dict:
    return httpx.get(server.url + "/load").json()


def _wait_idle(server, timeout=30.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        load = _load(server)
        if load["running"] == 0 and load["waiting"] == 0 and load["requests"] == 0:
            return load
        time.sleep(0.1)
    return _load(server)


def test_concurrent_streams_get_correct_usage(tiny_server):
    async def one(client, i):
        stream = await client.completions.create(
            model="tiny", prompt=f"Request number {i}", max_tokens=5 + i % 4, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        usage = None
        async for chunk in stream:
            if chunk.usage:
                usage = chunk.usage
        return usage

    async def main():
        async with openai.AsyncOpenAI(base_url=tiny_server.url + "/v1", api_key="x", max_retries=0) as c:
            return await asyncio.gather(*(one(c, i) for i in range(32)))

    usages = asyncio.run(main())
    for i, u in enumerate(usages):
        assert u is not None and u.completion_tokens == 5 + i % 4


def test_dropped_streams_free_their_blocks(tiny_server):
    idle = _wait_idle(tiny_server)

    async def drop_one(client, i):
        async with client.stream("POST", "/v1/completions", json={
                "model": "tiny", "prompt": f"drop {i} " * 20, "max_tokens": 200, "stream": True,
                "ignore_eos": True}) as r:
            assert r.status_code == 200
            n = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    n += 1
                    if n == 2 and i == 0:
                        # blocks in use, as a fraction of those requests can hold
                        load = (await client.get("/load")).json()
                        assert load["kv_blocks_used"] > 0
                        assert load["kv_cache_usage"] == pytest.approx(load["kv_blocks_used"] / load["kv_blocks_total"])
                        # (vLLM's name for the requests open, which its routers read)
                        assert load["server_load"] == load["requests"] > 0
                    if n >= 3:
                        break  # leave mid-way: closing the response drops the connection

    async def main():
        async with httpx.AsyncClient(base_url=tiny_server.url, timeout=60) as c:
            await asyncio.gather(*(drop_one(c, i) for i in range(8)))

    asyncio.run(main())
    after = _wait_idle(tiny_server)
    assert after["running"] == 0 and after["waiting"] == 0
    assert after["kv_blocks_used"] == idle["kv_blocks_used"]


def test_raw_sse_framing(tiny_server):
    with httpx.stream("POST", tiny_server.url + "/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 3,
            "stream": True, "ignore_eos": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        body = r.read().decode()
    frames = [f for f in body.split("\n\n") if f]
    assert all(f.startswith("data: ") for f in frames)
    assert frames[-1] == "data: [DONE]"
    for f in frames[:-1]:
        json.loads(f.removeprefix("data: "))


def test_invocations_routes_by_the_body(tiny_server):
    """POST /invocations (SageMaker's, as vLLM's): `messages` is a chat request, `prompt` a
    completion, `input` an embeddings request, `text_1` a score, `query` a rerank, each answered
    as its own route answers it."""
    def post(path, body):
        return httpx.post(tiny_server.url + path, json={"model": "tiny", **body}, timeout=60)

    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
    completion = {"prompt": "The quick", "max_tokens": 4, "temperature": 0}
    embedding = {"input": "The quick"}
    score = {"text_1": "The quick", "text_2": ["brown fox", "lazy dog"]}
    rerank = {"query": "The quick", "documents": ["brown fox", "lazy dog"]}
    for body, route in ((chat, "/v1/chat/completions"), (completion, "/v1/completions"),
                        (embedding, "/v1/embeddings"), (score, "/v1/score"), (rerank, "/v1/rerank")):
        via, direct = post("/invocations", body), post(route, body)
        assert via.status_code == direct.status_code, (via.text, direct.text)
        a, b = via.json(), direct.json()
        if "choices" in a:
            assert a["object"] == b["object"] and a["choices"] == b["choices"] and a["usage"] == b["usage"]
        elif route in ("/v1/score", "/v1/rerank"):
            assert a.get("data") == b.get("data") and a.get("results") == b.get("results"), (a, b)
        else:
            assert a.get("object") == b.get("object") and a.get("error", {}).get("code") == b.get("error", {}).get("code")
    streamed = post("/invocations", {**chat, "stream": True})
    assert streamed.headers["content-type"].startswith("text/event-stream") and "data: [DONE]" in streamed.text
    neither = post("/invocations", {"max_tokens": 4})
    assert neither.status_code == 400 and "`messages`" in neither.json()["error"]["message"]
    broken = httpx.post(tiny_server.url + "/invocations", content=b"{oops", timeout=60,
                        headers={"content-type": "application/json"})
    assert broken.status_code == 400 and broken.json()["error"]["code"] == "invalid_json"
