"""The contract's error table over HTTP on the tiny model: the exact body shape, `type`,
`code` and `param` of every 4xx a request can earn before generation.

(503 while loading/draining, the queue-full 503 and the engine-failure rows are tested in
test_contract_lifecycle.py and test_contract_queue.py.)
"""

from __future__ import annotations

import gzip
import json
import re
import socket
import zlib

import httpx
import openai
import pytest

MSG = [{"role": "user", "content": "x"}]


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


def _post(server, path, body) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=30)


CHAT_400 = [
    ({"messages": MSG}, "missing_required_parameter", "model"),
    ({"model": "tiny"}, "missing_required_parameter", "messages"),
    ({"model": "tiny", "messages": []}, "invalid_value", "messages"),
    ({"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, "invalid_value", "messages[0].role"),
    ({"model": "tiny", "messages": [{"role": "user"}]}, "missing_required_parameter", "messages[0].content"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": 5}]},
     "invalid_type", "messages[1].content"),
    ({"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "unsupported_parameter", "messages[0].content[0].type"),
    ({"model": "tiny", "messages": MSG, "n": 0}, "invalid_value", "n"),
    ({"model": "tiny", "messages": MSG, "n": "two"}, "invalid_type", "n"),
    ({"model": "tiny", "messages": MSG, "max_tokens": 0}, "invalid_value", "max_tokens"),
    ({"model": "tiny", "messages": MSG, "max_completion_tokens": -1}, "invalid_value", "max_completion_tokens"),
    ({"model": "tiny", "messages": MSG, "temperature": 2.5}, "invalid_value", "temperature"),
    ({"model": "tiny", "messages": MSG, "stop": ["a", ""]}, "invalid_value", "stop[1]"),
    ({"model": "tiny", "messages": MSG, "stop": 3}, "invalid_type", "stop"),
    ({"model": "tiny", "messages": MSG, "stop_token_ids": [99999]}, "invalid_value", "stop_token_ids[0]"),
    ({"model": "tiny", "messages": MSG, "seed": "abc"}, "invalid_type", "seed"),
    ({"model": "tiny", "messages": MSG, "stream_options": {"include_usage": True}}, "invalid_value",
     "stream_options"),
    ({"model": "tiny", "messages": MSG, "tools": []}, "invalid_value", "tools"),
    ({"model": "tiny", "messages": MSG, "tool_choice": "auto"}, "invalid_value", "tool_choice"),
    ({"model": "tiny", "messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "invalid_value",
     "tool_choice.function.name"),
    ({"model": "tiny", "messages": MSG, "tools": [{"type": "function", "function": {"name": "f",
                                                                                     "parameters": 3}}]},
     "invalid_type", "tools[0].function.parameters"),
    ({"model": "tiny", "messages": MSG, "response_format": {"type": "xml"}}, "invalid_value",
     "response_format.type"),
    ({"model": "tiny", "messages": MSG, "chat_template": "{{ x }}"}, "unsupported_parameter", "chat_template"),
    ({"model": "tiny", "messages": MSG, "min_tokens": 5, "max_tokens": 2}, "invalid_value", "min_tokens"),
    ({"model": "tiny", "messages": MSG, "add_generation_prompt": True, "continue_final_message": True},
     "invalid_value", "continue_final_message"),
    # as at OpenAI, tool results answer the calls right before them, each call once
    ({"model": "tiny", "messages": [*MSG, {"role": "tool", "tool_call_id": "c1", "content": "r"}]},
     "invalid_value", "messages[1].role"),
    ({"model": "tiny", "messages": [*MSG, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}, *MSG]},
     "invalid_value", "messages[1].tool_calls[0]"),
]

COMPLETION_400 = [
    ({"model": "tiny"}, "missing_required_parameter", "prompt"),
    ({"model": "tiny", "prompt": ""}, "invalid_value", "prompt"),
    ({"model": "tiny", "prompt": ["ok", ""]}, "invalid_value", "prompt[1]"),
    ({"model": "tiny", "prompt": [[1, 2], [3, -1]]}, "invalid_value", "prompt[1][1]"),
    ({"model": "tiny", "prompt": [1, 99999]}, "invalid_value", "prompt[1]"),
    ({"model": "tiny", "prompt": {"a": 1}}, "invalid_type", "prompt"),
    ({"model": "tiny", "prompt": "x", "suffix": "y"}, "unsupported_parameter", "suffix"),
    ({"model": "tiny", "prompt": "x", "best_of": 3, "n": 4}, "invalid_value", "best_of"),
    ({"model": "tiny", "prompt": "x", "best_of": 3, "stream": True}, "invalid_value", "best_of"),
    ({"model": "tiny", "prompt": "x", "logprobs": 30}, "invalid_value", "logprobs"),
]


@pytest.mark.parametrize("body,code,param", CHAT_400, ids=[c[2] for c in CHAT_400])
def test_chat_400_names_param(tiny_server, body, code, param):
    err = _error(_post(tiny_server, "/v1/chat/completions", body), 400)
    assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", code, param)


@pytest.mark.parametrize("body,code,param", COMPLETION_400, ids=[c[2] for c in COMPLETION_400])
def test_completion_400_names_param(tiny_server, body, code, param):
    err = _error(_post(tiny_server, "/v1/completions", body), 400)
    assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", code, param)


def test_malformed_and_non_object_bodies(tiny_server):
    for raw, code in ((b"{not json", "invalid_json"), (b"[1, 2]", "invalid_type")):
        for path in ("/v1/chat/completions", "/v1/completions"):
            r = httpx.post(tiny_server.url + path, content=raw, headers={"content-type": "application/json"})
            err = _error(r, 400)
            assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", code, "body")


def test_a_body_declared_as_not_json_is_refused(tiny_server):
    """A browser page can POST text/plain or a form to localhost without a CORS preflight;
    JSON is read only when the request says JSON (or says nothing, but from a web page), as
    vLLM does."""
    body = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 1})
    for path in ("/v1/completions", "/tokenize"):
        for ctype in ("text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                      "multipart/form-data; boundary=x"):
            err = _error(httpx.post(tiny_server.url + path, content=body, headers={"content-type": ctype}), 400)
            assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", "unsupported_media_type", None)
            assert "application/json" in err["message"]
        for ctype in ("application/json; charset=utf-8", "Application/JSON", "application/vnd.api+json", None):
            headers = {"content-type": ctype} if ctype else {}
            r = httpx.post(tiny_server.url + path, content=body, headers=headers)
            assert r.status_code == 200, (ctype, r.text)
        # a web page may send raw bytes with no Content-Type and no preflight: its Origin shows it
        err = _error(httpx.post(tiny_server.url + path, content=body, headers={"origin": "https://a.example"}), 400)
        assert (err["code"], err["param"]) == ("unsupported_media_type", None)
        r = httpx.post(tiny_server.url + path, content=body,
                       headers={"origin": "https://a.example", "content-type": "application/json"})
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": MSG}),
    ("/v1/completions", {"prompt": "x"}),
    ("/v1/chat/completions/render", {"messages": MSG}),
    ("/v1/completions/render", {"prompt": "x"}),
    ("/tokenize", {"prompt": "x"}),
    ("/detokenize", {"tokens": [5]}),
])
def test_unknown_model_is_404_everywhere(tiny_server, path, body):
    for model in ("nope", "tiny:my-lora", "tiny/alias"):
        err = _error(_post(tiny_server, path, {"model": model, **body}), 404)
        assert (err["type"], err["code"], err["param"]) == ("not_found_error", "model_not_found", "model")
        assert model in err["message"]


def test_unknown_model_via_sdk_and_models_route(tiny_server):
    with openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="x", max_retries=0) as c:
        with pytest.raises(openai.NotFoundError) as e:
            c.chat.completions.create(model="tiny-lora", messages=MSG)
        assert e.value.body["code"] == "model_not_found"
        # errors are named too (the SDK's error.request_id): the client's id, else a fresh one
        assert re.fullmatch(r"req_[0-9a-f]{32}", e.value.request_id)
        with pytest.raises(openai.NotFoundError) as e:
            c.chat.completions.create(model="tiny-lora", messages=MSG, extra_headers={"x-request-id": "mine-7"})
        assert e.value.request_id == "mine-7"
    err = _error(httpx.get(tiny_server.url + "/v1/models/nope"), 404)
    assert err["code"] == "model_not_found"
    r = httpx.get(tiny_server.url + "/v2/nothing")
    assert _error(r, 404)["type"] == "not_found_error" and r.headers["x-request-id"].startswith("req_")
    r = httpx.get(tiny_server.url + "/v1/completions")
    assert _error(r, 405) and r.headers["allow"] == "POST" and r.headers["x-request-id"].startswith("req_")


