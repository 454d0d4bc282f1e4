"""Nothing a client sends may crash the engine loop or leak KV blocks (the README's promise).

Valid requests of every route, each changed once or twice at random (a field dropped, replaced
by a value of another type or an edge of its range, an element duplicated, a stray key added),
or sent valid with some of its options, streamed or not, against the tiny model's server. Every answer must be a 2xx or a 4xx in the
route's error shape, never a 5xx or an error frame in a 200 stream, and afterwards the server
must be alive with nothing running and no KV block held. The seed fixes the requests, so a
failure reproduces."""

from __future__ import annotations

import copy
import json
import random
import time

import pytest

SEEDS = [11, 12]
REQUESTS_PER_SEED = 150
MODEL = "tiny"

_TOOL = {"type": "function", "function": {"name": "w", "description": "d", "parameters": {
    "type": "object", "properties": {"c": {"type": "string", "maxLength": 4}, "n": {"type": "integer"}},
    "required": ["c"]}}}

# One valid request of each route, with most of its fields set.
VALID = {
    "/v1/chat/completions": {
        "model": MODEL, "max_tokens": 4, "messages": [
            {"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{\"c\": \"x\"}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"}],
        "tools": [_TOOL], "tool_choice": "auto", "temperature": 0.5, "top_p": 0.9, "n": 2, "stop": ["x"],
        "logprobs": True, "top_logprobs": 2, "seed": 1, "logit_bias": {"5": 1}, "presence_penalty": 0.1,
        "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1, "stop_token_ids": [2],
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
            "type": "object", "properties": {"a": {"type": "integer"}}}}},
        "chat_template_kwargs": {"a": 1}, "priority": 0, "parallel_tool_calls": True},
    "/v1/completions": {
        "model": MODEL, "prompt": "Hello", "max_tokens": 4, "echo": True, "logprobs": 2, "n": 1, "best_of": 1,
        "stop": "x", "temperature": 1.0, "seed": 3, "logit_bias": {"7": -1}, "prompt_logprobs": 1},
    "/v1/responses": {
        "model": MODEL, "max_output_tokens": 4, "instructions": "be",
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
        "tools": [{"type": "function", "name": "w", "parameters": {"type": "object", "properties": {
            "c": {"type": "string"}}}}], "tool_choice": "auto", "temperature": 0.5, "top_logprobs": 1,
        "include": ["message.output_text.logprobs"], "metadata": {"a": "b"}, "store": True,
        "text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}}}},
    "/v1/embeddings": {"model": MODEL, "input": ["a", "b"], "encoding_format": "float"},
    "/v1/messages": {
        "model": MODEL, "max_tokens": 4, "system": "s", "stop_sequences": ["x"], "temperature": 0.5, "top_k": 3,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        "tools": [{"name": "w", "input_schema": {"type": "object", "properties": {"c": {"type": "string"}}}}],
        "tool_choice": {"type": "auto"}},
    "/tokenize": {"model": MODEL, "prompt": "hello", "add_special_tokens": True},
    "/detokenize": {"model": MODEL, "tokens": [1, 2, 3]},
    "/v1/score": {"model": MODEL, "text_1": "a", "text_2": ["b", "c"]},
    "/v1/rerank": {"model": MODEL, "query": "a", "documents": ["b", {"text": "c"}], "top_n": 1},
    "/v1/chat/completions/render": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]},
}
# What each route needs: the rest of VALID's fields are optional.
REQUIRED = {"model", "messages", "prompt", "input", "text_1", "text_2", "query", "documents", "tokens", "max_tokens"}
STREAMING = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")
# The generation routes' length field: put back when a mutation drops it, so that no request
# generates to the end of the context.
LENGTH = {"/v1/chat/completions": "max_tokens", "/v1/completions": "max_tokens",
          "/v1/responses": "max_output_tokens", "/v1/messages": "max_tokens"}

