"""The Starlette app factory (`create_app`) and `serve` for `llmserve run`.

`create_app(config)` gives an ASGI app that loads the model at startup (answering /ready
503 meanwhile) and drains on shutdown. Another Starlette or FastAPI service can mount it;
pass `engine=` to share an AsyncEngine it already started. A mounted app's lifespan does not
run (Starlette runs the outer app's only): its first request then starts the load, and the
host drains nothing at shutdown unless its own lifespan enters the mounted app's
(`async with inner.router.lifespan_context(inner): yield`), which also loads at startup.
Each lifespan of an app built from a config serves an engine of its own: a lifespan (or
request) that finds the engine an earlier lifespan drained loads a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import signal
import socket
import ssl
import stat
import threading
import time

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from llmserve._core import ApiError, Router
from llmserve.config import Config, ServerConfig
from llmserve.engine.async_engine import AsyncEngine
from llmserve.server import routes
from llmserve.server.background import Backgrounds
from llmserve.server.middleware import (AccessLogMiddleware, ApiKeyMiddleware, CORSMiddleware, RequestIdMiddleware,
                                        TrailingSlash, anthropic_errors, declares_far_more_than, error_body,
                                        error_request_id)

# What a page of an allowed origin may read of a response besides the CORS-safe headers.
EXPOSED_HEADERS = ["llmserve-ignored-fields", "llmserve-unused-template-kwargs", "llmserve-chat-template",
                   "x-request-id", "request-id", "retry-after"]

log = logging.getLogger("llmserve.server")


# Answers after which the connection is closed: the body stopped arriving (408), or the
# server failed (500: uvicorn drops the connection then; the header tells the client so it
# does not reuse it). Any error before a body far longer than --max-body-bytes is read closes it
# too (`declares_far_more_than`).
CLOSING_STATUSES = frozenset({408, 500})


def _error_response(err: ApiError, request: Request, headers=None) -> Response:
    headers = dict(headers or {})
    headers["x-request-id"] = error_request_id(request.headers.get("x-request-id"))
    if anthropic_errors(request.scope):
        headers["request-id"] = headers["x-request-id"]   # (Anthropic's name: its SDK's `error.request_id`)
    if err.retry_after:
        headers["retry-after"] = str(err.retry_after)
    limit = getattr(request.app.state, "max_body_bytes", None)
    if err.status in CLOSING_STATUSES or declares_far_more_than(request.scope, limit):
        headers["connection"] = "close"
    return Response(error_body(err, request.scope, headers["x-request-id"]), status_code=err.status,
                    media_type="application/json", headers=headers)


async def _on_api_error(request: Request, exc: Exception) -> Response:
    return _error_response(exc, request)


async def _on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        err = Router.error("not_found", f"No route {request.method} {request.url.path}.")
        return _error_response(err, request)
    # Starlette's only other routing error is 405, raised with the route's `Allow` header
    # (RFC 9110 requires it on a 405); keep whatever headers it carries.
    err = Router.error("method_not_allowed", f"{request.method} is not allowed on {request.url.path}.")
    return _error_response(err, request, exc.headers)


async def _on_client_gone(request: Request, exc: Exception) -> Response:
    # The client left while sending its body: nobody reads an answer, and nothing failed
    # here. 499 (nginx's "client closed request") is what the access log shows.
    return Response(status_code=routes.CLIENT_CLOSED)


async def _on_unexpected(request: Request, exc: Exception) -> Response:
    # NOTE: the client gets a generic 500; the detail goes to the log only.
    log.exception("unhandled error on %s", request.url.path)
    return _error_response(Router.error("internal", "Internal server error."), request)


ROUTES = [
    Route("/v1/chat/completions", routes.chat_completions, methods=["POST", "GET"]),
    Route("/v1/completions", routes.completions, methods=["POST"]),
    Route("/v1/responses", routes.responses, methods=["POST"]),
    Route("/v1/embeddings", routes.embeddings, methods=["POST"]),
    # vLLM's scoring routes, under each name it serves them by (Jina's and Cohere's among them)
    *(Route(path, routes.score, methods=["POST"]) for path in ("/score", "/v1/score")),
    *(Route(path, routes.rerank, methods=["POST"]) for path in ("/rerank", "/v1/rerank", "/v2/rerank")),
    Route("/v1/messages", routes.messages, methods=["POST"]),
    Route("/inference/v1/generate", routes.generate, methods=["POST"]),   # vLLM's tokens in, tokens out
    Route("/v1/messages/count_tokens", routes.messages_count_tokens, methods=["POST"]),
    Route("/v1/responses/input_tokens", routes.responses_input_tokens, methods=["POST"]),
    Route("/v1/responses/compact", routes.compact_response, methods=["POST"]),
    Route("/v1/responses/{response_id}", routes.stored_response, methods=["GET", "DELETE"]),
    Route("/v1/responses/{response_id}/cancel", routes.cancel_response, methods=["POST"]),
    Route("/v1/responses/{response_id}/input_items", routes.response_input_items, methods=["GET"]),
    Route("/v1/conversations", routes.conversations, methods=["POST"]),
    Route("/v1/conversations/{conversation_id}", routes.conversations, methods=["GET", "POST", "DELETE"]),
    Route("/v1/conversations/{conversation_id}/items", routes.conversation_items, methods=["GET", "POST"]),
    Route("/v1/conversations/{conversation_id}/items/{item_id}", routes.conversation_items, methods=["GET", "DELETE"]),
    Route("/v1/chat/completions/render", routes.chat_render, methods=["POST"]),
    # (after the render route, which would otherwise be read as a stored completion's id)
    Route("/v1/chat/completions/{completion_id}", routes.stored_chat_completions, methods=["GET", "POST", "DELETE"]),
    Route("/v1/chat/completions/{completion_id}/messages", routes.stored_chat_messages, methods=["GET"]),
    Route("/v1/completions/render", routes.completion_render, methods=["POST"]),
    Route("/v1/models", routes.models, methods=["GET"]),
    Route("/v1/models/{model_id:path}", routes.model, methods=["GET"]),
    Route("/tokenize", routes.tokenize, methods=["POST"]),
    Route("/detokenize", routes.detokenize, methods=["POST"]),
    Route("/health", routes.health, methods=["GET"]),
    Route("/ping", routes.health, methods=["GET", "POST"]),   # vLLM's name for it (SageMaker's probe)
    Route("/invocations", routes.invocations, methods=["POST"]),   # SageMaker's inference route, as vLLM's
    Route("/ready", routes.ready, methods=["GET"]),
    Route("/load", routes.load, methods=["GET"]),
    Route("/version", routes.version, methods=["GET"]),
    Route("/metrics", routes.metrics, methods=["GET"]),
]
# vLLM's routes that load and unload LoRA adapters: POST with --allow-runtime-lora-updating;
# without it, every method on them gets the 404 that names the flag (a 405 for GET would say
# they were open).
_EVERY_METHOD = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
RUNTIME_LORA_ROUTES = [
    Route("/v1/load_lora_adapter", routes.load_lora_adapter, methods=["POST"]),
    Route("/v1/unload_lora_adapter", routes.unload_lora_adapter, methods=["POST"]),
]
# Mounted with --admin-api-key, behind those keys alone (middleware.ADMIN_PATHS).
ADMIN_ROUTES = [
    Route("/reset_prefix_cache", routes.reset_prefix_cache, methods=["POST"]),
]


def create_app(config: Config | None = None, engine: AsyncEngine | None = None) -> Starlette:
    """An ASGI app serving `config` (or an already started `engine`)."""
    if config is not None and not isinstance(config, Config):
        raise TypeError(f"create_app takes a llmserve.Config (Config(model=...)), not a {type(config).__name__}")
    if config is not None and engine is not None and config != engine.config:
        # (the engine was built from its own config: the app would serve its model under
        # this config's keys and names, and neither would say so)
        raise ValueError("create_app takes a config (and builds its engine) or an engine (and serves its "
                         "config), not both: this config differs from the engine's")
    config = config or (engine.config if engine else Config())
    owns_engine = engine is None
    loading: list[asyncio.Future] = []   # the load, once started

    def start_loading() -> None:
        # Load in the background: the server answers /health and /ready (503) meanwhile.
        if owns_engine and not loading:
            if app.state.engine.state != "loading":
                # An earlier lifespan drained it (it served the event loop that ended): this
                # one (a test suite's next `with TestClient(app)`) loads a new engine rather
                # than answering every request with the dead one's 503.
                _serve_engine(app, AsyncEngine(config))
            task = app.state.engine.start_soon()
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
            loading.append(task)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        start_loading()
        try:
            yield
        finally:
            if owns_engine:
                if not loading[0].done():
                    loading[0].cancel()
                app.state.backgrounds.stop_all()
                await app.state.engine.drain(stop_timeout=_step_wait(app.state))
                loading.clear()   # (a next lifespan starts a new engine)

    lora_routes = RUNTIME_LORA_ROUTES if config.model.allow_runtime_lora_updating else [
        Route(r.path, routes.runtime_lora_off, methods=_EVERY_METHOD) for r in RUNTIME_LORA_ROUTES]
    served = [*ROUTES, *lora_routes]
    if config.server.admin_api_key:
        if set(config.server.admin_api_key) & set(config.server.api_key):
            raise ValueError("an --admin-api-key must be a key of its own, not also an --api-key")
        served += ADMIN_ROUTES
    app = Starlette(
        routes=served,
        lifespan=lifespan,
        exception_handlers={ApiError: _on_api_error, HTTPException: _on_http_error,
                            ClientDisconnect: _on_client_gone, Exception: _on_unexpected},
    )
    # (TrailingSlash answers a route's path with a slash added; Starlette's redirect is not
    # wanted)
    app.router.redirect_slashes = False
    _serve_engine(app, engine or AsyncEngine(config))
    app.state.max_body_bytes = config.server.max_body_bytes
    # how long the lifespan's drain waits for the engine's step in progress (None: until it
    # ends; `llmserve run` bounds it, then exits at once), and the time.monotonic() by which
    # the whole stop must be over (None: no such bound; `llmserve run` sets it at the signal)
    app.state.stop_timeout = None
    app.state.stop_deadline = None
    app.add_middleware(TrailingSlash)
    app.add_middleware(StartOnFirstRequest, start=start_loading)
    app.add_middleware(ApiKeyMiddleware, keys=config.server.api_key, admin_keys=config.server.admin_api_key,
                       max_body_bytes=config.server.max_body_bytes)
    if config.server.allowed_origins:
        # Outside the key check: a browser's preflight (OPTIONS) carries no key. The pages of
        # these origins may then send JSON with their keys, and read the answers and our
        # headers.
        server = config.server
        app.add_middleware(CORSMiddleware, allow_origins=list(server.allowed_origins),
                           allow_methods=list(server.allowed_methods or ("GET", "POST", "DELETE")),
                           allow_headers=list(server.allowed_headers or ("*",)),
                           allow_credentials=server.allow_credentials,
                           expose_headers=EXPOSED_HEADERS, max_age=600)
    if config.server.enable_request_id_headers:
        # (outside the key check and CORS: their own answers get the header too)
        app.add_middleware(RequestIdMiddleware)
    if config.server.logs_access():
        app.add_middleware(AccessLogMiddleware, quiet=config.server.quiet_paths())
    return app


def _serve_engine(app: Starlette, engine: AsyncEngine) -> None:
    """Makes `engine` the one the app's routes serve."""
    app.state.engine = engine
    app.state.backgrounds = Backgrounds.of(engine)


