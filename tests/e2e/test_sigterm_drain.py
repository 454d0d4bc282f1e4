"""`llmserve run` on SIGTERM: it drains before it stops listening (CONTRACT: /ready is 503
while draining; new requests get 503 with Retry-After) and the running stream finishes."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest

from llmserve.server.app import DRAIN_TIMEOUT_S
from server import ServerProcess
from tiny import build_tiny_llama


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory):
    # room for a stream long enough to still be running while the test probes the drain
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-long"), max_position_embeddings=8192)


def test_sigterm_drains_then_exits(long_context_model):
    server = ServerProcess(str(long_context_model), "--served-model-name", "tiny",
                           "--max-model-len", "8192")
    try:
        first_chunk = threading.Event()
        result: dict = {}

        def stream() -> None:
            # (long enough to still run while the test probes the drain, short enough to end
            # within the drain's 20 s on a slow machine)
            body = {"model": "tiny", "prompt": "hello", "max_tokens": 800, "ignore_eos": True,
                    "stream": True}
            frames = []
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        frames.append(line[6:])
                        first_chunk.set()
            result["frames"] = frames

        reader = threading.Thread(target=stream)
        reader.start()
        assert first_chunk.wait(60)
        server.proc.send_signal(signal.SIGTERM)

        deadline = time.monotonic() + 10
        while True:
            ready = httpx.get(server.url + "/ready", timeout=5)
            if ready.status_code == 503:
                break
            assert time.monotonic() < deadline, "never saw /ready turn 503"
            time.sleep(0.02)
        assert ready.json()["status"] == "draining"
        refused = httpx.post(server.url + "/v1/completions", timeout=5,
                             json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert refused.status_code == 503 and refused.headers.get("retry-after")
        assert refused.json()["error"]["type"] == "service_unavailable_error"
        assert "frames" not in result, "the stream ended before the drain was probed"
        assert server.proc.poll() is None       # still up: the stream is still running

        reader.join(120)
        frames = result["frames"]
        assert frames[-1] == "[DONE]"
        assert '"finish_reason":"length"' in frames[-2].replace(" ", "")
        server.proc.wait(60)                    # then it exits by itself
    finally:
        server.stop()


def test_a_second_signal_skips_the_drain_and_ends_what_runs_properly(long_context_model):
    # one batch slot and keep-alive comments: the requests after the first one wait in the
    # queue, and the queued stream's response has begun (with a comment) before any token
    server = ServerProcess(str(long_context_model), "--served-model-name", "tiny",
                           "--max-model-len", "8192", "--max-num-seqs", "1", "--sse-keep-alive", "0.2")
    try:
        first_chunk = threading.Event()
        kept_alive = threading.Event()
        result: dict = {}

        def stream(name: str) -> None:
            body = {"model": "tiny", "prompt": "hello", "max_tokens": 8000, "ignore_eos": True,
                    "stream": True}
            frames = []
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        frames.append(line[6:])
                        first_chunk.set()
                    elif line.startswith(":") and name == "queued":
                        kept_alive.set()
            result[name] = frames

        def plain() -> None:
            body = {"model": "tiny", "prompt": "hello", "max_tokens": 8000, "ignore_eos": True}
            result["plain"] = httpx.post(server.url + "/v1/completions", json=body, timeout=120)

        readers = [threading.Thread(target=stream, args=("running",))]
        readers[0].start()
        assert first_chunk.wait(60)
        readers += [threading.Thread(target=plain), threading.Thread(target=stream, args=("queued",))]
        for t in readers[1:]:
            t.start()
        assert kept_alive.wait(60)
        deadline = time.monotonic() + 10
        while httpx.get(server.url + "/load", timeout=5).json()["waiting"] != 2:
            assert time.monotonic() < deadline, "the two later requests never both queued"
            time.sleep(0.02)
        server.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while httpx.get(server.url + "/ready", timeout=5).status_code != 503:
            assert time.monotonic() < deadline, "never saw /ready turn 503"
            time.sleep(0.02)
        signalled = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(30)
        # it exits without waiting for the requests (8000 tokens take far longer here)...
        assert time.monotonic() - signalled < DRAIN_TIMEOUT_S
        for t in readers:
            t.join(30)
        # ...but ends them in the OpenAI shape: an error frame then [DONE] (also for the
        # stream whose response began with a keep-alive comment before any token), a 503 to
        # retry
        for name in ("running", "queued"):
            frames = result[name]
            assert frames[-1] == "[DONE]", (name, frames[-3:])
            assert '"service_unavailable_error"' in frames[-2] and "finish_reason" not in frames[-2]
        assert len(result["queued"]) == 2       # no token before its error frame
        plain = result["plain"]
        assert plain.status_code == 503 and plain.headers.get("retry-after")
        assert plain.json()["error"]["type"] == "service_unavailable_error"
    finally:
        server.stop()


def test_a_shutdown_stops_background_responses_at_once(long_context_model):
    """A background response would finish in a store that goes with the process: SIGTERM stops
    it at once (stored `failed`, which a poll may still read while the server closes) instead
    of holding the drain, and the server exits without waiting for it."""
    server = ServerProcess(str(long_context_model), "--served-model-name", "tiny", "--max-model-len", "8192")
    try:
        body = {"model": "tiny", "input": "hello", "max_output_tokens": 8000, "ignore_eos": True,
                "background": True}
        response_id = httpx.post(server.url + "/v1/responses", json=body, timeout=60).json()["id"]
        url = f"{server.url}/v1/responses/{response_id}"
        deadline = time.monotonic() + 30
        while httpx.get(url, timeout=5).json()["status"] != "in_progress":
            assert time.monotonic() < deadline, "the background response never began"
            time.sleep(0.02)
        signalled = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        seen = None
        while server.proc.poll() is None and seen != "failed":
            try:
                stored = httpx.get(url, timeout=5).json()
            except httpx.TransportError:        # (closed already)
                break
            seen = stored["status"]
            assert seen in ("in_progress", "failed"), stored
            time.sleep(0.02)
        if seen == "failed":
            assert "shutdown" in stored["error"]["message"]
        server.proc.wait(30)
        # (the drain would have waited DRAIN_TIMEOUT_S: 8000 tokens take far longer here)
        assert time.monotonic() - signalled < DRAIN_TIMEOUT_S
    finally:
        server.stop()
