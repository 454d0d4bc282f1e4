"""`llmserve run-batch`: OpenAI's batch file format run offline, as `vllm run-batch` runs it.

Each input line is a request, `{"custom_id", "method": "POST", "url", "body"}`, to
/v1/chat/completions, /v1/completions, /v1/embeddings, /v1/score or /v1/rerank. Each output line
answers the input line at the same place: `{"id", "custom_id", "response": {"status_code", "request_id", "body"},
"error": null}`, where `body` is what the server would have answered, an error body with its
status included (a 400 names its `param`, as over HTTP). A line that is no such request gets
`"response": null` and `"error": {"code", "message"}`, and the rest run on. Fields that have no
effect, which the server names in its `llmserve-ignored-fields` header, are logged (a warning
for each set of them, with the lines that sent it); with `--strict-fields` they are a 400.

Requests go through the offline path (Router.prepare -> Core -> runner -> commit) a window at
a time, so a window's requests share steps as a server's concurrent ones do.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Iterable, Iterator
from typing import Any

import orjson

from llmserve._core import ApiError
from llmserve.engine.loop import core_error, run_to_end

log = logging.getLogger("llmserve")

# The batch API's urls and the router's endpoints that answer them.
URLS = {"/v1/chat/completions": "chat", "/v1/completions": "completion", "/v1/embeddings": "embeddings",
        "/v1/score": "score", "/v1/rerank": "rerank"}
# Requests queued together (their bodies are held meanwhile).
WINDOW = 256


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _line_error(custom_id: Any, code: str, message: str) -> dict:
    return {"id": _new_id("batch_req"), "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


def _answer(custom_id: Any, status: int, body: dict, request_id: str | None = None) -> dict:
    """`request_id`: the answered request's id, as the server's `x-request-id` carries it (an
    embeddings body holds none of its own); errors get a fresh one."""
    if status != 200:
        request_id = _new_id("req")
    elif isinstance(body.get("id"), str):
        request_id = body["id"]
    request_id = request_id or _new_id("req")
    return {"id": _new_id("batch_req"), "custom_id": custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body}, "error": None}


def _read(index: int, line: str) -> tuple[Any, str, bytes] | dict:
    """A line's (custom_id, endpoint, body), or its output line when it is no request."""
    try:
        item = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        return _line_error(None, "invalid_json", f"Line {index + 1} is not JSON: {exc}.")
    if not isinstance(item, dict):
        return _line_error(None, "invalid_request", f"Line {index + 1} must be a JSON object.")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return _line_error(custom_id, "invalid_request", f"Line {index + 1}: `custom_id` must be a non-empty string.")
    if item.get("method", "POST") != "POST":
        return _line_error(custom_id, "invalid_request", f"Line {index + 1}: `method` must be \"POST\".")
    endpoint = URLS.get(item.get("url"))
    if endpoint is None:
        return _line_error(custom_id, "invalid_request", f"Line {index + 1}: `url` must be one of "
                           f"{', '.join(URLS)}, not {item.get('url')!r}.")
    body = item.get("body")
    if not isinstance(body, dict):
        return _line_error(custom_id, "invalid_request", f"Line {index + 1}: `body` must be a JSON object.")
    if body.get("stream"):
        return _answer(custom_id, 400, {"error": {
            "message": "`stream` is not available in a batch: each answer is written whole.",
            "type": "invalid_request_error", "param": "stream", "code": "invalid_value"}})
    return custom_id, endpoint, orjson.dumps(body)


def run_batch(engine, lines: Iterable[str], window: int = WINDOW) -> Iterator[dict]:
    """The output line of each of `lines` (blank ones skipped), in their order. `engine` is
    `build_engine`'s; nothing else may use it meanwhile."""
    core, runner, router = engine.core, engine.runner, engine.router
    batch: list[tuple[int, str]] = []
    for index, line in enumerate(lines):
        if line.strip():
            batch.append((index, line))
        if len(batch) == window:
            yield from _run_window(core, runner, router, batch)
            batch = []
    if batch:
        yield from _run_window(core, runner, router, batch)


def _run_window(core, runner, router, batch: list[tuple[int, str]]) -> list[dict]:
    out: list[dict | None] = [None] * len(batch)
    queued: list[tuple[int, Any]] = []   # (place, custom_id) of each prepared request
    prepared = []
    ignored: dict[tuple[str, ...], list[int]] = {}   # fields without effect -> the lines (from 1) that sent them
    for place, (index, line) in enumerate(batch):
        read = _read(index, line)
        if isinstance(read, dict):
            out[place] = read
            continue
        custom_id, endpoint, body = read
        try:
            prepared.append(router.prepare(endpoint, body))
        except ApiError as err:
            out[place] = _answer(custom_id, err.status, orjson.loads(err.body))
            continue
        queued.append((place, custom_id))
        if prepared[-1].ignored_fields:
            ignored.setdefault(tuple(prepared[-1].ignored_fields), []).append(index + 1)
    for fields, lines in ignored.items():
        shown = ", ".join(map(str, lines[:20])) + (f" and {len(lines) - 20} more" if len(lines) > 20 else "")
        log.warning("these request fields had no effect: %s (line%s %s)", ", ".join(fields),
                    "s" if len(lines) > 1 else "", shown)
    parts: list[list[bytes]] = [[] for _ in prepared]
    ids = [p.id for p in prepared]
    with contextlib.closing(run_to_end(core, runner, prepared)) as outputs:
        for i, data, finished, error in outputs:
            place, custom_id = queued[i]
            if error:
                # (its body is the error, with the status it has over HTTP: a 500, or a 400
                # for a grammar past the engine's limits)
                err = core_error(data)
                out[place] = _answer(custom_id, err.status, orjson.loads(err.body))
                continue
            parts[i].append(data)
            if finished:
                out[place] = _answer(custom_id, 200, orjson.loads(b"".join(parts[i])), ids[i])
    return [line for line in out if line is not None]
