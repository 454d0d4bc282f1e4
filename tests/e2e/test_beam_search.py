"""vLLM's beam search (`use_beam_search`) over HTTP on the tiny random model, checked against
an independent search written here the way vLLM's frontend runs it: one `max_tokens: 1`
completion per beam and step, whose top logprobs rank the candidates.
"""

from __future__ import annotations

import httpx
import openai
import pytest

EOS = 2  # <|im_end|> in tests/tiny.py


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": "tiny", **body}, timeout=120)


def _ok(server, path: str, body: dict) -> dict:
    r = _post(server, path, body)
    assert r.status_code == 200, r.text
    return r.json()


def _next_tokens(server, ids: list[int], k: int) -> list[tuple[int, float]]:
    """The k likeliest next tokens after `ids` with their logprobs, most likely first."""
    body = _ok(server, "/v1/completions", {
        "prompt": ids, "max_tokens": 1, "temperature": 0, "logprobs": k, "ignore_eos": True,
        "return_tokens_as_token_ids": True})
    top = body["choices"][0]["logprobs"]["top_logprobs"][0]
    pairs = [(int(t.removeprefix("token_id:")), lp) for t, lp in top.items()]
    return sorted(pairs, key=lambda p: -p[1])


def _reference(server, prompt: list[int], width: int, max_tokens: int, penalty: float) -> list[tuple[list[int], float]]:
    """vLLM's beam search: (output ids, score) of the best `width`, best first."""
    live = [([], 0.0)]
    done = []
    for step in range(max_tokens):
        candidates = []
        for out, cum in live:
            for t, lp in _next_tokens(server, prompt + out, 2 * width):
                if t == EOS:
                    done.append((out + [t], cum + lp, len(prompt) + len(out)))
                else:
                    candidates.append((out + [t], cum + lp))
        candidates.sort(key=lambda c: -c[1])
        live = candidates[:width]
    done += [(out, cum, len(prompt) + len(out)) for out, cum in live]
    ranked = sorted(done, key=lambda d: -d[1] / d[2] ** penalty)
    return [(out, cum / length ** penalty) for out, cum, length in ranked[:width]]


@pytest.mark.parametrize(("width", "max_tokens", "penalty"), [(3, 5, 1.0), (3, 5, 0.0), (2, 8, 2.0)])
def test_beams_are_those_of_an_independent_search(tiny_server, width, max_tokens, penalty):
    prompt = [5, 17, 33, 9, 61]
    body = _ok(tiny_server, "/v1/completions", {
        "prompt": prompt, "max_tokens": max_tokens, "n": width, "use_beam_search": True,
        "length_penalty": penalty, "return_token_ids": True, "logprobs": 1,
        "include_stop_str_in_output": True})
    want = _reference(tiny_server, prompt, width, max_tokens, penalty)
    got = [c["token_ids"] for c in body["choices"]]
    assert got == [out for out, _ in want]
    for choice, (out, _) in zip(body["choices"], want):
        assert choice["finish_reason"] == ("stop" if out[-1] == EOS else "length")
        assert len(choice["logprobs"]["token_logprobs"]) == len(out)
    assert body["usage"]["completion_tokens"] == sum(len(out) for out, _ in want)
    assert body["usage"]["prompt_tokens"] == len(prompt)


def test_chat_beams_stream_as_one_answer_and_match_the_body(tiny_server):
    request = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 6, "n": 2,
               "use_beam_search": True}
    body = _ok(tiny_server, "/v1/chat/completions", request)
    assert [c["index"] for c in body["choices"]] == [0, 1]
    with openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0) as client:
        stream = client.chat.completions.create(model="tiny", stream=True, **{
            k: v for k, v in request.items() if k != "use_beam_search"}, extra_body={"use_beam_search": True})
        texts = ["", ""]
        finishes = [None, None]
        for chunk in stream:
            for c in chunk.choices:
                texts[c.index] += c.delta.content or ""
                finishes[c.index] = c.finish_reason or finishes[c.index]
    assert texts == [c["message"]["content"] for c in body["choices"]]
    assert finishes == [c["finish_reason"] for c in body["choices"]]


def test_a_beam_search_leaves_no_block_behind(tiny_server):
    for _ in range(3):
        _ok(tiny_server, "/v1/completions", {"prompt": "a b c", "max_tokens": 8, "n": 4, "use_beam_search": True})
    load = httpx.get(tiny_server.url + "/load", timeout=10).json()
    assert (load["running"], load["waiting"], load["kv_blocks_used"], load["requests"]) == (0, 0, 0, 0)


def test_fields_beam_search_cannot_honour_are_refused(tiny_server):
    r = _post(tiny_server, "/v1/completions", {"prompt": "a", "use_beam_search": True, "logit_bias": {"5": 3}})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "logit_bias"
    r = _post(tiny_server, "/v1/completions", {"prompt": "a", "max_tokens": 2, "use_beam_search": True,
                                               "temperature": 0.5})
    assert r.status_code == 200
    assert r.headers["llmserve-ignored-fields"] == "temperature"


def test_a_prompt_only_request_ignores_the_search(tiny_server):
    body = _ok(tiny_server, "/v1/completions", {"prompt": "a b", "max_tokens": 0, "echo": True, "n": 2,
                                                "use_beam_search": True})
    assert [c["text"] for c in body["choices"]] == ["a b", "a b"]
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "length"]


def test_a_stop_string_cuts_a_beam_as_it_cuts_a_sample(tiny_server):
    request = {"prompt": [5, 17, 33, 9, 61], "max_tokens": 5, "n": 2, "use_beam_search": True}
    full = _ok(tiny_server, "/v1/completions", request)["choices"][0]["text"]
    stop = full[len(full) // 2:][:2]
    assert stop, full
    cut = _ok(tiny_server, "/v1/completions", {**request, "stop": [stop]})["choices"][0]
    assert cut["text"] == full[:full.index(stop)]
    assert cut["finish_reason"] == "stop"
