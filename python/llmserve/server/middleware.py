"""Pure-ASGI middleware: API keys, request-id headers, the access log, and a trailing slash
read as the route without it.

All sit outside Starlette's routing, so a rejected request costs one header lookup.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
import uuid

import orjson
from starlette.middleware import cors
from starlette.responses import Response

from llmserve._core import Router

access_log = logging.getLogger("llmserve.access")

# Probes and scrapes stay open so load balancers and Prometheus need no key.
OPEN_PATHS = frozenset({"/health", "/ping", "/ready", "/metrics"})
# Routes that change the server: with --admin-api-key, only an admin key opens them (and an
# API key does not). /reset_prefix_cache exists only then; vLLM's runtime LoRA routes
# (--allow-runtime-lora-updating, which read any folder the server sees) are behind the API
# keys without admin keys, as vLLM's are.
ADMIN_PATHS = frozenset({"/reset_prefix_cache", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"})


def error_request_id(sent: str | None) -> str:
    """The `x-request-id` of an error response: the client's own id if it sent a plain one,
    else a fresh one (a successful response is named by its response id instead), so the
    SDKs' `error.request_id` always names the failed call in logs."""
    return plain_request_id(sent) or f"req_{uuid.uuid4().hex}"


def plain_request_id(sent: str | None) -> str | None:
    """The client's `X-Request-Id` if it is a plain one (printable ASCII, at most 256
    characters): one a response header may carry back."""
    return sent if sent and len(sent) <= 256 and sent.isascii() and sent.isprintable() else None


# How far past --max-body-bytes a declared body may go and still be read (and dropped) after an
# answer sent before it, keeping the connection.
UNREAD_BODY_FACTOR = 8


def declares_far_more_than(scope, limit: int | None) -> bool:
    """Whether the request declares a body longer than UNREAD_BODY_FACTOR x `limit`
    (--max-body-bytes), which an answer sent before reading it leaves unread: the connection is
    then closed after the answer (`Connection: close`), or uvicorn would read, and drop, all a
    client sends (gigabytes a second). A shorter body is read to its end as usual, so its
    connection stays open: closing one a client is still writing to can cost it the answer (a
    reset), and a client that sends a little too much (a 413) should get its 413."""
    declared = _header(scope, b"content-length")
    return (limit is not None and declared is not None and declared.isdigit()
            and int(declared) > UNREAD_BODY_FACTOR * limit)