def _step_wait(state) -> float | None:
    """How long the lifespan's drain waits for the engine's step in progress: the app's
    `stop_timeout`, cut to what is left before its `stop_deadline` (at least a moment)."""
    timeout, deadline = state.stop_timeout, state.stop_deadline
    if deadline is None:
        return timeout
    left = max(0.5, deadline - time.monotonic())
    return left if timeout is None else min(timeout, left)


class StartOnFirstRequest:
    """Calls `start` (idempotent) before each HTTP request: where no lifespan started the
    model load (the app is mounted inside another), the first request starts it and gets
    the 503 "loading" any request gets until it is done."""

    def __init__(self, app, start) -> None:
        self.app = app
        self.start = start

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            self.start()
        await self.app(scope, receive, send)


# How long a stop signal waits for running requests before the server closes anyway.
DRAIN_TIMEOUT_S = 20.0
# After the drain: how long uvicorn waits for open connections to finish sending.
CLOSE_TIMEOUT_S = 5
# How long `llmserve run`'s shutdown waits for the engine's step in progress to end (a
# long prompt's step on a CPU takes seconds)...
ENGINE_STOP_TIMEOUT_S = 10.0
# ...but no later than this long after the first stop signal, so that the whole stop fits in
# Kubernetes' default 30 s grace period (the drain, the close and then the step's wait would
# otherwise add up to 40 s, and the pod would be killed instead of exiting 0).
STOP_BUDGET_S = 29.0
# The signals that stop `llmserve run` (with a drain).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# Exit status of `llmserve run` when it never served: the address could not be bound or the
# model failed to load (uvicorn's own code for a failed startup).
STARTUP_FAILURE = 3


