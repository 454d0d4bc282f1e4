"""`llmserve run`'s start-up failures, a stop during loading, and the 405 response.

A server that cannot load its model, or cannot bind its port, exits non-zero at once (a
supervisor or shell sees the failure) instead of listening forever with a dead engine. A
stop signal during a load ends the process without waiting for the load. A wrong method on
a known route is a 405 with the OpenAI error shape and an `Allow` header.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from server import free_port

from llmserve.config import Config, ServerConfig
from llmserve.engine.async_engine import AsyncEngine
from llmserve.server.app import STARTUP_FAILURE, create_app

EXIT_WITHIN_S = 60


def _run(model, port: int, *args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "llmserve.cli", "run", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--threads", "1", *args]
    env = {**os.environ, "LLMSERVE_LOG_LEVEL": "INFO"}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)


def _wait(proc: subprocess.Popen) -> tuple[int, str]:
    """Exit status and output; a server still running after EXIT_WITHIN_S is killed and fails."""
    try:
        out, _ = proc.communicate(timeout=EXIT_WITHIN_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"server still running after {EXIT_WITHIN_S} s:\n{out.decode(errors='replace')[-3000:]}")
    return proc.returncode, out.decode(errors="replace")


def _until_ready(proc: subprocess.Popen, port: int) -> None:
    """Wait for `/ready` to answer 200; a server that exits first, or is not ready within
    EXIT_WITHIN_S, fails the test (a signal sent to a loading server tests another stop)."""
    deadline = time.monotonic() + EXIT_WITHIN_S
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    proc.kill()
    out = proc.communicate()[0].decode(errors="replace")
    pytest.fail(f"the server was not ready within {EXIT_WITHIN_S} s:\n{out}")


def _port_closed(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_load_failure_exits_nonzero_and_frees_the_port(tiny_model):
    # 2 blocks of 16 tokens cannot hold one request of 256 tokens: the engine refuses to build.
    port = free_port()
    proc = _run(tiny_model, port, "--num-kv-blocks", "2", "--max-model-len", "256")
    code, out = _wait(proc)
    assert code == STARTUP_FAILURE, out
    assert "less than one request of --max-model-len 256" in out, out
    assert "failed to load" in out, out
    assert _port_closed(port)


def test_port_in_use_exits_before_loading_the_model(tiny_model):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, out = _wait(_run(tiny_model, port))
    assert code == STARTUP_FAILURE, out
    assert "cannot listen on 127.0.0.1" in out and "in use" in out, out
    # the bind is checked first: the model was never read
    assert "llmserve.loaders" not in out and "llmserve.engine" not in out, out


def test_load_failure_is_one_line_not_a_traceback(tiny_model, tmp_path):
    """What the user asked for cannot be served (a missing model, a KV cache too small): the
    message says so, without a traceback."""
    for model, args in ((tmp_path / "missing", []), (tiny_model, ["--num-kv-blocks", "2", "--max-model-len", "256"])):
        code, out = _wait(_run(model, free_port(), *args))
        assert code == STARTUP_FAILURE and "loading failed: " in out and "Traceback" not in out, out


@pytest.mark.parametrize("signals", [[signal.SIGTERM], [signal.SIGINT], [signal.SIGINT, signal.SIGINT]],
                         ids=["term", "int", "int-twice"])
def test_a_stop_with_a_request_running_exits_0_without_a_traceback(tiny_model, signals):
    """The drain is the stop that was asked for: exit 0 whichever signal asked (uvicorn would
    raise it again: death by SIGTERM, a KeyboardInterrupt traceback after a second SIGINT; a
    signal after the stop asked uvicorn to force its exit, cutting the lifespan short)."""
    port = free_port()
    proc = _run(tiny_model, port, "--served-model-name", "tiny")
    url = f"http://127.0.0.1:{port}"
    _until_ready(proc, port)

    async def request_and_stop():
        async with httpx.AsyncClient(base_url=url, timeout=EXIT_WITHIN_S) as c:
            sent = asyncio.ensure_future(c.post("/v1/completions", json={
                "model": "tiny", "prompt": "hi", "max_tokens": 500, "ignore_eos": True}))
            while (await c.get("/load")).json()["running"] == 0:
                await asyncio.sleep(0.02)
            for sig in signals:
                proc.send_signal(sig)
                await asyncio.sleep(0.05)
            return (await sent).status_code

    status = asyncio.run(request_and_stop())
    code, out = _wait(proc)
    assert status == (503 if len(signals) > 1 else 200), out
    assert code == 0 and "Traceback" not in out, out


@pytest.mark.parametrize("gap", [0.05, 0.3])
def test_a_second_sigint_on_an_idle_server_still_exits_0(tiny_model, gap):
    """Idle, the drain ends at once and the server stops: a second Ctrl-C lands in uvicorn's
    shutdown or in the interpreter's teardown, and neither may turn into a traceback or a
    death by signal."""
    port = free_port()
    proc = _run(tiny_model, port, "--served-model-name", "tiny")
    _until_ready(proc, port)
    proc.send_signal(signal.SIGINT)
    time.sleep(gap)
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    code, out = _wait(proc)
    assert code == 0 and "Traceback" not in out, out


# `llmserve run` whose model load never ends.
_HANGING_LOAD = """
import sys, time
import llmserve.engine.async_engine as ae
ae.build_engine = lambda config: time.sleep(3600)
from llmserve.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_signal_during_loading_exits_without_waiting_for_the_load(sig):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", _HANGING_LOAD, "run", "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env={**os.environ, "LLMSERVE_LOG_LEVEL": "INFO"})
    # uvicorn takes over the signals once it serves: /ready answers (503, loading) from then on
    deadline = time.monotonic() + EXIT_WITHIN_S
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready").status_code == 503:
                break
        except httpx.TransportError:
            time.sleep(0.1)
    proc.send_signal(sig)
    code, out = _wait(proc)
    # a stop is not a load failure: no traceback, no "loading failed"
    assert "Traceback" not in out and "loading failed" not in out, out
    assert code == 0 and "stopped while the model was loading" in out, out
    assert _port_closed(port)


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://llmserve.test")


