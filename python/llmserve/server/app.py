"""The Starlette app factory (`create_app`) and `serve` for `llmserve run`.

`create_app(config)` gives an ASGI app that loads the model at startup (answering /ready
503 meanwhile) and drains on shutdown. Another Starlette or FastAPI service can mount it;
pass `engine=` to share an AsyncEngine it already started.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from llmserve._core import ApiError, Router
from llmserve.config import Config
from llmserve.engine.async_engine import AsyncEngine
from llmserve.server import routes
from llmserve.server.middleware import AccessLogMiddleware, ApiKeyMiddleware

log = logging.getLogger("llmserve.server")


def _error_response(err: ApiError) -> Response:
    headers = {"retry-after": str(err.retry_after)} if err.retry_after else None
    return Response(err.body, status_code=err.status, media_type="application/json", headers=headers)


async def _on_api_error(request: Request, exc: Exception) -> Response:
    return _error_response(exc)


async def _on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        err = Router.error("not_found", f"No route {request.method} {request.url.path}.")
        return _error_response(err)
    err = Router.error("invalid_request", f"{request.method} is not allowed on {request.url.path}.")
    return Response(err.body, status_code=exc.status_code, media_type="application/json")


async def _on_unexpected(request: Request, exc: Exception) -> Response:
    # NOTE: the client gets a generic 500; the detail goes to the log only.
    log.exception("unhandled error on %s", request.url.path)
    return _error_response(Router.error("internal", "Internal server error."))


ROUTES = [
    Route("/v1/chat/completions", routes.chat_completions, methods=["POST"]),
    Route("/v1/completions", routes.completions, methods=["POST"]),
    Route("/v1/chat/completions/render", routes.chat_render, methods=["POST"]),
    Route("/v1/completions/render", routes.completion_render, methods=["POST"]),
    Route("/v1/models", routes.models, methods=["GET"]),
    Route("/v1/models/{model_id:path}", routes.model, methods=["GET"]),
    Route("/tokenize", routes.tokenize, methods=["POST"]),
    Route("/detokenize", routes.detokenize, methods=["POST"]),
    Route("/health", routes.health, methods=["GET"]),
    Route("/ready", routes.ready, methods=["GET"]),
    Route("/load", routes.load, methods=["GET"]),
    Route("/version", routes.version, methods=["GET"]),
    Route("/metrics", routes.metrics, methods=["GET"]),
]


def create_app(config: Config | None = None, engine: AsyncEngine | None = None) -> Starlette:
    """An ASGI app serving `config` (or an already started `engine`)."""
    config = config or (engine.config if engine else Config())
    owns_engine = engine is None
    engine = engine or AsyncEngine(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        loading = None
        if owns_engine:
            # Load in the background: the server answers /health and /ready (503) meanwhile.
            loading = asyncio.ensure_future(engine.start())
            loading.add_done_callback(lambda t: t.cancelled() or t.exception())
        try:
            yield
        finally:
            if owns_engine:
                if loading is not None and not loading.done():
                    loading.cancel()
                await engine.drain()

    app = Starlette(
        routes=ROUTES,
        lifespan=lifespan,
        exception_handlers={ApiError: _on_api_error, HTTPException: _on_http_error,
                            Exception: _on_unexpected},
    )
    app.state.engine = engine
    app.state.max_body_bytes = config.server.max_body_bytes
    app.add_middleware(ApiKeyMiddleware, keys=config.server.api_key)
    if config.server.access_log:
        app.add_middleware(AccessLogMiddleware)
    return app


def serve(config: Config) -> int:
    """Run `llmserve run`: bind, load, serve until interrupted, drain."""
    app = create_app(config)
    log.info("listening on http://%s:%d (OpenAI API under /v1)", config.server.host, config.server.port)
    uvicorn.run(app, host=config.server.host, port=config.server.port, access_log=False,
                log_level="warning", timeout_graceful_shutdown=30)
    return 0
