"""The routes: each reads bytes, hands them to the engine, writes the bytes it gets back.

No protocol logic lives here: validation, templates, tokenization and every response body
are built in Rust. The only decisions made here are HTTP ones: status codes of the engine's
state, streaming, keep-alive comments and client disconnects.
"""

from __future__ import annotations

import asyncio
import gzip
import zlib

import orjson
from prometheus_client.exposition import gzip_accepted
from starlette.requests import Request
from starlette.responses import Response

import llmserve
from llmserve import _core
from llmserve._core import Router
from llmserve._core import __version__ as core_version
from llmserve.engine.async_engine import AsyncEngine, RequestStream
from llmserve.server.background import KEEP_EVENTS_S, Backgrounds, Reader
from llmserve.server.middleware import error_request_id

JSON = "application/json"
# A body that stops arriving for this long is a 408 (the client keeps nothing of ours busy).
BODY_IDLE_TIMEOUT_S = 30.0


def _engine(request: Request) -> AsyncEngine:
    return request.app.state.engine


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == JSON or (media.startswith("application/") and media.endswith("+json"))


async def read_body(request: Request) -> bytes:
    """The request body, refused with 413 past --max-body-bytes (before reading it all),
    with 400 when its Content-Type says it is not JSON, and with 408 when it stops arriving
    for BODY_IDLE_TIMEOUT_S; a gzip or deflate Content-Encoding is undone.

    NOTE: as vLLM does. A web page may POST `text/plain` or a form to any origin without a
    CORS preflight: without this check, any page a local user opens could make a keyless
    llmserve on localhost generate. A request without a Content-Type is still read as JSON
    (clients that send raw bytes), but not from a web page (a browser sends `Origin` with
    every POST, and may send raw bytes with no Content-Type without a preflight too)."""
    content_type = request.headers.get("content-type")
    if content_type is not None and not _is_json(content_type):
        raise Router.error("unsupported_media_type",
                           f"Unsupported media type {content_type!r}: the body must be JSON "
                           f"(Content-Type: {JSON}).")
    if content_type is None and "origin" in request.headers:
        raise Router.error("unsupported_media_type",
                           f"A request from a web page (it has an Origin header) must say its body is "
                           f"JSON (Content-Type: {JSON}).")
    limit = request.app.state.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise Router.error("payload_too_large", limit=limit)
    parts, size = [], 0
    chunks = request.stream().__aiter__()
    while True:
        # NOTE: uvicorn has no body timeout: a client that declares more than it sends would
        # hold its connection (and this handler) forever.
        try:
            chunk = await asyncio.wait_for(chunks.__anext__(), BODY_IDLE_TIMEOUT_S)
        except StopAsyncIteration:
            break
        except TimeoutError:
            raise Router.error("request_timeout", limit=int(BODY_IDLE_TIMEOUT_S)) from None
        size += len(chunk)
        if size > limit:
            raise Router.error("payload_too_large", limit=limit)
        parts.append(chunk)
    body = b"".join(parts)
    # (several field lines are one list, RFC 9110 5.3)
    encoding = ",".join(request.headers.getlist("content-encoding"))
    if not encoding:
        return body
    # (inflating takes time in proportion to the body, off the event loop that answers every
    # other request)
    return await asyncio.to_thread(_decode, body, encoding, limit)


# Content-Encoding -> zlib's wbits: gzip, and HTTP's "deflate" (zlib-wrapped; a raw deflate
# stream, which some clients send under that name, is tried when the zlib header is missing)
_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


# The most codings a body may carry: each is inflated up to --max-body-bytes, so their number
# bounds the work (a client compresses once; a proxy may add one).
MAX_CODINGS = 2


def _decode(body: bytes, content_encoding: str, limit: int) -> bytes:
    """The body with its Content-Encoding undone (the codings are listed in the order they
    were applied); --max-body-bytes bounds the decoded size too, checked as it inflates, so a
    small compressed bomb is refused with 413 and never held whole."""
    codings = [c for c in (c.strip().lower() for c in content_encoding.split(",")) if c not in ("", "identity")]
    for coding in codings:
        if coding not in _WBITS:
            raise Router.error("unsupported_media_type",
                               f"Unsupported Content-Encoding {coding!r}: send the body as is, "
                               f"gzip or deflate.")
    if len(codings) > MAX_CODINGS:
        raise Router.error("unsupported_media_type",
                           f"A body may carry at most {MAX_CODINGS} content codings; this one lists "
                           f"{len(codings)} (Content-Encoding: {content_encoding[:100]!r}).")
    for coding in reversed(codings):
        body = _inflate(body, coding, limit)
    return body