def _header(scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def route_path(scope) -> str:
    """The request's path as the routes name it: mounted under a prefix (--root-path), the
    ASGI `path` keeps the prefix, which `root_path` names; the prefix alone is `/`."""
    path, root = scope["path"], scope.get("root_path", "")
    return (path[len(root):] or "/") if root and path.startswith(root) else path


class TrailingSlash:
    """A route's path with slashes added (`/v1/chat/completions/`, `/health/`) is that route,
    answered as such. Starlette would redirect it instead, to a URL built from the client's
    `Host` header, and a client that does not follow redirects (a POST's, most) would get an
    empty 307."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] == "http" and len(path) > 1 and path.endswith("/"):
            scope = {**scope, "path": path.rstrip("/") or "/"}
        await self.app(scope, receive, send)


def anthropic_errors(scope) -> bool:
    """Whether the request's errors take Anthropic's shape (`ApiError.anthropic_body`): those of
    Anthropic's Messages routes (also the 404 of one not served here, its Message Batches,
    `/v1/messages/batches`, which the `anthropic` SDK reads), and those of the models routes,
    which both SDKs call, when the request says it is Anthropic's (the `anthropic-version`
    header its SDK always sends)."""
    path = route_path(scope).rstrip("/")
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return True
    models = path == "/v1/models" or path.startswith("/v1/models/")
    return models and _header(scope, b"anthropic-version") is not None


def error_body(err, scope, request_id: str) -> bytes:
    """The body of `err` (an ApiError) as the request's route answers it: Anthropic's also
    names its `request_id` (the `request-id` header's), as Anthropic's error bodies do."""
    if not anthropic_errors(scope):
        return err.body
    return orjson.dumps({**orjson.loads(err.anthropic_body), "request_id": request_id})


class CORSMiddleware(cors.CORSMiddleware):
    """Starlette's CORS middleware, whose refused preflight (a 400 naming what it refused) is
    answered in the OpenAI error shape rather than as plain text."""

    def preflight_response(self, request_headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code != 400:
            return response
        refused = bytes(response.body).decode()   # "Disallowed CORS origin, method"
        err = Router.error("cors_refused", f"{refused} (the server's --allowed-origins, --allowed-methods and "
                                           "--allowed-headers say what a browser may send).")
        headers = {k: v for k, v in response.headers.items() if k not in ("content-length", "content-type")}
        return Response(err.body, status_code=400, headers=headers, media_type="application/json")


class ApiKeyMiddleware:
    """Every route but OPEN_PATHS needs one of `keys`, as `Authorization: Bearer <key>` (what
    OpenAI clients send) or `x-api-key: <key>` (what Anthropic clients send); ADMIN_PATHS need
    one of `admin_keys` instead, where there are some."""

    def __init__(self, app, keys: tuple[str, ...], admin_keys: tuple[str, ...] = (),
                 max_body_bytes: int | None = None) -> None:
        self.app = app
        self.keys = [k.encode() for k in keys]
        self.admin_keys = [k.encode() for k in admin_keys]
        self.max_body_bytes = max_body_bytes

    @staticmethod
    def _authorized(scope, keys: list[bytes]) -> bool:
        ok = False
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer":
                    ok |= _known(token.strip(), keys)
            elif name == b"x-api-key":
                ok |= _known(value.strip(), keys)
        return ok

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        # (with its trailing slash, an open path redirects to itself: open too)
        path = route_path(scope).rstrip("/")
        if path in ADMIN_PATHS and self.admin_keys:
            keys = self.admin_keys
        elif not self.keys or path in OPEN_PATHS:
            return await self.app(scope, receive, send)
        else:
            keys = self.keys
        if self._authorized(scope, keys):
            return await self.app(scope, receive, send)
        err = Router.error("unauthorized", "Invalid or missing API key (send `Authorization: Bearer <key>`, "
                                           "or `x-api-key: <key>`).")
        request_id = error_request_id(_header(scope, b"x-request-id")).encode()
        headers = [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer"),
                   (b"x-request-id", request_id)]
        if declares_far_more_than(scope, self.max_body_bytes):
            headers.append((b"connection", b"close"))
        if anthropic_errors(scope):
            headers.append((b"request-id", request_id))   # (Anthropic's name for it)
        await send({"type": "http.response.start", "status": err.status, "headers": headers})
        await send({"type": "http.response.body", "body": error_body(err, scope, request_id.decode())})


def _known(token: bytes, keys: list[bytes]) -> bool:
    # NOTE: compare against every key (no early exit) so timing says nothing about which key,
    # or how much of one, matched.
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(token, key)
    return ok


class RequestIdMiddleware:
    """--enable-request-id-headers: every response carries `x-request-id`: the client's own
    `X-Request-Id` when it sent a plain one (as vLLM's flag echoes it, generations included, so
    a proxy can match each response to its request), else the id a response names itself by
    (a generation's response id) or a fresh one."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                own = [value for name, value in headers if name.lower() == b"x-request-id"]
                sent = plain_request_id(_header(scope, b"x-request-id"))
                named = sent or (own[0].decode("latin-1") if own else error_request_id(None))
                if own != [named.encode()]:
                    headers = [(n, v) for n, v in headers if n.lower() != b"x-request-id"]
                    headers.append((b"x-request-id", named.encode()))
                    message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_wrapper)


class AccessLogMiddleware:
    """One line per request: client, method, path, status, `user` when sent, duration; none for
    the `quiet` paths (--disable-access-log-for-endpoints, as the routes name them: under
    --root-path too)."""

    def __init__(self, app, quiet: frozenset[str] = frozenset()) -> None:
        self.app = app
        self.quiet = quiet

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or route_path(scope) in self.quiet:
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status = 0

        async def send_wrapper(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            client = scope.get("client") or ("-", 0)
            user = (scope.get("state") or {}).get("user")
            access_log.info('%s:%s "%s %s" %d%s %.1fms', client[0], client[1], scope["method"],
                            _loggable(scope["path"]), status, f' user="{_loggable(user)}"' if user else "",
                            (time.perf_counter() - start) * 1000)


def _loggable(text: str, limit: int = 256) -> str:
    """Client text as a log line may hold it, between double quotes: cut to `limit`
    characters and written as a JSON string's inside (the path arrives percent-decoded, so a
    `%0a` would start a forged line, and a `"` end the quoted field early)."""
    if len(text) > limit:
        text = f"{text[:limit]}... ({len(text) - limit} more)"
    return json.dumps(text)[1:-1]
