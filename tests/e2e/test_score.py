"""vLLM's `/score` and `/rerank` end to end on the tiny model: each score is the cosine
similarity of the two texts' embeddings as `/v1/embeddings` returns them (computed here with
numpy), rerank orders the documents by it, and every route name vLLM serves them by answers.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest

DOCS = ["The quick brown fox jumps over the lazy dog.", "Hello, world!", "def add(a, b): return a + b",
        "Paris is the capital of France."]
QUERY = "What is the capital of France?"


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": "tiny", **body}, timeout=60)


def _ok(server, path: str, body: dict) -> dict:
    r = _post(server, path, body)
    assert r.status_code == 200, r.text
    return r.json()


def _cosines(server, query: str, docs: list[str]) -> np.ndarray:
    data = _ok(server, "/v1/embeddings", {"input": [query, *docs], "encoding_format": "float"})["data"]
    v = np.array([d["embedding"] for d in data], np.float64)
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    return v[1:] @ v[0]


@pytest.mark.parametrize("path", ["/score", "/v1/score"])
def test_score_is_the_cosine_of_the_embeddings(tiny_server, path):
    body = _ok(tiny_server, path, {"text_1": QUERY, "text_2": DOCS})
    want = _cosines(tiny_server, QUERY, DOCS)
    assert body["object"] == "list" and body["model"] == "tiny" and body["id"].startswith("score-")
    assert [d["index"] for d in body["data"]] == [0, 1, 2, 3]
    assert all(d["object"] == "score" for d in body["data"])
    np.testing.assert_allclose([d["score"] for d in body["data"]], want, atol=1e-5)
    counts = [_ok(tiny_server, "/tokenize", {"prompt": t})["count"] for t in [QUERY, *DOCS]]
    assert body["usage"] == {"prompt_tokens": sum(counts), "total_tokens": sum(counts), "completion_tokens": 0}


def test_score_lists_of_one_length_pair_by_pair(tiny_server):
    pairs = _ok(tiny_server, "/score", {"text_1": [QUERY, DOCS[0]], "text_2": [DOCS[3], DOCS[0]]})["data"]
    one = _ok(tiny_server, "/score", {"text_1": QUERY, "text_2": DOCS[3]})["data"]
    assert pairs[0]["score"] == pytest.approx(one[0]["score"], abs=1e-6)
    assert pairs[1]["score"] == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_orders_the_documents_by_that_score(tiny_server, path):
    body = _ok(tiny_server, path, {"query": QUERY, "documents": DOCS})
    want = _cosines(tiny_server, QUERY, DOCS)
    order = [r["index"] for r in body["results"]]
    assert order == sorted(range(len(DOCS)), key=lambda i: -want[i])
    for r in body["results"]:
        assert r["document"] == {"text": DOCS[r["index"]]}
        assert r["relevance_score"] == pytest.approx(want[r["index"]], abs=1e-5)
    assert body["id"].startswith("rerank-") and body["model"] == "tiny"
    assert body["usage"]["total_tokens"] > 0
    top = _ok(tiny_server, path, {"query": QUERY, "documents": [{"text": d} for d in DOCS], "top_n": 2,
                                  "return_documents": False})["results"]
    assert [r["index"] for r in top] == order[:2]
    assert all("document" not in r for r in top)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/score", {"text_1": ["a", "b"], "text_2": ["c"]}, "text_2"),
    ("/score", {"text_1": "a"}, "text_2"),
    ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
    ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": -2}, "top_n"),
])
def test_bad_requests_are_400s_naming_the_field(tiny_server, path, body, param):
    r = _post(tiny_server, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_unknown_models_and_fields(tiny_server):
    r = httpx.post(tiny_server.url + "/rerank", json={"model": "nope", "query": "q", "documents": ["a"]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = _post(tiny_server, "/rerank", {"query": "q", "documents": ["a"], "use_activation": True})
    assert r.status_code == 200 and r.headers["llmserve-ignored-fields"] == "use_activation"
    load = httpx.get(tiny_server.url + "/load", timeout=10).json()
    assert (load["running"], load["waiting"], load["kv_blocks_used"]) == (0, 0, 0)