def _numbers(text: str) -> set[int]:
    return {int(n) for n in re.findall(r"\d+", text)}


def test_context_length_exceeded_names_counts_and_limit(tiny_server):
    rendered = _post(tiny_server, "/v1/completions/render", {"model": "tiny", "prompt": "Hello world"}).json()
    n_prompt = len(rendered["prompts"][0]["prompt_token_ids"])
    for field in ("max_tokens", "max_completion_tokens"):
        err = _error(_post(tiny_server, "/v1/completions", {"model": "tiny", "prompt": "Hello world", field: 510}),
                     400)
        assert (err["code"], err["param"], err["type"]) == ("context_length_exceeded", field, "invalid_request_error")
        assert {n_prompt, 510, n_prompt + 510, 512} <= _numbers(err["message"])
    chat_ids = _post(tiny_server, "/v1/chat/completions/render", {"model": "tiny", "messages": MSG}).json()
    n_chat = len(chat_ids["prompt_token_ids"])
    err = _error(_post(tiny_server, "/v1/chat/completions", {"model": "tiny", "messages": MSG, "max_tokens": 505}),
                 400)
    assert err["code"] == "context_length_exceeded"
    assert {n_chat, 505, 512} <= _numbers(err["message"])
    # Exactly at the limit is fine.
    ok = _post(tiny_server, "/v1/completions", {"model": "tiny", "prompt": "Hello world",
                                                "max_tokens": 512 - n_prompt, "ignore_eos": True,
                                                "logit_bias": {"2": 100}})
    assert ok.status_code == 200, ok.text


