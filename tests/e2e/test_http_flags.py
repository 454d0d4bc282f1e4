"""vLLM's HTTP flags on `llmserve run`: `--ssl-certfile/--ssl-keyfile` serve the API over HTTPS
(with the official SDK), and a key that does not make a TLS context stops the server at once,
before the model loads, saying why; `--root-path` serves behind a proxy that strips it;
`--enable-log-requests` logs what each request asks for, `--max-log-len` bounding it, and
`--enable-log-outputs` what it answered; `--uds`
serves on a Unix socket; `--enable-request-id-headers` names every response. Also
`--kv-cache-dtype`, seen from outside: the SDK's requests and /metrics."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import time

import httpx
import pytest
from openai import OpenAI

from server import ServerProcess, free_port


@pytest.fixture(scope="module")
def cert(tmp_path_factory):
    """A self-signed certificate for 127.0.0.1 and its key."""
    folder = tmp_path_factory.mktemp("tls")
    key, crt = folder / "key.pem", folder / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                    "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key),
                    "-out", str(crt)], check=True, capture_output=True)
    return str(crt), str(key)


def test_the_api_is_served_over_https(tiny_model, cert):
    crt, key = cert
    server = ServerProcess(str(tiny_model), "--served-model-name", "tiny", "--ssl-certfile", crt,
                           "--ssl-keyfile", key, ca=crt)
    try:
        with OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0,
                    http_client=httpx.Client(verify=server.verify)) as client:
            out = client.completions.create(model="tiny", prompt="hello", max_tokens=3, temperature=0)
        assert out.usage.completion_tokens == 3
        with pytest.raises(httpx.HTTPError):          # (not plain HTTP on the same port)
            httpx.get(server.url.replace("https", "http") + "/health", timeout=5)
    finally:
        server.stop()


def test_a_key_that_is_not_the_certificates_stops_it_at_once(tiny_model, cert, tmp_path):
    crt, _ = cert
    other = tmp_path / "other.pem"
    subprocess.run(["openssl", "genrsa", "-out", str(other), "2048"], check=True, capture_output=True)
    done = subprocess.run([sys.executable, "-m", "llmserve.cli", "run", str(tiny_model), "--port", str(free_port()),
                           "--ssl-certfile", crt, "--ssl-keyfile", str(other)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "cannot serve HTTPS with --ssl-certfile" in done.stderr
    assert "engine ready" not in done.stderr


def test_root_path_serves_behind_a_proxy_that_strips_it(tiny_model):
    """As a proxy passes requests on (the prefix stripped, ASGI's root_path set): the routes and
    the paths open without a key are the same."""
    server = ServerProcess(str(tiny_model), "--served-model-name", "tiny", "--root-path", "/llm", "--api-key", "k")
    try:
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
        assert httpx.get(server.url + "/v1/models", timeout=30).status_code == 401
        models = httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer k"}, timeout=30)
        assert [m["id"] for m in models.json()["data"]] == ["tiny"]
    finally:
        server.stop()


def test_enable_log_requests_logs_each_prompt_and_its_parameters(tiny_model):
    # (and --disable-access-log-for-endpoints keeps the probes out of the access log)
    server = ServerProcess(str(tiny_model), "--served-model-name", "tiny", "--enable-log-requests",
                           "--max-log-len", "6", "--disable-access-log-for-endpoints", "/health,/metrics",
                           env={"LLMSERVE_LOG_LEVEL": "INFO"})
    try:
        with OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
            client.completions.create(model="tiny", prompt=["hello world", "bye"], max_tokens=2,
                                      temperature=0.5, extra_body={"request_id": "logme"})
            client.completions.create(model="tiny", prompt=[5, 6, 7, 8, 9, 10, 11, 12], max_tokens=1)
        for path in ("/health", "/metrics", "/health?probe=1", "/load", "/healthz"):
            httpx.get(server.url + path, timeout=10)
        # (a request's access line is written after its response is sent)
        deadline = time.monotonic() + 30
        while '"GET /healthz' not in server.logs():
            assert time.monotonic() < deadline, server.logs()
            time.sleep(0.05)
        logs = server.logs(whole=True)
    finally:
        server.stop()
    access = [line.split('"')[1] for line in logs.splitlines() if "llmserve.access" in line]
    # (the test harness polls /ready at start, once or more: a poll can come before the engine is up)
    polls = access.index("POST /v1/completions")
    assert polls >= 1 and set(access[:polls]) == {"GET /ready"}, access
    assert access[polls:] == ["POST /v1/completions", "POST /v1/completions", "GET /load", "GET /healthz"], access
    lines = [line for line in logs.splitlines() if "llmserve.requests" in line]
    assert len(lines) == 3, logs
    first, second, third = lines
    assert "Received request cmpl-logme-0: prompt: \"hello \"" in first       # (6 characters)
    assert "temperature: 0.5" in first and "max_tokens: Some(2)" in first
    assert "Received request cmpl-logme-1: prompt: \"bye\"" in second
    assert "prompt_token_ids: [5, 6, 7, 8, 9, 10]," in third                   # (6 ids)
    assert 'model: "tiny"' in third



def test_enable_log_outputs_logs_what_each_generation_answered(tiny_model):
    server = ServerProcess(str(tiny_model), "--served-model-name", "tiny", "--enable-log-requests",
                           "--enable-log-outputs", env={"LLMSERVE_LOG_LEVEL": "INFO"})
    try:
        with OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
            chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=3, n=2, temperature=1, seed=1,
                                                  extra_body={"request_id": "two", "ignore_eos": True})
            streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
                model="tiny", prompt="hello", max_tokens=4, temperature=0, stream=True,
                extra_body={"request_id": "flow", "ignore_eos": True}) if chunk.choices)
            client.embeddings.create(model="tiny", input="not a generation")
        logs = server.logs(whole=True)
    finally:
        server.stop()
    lines = [line.split("llmserve.requests: ", 1)[1] for line in logs.splitlines() if "Generated response" in line]
    assert lines == [
        *(f"Generated response chatcmpl-two-{i}: output: {c.message.content!r}, finish_reason: {c.finish_reason}, "
          f"completion_tokens: 3" for i, c in enumerate(chat.choices)),
        f"Generated response cmpl-flow: output: {streamed!r}, finish_reason: length, completion_tokens: 4",
    ], logs


def test_uds_serves_on_a_unix_socket_and_request_id_headers_name_every_response(tiny_model, tmp_path):
    path = str(tmp_path / "llm.sock")
    with socket.socket(socket.AF_UNIX) as stale:    # (a killed server's socket file: replaced)
        stale.bind(path)
    server = ServerProcess(str(tiny_model), "--served-model-name", "tiny", "--enable-request-id-headers", uds=path)
    try:
        assert stat.S_ISSOCK(os.stat(path).st_mode)
        with OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, http_client=server.http()) as client:
            raw = client.completions.with_raw_response.create(model="tiny", prompt="hello", max_tokens=3,
                                                               temperature=0)
            out = raw.parse()
            assert out.usage.completion_tokens == 3
            assert raw.headers["x-request-id"] == out.id              # a generation keeps its own id
            # ... unless the client named the request: then its id comes back as sent, as vLLM's
            # flag echoes it (the response id is built from it)
            raw = client.completions.with_raw_response.create(model="tiny", prompt="hello", max_tokens=1,
                                                               extra_headers={"X-Request-Id": "trace-9"})
            assert raw.headers.get_list("x-request-id") == ["trace-9"]
            assert raw.parse().id == "cmpl-trace-9"
        with server.http() as http:
            assert http.get("/v1/models", headers={"X-Request-Id": "trace-7"}).headers["x-request-id"] == "trace-7"
            fresh = http.get("/health").headers["x-request-id"]
            assert fresh and fresh != http.get("/health").headers["x-request-id"]
        # a second server on the same socket stops at once, saying why (and that --port does nothing)
        done = subprocess.run([sys.executable, "-m", "llmserve.cli", "run", str(tiny_model), "--uds", path,
                               "--port", "9123"], capture_output=True, text=True, timeout=60)
        assert done.returncode != 0 and f"another server listens on {path}" in done.stderr, done.stderr
        assert "--host/--port (127.0.0.1:9123) are not used" in done.stderr, done.stderr
        assert "engine ready" not in done.stderr
    finally:
        server.stop()
    assert not os.path.exists(path), "the socket file is removed at exit"


def test_kv_cache_dtype_fp8_serves_with_four_times_the_blocks(tiny_model):
    """`--kv-cache-dtype fp8` (vLLM's flag): the official SDK's requests are served from an fp8
    cache, streamed and not, and /metrics reports the dtype and 4x the blocks a float32 cache of
    the same --kv-cache-memory has (the tiny model is float32)."""
    def blocks_and_dtype(server):
        text = httpx.get(server.url + "/metrics", timeout=30).text
        line = next(x for x in text.splitlines() if x.startswith("llmserve:cache_config_info{"))
        labels = dict(kv.split("=", 1) for kv in line[line.index("{") + 1:line.index("}")].split(","))
        return int(labels["num_gpu_blocks"].strip('"')), labels["cache_dtype"].strip('"')

    counts = {}
    for dtype in ("auto", "fp8"):
        server = ServerProcess(str(tiny_model), "--served-model-name", "tiny", "--kv-cache-memory", "8MiB",
                               "--kv-cache-dtype", dtype)
        try:
            counts[dtype] = blocks_and_dtype(server)
            if dtype == "fp8":
                with OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
                    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                         max_tokens=5, temperature=0,
                                                         extra_body={"ignore_eos": True})
                    assert out.usage.completion_tokens == 5
                    stream = client.completions.create(model="tiny", prompt="hello " * 40, max_tokens=5, stream=True,
                                                       temperature=0, stream_options={"include_usage": True},
                                                       extra_body={"ignore_eos": True})
                    assert [c.usage.completion_tokens for c in stream if c.usage] == [5]
        finally:
            server.stop()
    assert counts["auto"][1] == "auto" and counts["fp8"][1] == "fp8"
    assert 0 <= counts["fp8"][0] - 4 * counts["auto"][0] < 4     # (each count is rounded down)
