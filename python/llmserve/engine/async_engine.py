"""AsyncEngine: submit request bytes, iterate response bytes.

The asyncio side never touches the Core: it validates through the Router (Rust, GIL
released), posts the prepared request to the engine thread, and receives each step's bytes
once per step through `call_soon_threadsafe`. Closing a stream before it finished (client
gone, task cancelled) aborts the request, which frees its KV blocks at once.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator

import orjson

from llmserve._core import ApiError, NotFoundError, Prepared, Router, responses_error_event
from llmserve.config import Config
from llmserve.engine import output_log
from llmserve.engine.adapters import resolver_bases
from llmserve.engine.build import Engine, SetupError, build_engine
from llmserve.engine.loop import EngineThread, core_error, hard_exit
from llmserve.engine.metrics import Metrics
from llmserve.loaders.checkpoint import LoadError

log = logging.getLogger("llmserve.engine")
# --enable-log-requests: what each generation request asks for.
request_log = logging.getLogger("llmserve.requests")

# Bodies larger than this are validated on a worker thread so the event loop keeps serving
# (the router releases the GIL): a ~1,000-token prompt takes about 1 ms to render and tokenize.
# NOTE: measured with benches/serving_overhead.py (~1,024-token prompts, concurrency 256, two
# runs each): 4 KiB gave 32-36k output tok/s and 30-33 us of server CPU per token, 64 KiB
# 23-27k and 41-45 us; ~100-token prompts (under 4 KiB) gain nothing from the hop.
# So are bodies that may compile a grammar (a constraint, a Responses `text.format`
# json_schema, or tools), whatever their size: compiling one can take a second (a regex with a
# large repeat count). A key can be spelled with JSON escapes ("structured_output\u0073"), so a
# body holding any is sent off too.
_INLINE_BODY_BYTES = 4 * 1024
# (`previous_response_id` and `conversation` read a stored history, as long as the client made it)
_OFF_LOOP_MARKERS = (b'"response_format"', b'"json_schema"', b'"structured_outputs"', b'"guided_', b'"tools"',
                     b'"functions"', b'"previous_response_id"', b'"conversation"', b"\\u")


def _off_loop(body: bytes) -> bool:
    return len(body) > _INLINE_BODY_BYTES or any(marker in body for marker in _OFF_LOOP_MARKERS)


_END = object()


def _is_sse_frame(data) -> bool:
    """Whether `data` is wire-ready SSE (the mid-stream error frame: OpenAI's, or Anthropic's
    `error` event), not an error body."""
    return isinstance(data, (bytes, bytearray)) and data.startswith((b"data: ", b"event: "))


class RequestStream:
    """One generation request's output, as an async iterator of wire-ready bytes."""

    def __init__(self, engine: AsyncEngine, prepared, anthropic: bool = False, log_outputs: str | None = None,
                 responses: bool = False) -> None:
        self._engine = engine
        # --enable-log-outputs: the request's endpoint, and everything it sent (read back at its end)
        self._log_endpoint = log_outputs
        self._sent = bytearray() if log_outputs else None
        # An Anthropic Messages request: its errors take Anthropic's shape.
        self.anthropic = anthropic
        # A Responses request: the events it has sent (each frame's one `data:` line), which
        # number the `error` event an error ends its stream with; None for other requests.
        self._events: int | None = 0 if responses else None
        self.id: str = prepared.id
        # Whether its bytes are SSE (a background response's always are: its events).
        self.stream: bool = prepared.stream or prepared.background
        # A Responses request with `background: true`, which runs whether or not it is read;
        # `answer_streamed`: whether its client asked for the events (else its queued object).
        self.background: bool = prepared.background
        self.answer_streamed: bool = prepared.stream
        self.headers: list[tuple[str, str]] = prepared.headers
        self.user: str | None = prepared.user
        self.prompt_tokens: int = prepared.prompt_tokens
        self.n: int = prepared.n
        self.returned_n: int = prepared.returned_n     # (fewer than n under best_of)
        # per prompt (a completions list has several; each has n choices)
        self.prompt_lens: list[int] = prepared.prompt_lens
        self.max_tokens: int | None = prepared.max_tokens
        self.submitted = time.perf_counter()
        # Set by the engine thread when a step first holds the request (before the event
        # loop learns of any output of that step).
        self.scheduled: float | None = None
        self.first_token: float | None = None
        self._last_token = 0.0
        self.finished = False
        # Whether the response has begun (its bytes, or a streamed response's status and a
        # keep-alive comment, went out): an error is then an SSE frame, not an HTTP error.
        self.started = False
        # What the engine delivered and the reader has not taken: bytes, ApiError, _END; the
        # reader waits on `_waiter` while it is empty.
        self._items: deque = deque()
        self._waiter: asyncio.Future | None = None

    def _push(self, data, finished: str | None, error: bool, ntok: int,
              ends: list[tuple[str, int]] | None = None, gaps: list[float] | None = None) -> None:
        """One step's output for this request. `gaps`: where the inter-token gap goes (the
        step's list, observed in bulk), else straight to the metrics."""
        if self not in self._engine._open:
            # aborted (its client left) while a step that held it was in flight: nobody
            # reads this, and its metrics were taken when it was aborted
            return
        if ntok:
            now = time.perf_counter()
            if self.first_token is None:
                self.first_token = now
            elif gaps is not None:
                gaps.append(now - self._last_token)
            else:
                self._engine.metrics.on_tokens(now - self._last_token)
            self._last_token = now
        if error and not isinstance(data, ApiError) and not (self.stream and _is_sse_frame(data)):
            # NOTE: the Core hands over its error as bytes (a body, or an SSE frame once it
            # thinks the stream began); passed through, a body would go out as a 200. As an
            # ApiError it becomes a real 500 (or 400), or its SSE frame if the stream began
            # meanwhile. Only a streamed request can ever carry the frame. The Core's message stays.
            data = core_error(data)
        if data:  # NOTE: steps that produced no bytes (held-back text, non-streamed) wake nobody
            self._put(data)
            if self._sent is not None and isinstance(data, (bytes, bytearray)):
                self._sent += data
        if finished:
            self.finished = True
            self._put(_END)
            if self._sent is not None and not error:
                for line in output_log.log_lines(self.id, self._log_endpoint, self.stream, bytes(self._sent), ends,
                                                 self._engine.config.server.max_log_len):
                    request_log.info(line)
            self._sent = None
            self._engine._finished(self, "error" if error else finished, None if error else ends)

    def _put(self, item) -> None:
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def next(self, timeout: float | None = None) -> bytes | None:
        """The next bytes; None at the end. Raises the request's ApiError if it failed before
        anything was sent, and TimeoutError after `timeout` seconds without output.

        Bytes of several steps that are all waiting come as one piece, so a reader that fell
        behind (a busy event loop) catches up in one write: SSE frames are self-delimiting."""
        loop = asyncio.get_running_loop()
        if loop is not self._engine._loop:
            # its outputs are queued on the engine's loop, which would never wake this one
            raise RuntimeError(_OTHER_LOOP)
        while not self._items:
            self._waiter = loop.create_future()
            try:
                if timeout:
                    await asyncio.wait_for(self._waiter, timeout)
                else:
                    await self._waiter
            finally:
                self._waiter = None
        item = self._items.popleft()
        if item is _END:
            return None
        if isinstance(item, bytes) and self._items and isinstance(self._items[0], bytes):
            parts = [item]
            while self._items and isinstance(self._items[0], bytes):
                parts.append(self._items.popleft())
            item = b"".join(parts)
        if isinstance(item, ApiError):
            # A non-streamed body can't hold a frame; a stream whose response has not begun
            # (no bytes, no keep-alive comment) can still 500.
            if not (self.stream and self.started):
                raise item
            if self.anthropic:
                item = item.anthropic_sse
            elif self._events is not None:
                item = responses_error_event(item, self._events)
            else:
                item = item.sse
        elif self._events is not None and isinstance(item, bytes):
            self._events += item.count(b"\ndata: ")
        self.started = True
        return item

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            while (item := await self.next()) is not None:
                yield item
        finally:
            await self.aclose()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Abort the request if it has not finished (reading with `next()`, call this, or use
        the stream as `async with`, when the reader may stop early or be cancelled)."""
        self.close()

    def close(self) -> None:
        """`aclose`, for code that cannot await."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self)

    async def read_all(self) -> bytes:
        """Every byte of the response (the JSON body of a non-streamed request)."""
        parts = []
        try:
            while (item := await self.next()) is not None:
                parts.append(item)
        finally:
            await self.aclose()
        return b"".join(parts)


