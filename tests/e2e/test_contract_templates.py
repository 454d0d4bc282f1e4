"""Chat templates and field reporting: the `llmserve-chat-template` header, unused
`chat_template_kwargs`, add_generation_prompt / continue_final_message, content as a string
or text parts (and `--chat-template-content-format` overriding the detected shape), a model
without a template, `llmserve-ignored-fields` and `--strict-fields`,
and constant-time API-key comparison.

Template and field behaviour goes over HTTP to the shared tiny server; the configurations
that need their own engine (no template, strict fields, a content format) run in process
through `create_app`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil

import httpx
import pytest

from llmserve.config import CacheConfig, Config, DeviceConfig, ModelConfig, SchedulerConfig, ServerConfig
from llmserve.engine.async_engine import AsyncEngine
from llmserve.server import middleware
from llmserve.server.app import create_app
from tiny import CHATML

MSG = [{"role": "user", "content": "Hello"}]


def _post(server, path, body) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": "tiny", **body}, timeout=30)


def _render(server, **body) -> dict:
    r = _post(server, "/v1/chat/completions/render", body)
    assert r.status_code == 200, r.text
    return r.json()


def test_template_header_names_source_and_hash(tiny_server):
    r = _post(tiny_server, "/v1/chat/completions", {"messages": MSG, "max_tokens": 2})
    assert r.status_code == 200
    origin, digest = r.headers["llmserve-chat-template"].split(" ")
    assert origin == "tokenizer_config.json"
    assert digest == "sha256:" + hashlib.sha256(CHATML.encode()).hexdigest()[:16]
    rendered = _render(tiny_server, messages=MSG)
    assert rendered["template"] == {"origin": origin, "hash": digest}
    streamed = httpx.post(tiny_server.url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": MSG, "max_tokens": 2, "stream": True})
    assert streamed.headers["llmserve-chat-template"] == f"{origin} {digest}"
    # /tokenize renders messages through it too (a prompt, through none)
    counted = _post(tiny_server, "/tokenize", {"messages": MSG})
    assert counted.headers["llmserve-chat-template"] == f"{origin} {digest}"
    assert "llmserve-chat-template" not in _post(tiny_server, "/tokenize", {"prompt": "hi"}).headers


def test_unused_template_kwargs_are_reported(tiny_server):
    body = {"messages": MSG, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False, "zz": 1}}
    r = _post(tiny_server, "/v1/chat/completions", body)
    assert r.status_code == 200
    assert {k.strip() for k in r.headers["llmserve-unused-template-kwargs"].split(",")} == {"enable_thinking", "zz"}
    # each is a field accepted with no effect: the contract's header names it too
    ignored = {k.strip() for k in r.headers["llmserve-ignored-fields"].split(",")}
    assert ignored == {"chat_template_kwargs.enable_thinking", "chat_template_kwargs.zz"}
    rendered = _render(tiny_server, **body)
    assert sorted(rendered["unused_template_kwargs"]) == ["enable_thinking", "zz"]
    assert sorted(rendered["ignored_fields"]) == ["chat_template_kwargs.enable_thinking", "chat_template_kwargs.zz"]
    plain = _post(tiny_server, "/v1/chat/completions", {"messages": MSG, "max_tokens": 2})
    assert "llmserve-unused-template-kwargs" not in plain.headers
    assert "llmserve-ignored-fields" not in plain.headers


def test_generation_prompt_flags(tiny_server):
    default = _render(tiny_server, messages=MSG)["prompt"]
    assert default.endswith("<|im_start|>assistant\n")
    without = _render(tiny_server, messages=MSG, add_generation_prompt=False)["prompt"]
    assert without == default.removesuffix("<|im_start|>assistant\n")
    partial = MSG + [{"role": "assistant", "content": "The answer is"}]
    cont = _render(tiny_server, messages=partial, continue_final_message=True)["prompt"]
    assert cont.endswith("<|im_start|>assistant\nThe answer is")
    r = _post(tiny_server, "/v1/chat/completions", {"messages": partial, "continue_final_message": True,
                                                    "max_tokens": 2})
    assert r.status_code == 200
    both = _post(tiny_server, "/v1/chat/completions", {"messages": partial, "continue_final_message": True,
                                                       "add_generation_prompt": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"
    tok = _post(tiny_server, "/tokenize", {"messages": partial, "continue_final_message": True,
                                           "add_generation_prompt": True})
    assert tok.status_code == 400


def test_echo_starts_a_continued_message_with_its_text(tiny_server):
    """vLLM's chat `echo` with a continued final message: the reply's content is the whole
    message, its start as sent and then the generated rest; streamed, the same text."""
    from openai import OpenAI

    partial = MSG + [{"role": "assistant", "content": "The answer is"}]
    extra = {"continue_final_message": True, "add_generation_prompt": False}
    with OpenAI(base_url=tiny_server.url + "/v1", api_key="x", max_retries=0) as client:
        req = dict(model="tiny", messages=partial, max_tokens=6, temperature=0)
        plain = client.chat.completions.create(**req, extra_body=extra).choices[0].message.content
        echoed = client.chat.completions.create(**req, extra_body={**extra, "echo": True}).choices[0].message.content
        assert echoed == "The answer is" + plain
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            **req, stream=True, extra_body={**extra, "echo": True}) if c.choices)
        assert streamed == echoed
        # the last message is the user's: nothing to start with
        alone = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=6, temperature=0,
                                               extra_body={"echo": True}).choices[0].message.content
        assert alone == client.chat.completions.create(model="tiny", messages=MSG, max_tokens=6,
                                                       temperature=0).choices[0].message.content


def test_string_and_text_parts_render_alike(tiny_server):
    as_string = _render(tiny_server, messages=[{"role": "user", "content": "Hello there"}])
    as_parts = _render(tiny_server, messages=[{"role": "user", "content": [
        {"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]}])
    assert as_parts["prompt_token_ids"] == as_string["prompt_token_ids"]
    r = _post(tiny_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Hello there"}]}], "max_tokens": 2})
    assert r.status_code == 200
    assert r.json()["usage"]["prompt_tokens"] == len(as_string["prompt_token_ids"])
    tok = _post(tiny_server, "/tokenize", {"messages": [{"role": "user", "content": "Hello there"}]}).json()
    assert tok["tokens"] == as_string["prompt_token_ids"] and tok["count"] == len(tok["tokens"])


def test_ignored_fields_header_names_inert_and_unknown(tiny_server):
    body = {"prompt": "x", "max_tokens": 2, "service_tier": "priority", "store": True, "wibble": [1],
            "stream": True, "stream_options": {"include_usage": True, "flux": 1}, "user": "bob"}
    r = _post(tiny_server, "/v1/completions", body)
    assert r.status_code == 200
    assert {f.strip() for f in r.headers["llmserve-ignored-fields"].split(",")} == {
        "service_tier", "store", "wibble", "stream_options.flux"}
    clean = _post(tiny_server, "/v1/completions", {"prompt": "x", "max_tokens": 2, "top_k": 3, "min_p": 0.1,
                                                   "priority": 0, "request_id": "r-1", "cache_salt": "s"})
    assert "llmserve-ignored-fields" not in clean.headers
    assert clean.json()["id"] == clean.headers["x-request-id"] == "cmpl-r-1"
    traced = httpx.post(tiny_server.url + "/v1/chat/completions", timeout=60, headers={"x-request-id": "trace-9"},
                        json={"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1})
    assert traced.json()["id"] == traced.headers["x-request-id"] == "chatcmpl-trace-9"
    # the id goes back in a header: one a header cannot carry is a 400, and the server goes on
    for bad in ("a\r\nX-Evil: 1", "smile \U0001F600", "abc "):
        r = _post(tiny_server, "/v1/completions", {"prompt": "x", "max_tokens": 1, "request_id": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "request_id"
        assert "x-evil" not in r.headers
    assert _post(tiny_server, "/v1/completions", {"prompt": "x", "max_tokens": 1}).status_code == 200


# -- in process: a model without a template, and --strict-fields ----------------------------

@pytest.fixture(scope="module")
def untemplated_model(tiny_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-no-template")
    shutil.copytree(tiny_model, folder, dirs_exist_ok=True)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return folder


def _run(model, strict: bool, requests: list[tuple[str, dict]], **model_options) -> list[httpx.Response]:
    config = Config(model=ModelConfig(model=str(model), served_model_name=("tiny",), **model_options),
                    cache=CacheConfig(num_kv_blocks=64), scheduler=SchedulerConfig(max_num_seqs=2),
                    device=DeviceConfig(device="cpu", threads=1),
                    server=ServerConfig(access_log=False, strict_fields=strict))
    engine = AsyncEngine(config)

    async def main():
        await engine.start()
        try:
            transport = httpx.ASGITransport(app=create_app(engine=engine))
            async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as c:
                return [await c.post(path, json={"model": "tiny", **body}) for path, body in requests]
        finally:
            await engine.drain()

    return asyncio.run(main())


def test_model_without_template_is_400_naming_the_flag(untemplated_model):
    chat, render, tok, comp = _run(untemplated_model, False, [
        ("/v1/chat/completions", {"messages": MSG, "max_tokens": 2}),
        ("/v1/chat/completions/render", {"messages": MSG}),
        ("/tokenize", {"messages": MSG}),
        ("/v1/completions", {"prompt": "Hello", "max_tokens": 2}),
    ])
    for r in (chat, render, tok):
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and "--chat-template" in err["message"]
    assert comp.status_code == 200 and "llmserve-chat-template" not in comp.headers


def test_strict_fields_turns_ignored_fields_into_400(tiny_model):
    results = _run(tiny_model, True, [
        ("/v1/chat/completions", {"messages": MSG, "max_tokens": 2, "frobnicate": 1}),
        ("/v1/completions", {"prompt": "x", "max_tokens": 2, "store": True}),
        ("/v1/chat/completions", {"messages": MSG, "max_tokens": 2, "metadata": {"a": "b"}}),
        ("/v1/completions", {"prompt": "x", "max_tokens": 2, "user": "alice", "top_k": 2}),
    ])
    for r, param in zip(results[:3], ("frobnicate", "store", "metadata")):
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (err["code"], err["param"]) == ("unsupported_parameter", param)
    assert results[3].status_code == 200  # `user` is logged and extensions work: neither is ignored


def test_api_keys_compare_in_constant_time(monkeypatch):
    calls: list[tuple[bytes, bytes]] = []
    real = middleware.hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(middleware.hmac, "compare_digest", spy)
    mw = middleware.ApiKeyMiddleware(app=None, keys=("k1", "k2", "k3"), admin_keys=("a1", "a2"))
    scope = {"headers": [(b"authorization", b"Bearer k1")]}
    assert mw._authorized(scope, mw.keys)
    # Every key is compared, with compare_digest, even after the first one matched.
    assert calls == [(b"k1", b"k1"), (b"k1", b"k2"), (b"k1", b"k3")]
    calls.clear()
    assert not mw._authorized({"headers": [(b"authorization", b"Bearer k")]}, mw.keys)
    assert len(calls) == 3
    calls.clear()
    assert mw._authorized({"headers": [(b"x-api-key", b"a2")]}, mw.admin_keys)
    assert calls == [(b"a2", b"a1"), (b"a2", b"a2")]


def test_content_format_flag_overrides_the_detected_one(tiny_model, tiny_server):
    # The tiny template walks text parts (detected "openai"): parts render back to back.
    # Forced to "string", parts are joined with "\n" before the template sees them.
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}]
    detected = _render(tiny_server, messages=parts)["prompt"]
    assert "Hellothere" in detected
    (forced,) = _run(tiny_model, False, [("/v1/chat/completions/render", {"messages": parts})],
                     chat_template_content_format="string")
    assert forced.status_code == 200, forced.text
    assert "Hello\nthere" in forced.json()["prompt"]
