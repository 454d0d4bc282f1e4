"""`POST /v1/embeddings` end to end, with the official SDK and raw HTTP.

The SDK asks for base64 unless told otherwise and decodes it itself, so both encodings must
carry the same float32 vectors. An input's embedding does not depend on what else the
request or the batch holds; usage counts the inputs' tokens as /tokenize does; bad fields are
400s in OpenAI's error shape, and embeddings share the engine with generation without
leaking a KV block. (Numerical agreement with transformers: tests/parity.)
"""

from __future__ import annotations

import asyncio
import base64
import time

import httpx
import numpy as np
import openai
import pytest

from server import ServerProcess

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Hello, world!", "def add(a, b): return a + b"]


@pytest.fixture(scope="module")
def client(tiny_server):
    with openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def _vectors(response) -> np.ndarray:
    return np.array([d.embedding for d in sorted(response.data, key=lambda d: d.index)], np.float64)


def test_the_sdks_default_base64_and_floats_carry_the_same_vectors(client):
    default = client.embeddings.create(model="tiny", input=TEXTS)   # the SDK sends base64
    floats = client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
    assert default.object == "list" and default.model == "tiny"
    assert [d.index for d in default.data] == [0, 1, 2]
    assert all(d.object == "embedding" for d in default.data)
    a, b = _vectors(default), _vectors(floats)
    assert a.shape == (3, 64)
    np.testing.assert_array_equal(a.astype(np.float32), b.astype(np.float32))
    np.testing.assert_allclose(np.linalg.norm(a, axis=1), 1.0, atol=1e-5)
    # different texts, different vectors
    assert np.abs(a[0] - a[1]).max() > 1e-3


def test_raw_base64_is_little_endian_float32(tiny_server):
    r = httpx.post(tiny_server.url + "/v1/embeddings", timeout=60,
                   json={"model": "tiny", "input": "Hello", "encoding_format": "base64"})
    assert r.status_code == 200, r.text
    raw = base64.b64decode(r.json()["data"][0]["embedding"])
    assert len(raw) == 64 * 4
    floats = httpx.post(tiny_server.url + "/v1/embeddings", timeout=60,
                        json={"model": "tiny", "input": "Hello"}).json()["data"][0]["embedding"]
    np.testing.assert_array_equal(np.frombuffer(raw, "<f4"), np.array(floats, np.float32))
    assert r.headers["x-request-id"].startswith("embd-")
    assert "llmserve-ignored-fields" not in r.headers


def test_an_input_embeds_the_same_alone_or_in_a_batch(client):
    batch = _vectors(client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float"))
    for i, text in enumerate(TEXTS):
        alone = _vectors(client.embeddings.create(model="tiny-alias", input=text, encoding_format="float"))
        np.testing.assert_allclose(alone[0], batch[i], atol=1e-6)


def _metrics(server, *names: str) -> list[float]:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return [sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))
            for name in names]


def test_usage_counts_the_input_tokens_as_tokenize_does(client, tiny_server):
    """... and /metrics counts them where vLLM's engine counts a pooled prompt: its tokens, and
    the time to its answer (its first output) as a time to first token."""
    names = ("llmserve:prompt_tokens_total", "llmserve:time_to_first_token_seconds_count",
             "llmserve:iteration_tokens_total_sum", "llmserve:request_prompt_tokens_sum")
    before = _metrics(tiny_server, *names)
    ids = [[5, 6, 7, 8, 9], [10, 11]]
    r = client.embeddings.create(model="tiny", input=ids)
    assert (r.usage.prompt_tokens, r.usage.total_tokens) == (7, 7)
    assert [a - b for a, b in zip(_metrics(tiny_server, *names), before)] == [7, 1, 7, 7]
    counts = [httpx.post(tiny_server.url + "/tokenize", json={"model": "tiny", "prompt": t}).json()["count"]
              for t in TEXTS]
    r = client.embeddings.create(model="tiny", input=TEXTS)
    assert r.usage.prompt_tokens == sum(counts)


