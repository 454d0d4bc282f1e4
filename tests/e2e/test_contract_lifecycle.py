"""The contract's 503 and 500 rows, in process: `create_app` over an `AsyncEngine` whose
life cycle the test drives (held-back load, drain) and whose model runner fails on purpose.

The app runs through `httpx.ASGITransport` (no lifespan: the test starts and drains the
engine itself), so the engine's states can be observed at exact moments.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time

import httpx
import pytest

import llmserve.engine.async_engine as async_engine_mod
from llmserve.config import CacheConfig, Config, DeviceConfig, ModelConfig, SchedulerConfig, ServerConfig
from llmserve.engine.async_engine import AsyncEngine
from llmserve.engine.build import build_engine
from llmserve.server.app import create_app

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "ignore_eos": True}


def _config(model) -> Config:
    return Config(
        model=ModelConfig(model=str(model), served_model_name=("tiny",)),
        cache=CacheConfig(num_kv_blocks=64),
        scheduler=SchedulerConfig(max_num_seqs=4),
        device=DeviceConfig(device="cpu", threads=1),
        server=ServerConfig(access_log=False),
    )


class FailingRunner:
    """Wraps the real runner; `fail_in(k)` makes the k-th `execute` from now raise."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.countdown: int | None = None

    def fail_in(self, k: int) -> None:
        self.countdown = k

    def execute(self, plan):
        if self.countdown is not None:
            self.countdown -= 1
            if self.countdown == 0:
                self.countdown = None
                raise RuntimeError("injected model failure (secret detail)")
        return self.inner.execute(plan)


def _engine_wrapping(tiny_model, monkeypatch, wrapper):
    """An AsyncEngine (not started) whose runner is wrapped by `wrapper`, and the list the
    wrappers it builds go to (one per engine build)."""
    runners = []

    def build(cfg):
        engine = build_engine(cfg)
        engine.runner = wrapper(engine.runner)
        runners.append(engine.runner)
        return engine

    monkeypatch.setattr(async_engine_mod, "build_engine", build)
    return AsyncEngine(_config(tiny_model)), runners


@pytest.fixture
def failing_engine(tiny_model, monkeypatch):
    """An AsyncEngine (not started) whose runner is a FailingRunner."""
    return _engine_wrapping(tiny_model, monkeypatch, FailingRunner)


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://llmserve.test",
                             timeout=60)


@contextlib.asynccontextmanager
async def _serving(engine: AsyncEngine):
    """A client of `engine`'s app, the engine started; drained after."""
    await engine.start()
    try:
        async with _client(create_app(engine=engine)) as c:
            yield c
    finally:
        await engine.drain()


def _assert_error(r: httpx.Response, status: int, type_: str, code: str) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["type"], err["code"]) == (type_, code)
    return err


def _sse_frames(text: str) -> list[str]:
    return [f.removeprefix("data: ") for f in text.split("\n\n") if f.startswith("data: ")]


def test_503_while_loading(tiny_model, monkeypatch):
    engine = AsyncEngine(_config(tiny_model))
    gate = threading.Event()   # the load is held back until the checks are done
    monkeypatch.setattr(async_engine_mod, "build_engine", lambda cfg: gate.wait(60) and build_engine(cfg))

    async def main():
        loading = engine.start_soon()
        async with _client(create_app(engine=engine)) as c:
            for path, body in (("/v1/chat/completions", CHAT),
                               ("/v1/completions", {"model": "tiny", "prompt": "x"}),
                               ("/tokenize", {"prompt": "x"})):
                r = await c.post(path, json=body)
                _assert_error(r, 503, "service_unavailable_error", "service_unavailable")
                assert int(r.headers["retry-after"]) >= 1
            ready = await c.get("/ready")
            assert ready.status_code == 503 and ready.json()["status"] == "loading"
            assert "retry-after" in ready.headers
            assert (await c.get("/health")).status_code == 200
            # /metrics answers while loading: the metrics are listed, with no series until the
            # model (and so its model_name label) is known
            metrics = await c.get("/metrics")
            assert metrics.status_code == 200
            assert "# TYPE llmserve:num_requests_running gauge" in metrics.text
            assert "llmserve:num_requests_running{" not in metrics.text
            gate.set()
            await loading
            assert (await c.get("/ready")).status_code == 200
        await engine.drain()

    asyncio.run(main())