ODD = [None, True, False, 0, -1, 1, 2**63, -2**63, 2**64, 1.5, -0.0, 1e308, "", "x", "\u0000", [], [None],
       [1, "a"], {}, {"a": None}, "9" * 300, [[1]], {"type": "bogus"}, {"role": "user"}]


def _mutate(value, rng: random.Random, top: bool = False):
    """`value` with one change somewhere inside it (a request body stays an object)."""
    if isinstance(value, dict) and value and (top or rng.random() < 0.8):
        value = dict(value)
        key = rng.choice(list(value))
        r = rng.random()
        if r < 0.15:
            del value[key]
        elif r < 0.6:
            value[key] = _mutate(value[key], rng)
        else:
            value[key] = copy.deepcopy(rng.choice(ODD))
        if rng.random() < 0.1:
            value[rng.choice(["extra", "type", "role", "content", "name", "text"])] = copy.deepcopy(rng.choice(ODD))
        return value
    if isinstance(value, list) and value and rng.random() < 0.8:
        value = list(value)
        i = rng.randrange(len(value))
        r = rng.random()
        if r < 0.5:
            value[i] = _mutate(value[i], rng)
        elif r < 0.7:
            value.append(copy.deepcopy(value[i]))
        else:
            value[i] = copy.deepcopy(rng.choice(ODD))
        return value
    return copy.deepcopy(rng.choice(ODD))


def _requests(seed: int):
    rng = random.Random(seed)
    for _ in range(REQUESTS_PER_SEED):
        path = rng.choice(list(VALID))
        body = VALID[path]
        if rng.random() < 0.3:
            # a valid request with some of its options: the generation paths, not validation
            body = {k: v for k, v in body.items() if k in REQUIRED or rng.random() < 0.5}
        else:
            for _ in range(1 if rng.random() < 0.7 else 2):
                body = _mutate(body, rng, top=True)
        if path in LENGTH and LENGTH[path] not in body:
            body = {**body, LENGTH[path]: 4}
        if path in STREAMING and rng.random() < 0.5:
            body = {**body, "stream": True}
            if path != "/v1/messages" and rng.random() < 0.5:
                body["stream_options"] = rng.choice([{"include_usage": True}, {"continuous_usage_stats": True}])
        yield path, body


def _error_shape(path: str, data) -> bool:
    if path == "/v1/messages":
        if not (isinstance(data, dict) and data.get("type") == "error"):
            return False
    err = data.get("error") if isinstance(data, dict) else None
    return isinstance(err, dict) and isinstance(err.get("message"), str) and {"type", "param", "code"} <= set(err)


@pytest.mark.parametrize("seed", SEEDS)
def test_mutated_requests_get_answers_and_leave_nothing_behind(tiny_server, seed):
    problems = []
    with tiny_server.http(timeout=120) as http:
        for path, body in _requests(seed):
            sent = json.dumps(body)
            r = http.post(path, content=sent, headers={"content-type": "application/json"})
            text = r.text
            if r.status_code >= 500:
                problems.append(f"{r.status_code} on {path} {sent[:300]}: {text[:300]}")
            elif r.status_code >= 400:
                if not _error_shape(path, r.json()):
                    problems.append(f"error shape on {path} {sent[:300]}: {text[:300]}")
            elif r.headers["content-type"].startswith("text/event-stream"):
                if "server_error" in text or "internal_error" in text:
                    problems.append(f"error frame on {path} {sent[:300]}: {text[-300:]}")
            else:
                r.json()     # (a 200 body parses)
        assert not problems, "\n".join(problems[:10])
        assert http.get("/health").status_code == 200
        # (the engine frees a request's blocks in the step after its last bytes went out)
        deadline = time.monotonic() + 10
        while (load := http.get("/load").json())["running"] or load["kv_blocks_used"]:
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
    assert (load["running"], load["waiting"], load["kv_blocks_used"]) == (0, 0, 0), load
