"""vLLM's tokens-in, tokens-out route, `POST /inference/v1/generate`, against the real server:
its ids and logprobs are those `/v1/completions` gives the same token prompt (greedy and
seeded), streamed or not, a stop string or stop token ends it with that token returned (and
its logprobs), and bad input gets the OpenAI error shape in this route's terms."""

from __future__ import annotations

import json

import httpx
import pytest

MAX_TOKENS = 6


def _ids(server, text: str) -> list[int]:
    r = httpx.post(server.url + "/tokenize", json={"model": "tiny", "prompt": text}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def _generate(server, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/inference/v1/generate", json=body, timeout=120)


def _ok(server, body: dict) -> dict:
    r = _generate(server, body)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(server, body: dict) -> list[dict]:
    r = _generate(server, {**body, "stream": True})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    lines = [line for line in r.text.split("\n\n") if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def _completion(server, body: dict) -> dict:
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "return_token_ids": True, **body},
                   timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 11, "top_k": 20}])
def test_ids_and_logprobs_match_the_completions_route(tiny_server, sampling):
    prompt = _ids(tiny_server, "hello world, the quick brown")
    params = {"max_tokens": MAX_TOKENS, "ignore_eos": True, "logprobs": 2, **sampling}
    body = _ok(tiny_server, {"model": "tiny", "token_ids": prompt, "sampling_params": params})
    ref = _completion(tiny_server, {"prompt": prompt, **params})["choices"][0]

    (choice,) = body["choices"]
    assert body["request_id"].startswith("generate-tokens-")
    assert body["kv_transfer_params"] is None
    assert choice["token_ids"] == ref["token_ids"]
    assert len(choice["token_ids"]) == MAX_TOKENS
    assert choice["finish_reason"] == "length"
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert [c["logprob"] for c in content] == pytest.approx(ref["logprobs"]["token_logprobs"], abs=1e-5)
    for c in content:
        assert len(c["top_logprobs"]) == 2
        assert c["top_logprobs"][0]["logprob"] >= c["top_logprobs"][1]["logprob"]
    assert body["usage"] == {**body["usage"], "prompt_tokens": len(prompt), "completion_tokens": MAX_TOKENS,
                             "total_tokens": len(prompt) + MAX_TOKENS}

    # the same request streamed: the same ids, each chunk with its own ids' logprobs
    chunks = _stream(tiny_server, {"token_ids": prompt, "sampling_params": params,
                                   "stream_options": {"include_usage": True}})
    *steps, last = chunks
    assert {c["request_id"] for c in chunks} == {chunks[0]["request_id"]}
    assert [t for c in steps for t in c["choices"][0]["token_ids"]] == choice["token_ids"]
    for c in steps:
        (ch,) = c["choices"]
        assert len(ch["logprobs"]["content"]) == len(ch["token_ids"])
    assert [c["choices"][0]["finish_reason"] for c in steps] == [None] * (len(steps) - 1) + ["length"]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == MAX_TOKENS


def test_a_stop_ends_with_its_token_returned(tiny_server):
    prompt = _ids(tiny_server, "hello world")
    base = {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    greedy = _ok(tiny_server, {"token_ids": prompt, "sampling_params": base})["choices"][0]["token_ids"]

    # a stop token: returned last, and named by stop_reason
    stop_id = greedy[2]
    first = greedy.index(stop_id)
    body = _ok(tiny_server, {"token_ids": prompt, "sampling_params": {**base, "stop_token_ids": [stop_id],
                                                                      "logprobs": 0}})
    (choice,) = body["choices"]
    assert choice["token_ids"] == greedy[:first + 1]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop_id)
    assert len(choice["logprobs"]["content"]) == first + 1

    # a stop string: the token that completes it is the last one returned, with its logprobs
    r = httpx.post(tiny_server.url + "/detokenize", json={"model": "tiny", "tokens": greedy[3:5]}, timeout=60)
    stop = r.json()["prompt"].strip()
    if not stop:
        pytest.skip("the tiny model's 4th and 5th tokens have no visible text")
    for streamed in (False, True):
        request = {"token_ids": prompt, "sampling_params": {**base, "stop": [stop], "logprobs": 1}}
        if streamed:
            steps = [c for c in _stream(tiny_server, request) if c["choices"]]
            ids = [t for c in steps for t in c["choices"][0]["token_ids"]]
            lps = [lp for c in steps for lp in c["choices"][0]["logprobs"]["content"]]
            finish, reason = steps[-1]["choices"][0]["finish_reason"], steps[-1]["choices"][0]["stop_reason"]
        else:
            (choice,) = _ok(tiny_server, request)["choices"]
            ids, lps = choice["token_ids"], choice["logprobs"]["content"]
            finish, reason = choice["finish_reason"], choice["stop_reason"]
        assert (finish, reason) == ("stop", stop)
        assert ids == greedy[:len(ids)] and len(ids) <= 5
        assert [lp["token"] for lp in lps] == [f"token_id:{t}" for t in ids]


def test_n_choices_and_seeds(tiny_server):
    prompt = _ids(tiny_server, "a b c")
    params = {"temperature": 1.0, "seed": 5, "n": 3, "max_tokens": 4, "ignore_eos": True}
    one = _ok(tiny_server, {"token_ids": prompt, "sampling_params": params})
    two = _ok(tiny_server, {"token_ids": prompt, "sampling_params": params})
    assert [c["index"] for c in one["choices"]] == [0, 1, 2]
    assert [c["token_ids"] for c in one["choices"]] == [c["token_ids"] for c in two["choices"]]
    assert one["usage"]["completion_tokens"] == 12


def test_errors_and_ignored_fields_in_this_routes_terms(tiny_server):
    cases = [
        ({"sampling_params": {}}, "token_ids"),
        ({"token_ids": [1, 2]}, "sampling_params"),
        ({"token_ids": [1, 10**9], "sampling_params": {}}, "token_ids[1]"),
        # one prompt of ids: no text, no batch of prompts
        ({"token_ids": ["a"], "sampling_params": {}}, "token_ids[0]"),
        ({"token_ids": [1, [2, 3]], "sampling_params": {}}, "token_ids[1]"),
        ({"token_ids": [1, 2], "sampling_params": {"prompt_logprobs": -1}}, "sampling_params.prompt_logprobs"),
        ({"token_ids": [1, 2], "sampling_params": {"top_p": 2}}, "sampling_params.top_p"),
        ({"token_ids": [1, 2], "sampling_params": {"logprobs": 100}}, "sampling_params.logprobs"),
        ({"token_ids": [1, 2], "sampling_params": {"max_tokens": 10**6}}, "sampling_params.max_tokens"),
    ]
    for body, param in cases:
        r = _generate(tiny_server, body)
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        assert error["param"] == param, (body, error)
        assert error["type"] == "invalid_request_error"
        assert "`prompt" not in error["message"], error
    r = _generate(tiny_server, {"model": "nope", "token_ids": [1, 2], "sampling_params": {}})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"

    r = _generate(tiny_server, {"token_ids": [1, 2], "kv_transfer_params": {"x": 1},
                                "sampling_params": {"max_tokens": 1, "detokenize": False, "echo": True}})
    assert r.status_code == 200, r.text
    assert r.headers["llmserve-ignored-fields"] == "kv_transfer_params, sampling_params.detokenize, sampling_params.echo"
    # the server kept serving
    assert _ok(tiny_server, {"token_ids": [1, 2], "sampling_params": {"max_tokens": 1}})["choices"][0]["token_ids"]