def _inflate(body: bytes, coding: str, limit: int) -> bytes:
    for bits in (_WBITS[coding], -zlib.MAX_WBITS) if coding == "deflate" else (_WBITS[coding],):
        out = _inflate_members(body, bits, limit)
        if out is not None:
            return out
    raise Router.error("invalid_request",
                       f"The request body is not valid {coding} data (Content-Encoding: {coding}).",
                       param="body")


# Compressed bytes handed to the inflater at a time: what it leaves unused past a member's end
# (copied out by zlib) is at most this, so many small members cost time in proportion to the
# body, not to its square.
_INFLATE_WINDOW = 16 * 1024
# The most gzip members a body may hold (a writer that flushes often makes one per flush): each
# costs an inflater and a window's copy, so a small body of many empty ones, compressed again,
# took seconds.
MAX_GZIP_MEMBERS = 4096


def _inflate_members(data: bytes, wbits: int, limit: int) -> bytes | None:
    """Every member of `data` inflated and joined (gzip allows several, RFC 1952 2.2; zero
    padding after the last is ignored, as gzip(1) does); None if it is not such data."""
    view = memoryview(data)
    parts, size, at = [], 0, 0
    for _ in range(MAX_GZIP_MEMBERS):
        inflater = zlib.decompressobj(wbits)
        while not inflater.eof:
            if at >= len(view):
                return None               # (the data ends inside a member)
            chunk = view[at:at + _INFLATE_WINDOW]
            try:
                out = inflater.decompress(chunk, limit + 1 - size)
                while inflater.unconsumed_tail and not inflater.eof and size + len(out) <= limit:
                    out += inflater.decompress(inflater.unconsumed_tail, limit + 1 - size - len(out))
            except zlib.error:
                return None
            size += len(out)
            if size > limit:
                raise Router.error("payload_too_large", limit=limit)
            parts.append(out)
            at += len(chunk) - len(inflater.unused_data) - len(inflater.unconsumed_tail)
        if at == len(view) or not any(view[at:]):
            return b"".join(parts)
        if wbits != _WBITS["gzip"]:  # only gzip has members
            return None
    raise Router.error("invalid_request", f"The request body holds more than {MAX_GZIP_MEMBERS} gzip members: "
                                          f"compress it as one.", param="body")


async def _until_disconnect(request: Request) -> None:
    await _until_disconnect_raw(request.receive)


async def _whole(request: Request, stream: RequestStream) -> bytes | None:
    """A non-streamed response; None if the client left first (the request is aborted)."""
    return await _unless_client_leaves(request, stream, stream.read_all())


async def _first_frame(request: Request, stream: RequestStream, keep_alive: float | None) -> bytes | None:
    """A stream's first bytes (a keep-alive comment after `keep_alive` seconds without any);
    None if the client left first (the request is aborted: a long prompt's prefill, or
    the wait in the queue, is not worked through for nobody)."""
    async def first() -> bytes | None:
        try:
            return await stream.next(timeout=keep_alive)
        except TimeoutError:
            return KEEP_ALIVE
    return await _unless_client_leaves(request, stream, first())