class DrainingServer(uvicorn.Server):
    """uvicorn, with a drain before it stops listening, and an exit when loading fails.

    On SIGTERM or SIGINT uvicorn closes its sockets at once, so a load balancer probing /ready
    sees a refused connection, not a drain. Here the first signal keeps the listener open:
    /ready answers 503 "draining", new requests get 503 with Retry-After, running ones finish
    (up to DRAIN_TIMEOUT_S); then uvicorn's own shutdown runs: it gives open connections
    CLOSE_TIMEOUT_S to finish sending, and the lifespan's drain waits no longer than what
    is left of the first one. A second signal skips the wait. Requests still running when the
    wait ends (or at the second signal) get a proper ending first: a 503 with Retry-After, or
    an error frame and [DONE] (`_end_running`), never a cut-off stream.

    The model loads in the background after the socket is open. If loading fails the
    server can never become ready, so it shuts down (`load_failed` is then True) instead of
    answering 503 + Retry-After forever: a supervisor or a shell sees the exit.
    """

    def __init__(self, config: uvicorn.Config, app: Starlette) -> None:
        super().__init__(config)
        self.app_state = app.state
        self.engine: AsyncEngine = app.state.engine
        self.load_failed = False
        self._drain: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    async def on_tick(self, counter: int) -> bool:
        # uvicorn's main loop calls this every 0.1 s; a load failure ends the loop like a
        # signal would (the lifespan's drain then finds nothing to wait for).
        # NOTE: only while the loop runs: a shutdown that cancels the load also leaves the
        # engine "failed", and that is not a load failure.
        if self.engine.state == "failed" and not self.should_exit:
            log.error("the model failed to load (see the error above); exiting")
            self.load_failed = True
            self.should_exit = True
        return await super().on_tick(counter)

    @contextlib.contextmanager
    def capture_signals(self):
        """uvicorn's, without raising the caught signals again once the server has stopped:
        the drain was the stop that was asked for, so `llmserve run` exits 0 whichever signal
        asked (re-raised, SIGTERM ended the process by signal and a second SIGINT surfaced as
        a KeyboardInterrupt traceback). Signals that come after the server stopped are
        ignored from then on: the process is on its way out (a SIGINT during the
        interpreter's teardown would end it by signal)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        for sig in STOP_SIGNALS:
            signal.signal(sig, self.handle_exit)
        try:
            yield
        finally:
            for sig in STOP_SIGNALS:
                signal.signal(sig, signal.SIG_IGN)

    def handle_exit(self, sig: int, frame) -> None:
        if self.app_state.stop_deadline is None:
            self.app_state.stop_deadline = time.monotonic() + STOP_BUDGET_S
        if self.should_exit:
            # Already stopping. Asking uvicorn again would make it force the exit, which
            # cuts the lifespan's shutdown short; what still runs is answered instead.
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._end_running)
            return
        if self._drain is not None and self._loop is not None:
            # A second signal: stop now, but answer what still runs first (below).
            self._loop.call_soon_threadsafe(self._end_running)
        if self._drain is not None or self._loop is None or self.engine.state != "ready":
            super().handle_exit(sig, frame)
            return
        running = self.engine.load()["requests"]
        log.info("signal %d: draining (%d request%s running)", sig, running, "" if running == 1 else "s")
        # NOTE: a signal handler runs between bytecodes of the loop's thread: hand the work
        # to the loop instead of starting it here.
        self._drain = self._loop.create_task(self._drain_then_exit(sig))

    async def _drain_then_exit(self, sig: int) -> None:
        if stopped := self.app_state.backgrounds.stop_all():
            log.info("stopped %d background responses: they would finish in a store that goes with the process",
                     stopped)
        if not await self.engine.wait_drained(DRAIN_TIMEOUT_S):
            log.warning("drain timed out after %.0f s; closing with requests running", DRAIN_TIMEOUT_S)
            self._end_running()
            # let the handlers write those endings before uvicorn closes the connections
            await asyncio.sleep(0.2)
        if not self.should_exit:
            # (a second signal already asked; asking again would make uvicorn force the exit
            # and cut the lifespan's shutdown short)
            super().handle_exit(sig, None)

    def _end_running(self) -> None:
        """Requests still running when the server must stop get a proper ending (503 with
        Retry-After, or an error frame and [DONE]) instead of being cut off."""
        ended = self.engine.end_all()
        if ended:
            log.warning("ended %d running requests with 503: the server is stopping", ended)


def _tls_options(server: ServerConfig) -> dict | None:
    """uvicorn's TLS options for --ssl-certfile and the rest ({} for plain HTTP), or None (and
    the error logged) when the files do not make a TLS context: checked before anything binds
    or loads, so a bad key fails at once with what is wrong."""
    if server.ssl_certfile is None:
        return {}
    options = {"ssl_certfile": server.ssl_certfile, "ssl_keyfile": server.ssl_keyfile,
               "ssl_ca_certs": server.ssl_ca_certs, "ssl_cert_reqs": server.ssl_cert_reqs}
    try:
        uvicorn.config.create_ssl_context(server.ssl_certfile, server.ssl_keyfile, None, ssl.PROTOCOL_TLS_SERVER,
                                          server.ssl_cert_reqs, server.ssl_ca_certs, None)
    except (OSError, ssl.SSLError) as exc:
        log.error("cannot serve HTTPS with --ssl-certfile %s: %s", server.ssl_certfile, exc)
        return None
    return options


def _listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (uvicorn starts listening on it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def _listen_unix(path: str) -> socket.socket:
    """A Unix domain socket bound at `path` (uvicorn starts listening on it), mode 0666 as
    uvicorn's own --uds makes it. A socket file nobody listens on (a server that was killed)
    is replaced; one that answers, or a path that is not a socket, is an error."""
    if os.path.lexists(path):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise OSError(f"{path} exists and is not a socket")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(path)
            except OSError:
                os.unlink(path)        # stale: nothing listens there
            else:
                raise OSError(f"another server listens on {path}")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        os.chmod(path, 0o666)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def _loopback(host: str) -> bool:
    """Whether `host` (an address or name this server bound) is this machine's loopback only."""
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback for info in socket.getaddrinfo(host, None))
    except (OSError, ValueError):
        return False


