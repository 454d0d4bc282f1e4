"""API keys: several keys, LLMSERVE_API_KEY, `x-api-key`, 401 in the OpenAI shape, open probes;
admin routes behind keys of their own."""

from __future__ import annotations

import asyncio
import socket

import httpx
import openai
import pytest

from server import ServerProcess


@pytest.fixture(scope="module")
def keyed_server(tiny_model):
    server = ServerProcess(str(tiny_model), "--served-model-name", "tiny", "--api-key", "k1",
                           "--num-kv-blocks", "64", "--allowed-origins", "https://app.example",
                           "--admin-api-key", "a1",
                           env={"LLMSERVE_API_KEY": "ignored-when-flag-given"})
    yield server
    server.stop()


@pytest.fixture(scope="module")
def env_keyed_server(tiny_model):
    server = ServerProcess(str(tiny_model), "--served-model-name", "tiny", "--num-kv-blocks", "64",
                           env={"LLMSERVE_API_KEY": "e1, e2", "LLMSERVE_ADMIN_API_KEY": "a2"})
    yield server
    server.stop()


def test_missing_and_wrong_key_are_401(keyed_server):
    r = httpx.get(keyed_server.url + "/v1/models")
    assert r.status_code == 401
    err = r.json()["error"]
    assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"
    with openai.OpenAI(base_url=keyed_server.url + "/v1", api_key="wrong", max_retries=0) as c:
        with pytest.raises(openai.AuthenticationError) as e:
            c.models.list()
        assert e.value.request_id.startswith("req_")
    with openai.OpenAI(base_url=keyed_server.url + "/v1", api_key="k1", max_retries=0) as c:
        assert [m.id for m in c.models.list().data] == ["tiny"]


def test_a_401_before_the_body_closes_the_connection(keyed_server):
    """Without a key the body is never read: declared far longer than --max-body-bytes, the
    connection is closed after the 401, so a keyless client cannot make the server read (and
    drop) all it sends; a shorter body is read to its end and the connection kept."""
    host, port = keyed_server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: 100000000000\r\n\r\n")
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += s.recv(65536)
        assert answer.startswith(b"HTTP/1.1 401") and b"connection: close" in answer.lower(), answer
        with pytest.raises(OSError):
            for _ in range(1000):
                s.sendall(b"x" * 65536)
    # (a request without a body, or with one within the limit, keeps its connection)
    r = httpx.get(keyed_server.url + "/v1/models")
    assert r.status_code == 401 and "connection" not in r.headers
    r = httpx.post(keyed_server.url + "/v1/completions", content=b"x" * 1_000_000)
    assert r.status_code == 401 and "connection" not in r.headers