def test_prompt_alone_over_the_context(tiny_server):
    long_ids = [5] * 600
    err = _error(_post(tiny_server, "/v1/completions", {"model": "tiny", "prompt": long_ids}), 400)
    assert (err["code"], err["param"]) == ("context_length_exceeded", "prompt")
    assert {600, 512} <= _numbers(err["message"])
    err = _error(_post(tiny_server, "/v1/completions", {"model": "tiny", "prompt": [[5, 6], long_ids]}), 400)
    assert (err["code"], err["param"]) == ("context_length_exceeded", "prompt[1]")
    # Exactly max_model_len prompt tokens leave no room for one token.
    err = _error(_post(tiny_server, "/v1/completions", {"model": "tiny", "prompt": [5] * 512}), 400)
    assert err["code"] == "context_length_exceeded"
    err = _error(_post(tiny_server, "/v1/chat/completions", {"model": "tiny", "messages": [
        {"role": "user", "content": "Hello world " * 400}]}), 400)
    assert (err["code"], err["param"]) == ("context_length_exceeded", "messages")


def test_body_over_limit_is_413_on_both_routes(tiny_server):
    big = b'{"model": "tiny", "prompt": "' + b"x" * (9 * 1024 * 1024) + b'"}'
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        err = _error(httpx.post(tiny_server.url + path, content=big,
                                headers={"content-type": "application/json"}, timeout=60), 413)
        assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", "request_too_large", None)