def test_503_while_draining_and_running_requests_finish(tiny_model):
    engine = AsyncEngine(_config(tiny_model))

    async def main():
        await engine.start()
        async with _client(create_app(engine=engine)) as c:
            assert (await c.get("/ready")).status_code == 200
            long = asyncio.ensure_future(c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 120}))
            while engine.load()["running"] == 0:
                await asyncio.sleep(0.01)
            draining = asyncio.ensure_future(engine.drain())
            while engine.state != "draining":
                await asyncio.sleep(0.01)
            r = await c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2})
            _assert_error(r, 503, "service_unavailable_error", "service_unavailable")
            assert int(r.headers["retry-after"]) >= 1
            ready = await c.get("/ready")
            assert ready.status_code == 503 and ready.json()["status"] == "draining"
            done = await long
            assert done.status_code == 200
            assert done.json()["usage"]["completion_tokens"] == 120
            await draining
            assert engine.state == "stopped"

    asyncio.run(main())


class SlowRunner:
    """Wraps the real runner; each step takes at least 20 ms (a request outlives a short drain)."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def execute(self, plan):
        time.sleep(0.02)
        return self.inner.execute(plan)


def test_a_drain_that_runs_out_ends_what_runs_with_a_503_and_holds_no_blocks(tiny_model, monkeypatch):
    """`drain(timeout)` ends the requests that outlive it as `llmserve run` does: a 503 to
    retry, or for a stream that began its error frame and [DONE] (not a 500); the stopped
    engine then holds no sequence and no KV block (audit 47: A47-2, A47-3)."""
    engine, _ = _engine_wrapping(tiny_model, monkeypatch, SlowRunner)

    async def main():
        await engine.start()
        async with _client(create_app(engine=engine)) as c:
            streamed = asyncio.ensure_future(
                c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 400, "stream": True}))
            whole = asyncio.ensure_future(c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 400}))
            while engine.load()["running"] < 2:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)   # the stream has begun
            await engine.drain(timeout=0.2)
            frames = _sse_frames((await streamed).text)
            assert frames[-1] == "[DONE]" and frames.count("[DONE]") == 1
            err = json.loads(frames[-2])["error"]
            assert (err["type"], err["code"]) == ("service_unavailable_error", "service_unavailable")
            r = await whole
            _assert_error(r, 503, "service_unavailable_error", "service_unavailable")
            assert int(r.headers["retry-after"]) >= 1
        assert engine.state == "stopped"
        load = engine.load()
        assert (load["running"], load["waiting"], load["kv_blocks_used"], load["requests"]) == (0, 0, 0, 0)
        assert engine.engine.core.stats()["used_blocks"] == 0

    asyncio.run(main())


def test_engine_failure_after_streaming_began_is_error_frame_then_done(failing_engine):
    engine, runners = failing_engine

    async def main():
        await engine.start()
        try:
            async with _client(create_app(engine=engine)) as c:
                runners[0].fail_in(4)  # prefill + 2 decode steps succeed, then the model fails
                r = await c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 30, "stream": True})
                assert r.status_code == 200
                assert r.headers["content-type"].startswith("text/event-stream")
                frames = _sse_frames(r.text)
                assert frames[-1] == "[DONE]"
                assert frames.count("[DONE]") == 1
                err = json.loads(frames[-2])
                assert set(err) == {"error"}
                assert set(err["error"]) == {"message", "type", "param", "code"}
                assert err["error"]["type"] == "server_error"
                assert "secret detail" not in err["error"]["message"]
                chunks = [json.loads(f) for f in frames[:-2]]
                assert chunks and all(ch["object"] == "chat.completion.chunk" for ch in chunks)
                assert not any(ch["choices"] and ch["choices"][0]["finish_reason"] for ch in chunks)
                # The engine survives a failed step: the next request is served.
                ok = await c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 3})
                assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
                assert (await c.get("/health")).status_code == 200
        finally:
            await engine.drain()

    asyncio.run(main())


@pytest.mark.parametrize("stream", [False, True])
def test_engine_failure_before_first_byte_is_500(failing_engine, stream):
    engine, runners = failing_engine

    async def main():
        await engine.start()
        try:
            async with _client(create_app(engine=engine)) as c:
                runners[0].fail_in(1)  # the very first step (prefill) fails
                r = await c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 5, "stream": stream})
                err = _assert_error(r, 500, "server_error", "internal_error")
                assert "secret detail" not in err["message"]
                assert r.headers["content-type"].startswith("application/json")
        finally:
            await engine.drain()

    asyncio.run(main())


def test_non_streamed_failure_mid_generation_is_500(failing_engine):
    engine, runners = failing_engine

    async def main():
        await engine.start()
        try:
            async with _client(create_app(engine=engine)) as c:
                runners[0].fail_in(5)  # tokens were generated, but none were sent
                r = await c.post("/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 20,
                                                          "ignore_eos": True})
                _assert_error(r, 500, "server_error", "internal_error")
        finally:
            await engine.drain()

    asyncio.run(main())


def test_a_body_that_stops_arriving_is_408(tiny_model, monkeypatch):
    """uvicorn has no body timeout: a client that declares more than it sends gets a 408 in
    the OpenAI shape once nothing arrives for BODY_IDLE_TIMEOUT_S, instead of holding its
    connection forever."""
    from llmserve.server import routes

    monkeypatch.setattr(routes, "BODY_IDLE_TIMEOUT_S", 0.3)
    engine = AsyncEngine(_config(tiny_model))

    async def main():
        await engine.start()
        app = create_app(engine=engine)
        chunks = [{"type": "http.request", "body": b'{"model": "tiny", ', "more_body": True}]
        stalled = asyncio.Event()

        async def receive():
            if chunks:
                return chunks.pop(0)
            await stalled.wait()           # never set: the rest of the body never comes
            return {"type": "http.disconnect"}

        sent = []

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "raw_path": b"/v1/completions",
                 "root_path": "", "scheme": "http", "query_string": b"", "server": ("test", 80),
                 "client": ("127.0.0.1", 1), "http_version": "1.1",
                 "headers": [(b"content-type", b"application/json"), (b"content-length", b"500")]}
        await asyncio.wait_for(app(scope, receive, send), 10)
        start = next(m for m in sent if m["type"] == "http.response.start")
        body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
        assert start["status"] == 408
        err = json.loads(body)["error"]
        assert (err["type"], err["code"]) == ("invalid_request_error", "request_timeout")
        await engine.drain()

    asyncio.run(main())


def test_requests_that_may_compile_a_grammar_are_validated_off_the_event_loop(tiny_model):
    """Compiling a grammar can take a second (a regex with a large repeat count): a request
    with a constraint or tools is prepared on a worker thread, whatever its size, so /health
    and every stream keep going; a plain small one inline (no thread hop)."""
    import threading

    engine = AsyncEngine(_config(tiny_model))

    class Recorder:
        def __init__(self, inner):
            self.inner, self.threads = inner, []

        def prepare(self, *args):
            self.threads.append(threading.current_thread())
            return self.inner.prepare(*args)

        def handle(self, *args):
            self.threads.append(threading.current_thread())
            return self.inner.handle(*args)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    async def main():
        await engine.start()
        recorder = engine.engine.router = Recorder(engine.engine.router)
        app = create_app(engine=engine)
        chat = {"model": "tiny", "messages": CHAT["messages"], "max_tokens": 2}
        regex = {"type": "regex", "regex": "a{2,5}"}
        async with _client(app) as client:
            for path, body in (("/v1/chat/completions", chat),
                               ("/v1/chat/completions", {**chat, "response_format": regex}),
                               ("/v1/chat/completions/render", {**chat, "structured_outputs": {"regex": "b+"}}),
                               ("/v1/messages", {**chat, "output_config": {"format": {
                                   "type": "json_schema", "schema": {"type": "object"}}}})):
                r = await client.post(path, json=body)
                assert r.status_code == 200, r.text
            # the same key spelled with a JSON escape
            escaped = json.dumps({**chat, "structured_outputs": {"regex": "b+"}}).replace(
                '"structured_outputs"', '"structured_output\\u0073"')
            r = await client.post("/v1/chat/completions", content=escaped,
                                  headers={"content-type": "application/json"})
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"].strip("b") == "", r.text
        await engine.drain()
        return recorder.threads

    main_thread = threading.current_thread()
    assert [t is main_thread for t in asyncio.run(main())] == [True, False, False, False, False]


class HeldRunner:
    """Wraps the real runner; every step waits until `release` is set (a long prefill)."""

    def __init__(self, inner) -> None:
        import threading

        self.inner = inner
        self.entered, self.release = threading.Event(), threading.Event()

    def execute(self, plan):
        self.entered.set()
        assert self.release.wait(30)
        return self.inner.execute(plan)


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_before_any_output_aborts_at_once(tiny_model, monkeypatch, stream):
    """A request whose client goes away while its first step runs (or while it waits in the
    queue) is aborted then, not after the step: the handler returns (499 in the access log)
    while the step is still held, and the request never reaches the client or the queue."""
    engine, held = _engine_wrapping(tiny_model, monkeypatch, HeldRunner)

    async def main():
        await engine.start()
        app = create_app(engine=engine)
        body = json.dumps({**CHAT, "max_tokens": 4, "stream": stream}).encode()
        gone = asyncio.Event()
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            if messages:
                return messages.pop(0)
            await gone.wait()
            return {"type": "http.disconnect"}

        sent = []

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
                 "raw_path": b"/v1/chat/completions", "root_path": "", "scheme": "http",
                 "query_string": b"", "server": ("test", 80), "client": ("127.0.0.1", 1),
                 "http_version": "1.1", "headers": [(b"content-type", b"application/json")]}
        handler = asyncio.ensure_future(app(scope, receive, send))
        assert await asyncio.to_thread(held[0].entered.wait, 10)   # its first step runs
        gone.set()
        await asyncio.wait_for(handler, 5)                          # while the step is held
        assert not held[0].release.is_set()
        start = next(m for m in sent if m["type"] == "http.response.start")
        assert start["status"] == 499
        held[0].release.set()
        for _ in range(100):
            if engine.load()["requests"] == 0 and engine.load()["kv_blocks_used"] == 0:
                break
            await asyncio.sleep(0.05)
        assert engine.load()["requests"] == 0 and engine.load()["kv_blocks_used"] == 0
        await engine.drain()

    asyncio.run(main())


RESPONSES = {"model": "tiny", "input": "Hello", "ignore_eos": True, "stream": True}


def test_responses_stream_failure_is_the_error_frame_and_before_the_first_byte_a_500(failing_engine):
    """/v1/responses keeps the contract's two failure rows: a failure after its events began
    is the error frame and [DONE] (which the SDK raises as an APIError: a frame holding
    `error`), named `event: error` and holding OpenAI's `error` event fields, numbered after
    the events before it; one in the first step a 500. A stream the server ends as it stops
    (a drain run out) ends the same way."""
    engine, runners = failing_engine

    def ends_with_the_error_event(text: str, code: str) -> None:
        assert "response.completed" not in text
        assert text.endswith("\n\ndata: [DONE]\n\n"), text
        events = [f for f in text.split("\n\n") if f.startswith("event: ")]
        kind, data = events[-1].removeprefix("event: ").split("\ndata: ")
        error = json.loads(data)
        assert (kind, error["type"], error["code"], error["error"]["code"]) == ("error", "error", code, code)
        assert error["sequence_number"] == len(events) - 1 and error["message"] == error["error"]["message"]
        assert error["error"]["type"] in ("server_error", "service_unavailable_error") and "secret" not in text
        assert [json.loads(e.split("\ndata: ")[1])["sequence_number"] for e in events] == list(range(len(events)))

    async def main():
        async with _serving(engine) as c:
            runners[0].fail_in(4)
            r = await c.post("/v1/responses", json={**RESPONSES, "max_output_tokens": 30})
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            assert "event: response.created" in r.text
            ends_with_the_error_event(r.text, "internal_error")
            runners[0].fail_in(1)
            r = await c.post("/v1/responses", json={**RESPONSES, "max_output_tokens": 5})
            _assert_error(r, 500, "server_error", "internal_error")
            ok = await c.post("/v1/responses", json={**RESPONSES, "stream": False, "max_output_tokens": 3})
            assert ok.status_code == 200 and ok.json()["usage"]["output_tokens"] == 3
            # (last: the step that held the request it ends may still run after it)
            stream = await engine.submit("responses", json.dumps({**RESPONSES, "max_output_tokens": 480}).encode())
            text = ""
            while "response.output_text.delta" not in text:
                text += (await stream.next()).decode()
            assert engine.end_all() == 1
            while (item := await stream.next()) is not None:
                text += item.decode()
            ends_with_the_error_event(text, "service_unavailable")
        assert engine.engine.core.stats()["used_blocks"] == 0

    asyncio.run(main())


async def _ended(c: httpx.AsyncClient, response_id: str) -> dict:
    """The stored background response `response_id`, once it has ended."""
    while (body := (await c.get(f"/v1/responses/{response_id}")).json())["status"] in ("queued", "in_progress"):
        await asyncio.sleep(0.02)
    return body


BACKGROUND = {**RESPONSES, "stream": False, "background": True}


def test_a_background_response_the_engine_fails_is_failed(failing_engine):
    """Nobody reads a background response when the engine fails it: its stored object says
    so (`failed`, with a server_error that hides the detail) and its events end with
    `response.failed`; a drain that runs out fails the ones still running."""
    engine, runners = failing_engine

    async def main():
        async with _serving(engine) as c:
            runners[0].fail_in(4)
            r = await c.post("/v1/responses", json={**BACKGROUND, "max_output_tokens": 30})
            assert (r.status_code, r.json()["status"]) == (200, "queued")
            failed = await _ended(c, r.json()["id"])
            assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
            assert "secret detail" not in failed["error"]["message"]
            events = await c.get(f"/v1/responses/{failed['id']}", params={"stream": "true"})
            kinds = [line.removeprefix("event: ") for line in events.text.split("\n") if line.startswith("event: ")]
            assert kinds[:3] == ["response.created", "response.queued", "response.in_progress"]
            assert kinds[-1] == "response.failed"
            last = json.loads(events.text.rstrip().rsplit("\ndata: ", 1)[1])
            assert last["response"] == failed and last["sequence_number"] == len(kinds) - 1
            # another app mounted on the same engine serves the same runs (one store, one
            # registry of runs per engine)
            async with _client(create_app(engine=engine)) as other:
                again = await other.get(f"/v1/responses/{failed['id']}", params={"stream": "true"})
                assert again.text == events.text
            # the engine serves on; a background response still running when a drain runs
            # out is failed too
            r = await c.post("/v1/responses", json={**BACKGROUND, "max_output_tokens": 480})
            assert r.status_code == 200, r.text
            while engine.load()["running"] < 1:
                await asyncio.sleep(0.01)
            await engine.drain(timeout=0.1)
            stopped = (await c.get(f"/v1/responses/{r.json()['id']}")).json()
            assert (stopped["status"], stopped["error"]["code"]) == ("failed", "server_error")
            assert "shutdown" in stopped["error"]["message"]
            assert engine.engine.core.stats()["used_blocks"] == 0

    asyncio.run(main())


def test_embeddings_engine_failure_is_a_500_and_frees_every_block(failing_engine):
    """/v1/embeddings keeps the contract's failure row (it never streams): a step that fails
    while it holds the inputs' prompts is a 500 in the error shape, the engine goes on serving,
    and no KV block stays held."""
    engine, runners = failing_engine
    body = {"model": "tiny", "input": ["Hello there", "The quick brown fox jumps over the lazy dog."]}

    async def main():
        await engine.start()
        try:
            async with _client(create_app(engine=engine)) as c:
                runners[0].fail_in(1)
                r = await c.post("/v1/embeddings", json=body)
                _assert_error(r, 500, "server_error", "internal_error")
                ok = await c.post("/v1/embeddings", json=body)
                assert ok.status_code == 200 and len(ok.json()["data"]) == 2, ok.text
        finally:
            await engine.drain()
        assert engine.engine.core.stats()["used_blocks"] == 0

    asyncio.run(main())


MESSAGES = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "ignore_eos": True, "stream": True}


def test_messages_failures_are_anthropic_errors_and_free_every_block(failing_engine):
    """/v1/messages keeps the contract's failure rows in Anthropic's shape: a failure after its
    events began is Anthropic's `error` event (no `[DONE]`, which its streams never send), one
    in the first step a 500 whose body is `{"type": "error", "error": {...}}`."""
    engine, runners = failing_engine

    async def main():
        await engine.start()
        try:
            async with _client(create_app(engine=engine)) as c:
                runners[0].fail_in(4)
                r = await c.post("/v1/messages", json={**MESSAGES, "max_tokens": 30})
                assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
                frames = r.text.split("\n\n")
                assert frames[0].startswith("event: message_start\n") and "[DONE]" not in r.text
                assert "message_stop" not in r.text
                last = [f for f in frames if f][-1]
                assert last.startswith("event: error\ndata: ")
                error = json.loads(last.removeprefix("event: error\ndata: "))
                assert error["type"] == "error" and error["error"]["type"] == "api_error"
                assert "secret" not in r.text
                for stream in (True, False):
                    runners[0].fail_in(1)
                    r = await c.post("/v1/messages", json={**MESSAGES, "stream": stream, "max_tokens": 5})
                    assert r.status_code == 500, r.text
                    body = r.json()
                    assert body["type"] == "error" and body["error"]["type"] == "api_error", body
                    assert body["error"]["code"] == "internal_error"
                ok = await c.post("/v1/messages", json={**MESSAGES, "stream": False, "max_tokens": 3})
                assert ok.status_code == 200 and ok.json()["usage"]["output_tokens"] == 3, ok.text
            # the contract's other rows, in Anthropic's shape: a body over the limit is a 413, a
            # request while the server drains a 503 with Retry-After
            app = create_app(engine=engine)
            app.state.max_body_bytes = 64
            async with _client(app) as c:
                r = await c.post("/v1/messages", json={**MESSAGES, "max_tokens": 3, "pad": "x" * 100})
                assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large", r.text
                assert r.json()["type"] == "error" and r.headers["request-id"] == r.headers["x-request-id"]
                app.state.max_body_bytes = 1 << 20
                await engine.drain()
                r = await c.post("/v1/messages", json={**MESSAGES, "max_tokens": 3})
                assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1, r.text
                assert (r.json()["type"], r.json()["error"]["type"]) == ("error", "overloaded_error")
        finally:
            await engine.drain()
        assert engine.engine.core.stats()["used_blocks"] == 0

    asyncio.run(main())


def test_an_app_serves_again_when_its_lifespan_runs_again(tiny_model):
    # A test suite that imports one module-level app opens `with TestClient(app)` per test:
    # each lifespan (on an event loop of its own) loads an engine and drains it at its end,
    # and the next one serves too, rather than answering with the drained engine.
    from starlette.testclient import TestClient

    app = create_app(_config(tiny_model))
    served = []
    for _ in range(2):
        with TestClient(app) as c:
            deadline = time.monotonic() + 120
            while c.get("/ready").status_code != 200:
                assert time.monotonic() < deadline, c.get("/ready").text
                time.sleep(0.05)
            r = c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
            served.append(app.state.engine)
        assert served[-1].state == "stopped"
    assert served[0] is not served[1]


def test_create_app_takes_a_config_or_an_engine_not_two_that_differ(tiny_model):
    engine = AsyncEngine(_config(tiny_model))
    assert create_app(_config(tiny_model), engine=engine).state.engine is engine   # (the same config)
    other = Config(model=ModelConfig(model="elsewhere.gguf"), server=ServerConfig(api_key=("k",)))
    with pytest.raises(ValueError, match="not both"):
        create_app(other, engine=engine)


def test_a_cancelled_load_is_said_to_be_one(tiny_model):
    # (not "the server's log says why": a cancelled load logs nothing)
    async def main():
        engine = AsyncEngine(_config(tiny_model))
        load = asyncio.ensure_future(engine.start())
        await asyncio.sleep(0)
        load.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await load
        async with _client(create_app(engine=engine)) as c:
            r = await c.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 503 and "retry-after" not in r.headers, r.text
            assert r.json()["error"]["message"].startswith("The model load was cancelled"), r.text
            assert (await c.get("/ready")).json() == {"status": "failed"}
        while AsyncEngine.loading():   # (the load's thread runs on; wait for it to end)
            await asyncio.sleep(0.05)

    asyncio.run(main())