def test_x_api_key_is_a_key_too(keyed_server):
    """Anthropic's clients send the key as `x-api-key`: it opens every route, as a Bearer key
    does; a wrong one (or a right one under another scheme) is still a 401."""
    assert httpx.get(keyed_server.url + "/v1/models", headers={"x-api-key": "k1"}).status_code == 200
    assert httpx.get(keyed_server.url + "/v1/models", headers={"x-api-key": "k2"}).status_code == 401
    assert httpx.get(keyed_server.url + "/v1/models", headers={"authorization": "Basic k1"}).status_code == 401
    # either header may carry it when both are sent
    both = {"x-api-key": "k1", "authorization": "Bearer wrong"}
    assert httpx.get(keyed_server.url + "/v1/models", headers=both).status_code == 200
    # on the Messages routes, the 401 has Anthropic's shape
    r = httpx.post(keyed_server.url + "/v1/messages", json={}, headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "authentication_error"


def test_probes_stay_open(keyed_server):
    for path in ("/health", "/ping", "/ready", "/metrics"):
        assert httpx.get(keyed_server.url + path).status_code == 200, path
        # with a trailing slash: the open path, answered as such (not redirected)
        assert httpx.get(keyed_server.url + path + "/").status_code == 200, path
    assert httpx.post(keyed_server.url + "/ping").json() == {"status": "ok"}   # (vLLM's, SageMaker's probe)
    assert httpx.get(keyed_server.url + "/load").status_code == 401
    assert httpx.get(keyed_server.url + "/load/").status_code == 401


def test_env_keys_comma_separated(env_keyed_server):
    for key in ("e1", "e2"):
        r = httpx.get(env_keyed_server.url + "/v1/models", headers={"authorization": f"Bearer {key}"})
        assert r.status_code == 200
    assert httpx.get(env_keyed_server.url + "/v1/models",
                     headers={"authorization": "Bearer e3"}).status_code == 401


def _cached(server, key: str) -> int:
    prompt = list(range(5, 45))   # two full blocks of 16 a later prompt can find
    r = httpx.post(server.url + "/v1/completions", headers={"authorization": f"Bearer {key}"}, timeout=60,
                   json={"model": "tiny", "prompt": prompt, "max_tokens": 1})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_admin_routes_open_to_their_own_keys_alone(keyed_server, env_keyed_server, tiny_server):
    url = keyed_server.url + "/reset_prefix_cache"
    for headers in ({}, {"authorization": "Bearer k1"}, {"x-api-key": "k1"}, {"authorization": "Bearer a2"}):
        r = httpx.post(url, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", headers
        assert httpx.post(url + "/", headers=headers).status_code == 401, headers
    # an admin key opens no API route
    assert httpx.get(keyed_server.url + "/v1/models", headers={"authorization": "Bearer a1"}).status_code == 401
    _cached(keyed_server, "k1")
    assert _cached(keyed_server, "k1") == 32
    r = httpx.post(url, headers={"authorization": "Bearer a1"})
    assert r.status_code == 200 and r.json()["reset"] is True and r.json()["cached_blocks"] >= 2, r.text
    assert _cached(keyed_server, "k1") == 0, "the reset cache holds nothing"
    assert _cached(keyed_server, "k1") == 32
    # LLMSERVE_ADMIN_API_KEY; without any admin key the route does not exist
    r = httpx.post(env_keyed_server.url + "/reset_prefix_cache", headers={"x-api-key": "a2"})
    assert r.status_code == 200, r.text
    assert httpx.post(env_keyed_server.url + "/reset_prefix_cache",
                      headers={"x-api-key": "e1"}).status_code == 401
    assert httpx.post(tiny_server.url + "/reset_prefix_cache").status_code == 404


def test_allowed_origins_get_cors_and_a_keyless_preflight(keyed_server, env_keyed_server):
    """--allowed-origins: a browser's preflight (no key) is answered for those origins only,
    and their pages may read the answers and llmserve's headers; without the flag no CORS
    header is sent (browsers keep other origins' pages out)."""
    page = "https://app.example"
    preflight = {"origin": page, "access-control-request-method": "POST",
                 "access-control-request-headers": "authorization, content-type"}
    r = httpx.options(keyed_server.url + "/v1/chat/completions", headers=preflight)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == page
    assert "POST" in r.headers["access-control-allow-methods"]
    other = httpx.options(keyed_server.url + "/v1/chat/completions", headers={**preflight, "origin": "https://evil.example"})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    # (in the OpenAI error shape, saying what was refused)
    assert other.headers["content-type"] == "application/json"
    err = other.json()["error"]
    assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", "cors_refused", None)
    assert err["message"].startswith("Disallowed CORS origin"), err
    r = httpx.post(keyed_server.url + "/v1/completions", headers={"origin": page, "authorization": "Bearer k1"},
                   json={"model": "tiny", "prompt": "x", "max_tokens": 1, "store": True})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == page
    exposed = {h.strip() for h in r.headers["access-control-expose-headers"].split(",")}
    assert {"llmserve-ignored-fields", "llmserve-unused-template-kwargs", "llmserve-chat-template",
            "x-request-id", "retry-after"} <= exposed, exposed
    # the key is still required on the request itself
    assert httpx.get(keyed_server.url + "/v1/models", headers={"origin": page}).status_code == 401
    r = httpx.get(env_keyed_server.url + "/v1/models", headers={"origin": page, "authorization": "Bearer e1"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_cors_methods_headers_and_credentials_are_vllms_flags():
    """--allowed-methods, --allowed-headers, --allow-credentials (vLLM's): what a preflight
    answers; by default llmserve's own methods (GET, POST, DELETE) and any header, without
    credentials. Answered in process: a preflight never reaches the engine (nothing loads)."""
    import asyncio

    from llmserve.config import Config, ServerConfig
    from llmserve.server.app import create_app

    page = "https://app.example"

    async def preflight(**server) -> httpx.Response:
        app = create_app(Config(server=ServerConfig(allowed_origins=(page,), access_log=False, **server)))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.options("/v1/responses/r1", headers={
                "origin": page, "access-control-request-method": "DELETE",
                "access-control-request-headers": "x-custom"})

    r = asyncio.run(preflight())
    assert r.status_code == 200 and {"GET", "POST", "DELETE"} <= set(r.headers["access-control-allow-methods"].split(", "))
    assert "access-control-allow-credentials" not in r.headers
    r = asyncio.run(preflight(allowed_methods=("GET",), allowed_headers=("x-other",), allow_credentials=True))
    assert r.status_code == 400   # DELETE and x-custom are not allowed now
    r = asyncio.run(preflight(allowed_methods=("*",), allowed_headers=("x-custom",), allow_credentials=True))
    assert r.status_code == 200 and r.headers["access-control-allow-credentials"] == "true"


@pytest.mark.parametrize("admin_keys", [(), ("a1",)])
def test_runtime_lora_routes_take_the_admin_keys_when_there_are_some(admin_keys):
    # They read any folder the server can see: with --admin-api-key only an admin key opens
    # them; without one, the API keys do, as vLLM's do.
    from llmserve.server.middleware import ApiKeyMiddleware

    async def served(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    app = ApiKeyMiddleware(served, keys=("k1",), admin_keys=admin_keys)
    opens, shut = ("a1", "k1") if admin_keys else ("k1", "a1")

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://llmserve.test") as c:
            for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
                r = await c.post(path, json={}, headers={"authorization": f"Bearer {opens}"})
                assert r.status_code == 200, (path, r.text)
                r = await c.post(path, json={}, headers={"authorization": f"Bearer {shut}"})
                assert r.status_code == 401, (path, r.text)
            # the API itself stays behind the API keys alone
            assert (await c.get("/v1/models", headers={"authorization": "Bearer a1"})).status_code == 401
            assert (await c.get("/v1/models", headers={"authorization": "Bearer k1"})).status_code == 200

    asyncio.run(main())