def _answer_then_eof(url: str, request: bytes) -> tuple[bytes, bool]:
    """A raw request's answer, and whether the server then closed the connection while the
    client still had its (declared) body to send."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(request)
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += s.recv(65536)
        try:
            for _ in range(1000):           # (up to ~64 MB of the 100 GB declared)
                s.sendall(b"x" * 65536)
        except OSError:
            return answer, True
        return answer, False


def test_a_refused_body_closes_its_connection(tiny_server):
    """A 413 for a declared length over the limit is sent before the body is read; declared
    far over it (8x), the connection is then closed, so a client that keeps sending is not read
    on and on. A little over it, the body is read to its end and the connection kept: the SDK
    gets its 413 every time, where a connection closed while it still writes can cost it the
    answer (a reset)."""
    answer, closed = _answer_then_eof(tiny_server.url, b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"
                                      b"content-type: application/json\r\ncontent-length: 100000000000\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 413") and b"connection: close" in answer.lower(), answer
    assert closed
    with openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="x", max_retries=0) as client:
        for _ in range(5):
            client.completions.create(model="tiny", prompt="hi", max_tokens=1)
            with pytest.raises(openai.APIStatusError) as e:
                client.completions.create(model="tiny", prompt="x" * (9 * 1024 * 1024), max_tokens=1)
            assert e.value.status_code == 413


def test_compressed_bodies_are_decoded_and_bounded_after_decoding(tiny_server):
    """Content-Encoding gzip and deflate (zlib-wrapped, or raw as some clients send it) are
    undone; other codings and corrupt data are a 400 that says so; --max-body-bytes (8 MiB
    here) bounds the decoded size, so a 9 MiB body that compresses to a few KiB is a 413."""
    body = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 1}).encode()
    raw = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    encoded = {"gzip": gzip.compress(body), "deflate": zlib.compress(body),
               "Deflate": raw.compress(body) + raw.flush(), "identity, gzip": gzip.compress(body),
               "gzip, gzip": gzip.compress(gzip.compress(body)),
               # two members (as streaming writers emit), then zero padding
               "GZIP": gzip.compress(body[:9]) + gzip.compress(body[9:]) + bytes(16)}
    for coding, data in encoded.items():
        r = httpx.post(tiny_server.url + "/v1/completions", content=data,
                       headers={"content-type": "application/json", "content-encoding": coding})
        assert r.status_code == 200, (coding, r.text)
        assert r.json()["usage"]["prompt_tokens"] >= 1
    # several Content-Encoding field lines are one list
    r = httpx.post(tiny_server.url + "/v1/completions", content=gzip.compress(gzip.compress(body)),
                   headers=[("content-type", "application/json"), ("content-encoding", "gzip"),
                            ("content-encoding", "gzip")])
    assert r.status_code == 200, r.text
    for coding, data, code in (("br", body, "unsupported_media_type"),
                               ("gzip", body, "invalid_value"),
                               ("gzip", gzip.compress(body)[:-6], "invalid_value")):
        err = _error(httpx.post(tiny_server.url + "/v1/completions", content=data,
                                headers={"content-type": "application/json", "content-encoding": coding}), 400)
        assert err["code"] == code and coding in err["message"]
        # corrupt data is the body's fault, as malformed JSON is
        assert err["param"] == (None if code == "unsupported_media_type" else "body")
    bomb = gzip.compress(b'{"model": "tiny", "prompt": "' + b"x" * (9 * 1024 * 1024) + b'"}')
    assert len(bomb) < 64 * 1024
    err = _error(httpx.post(tiny_server.url + "/tokenize", content=bomb,
                            headers={"content-type": "application/json", "content-encoding": "gzip"}), 413)
    assert err["code"] == "request_too_large"
    # the work is bounded too: at most two codings (each may inflate to the limit), and at most
    # 4096 gzip members, which inflate in time proportional to the body (it was its square)
    err = _error(httpx.post(tiny_server.url + "/v1/completions", content=gzip.compress(gzip.compress(body)),
                            headers={"content-type": "application/json", "content-encoding": "gzip, gzip, gzip"}),
                 400)
    assert err["code"] == "unsupported_media_type" and "at most 2" in err["message"]
    for members, status in ((4000, 200), (200_000, 400)):
        data = gzip.compress(body, mtime=0) + gzip.compress(b"", mtime=0) * members
        r = httpx.post(tiny_server.url + "/v1/completions", content=data, timeout=60,
                       headers={"content-type": "application/json", "content-encoding": "gzip"})
        assert r.status_code == status, r.text
    assert "more than 4096 gzip members" in r.json()["error"]["message"]