def test_405_names_allowed_methods_in_openai_error_shape():
    # Routing needs no model: the engine is never started.
    app = create_app(engine=AsyncEngine(Config(server=ServerConfig(access_log=False))))

    async def main():
        async with _client(app) as c:
            cases = (("POST", "/v1/models", {"GET", "HEAD"}),
                     ("DELETE", "/v1/models/tiny", {"GET", "HEAD"}),
                     ("PUT", "/v1/chat/completions", {"POST", "GET", "HEAD"}),
                     ("PUT", "/health", {"GET", "HEAD"}))
            for method, path, allowed in cases:
                r = await c.request(method, path)
                assert r.status_code == 405, (method, path, r.text)
                assert {m.strip() for m in r.headers["allow"].split(",")} == allowed
                assert r.headers["content-type"] == "application/json"
                assert r.json() == {"error": {
                    "message": f"{method} is not allowed on {path}.",
                    "type": "invalid_request_error", "param": None, "code": "method_not_allowed"}}
            # every method the header lists is served (HEAD included)
            assert (await c.head("/health")).status_code == 200
            # an unknown route stays a 404 without Allow
            r = await c.post("/v1/nope")
            assert r.status_code == 404 and "allow" not in r.headers
            assert r.json()["error"]["code"] == "not_found"
            # a route's path with a slash added is that route, answered as such, not
            # redirected to a URL built from the client's Host header
            elsewhere = {"host": "elsewhere.example"}
            r = await c.get("/health/", headers=elsewhere)
            assert r.status_code == 200 and "location" not in r.headers, r.headers
            r = await c.put("/v1/chat/completions//", headers=elsewhere)
            assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
            assert (await c.post("/v1/nope/")).status_code == 404

    asyncio.run(main())