async def _unless_client_leaves(request: Request, stream: RequestStream, work) -> bytes | None:
    """`work`'s result, or None (and the request aborted) if the client disconnects first."""
    reading = asyncio.ensure_future(work)
    leaving = asyncio.ensure_future(_until_disconnect(request))
    try:
        done, _ = await asyncio.wait({reading, leaving}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        leaving.cancel()
        if not reading.done():
            reading.cancel()
            await stream.aclose()
    return reading.result() if reading in done else None


async def _generate(request: Request, endpoint: str, body: bytes | None = None) -> Response:
    engine = _engine(request)
    body = await read_body(request) if body is None else body
    stream = await engine.submit(endpoint, body, request.headers.get("x-request-id"))
    request.state.user = stream.user
    headers = dict(stream.headers)
    if stream.background:
        return await _background(request, stream, headers)
    if not stream.stream:
        data = await _whole(request, stream)
        if data is None:
            return Response(status_code=CLIENT_CLOSED)
        return Response(data, media_type=JSON, headers=headers)

    keep_alive = engine.config.server.sse_keep_alive
    try:
        # NOTE: wait for the first bytes so a failure before any output is a real 500 (or
        # 4xx), not a 200 with an error frame; keep-alive still bounds the silent wait (once
        # a comment has begun the response, a failure is an error frame and [DONE]).
        first = await _first_frame(request, stream, keep_alive)
    except BaseException:
        await stream.aclose()
        raise
    if first is None:
        return Response(status_code=CLIENT_CLOSED)
    headers.update({"cache-control": "no-cache", "x-accel-buffering": "no"})
    return EventStreamResponse(stream, first, keep_alive, headers)


KEEP_ALIVE = b": keep-alive\n\n"
# What the access log shows for a request whose client left before its answer (nginx's 499).
CLIENT_CLOSED = 499


class EventStreamResponse(Response):
    """Writes a request's SSE bytes as they come and aborts the request the moment the
    client goes away (disconnect or failed write), so its KV blocks are freed at once."""

    media_type = "text/event-stream"

    def __init__(self, stream: RequestStream | Reader, first: bytes | None, keep_alive: float | None,
                 headers: dict) -> None:
        # NOTE: no content-length: the body's size is unknown until the stream ends.
        self.status_code, self.background = 200, None
        self.init_headers(headers)
        self.stream, self.first, self.keep_alive = stream, first, keep_alive

    async def _pump(self, send) -> None:
        # From here on the status is sent: an error, even before the first token (this
        # response may begin with a keep-alive comment), must go out as an SSE frame.
        self.stream.started = True
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        item = self.first if self.first is not None else await self._next()
        while item is not None:
            await send({"type": "http.response.body", "body": item, "more_body": True})
            item = await self._next()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _next(self) -> bytes | None:
        try:
            return await self.stream.next(timeout=self.keep_alive)
        except TimeoutError:
            return KEEP_ALIVE

    async def __call__(self, scope, receive, send) -> None:
        pump = asyncio.ensure_future(self._pump(send))
        watch = asyncio.ensure_future(_until_disconnect_raw(receive))
        try:
            await asyncio.wait({pump, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (pump, watch):
                task.cancel()
            await self.stream.aclose()
        if pump.done() and not pump.cancelled() and pump.exception() is not None:
            exc = pump.exception()
            if not isinstance(exc, OSError):  # a client gone mid-write is not our error
                raise exc


async def _until_disconnect_raw(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def chat_completions(request: Request) -> Response:
    """POST generates; GET lists the completions kept by `store: true`."""
    if request.method in ("GET", "HEAD"):
        return await _stored_chat(request, messages=False)
    return await _generate(request, "chat")


async def completions(request: Request) -> Response:
    return await _generate(request, "completion")


async def generate(request: Request) -> Response:
    """POST /inference/v1/generate: vLLM's tokens-in, tokens-out route (token ids and a
    `sampling_params` object in; token ids, no text, out)."""
    return await _generate(request, "generate")


async def responses(request: Request) -> Response:
    return await _generate(request, "responses")


async def embeddings(request: Request) -> Response:
    return await _generate(request, "embeddings")


async def reset_prefix_cache(request: Request) -> Response:
    """Admin (vLLM's dev route): empty the prefix cache, so no later prompt finds an earlier
    one's blocks (a cold-cache benchmark, a changed model file). Answers how many blocks it
    held."""
    blocks = await _engine(request).reset_prefix_cache()
    return Response(orjson.dumps({"reset": True, "cached_blocks": blocks}), media_type=JSON)


async def score(request: Request) -> Response:
    """vLLM's /score: text pairs scored by the cosine of their embeddings."""
    return await _generate(request, "score")


async def rerank(request: Request) -> Response:
    """vLLM's /rerank: documents ranked by the cosine of their embeddings with a query's."""
    return await _generate(request, "rerank")


async def messages(request: Request) -> Response:
    """Anthropic's Messages API."""
    return await _generate(request, "messages")


async def invocations(request: Request) -> Response:
    """POST /invocations (SageMaker's, as vLLM serves it): a chat, completion, embeddings, score
    or rerank request by its keys (the router says which), answered as its own route answers it."""
    body = await read_body(request)
    return await _generate(request, Router.invocation_endpoint(body), body)


def _backgrounds(request: Request) -> Backgrounds:
    return request.app.state.backgrounds


async def _background(request: Request, stream: RequestStream, headers: dict) -> Response:
    """A background response runs on its own (a client that leaves does not stop it): the
    answer is its `queued` object, or its events as they come when the client streams."""
    run = _backgrounds(request).start(stream)
    if not stream.answer_streamed:
        return Response(_engine(request).router.stored_response(run.id), media_type=JSON, headers=headers)
    return _events(request, Reader(run, -1), headers)


def _events(request: Request, reader: Reader, headers: dict) -> Response:
    headers.update({"cache-control": "no-cache", "x-accel-buffering": "no"})
    return EventStreamResponse(reader, None, _engine(request).config.server.sse_keep_alive, headers)


async def stored_response(request: Request) -> Response:
    """GET (read) and DELETE (forget) /v1/responses/{id}: a response kept by `store`; a
    background response's events with `?stream=true` (after `starting_after`)."""
    router, response_id = _engine(request).router, request.path_params["response_id"]
    if request.method == "DELETE":
        body = router.delete_response(response_id)
        _backgrounds(request).stop(response_id)
        return Response(body, media_type=JSON)
    query = list(request.query_params.multi_items())
    # (404 first, for an unknown id)
    body, headers = router.read_response(response_id, False, query)
    after = Router.replay_start(query)
    if after is None:
        return Response(body, media_type=JSON, headers=dict(headers))
    run = _backgrounds(request).get(response_id)
    if run is None:
        # OpenAI streams a stored response's events only for a background one
        why = ("its events are kept for "
               f"{KEEP_EVENTS_S / 60:g} minutes after it ends" if router.background_response(response_id)
               else "only background responses (`background: true`) can be streamed again")
        raise Router.error("invalid_request", f"Response {response_id!r} cannot be streamed: {why}. Read it "
                           "without `stream`.", param="stream")
    return _events(request, Reader(run, after), dict(headers))


async def response_input_items(request: Request) -> Response:
    """GET /v1/responses/{id}/input_items?order=&limit=&after=&include=: the conversation it
    answered."""
    page, headers = _engine(request).router.read_response(
        request.path_params["response_id"], True, list(request.query_params.multi_items()))
    return Response(page, media_type=JSON, headers=dict(headers))


async def cancel_response(request: Request) -> Response:
    """POST /v1/responses/{id}/cancel: a running background response stops, `cancelled`; one
    that has ended is answered as it is (a 400 for a response not run in the background)."""
    response_id = request.path_params["response_id"]
    body = _engine(request).router.cancel_response(response_id)
    _backgrounds(request).stop(response_id)
    return Response(body, media_type=JSON)


async def _store_route(request: Request, route, *args) -> Response:
    """A stored-item route (the Conversations API, stored chat completions): the method, `args`
    (the path's ids), the query and the body go to the router's `route`, which answers them
    from its store."""
    body = await read_body(request) if request.method == "POST" else b""
    method = "GET" if request.method == "HEAD" else request.method   # (Starlette sends no body back)
    out, headers = await asyncio.to_thread(route, method, *args, list(request.query_params.multi_items()), body)
    return Response(out, media_type=JSON, headers=dict(headers))


async def _conversations(request: Request, items: bool) -> Response:
    """OpenAI's Conversations API."""
    path = request.path_params
    return await _store_route(request, _engine(request).router.conversations, path.get("conversation_id"),
                              path.get("item_id"), items)


async def _stored_chat(request: Request, messages: bool) -> Response:
    """OpenAI's stored chat completions (`store: true`)."""
    return await _store_route(request, _engine(request).router.stored_chat, request.path_params.get("completion_id"),
                              messages)


async def stored_chat_completions(request: Request) -> Response:
    """/v1/chat/completions/{id}: a kept completion."""
    return await _stored_chat(request, messages=False)


async def stored_chat_messages(request: Request) -> Response:
    """GET /v1/chat/completions/{id}/messages."""
    return await _stored_chat(request, messages=True)


async def conversations(request: Request) -> Response:
    """/v1/conversations and /v1/conversations/{id}."""
    return await _conversations(request, items=False)


async def conversation_items(request: Request) -> Response:
    """/v1/conversations/{id}/items and /v1/conversations/{id}/items/{item_id}."""
    return await _conversations(request, items=True)


def _handler(endpoint: str):
    async def handle(request: Request) -> Response:
        body = await read_body(request)
        out, headers = await _engine(request).handle(endpoint, body)
        return Response(out, media_type=JSON, headers=dict(headers))

    handle.__name__ = endpoint
    return handle


tokenize = _handler("tokenize")
detokenize = _handler("detokenize")
chat_render = _handler("chat_render")
completion_render = _handler("completion_render")
responses_input_tokens = _handler("responses_input_tokens")   # POST /v1/responses/input_tokens


async def compact_response(request: Request) -> Response:
    """POST /v1/responses/compact: OpenAI's compaction of a conversation, which this server
    does not do (named here, or `/v1/responses/{id}` would answer it as a 405)."""
    raise Router.error("not_found", "Compacting a conversation (/v1/responses/compact) is not supported: send the "
                       "conversation in `input`, or continue it with `previous_response_id`.")


async def messages_count_tokens(request: Request) -> Response:
    """POST /v1/messages/count_tokens; its answer is named, as every answer on the Messages
    routes is (Anthropic's SDK reads `request-id` as the result's `_request_id`)."""
    body = await read_body(request)
    out, headers = await _engine(request).handle("messages_count_tokens", body)
    named = dict(headers)
    named["x-request-id"] = named["request-id"] = error_request_id(request.headers.get("x-request-id"))
    return Response(out, media_type=JSON, headers=named)


async def runtime_lora_off(request: Request) -> Response:
    """The LoRA load and unload routes of a server started without --allow-runtime-lora-updating
    (app.py mounts them so, for every method)."""
    raise Router.error("not_found", "Loading and unloading LoRA adapters while the server runs is off: start it "
                       "with --allow-runtime-lora-updating (or VLLM_ALLOW_RUNTIME_LORA_UPDATING=true).")


async def load_lora_adapter(request: Request) -> Response:
    """vLLM's POST /v1/load_lora_adapter; its answer is text, as vLLM's."""
    engine = _engine(request)
    text, headers = await engine.load_lora(await read_body(request))
    return Response(text, media_type="text/plain; charset=utf-8", headers=dict(headers))


async def unload_lora_adapter(request: Request) -> Response:
    """vLLM's POST /v1/unload_lora_adapter."""
    engine = _engine(request)
    text, headers = engine.unload_lora(await read_body(request))
    return Response(text, media_type="text/plain; charset=utf-8", headers=dict(headers))


async def models(request: Request) -> Response:
    return Response(_engine(request).router.models(), media_type=JSON)


async def model(request: Request) -> Response:
    return Response(_engine(request).router.model(request.path_params["model_id"]), media_type=JSON)


async def health(request: Request) -> Response:
    alive = _engine(request).alive
    return Response(orjson.dumps({"status": "ok" if alive else "dead"}), status_code=200 if alive else 503,
                    media_type=JSON)


async def ready(request: Request) -> Response:
    engine = _engine(request)
    if engine.state == "ready" and engine.alive:
        return Response(orjson.dumps({"status": "ready"}), media_type=JSON)
    # (a failed load is for good: nothing to retry)
    headers = {} if engine.state == "failed" else {"retry-after": "5"}
    return Response(orjson.dumps({"status": engine.state}), status_code=503, media_type=JSON, headers=headers)


async def load(request: Request) -> Response:
    return Response(orjson.dumps(_engine(request).load()), media_type=JSON)


async def version(request: Request) -> Response:
    import torch

    engine = _engine(request)
    device = str(engine.engine.device) if engine.engine else None
    return Response(orjson.dumps({"version": llmserve.__version__, "core": core_version,
                                  "torch": torch.__version__, "device": device,
                                  "build": _core.build_info}), media_type=JSON)


async def metrics(request: Request) -> Response:
    body = _engine(request).metrics.render()
    headers = {}
    # (Prometheus asks for gzip: the text is ~40 KB, a tenth of it compressed, as vLLM's route sends it)
    if gzip_accepted(request.headers.get("accept-encoding", "")):
        body, headers = gzip.compress(body, compresslevel=6), {"content-encoding": "gzip"}
    return Response(body, headers=headers, media_type="text/plain; version=0.0.4; charset=utf-8")
