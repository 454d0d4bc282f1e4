"""--batch-invariant over HTTP: a greedy and a seeded request give the same tokens and logprobs
alone and among 15 other concurrent requests of other lengths (so they share steps with
different rows, and under --max-num-batched-tokens 64 their prompts are chunked differently).
Prefix caching is off so that the loaded run really recomputes the prompts."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from server import ServerProcess

WORDS = "the quick brown fox jumps over the lazy dog hello world numbers 42 and more text".split()
TARGET_PROMPT = " ".join(WORDS * 4)
TARGETS = [
    {"prompt": TARGET_PROMPT, "max_tokens": 16, "temperature": 0.0},
    {"prompt": TARGET_PROMPT[:150], "max_tokens": 16, "temperature": 1.0, "seed": 1234},
]


@pytest.fixture(scope="module")
def server(tiny_model):
    s = ServerProcess(str(tiny_model), "--served-model-name", "tiny", "--batch-invariant",
                      "--max-num-seqs", "16", "--max-num-batched-tokens", "64",
                      "--num-kv-blocks", "400", "--no-enable-prefix-caching")
    yield s
    s.stop()


def _complete(url: str, body: dict) -> tuple[str, list[str], list[float]]:
    body = {"model": "tiny", "logprobs": 2, "ignore_eos": True, **body}
    r = httpx.post(url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["text"], choice["logprobs"]["tokens"], choice["logprobs"]["token_logprobs"]


def _others(n: int) -> list[dict]:
    return [{"prompt": " ".join(WORDS[i % 5:] * (1 + i % 6)), "max_tokens": 6 + (i * 5) % 19,
             "temperature": 1.0 if i % 2 else 0.0} for i in range(n)]


def test_output_does_not_depend_on_the_batch(server):
    alone = [_complete(server.url, t) for t in TARGETS]
    assert all(len(tokens) == 16 for _, tokens, _ in alone)
    for order in range(2):
        bodies = _others(15)
        # the targets sit at different places among the others in each round
        bodies.insert(3 + 7 * order, TARGETS[0])
        bodies.insert(11 - 9 * order, TARGETS[1])
        where = [bodies.index(t) for t in TARGETS]
        with ThreadPoolExecutor(len(bodies)) as pool:
            results = list(pool.map(lambda b: _complete(server.url, b), bodies))
        for target, at in zip(alone, where):
            assert results[at] == target