def test_vllm_fields_normalize_and_truncate(client):
    raw = client.embeddings.create(model="tiny", input="Hello, world!", encoding_format="float",
                                   extra_body={"normalize": False})
    v = np.array(raw.data[0].embedding)
    assert abs(np.linalg.norm(v) - 1.0) > 1e-3
    normed = _vectors(client.embeddings.create(model="tiny", input="Hello, world!", encoding_format="float"))
    np.testing.assert_allclose(v / np.linalg.norm(v), normed[0], atol=1e-6)
    cut = client.embeddings.create(model="tiny", input=[[5, 6, 7, 8, 9]], extra_body={"truncate_prompt_tokens": 2})
    last_two = client.embeddings.create(model="tiny", input=[[8, 9]])
    assert cut.usage.prompt_tokens == 2
    np.testing.assert_allclose(_vectors(cut), _vectors(last_two), atol=1e-6)


@pytest.mark.parametrize("kwargs, param, code", [
    ({"input": ""}, "input", "invalid_value"),
    ({"input": []}, "input", "invalid_value"),
    ({"input": ["a", [5]]}, "input[1]", "invalid_type"),
    ({"input": "a", "dimensions": 16}, "dimensions", "unsupported_parameter"),
    ({"input": "a", "dimensions": 65}, "dimensions", "invalid_value"),
    ({"input": "a", "encoding_format": "int8"}, "encoding_format", "invalid_value"),
    ({"input": [[5, 6, 7] * 200]}, "input[0]", "context_length_exceeded"),
])
def test_bad_requests_are_400s_naming_the_field(client, kwargs, param, code):
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model="tiny", **kwargs)
    body = err.value.body
    assert (body["param"], body["code"], body["type"]) == (param, code, "invalid_request_error")


def test_an_unknown_model_is_a_404_and_unknown_fields_are_reported(client, tiny_server):
    with pytest.raises(openai.NotFoundError) as err:
        client.embeddings.create(model="nope", input="a")
    assert err.value.body["code"] == "model_not_found"
    r = httpx.post(tiny_server.url + "/v1/embeddings", timeout=60, json={"model": "tiny", "input": "a", "stream": True})
    assert r.status_code == 200 and r.headers["llmserve-ignored-fields"] == "stream"


def test_embeddings_share_the_engine_with_generation_and_leak_nothing(tiny_server):
    async def run():
        async with httpx.AsyncClient(base_url=tiny_server.url, timeout=120) as c:
            async def stream():
                body = {"model": "tiny", "prompt": "Numbers: 1 2 3", "max_tokens": 40, "ignore_eos": True,
                        "stream": True}
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    return b"".join([chunk async for chunk in r.aiter_bytes()])

            async def embed(i):
                r = await c.post("/v1/embeddings", json={"model": "tiny", "input": [TEXTS[i % 3]] * 3})
                assert r.status_code == 200, r.text
                return r.json()

            return await asyncio.gather(stream(), *(embed(i) for i in range(8)))

    streamed, *embedded = asyncio.run(run())
    assert streamed.endswith(b"data: [DONE]\n\n")
    assert all(len(e["data"]) == 3 for e in embedded)
    deadline = time.monotonic() + 10
    while (load := httpx.get(tiny_server.url + "/load").json())["running"] or load["kv_cache_usage"]:
        assert time.monotonic() < deadline, load
        time.sleep(0.05)


@pytest.fixture(scope="module")
def smol():
    server = ServerProcess(None, "--max-model-len", "2048", "--kv-cache-memory", "256MiB",
                           "--max-num-batched-tokens", "64")
    yield server
    server.stop()


def test_the_default_model_embeds_long_inputs_in_chunks(smol):
    with openai.OpenAI(base_url=smol.url + "/v1", api_key="x", max_retries=0, timeout=120) as c:
        long = "The history of the city is long and full of stories. " * 20   # ~240 tokens: 4+ steps
        r = c.embeddings.create(model="SmolLM2-135M-Instruct", input=[long, "Paris"])
        v = _vectors(r)
        assert v.shape == (2, 576) and r.usage.prompt_tokens > 200
        np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
        alone = _vectors(c.embeddings.create(model="SmolLM2-135M-Instruct", input=long))
        np.testing.assert_allclose(alone[0], v[0], atol=1e-5)