# The name of the thread that loads the model (`AsyncEngine.loading`).
LOAD_THREAD = "llmserve-load"
_OTHER_LOOP = ("this AsyncEngine serves the event loop that started it, not this one (Starlette's TestClient "
               "runs each request on a new loop unless used as `with TestClient(app) as client:`)")


# How long an exit waits for a model load to end (a download from the hub may take longer:
# that part is not inside torch, and the exit then goes on without it).
EXIT_LOAD_WAIT_S = 60.0


@atexit.register
def _finish_loads() -> None:
    """A process that exits while a model loads (stopped before its engine started) waits for
    the load: it runs inside torch, and an interpreter that finalizes around such a thread
    aborts the process. (`llmserve run` exits at once instead: `serve`.)"""
    for thread in threading.enumerate():
        if thread.name == LOAD_THREAD and thread.is_alive():
            log.warning("waiting up to %.0f s for the model load to end before exiting", EXIT_LOAD_WAIT_S)
            thread.join(EXIT_LOAD_WAIT_S)
            if thread.is_alive():
                log.error("the model load did not end within %.0f s; exiting without it", EXIT_LOAD_WAIT_S)
                hard_exit(1)


async def _on_daemon_thread(fn, *args):
    """`fn(*args)` on a daemon thread. Unlike `asyncio.to_thread`'s pool, whose threads the
    interpreter joins at exit, nothing waits for it: a stop signal during a long model load
    ends the process at once instead of after the load."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(ok: bool, value) -> None:
        if not future.done():   # cancelled meanwhile: nobody wants the result
            future.set_result(value) if ok else future.set_exception(value)

    def work() -> None:
        try:
            outcome = (True, fn(*args))
        except BaseException as exc:
            outcome = (False, exc)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:
            pass                # the loop has closed: the server is gone

    threading.Thread(target=work, name=LOAD_THREAD, daemon=True).start()
    return await future


# The endpoints `submit` takes (the others are answered by `handle`).
GENERATING = ("chat", "completion", "responses", "messages", "generate", "embeddings", "score", "rerank")
# The endpoints whose prompts are inputs to embed (none generates a token).
EMBEDDING = ("embeddings", "score", "rerank")
# How long a request refused for want of room in the queue holds that room for its retry (its
# 503 says Retry-After: 1).
RESERVE_S = 3.0
FAILED_LOAD = "The model failed to load (the server's log says why); this server cannot serve requests."
CANCELLED_LOAD = ("The model load was cancelled before it ended: the server stopped, or the event loop that "
                  "started it ended (Starlette's TestClient used without `with` runs each request on a loop "
                  "of its own); this engine cannot serve requests.")
NOT_STARTED = ("This engine was never started: `await engine.start()` loads its model (an app made with "
               "`create_app(engine=engine)` serves an engine its host starts; one made from a config starts "
               "its own).")


class AsyncEngine:
    """The serving engine: load once, then submit requests from asyncio."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.state = "loading"  # loading -> ready -> draining -> stopped | failed
        self.engine: Engine | None = None
        self.metrics = Metrics()
        self._thread: EngineThread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._open: set[RequestStream] = set()
        self._drain_deadline: float | None = None   # set when a drain begins
        # The room a request refused for want of it holds in the queue (its sequences, and
        # until when): see _admit.
        self._reserved: tuple[int, float] = (0, 0.0)
        self._failure = FAILED_LOAD   # what a request is told once the state is "failed"

    # -- life cycle ---------------------------------------------------------------------
    async def start(self) -> None:
        """Load the model on a worker thread (the server answers /ready 503 meanwhile). An
        engine starts once, and serves the event loop that started it."""
        self._claim_loop()
        await self._load()

    def start_soon(self) -> asyncio.Future[None]:
        """`start()` as a task of the running loop, which the engine serves from now on (a
        request before the load ends is told the model is still loading)."""
        self._claim_loop()
        return asyncio.ensure_future(self._load())

    def _claim_loop(self) -> None:
        if self._loop is not None:
            raise RuntimeError("AsyncEngine.start() was already called")
        self._loop = asyncio.get_running_loop()

    async def _load(self) -> None:
        try:
            engine = await _on_daemon_thread(build_engine, self.config)
        except asyncio.CancelledError:
            self.state = "failed"   # the server stopped while loading
            self._failure = CANCELLED_LOAD
            raise
        except BaseException as exc:
            self.state = "failed"
            if isinstance(exc, (LoadError, SetupError)):
                # what the user asked for cannot be served: the message says why and what to do
                log.error("loading failed: %s", exc)
                log.debug("loading failed", exc_info=exc)
            else:
                log.exception("loading failed")
            raise
        self._attach(engine)

    def _attach(self, engine: Engine) -> None:
        self.engine = engine
        cfg = engine.config
        self.metrics.bind(engine.router.served_model_names[0], {
            "block_size": cfg.cache.block_size, "num_gpu_blocks": engine.num_blocks,
            "cache_dtype": cfg.cache.kv_cache_dtype,
            "enable_prefix_caching": cfg.cache.enable_prefix_caching,
            "gpu_memory_utilization": cfg.cache.gpu_memory_utilization},
            max_lora=max(len(cfg.model.lora_adapters()), int(cfg.model.allow_runtime_lora_updating)),
            lora_bound=cfg.model.max_loras, max_model_len=engine.max_model_len,
            draft_positions=(cfg.scheduler.speculation() or {}).get("num_tokens", 0))
        self._thread = EngineThread(engine.core, engine.runner, self._deliver, self.metrics.on_step,
                                    self._first_scheduled, plan_ahead=engine.plan_ahead,
                                    adapters=engine.adapters, router=engine.router)
        # (read as /metrics is scraped, as /load reads it: with the requests the engine thread
        # has not taken in yet, which its own count leaves out)
        self.metrics.waiting.set_function(lambda: self.load()["waiting"])
        if engine.adapters is not None:
            engine.adapters.retire = lambda index: self._thread.post(("retire", index))
        self._thread.start()
        self.state = "ready"

    async def wait_drained(self, timeout: float = 30.0) -> bool:
        """Stop taking requests (503 with Retry-After; /ready says "draining") and wait for the
        running ones to finish, up to `timeout` seconds after the drain began (a later call
        does not start the clock again). True when none is left."""
        if self.state == "ready":
            self.state = "draining"
        if self._drain_deadline is None:
            self._drain_deadline = time.monotonic() + timeout
        while self._open and time.monotonic() < self._drain_deadline:
            await asyncio.sleep(0.05)
        return not self._open

    def end_all(self, message: str = "The server is shutting down before this request "
                                      "finished; retry it.") -> int:
        """End every open request now with a 503 (Retry-After) in the OpenAI shape, or, for a
        stream that has begun, an error frame and `[DONE]`; their sequences are aborted (KV
        blocks freed). For a drain that ran out of time: uvicorn would otherwise cancel the
        handlers, and clients would get a plain-text 500 or a cut-off stream. Returns how
        many requests it ended. Event loop only."""
        streams = list(self._open)
        for stream in streams:
            stream._push(self.unavailable(message), "abort", False, 0)
            if self._thread is not None:
                self._thread.post(("abort", stream))
        return len(streams)

    async def drain(self, timeout: float = 30.0, stop_timeout: float | None = None) -> None:
        """Stop taking requests, let running ones finish (up to `timeout`; those still running
        then end with a 503, or an error frame for a stream: `end_all`), stop the loop:
        it stops once the step it is running ends, which this waits for up to `stop_timeout`
        seconds (None: until it has; a long prompt's step may take a while on a CPU). The
        state is then "stopped", or "stopping" while the step still runs (`busy()`)."""
        if not await self.wait_drained(timeout):
            # What still runs is ended as `llmserve run` ends it: a 503 to retry, not a 500.
            self.end_all()
        stopped = True
        if self._thread is not None:
            stopped = await asyncio.to_thread(self._thread.stop, stop_timeout)
        self.state = "stopped" if stopped else "stopping"

    def busy(self) -> bool:
        """Whether a thread of this engine still runs: the model load, or the engine loop
        (before it started, or inside the step a stop waits for). A process must not exit
        normally while one does: the interpreter's teardown around a thread inside torch
        aborts it."""
        return self.loading() or (self._thread is not None and self._thread.running)

    @property
    def alive(self) -> bool:
        """False once the engine loop has died (or loading failed)."""
        if self.state == "failed":
            return False
        return self._thread is None or self._thread.alive or self.state in ("stopped", "stopping")

    @property
    def router(self) -> Router:
        if self.engine is None:
            if self.state == "failed":
                raise self.unavailable(self._failure, retry_after=None)
            self._check_started()
            raise self.unavailable("The model is still loading.", retry_after=5)
        return self.engine.router

    def _check_started(self) -> None:
        if self._loop is None:
            # (a library's mistake, which no retry mends: said as what to do)
            raise self.unavailable(NOT_STARTED, retry_after=None)

    async def reset_prefix_cache(self) -> int:
        """Empty the prefix cache between two steps (Scheduler::reset_prefix_cache); how many
        blocks it held."""
        self._check_serving()
        loop = asyncio.get_running_loop()
        done: asyncio.Future[int | None] = loop.create_future()
        self._thread.post(("reset_prefix_cache", lambda n: loop.call_soon_threadsafe(done.set_result, n)))
        blocks = await done
        if blocks is None:
            raise self.unavailable("The engine stopped before the prefix cache was reset.", retry_after=None)
        return blocks

    def load(self) -> dict:
        stats, pending = self._thread.snapshot() if self._thread else ({}, 0)
        return {
            "state": self.state,
            "running": stats.get("running", 0),
            "waiting": max(0, stats.get("waiting", 0) + pending),
            "kv_cache_usage": stats.get("kv_cache_usage", 0.0),
            "kv_blocks_used": stats.get("used_blocks", 0),
            # blocks requests can hold (the pool's block 0 pads block tables, never held), so
            # kv_cache_usage == kv_blocks_used / kv_blocks_total
            "kv_blocks_total": max(0, stats.get("num_blocks", 0) - 1),
            "requests": len(self._open),
            # (vLLM's name for it, with --enable-server-load-tracking: what its routers read)
            "server_load": len(self._open),
        }

    # -- errors ------------------------------------------------------------------------
    @staticmethod
    def unavailable(message: str, retry_after: int | None = 1) -> ApiError:
        return Router.error("unavailable", message, retry_after=retry_after)

    # -- requests ----------------------------------------------------------------------
    def _check_serving(self) -> None:
        if self._loop is not None and asyncio.get_running_loop() is not self._loop:
            # its outputs are delivered to the loop that started it, and would never come
            raise RuntimeError(_OTHER_LOOP)
        if self.state == "loading":
            self._check_started()
            raise self.unavailable("The model is still loading.", retry_after=5)
        if self.state == "failed":
            raise self.unavailable(self._failure, retry_after=None)
        if self.state != "ready" or not self.alive:
            raise self.unavailable("The server is not taking requests.", retry_after=5)

    async def submit(self, endpoint: str, body: bytes, request_id: str | None = None) -> RequestStream:
        """Validate and queue a chat ("chat"), completion ("completion"), Responses API
        ("responses"), Anthropic Messages ("messages"), vLLM's tokens in, tokens out ("generate"),
        embeddings ("embeddings") or scoring ("score", "rerank") request.
        `request_id` (an HTTP `X-Request-Id`) names it when the body's `request_id` does not."""
        if endpoint not in GENERATING:
            raise ValueError(f"submit takes {' or '.join(map(repr, GENERATING))}, not {endpoint!r} (see handle)")
        if not isinstance(body, bytes):
            raise TypeError(f"the request body must be bytes (its JSON), not {type(body).__name__}")
        self._check_serving()
        try:
            prepared = await self._prepare(endpoint, body, request_id)
        except NotFoundError as exc:
            # (--lora-resolver-dir: an adapter of that name is loaded, then the request runs)
            if exc.code != "model_not_found" or not await self._resolve_lora(body):
                raise
            prepared = await self._prepare(endpoint, body, request_id)
        self._check_serving()
        self._admit(prepared)
        server = self.config.server
        if server.enable_log_requests:
            for line in prepared.log_lines(server.max_log_len):
                request_log.info(line)
        logged = server.enable_log_outputs and endpoint not in EMBEDDING
        stream = RequestStream(self, prepared, anthropic=endpoint == "messages", log_outputs=endpoint if logged else None,
                               responses=endpoint == "responses")
        self._open.add(stream)
        self._thread.post(("add", prepared, stream))
        return stream

    async def _prepare(self, endpoint: str, body: bytes, request_id: str | None) -> Prepared:
        if _off_loop(body):
            return await asyncio.to_thread(self.router.prepare, endpoint, body, request_id)
        return self.router.prepare(endpoint, body, request_id)

    async def _resolve_lora(self, body: bytes) -> bool:
        """Whether the request's unknown `model` is now an adapter --lora-resolver-dir gave."""
        cfg = self.config.model
        if cfg.lora_resolver_dir is None:
            return False
        try:
            name = orjson.loads(body).get("model")
        except (orjson.JSONDecodeError, AttributeError):
            return False
        if not isinstance(name, str) or not name:
            return False
        bases = resolver_bases(self.router.served_model_names, cfg.model)
        return await self.engine.adapters.resolve(self.router, name, cfg.lora_resolver_dir, bases)

    async def load_lora(self, body: bytes) -> tuple[str, list]:
        """vLLM's `POST /v1/load_lora_adapter` (`{"lora_name", "lora_path", "load_inplace"}`):
        reads a PEFT adapter and serves it under its name; (the answer's text, headers), or
        raises ApiError. Whether the route is open is the server's decision (app.py)."""
        self._check_serving()
        return await self.engine.adapters.load(self.router, body)

    def unload_lora(self, body: bytes) -> tuple[str, list]:
        """vLLM's `POST /v1/unload_lora_adapter` (`{"lora_name"}`): stops serving the adapter;
        the requests already admitted through it finish. (text, headers), or raises ApiError."""
        self._check_serving()
        return self.engine.adapters.unload(self.router, body)

    def _admit(self, prepared: Prepared) -> None:
        """--max-waiting caps the sequences waiting to start beyond the step's free slots
        (--max-num-seqs less those running), this request's included: one that could never fit
        is refused for good (400), one that fits later gets 503. (A burst arrives between steps,
        before any of it runs: counted against the waiting alone, it would be refused while
        slots were free.) A request refused for want of room holds it for its retry
        (RESERVE_S): smaller ones leave it free meanwhile."""
        sched = self.config.scheduler
        need, limit, slots = prepared.num_seqs, sched.max_waiting, sched.max_num_seqs
        prepared.check_fits(slots, limit)
        load = self.load()
        free = max(0, slots - load["running"])
        left = limit + free - load["waiting"]
        # NOTE: admission is whole or nothing, so a request of many sequences (n, prompts,
        # inputs) would never find its room while single ones take each place that frees.
        # Refused, it holds the room it needs for RESERVE_S: smaller requests leave that much
        # free meanwhile, and the first that needs as much takes it.
        reserved, until = self._reserved
        now = time.monotonic()
        if now >= until:
            reserved = 0
        held = reserved if need < reserved else 0
        if need > left - held:
            if need > left and need >= reserved:
                self._reserved = (need, now + RESERVE_S)
            raise self.unavailable(
                f"The queue is full ({load['waiting']} sequences waiting for {free} free slots, at most {limit} "
                f"beyond them{f', and {held} held for a larger request refused before' if held else ''}; this "
                f"request needs {need}); try again shortly.")
        if need >= reserved:
            self._reserved = (0, 0.0)

    async def handle(self, endpoint: str, body: bytes) -> tuple[bytes, list[tuple[str, str]]]:
        """tokenize / detokenize / render routes: no generation, no engine thread. Returns
        the JSON body and its response headers."""
        if endpoint in GENERATING:
            raise ValueError(f"{endpoint!r} generates: it goes through submit")
        router = self.router
        if _off_loop(body):
            return await asyncio.to_thread(router.handle, endpoint, body)
        return router.handle(endpoint, body)

    @staticmethod
    def loading() -> bool:
        """Whether a model load is still running on its thread (a stop during a load
        leaves it running: nothing waits for it)."""
        return any(t.name == LOAD_THREAD and t.is_alive() for t in threading.enumerate())

    def abort(self, stream: RequestStream) -> None:
        if stream in self._open:
            self._finished(stream, "abort")
            self._thread.post(("abort", stream))

    def _finished(self, stream: RequestStream, reason: str, ends: list[tuple[str, int]] | None = None) -> None:
        """`ends`: each choice's (finish reason, completion tokens), when it ended normally
        (an abort or failure leaves them unknown)."""
        if stream not in self._open:
            return
        self._open.discard(stream)
        self.metrics.on_finish(reason=reason, prompt_lens=stream.prompt_lens, submitted=stream.submitted,
                               scheduled=stream.scheduled, first_token=stream.first_token,
                               finished=time.perf_counter(), n=stream.n, returned_n=stream.returned_n,
                               max_tokens=stream.max_tokens, ends=ends)

    @staticmethod
    def _first_scheduled(streams: list, when: float) -> None:
        """Engine thread: these requests' first step was just planned."""
        for stream in streams:
            stream.scheduled = when

    # -- engine thread -> asyncio --------------------------------------------------------
    def _deliver(self, items: list) -> None:
        """Engine thread: hand one step's outputs to the event loop, once."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._dispatch, items)

    def _dispatch(self, items: list) -> None:
        """One step's outputs, in the event loop, and its counts as vLLM's engine keeps them:
        the tokens generated, and the prompt of each request whose first output came (its whole
        prompt, cached or not, once per choice) with its time to that output: its first token,
        or for a request that ends without one (an embedding, a score, an echo of the prompt
        alone) its answer."""
        prompt_tokens = generated = 0
        waits: list[float] = []
        gaps: list[float] = []
        for stream, data, finished, error, ntok, ends in items:
            first = stream in self._open and stream.first_token is None and (ntok or (finished and not error))
            if ntok and stream in self._open:
                generated += ntok
            if first and not ntok:
                stream.first_token = time.perf_counter()
            stream._push(data, finished, error, ntok, ends, gaps)
            if first:
                prompt_tokens += sum(stream.prompt_lens) * stream.n
                waits.append(stream.first_token - stream.submitted)
        self.metrics.on_token_gaps(gaps)
        if generated or prompt_tokens:
            self.metrics.on_iteration(prompt_tokens, generated, waits)