def serve(config: Config) -> int:
    """Run `llmserve run`: bind, load, serve until interrupted, drain. Returns the exit
    status: 0 after a normal stop, STARTUP_FAILURE if the address could not be bound or the
    model failed to load. SIGINT and SIGTERM stay ignored once it returns: the process is
    meant to exit."""
    host, port, uds = config.server.host, config.server.port, config.server.uds
    tls = _tls_options(config.server)
    if tls is None:
        return STARTUP_FAILURE
    # Bind before anything loads: a taken port fails in milliseconds, not after loading the
    # model (uvicorn binds only after the lifespan has started the load, and the process
    # would then wait for the loading thread before it could exit).
    if uds and (host, port) != (ServerConfig.host, ServerConfig.port):
        log.warning("--host/--port (%s:%d) are not used: --uds serves on the socket alone", host, port)
    try:
        sock = _listen_unix(uds) if uds else _listen(host, port)
    except OSError as exc:
        log.error("cannot listen on %s: %s", uds or f"{host}:{port}", exc)
        return STARTUP_FAILURE
    app = create_app(config)
    app.state.stop_timeout = ENGINE_STOP_TIMEOUT_S
    scheme = "https" if tls else "http"
    if uds:
        log.info("listening on %s over the Unix socket %s (OpenAI API under /v1)", scheme, uds)
    else:
        # (an IPv6 address in a URL is bracketed: http://[::1]:8000)
        log.info("listening on %s://%s:%d (OpenAI API under /v1)", scheme, f"[{host}]" if ":" in host else host,
                 sock.getsockname()[1])
    if config.server.admin_api_key:
        log.info("admin routes (POST /reset_prefix_cache) mounted behind their own keys (%d)",
                 len(config.server.admin_api_key))
    if config.server.api_key:
        log.info("API keys required (%d) on every route but /health (/ping), /ready and /metrics",
                 len(config.server.api_key))
        if not all(key.isascii() for key in config.server.api_key):
            log.warning("an API key holds non-ASCII characters: most clients (the openai SDK, httpx, "
                        "browsers) cannot send it in a header")
    elif not uds and not _loopback(host):
        log.warning("no API key (--api-key or LLMSERVE_API_KEY): anyone who reaches %s:%d can use the model",
                    host, sock.getsockname()[1])
    else:
        log.info("no API key: requests are not authenticated (only this machine can reach %s)", uds or host)
    server = DrainingServer(uvicorn.Config(app, host=host, port=port,
                                           access_log=False, log_level=config.server.uvicorn_log_level or "warning",
                                           timeout_graceful_shutdown=CLOSE_TIMEOUT_S,
                                           root_path=config.server.root_path, **tls),
                            app)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        if uds:
            with contextlib.suppress(OSError):
                os.unlink(uds)
    code = STARTUP_FAILURE if server.load_failed or not server.started else 0
    if app.state.engine.loading():
        log.info("stopped while the model was loading (exit status 0: a stop that was asked for)")
    if app.state.engine.busy():
        # Stopped while the model loads, or inside a step that outlasted the stop (a long
        # prompt on a CPU): that thread is inside torch, and an interpreter that finalizes
        # around it aborts the process. Every request has had its answer; nothing is left to
        # save.
        logging.shutdown()
        os._exit(code)
    return code
