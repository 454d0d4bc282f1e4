"""Nothing a client sends may crash the engine loop or leak KV blocks (the README's promise),
and constrained output follows whatever schema it is given.

Valid requests of every route, each changed once or twice at random (a field dropped, replaced
by a value of another type or an edge of its range, an element duplicated, a stray key added),
or sent valid with some of its options, streamed or not, against the tiny model's server. Every answer must be a 2xx or a 4xx in the
route's error shape, never a 5xx or an error frame in a 200 stream, and afterwards the server
must be alive with nothing running and no KV block held.

Random JSON schemas (objects of strings with lengths, patterns and formats, bounded and open
numbers, enums, consts, arrays, unions, local refs, closed and open objects), as
`response_format` and as forced tools' `parameters`: every answer that ends `stop` (or
`tool_calls`) must validate against its schema by `jsonschema`, an independent reference. The
tiny random model writes whatever the grammar lets through, which is what this checks.

The seeds fix the requests, so a failure reproduces."""

from __future__ import annotations

import copy
import json
import random
import time

import jsonschema
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
        "chat_template_kwargs": {"a": 1}, "priority": 0, "parallel_tool_calls": True, "thinking_token_budget": 2},
    "/v1/completions": {
        "model": MODEL, "prompt": "Hello", "max_tokens": 4, "echo": True, "logprobs": 2, "n": 1, "best_of": 1,
        "stop": "x", "temperature": 1.0, "seed": 3, "logit_bias": {"7": -1}, "prompt_logprobs": 1,
        "repetition_detection": {"max_pattern_size": 2, "min_pattern_size": 1, "min_count": 2}},
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
        "tool_choice": {"type": "auto"}, "thinking": {"type": "enabled", "budget_tokens": 2}},
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


def _leaf(rng: random.Random, depth: int) -> dict:
    kinds = ["string", "integer", "number", "boolean", "null", "enum", "const", "array", "object", "anyOf", "ref"]
    kind = rng.choice(kinds if depth < 3 else kinds[:6])
    if kind == "string":
        r = rng.random()
        if r < 0.3:
            top = rng.randint(0, 8)
            return {"type": "string", "minLength": rng.randint(0, top), "maxLength": top}
        if r < 0.5:
            return {"type": "string", "pattern": rng.choice(["^[a-z]{1,5}$", "^[0-9]{3}-[0-9]{2}$", "^(yes|no)$"])}
        if r < 0.6:
            return {"type": "string", "format": rng.choice(["date", "email", "uuid"])}
        return {"type": "string", "maxLength": 6}
    if kind == "integer":
        s = {"type": "integer"}
        if rng.random() < 0.5:
            s["minimum"] = rng.randint(-100, 100)
            s["maximum"] = s["minimum"] + rng.randint(0, 1000)
        if rng.random() < 0.2:
            s["multipleOf"] = rng.choice([2, 5, 10])
        return s
    if kind == "number":
        s = {"type": "number"}
        if rng.random() < 0.4:
            s["minimum"] = round(rng.uniform(-10, 10), 3)
            s["maximum"] = s["minimum"] + round(rng.uniform(0, 100), 3)
        return s
    if kind in ("boolean", "null"):
        return {"type": kind}
    if kind == "enum":
        return {"enum": rng.sample(["a", "b", 1, 2.5, None, True, "x y"], rng.randint(1, 4))}
    if kind == "const":
        return {"const": rng.choice(["k", 7, False, None, [1, 2], {"z": 1}])}
    if kind == "array":
        top = rng.randint(0, 4)
        return {"type": "array", "items": _leaf(rng, depth + 1), "minItems": rng.randint(0, top), "maxItems": top}
    if kind == "anyOf":
        return {"anyOf": [_leaf(rng, depth + 1) for _ in range(rng.randint(1, 3))]}
    if kind == "ref":
        return {"$ref": "#/$defs/D"}
    return _object(rng, depth + 1)


def _object(rng: random.Random, depth: int) -> dict:
    props = {f"k{i}": _leaf(rng, depth) for i in range(rng.randint(0, 4))}
    schema = {"type": "object", "properties": props}
    if props and rng.random() < 0.8:
        schema["required"] = rng.sample(list(props), rng.randint(0, len(props)))
    r = rng.random()
    if r < 0.5:
        schema["additionalProperties"] = False
    elif r < 0.6:
        schema["additionalProperties"] = {"type": "integer"}
    return schema


def _schema(rng: random.Random) -> dict:
    schema = _object(rng, 0)
    schema["$defs"] = {"D": {"type": "object", "properties": {"q": {"type": "integer", "minimum": 0, "maximum": 9}},
                             "required": ["q"], "additionalProperties": False}}
    return schema


def _follows(value_text: str, schema: dict) -> str | None:
    """Why `value_text` is not JSON that `schema` accepts, or None."""
    try:
        jsonschema.validate(json.loads(value_text), schema, format_checker=jsonschema.FormatChecker())
    except (ValueError, jsonschema.ValidationError) as exc:
        return str(exc).splitlines()[0]
    return None


@pytest.mark.parametrize("seed", [21, 22])
def test_random_schemas_are_followed(tiny_server, seed):
    rng = random.Random(seed)
    problems, ended = [], 0
    with tiny_server.http(timeout=120) as http:
        for i in range(60):
            schema = _schema(rng)
            r = http.post("/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "Fill the JSON."}], "max_tokens": 160,
                "temperature": 1, "seed": i,
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
            if r.status_code == 400:     # (a keyword the grammar engine cannot enforce)
                assert r.json()["error"]["param"].startswith("response_format"), r.text
                continue
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            if choice["finish_reason"] == "stop":
                ended += 1
                if why := _follows(choice["message"]["content"], schema):
                    problems.append(f"{json.dumps(schema)} -> {choice['message']['content']}: {why}")
    assert not problems, "\n".join(problems[:5])
    assert ended >= 30, f"only {ended} answers ended: too few to check"


def _tags_in(text: str, tags: list[dict], triggers: list[str]) -> list[str]:
    """What is wrong with the tags in a finished `text` of free text and triggered tags: each
    trigger must open a tag whose JSON follows that tag's schema and which then closes."""
    problems, at, decoder = [], 0, json.JSONDecoder()
    while (found := min(((text.find(t, at), t) for t in triggers if t in text[at:]), default=None)) is not None:
        start = found[0]
        tag = next((t for t in tags if text.startswith(t["begin"], start)), None)
        if tag is None:
            return problems + [f"a trigger opens no tag at {start}: {text[start:start + 20]!r}"]
        body = start + len(tag["begin"])
        try:
            value, end = decoder.raw_decode(text, body)
        except ValueError as exc:
            return problems + [f"no JSON after {tag['begin']!r}: {exc}"]
        try:
            jsonschema.validate(value, tag["content"]["json_schema"], format_checker=jsonschema.FormatChecker())
        except jsonschema.ValidationError as exc:
            problems.append(f"{json.dumps(tag['content']['json_schema'])} -> {value!r}: {str(exc).splitlines()[0]}")
        if not text.startswith(tag["end"], end):
            return problems + [f"{tag['end']!r} does not follow the JSON at {end}: {text[end:end + 20]!r}"]
        at = end + len(tag["end"])
    return problems


@pytest.mark.parametrize("seed", [41])
def test_random_structural_tags_are_followed(tiny_server, seed):
    """`structural_tag`s of 1 to 3 triggered tags with random schemas, each option at random:
    in every answer that ends `stop`, each trigger opens a whole tag whose JSON validates."""
    rng = random.Random(seed)
    problems, tagged = [], 0
    with tiny_server.http(timeout=120) as http:
        for i in range(50):
            names = rng.sample("abc", rng.randint(1, 3))
            triggers = ["<"] if rng.random() < 0.5 else [f"<{n}" for n in names]
            tags = [{"begin": f"<{n}>", "content": {"type": "json_schema", "json_schema": _schema(rng)},
                     "end": f"</{n}>"} for n in names]
            least, first = rng.random() < 0.7, rng.random() < 0.5
            fmt = {"type": "triggered_tags", "triggers": triggers, "tags": tags,
                   "at_least_one": least, "stop_after_first": first}
            r = http.post("/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "Tag it."}], "max_tokens": 160,
                "temperature": 1, "seed": i, "response_format": {"type": "structural_tag", "format": fmt}})
            if r.status_code == 400:     # (a keyword the grammar engine cannot enforce)
                assert r.json()["error"]["param"].startswith("response_format.format.tags["), r.text
                continue
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            if choice["finish_reason"] != "stop":
                continue
            text = choice["message"]["content"]
            tagged += any(t in text for t in triggers)
            problems += [f"{text!r}: {p}" for p in _tags_in(text, tags, triggers)]
            if least and not text.startswith(tuple(t["begin"] for t in tags)):
                problems.append(f"{text!r}: at_least_one, yet it does not open with a tag")
    assert not problems, "\n".join(problems[:5])
    assert tagged >= 12, f"only {tagged} finished answers held a tag: too few to check"


@pytest.mark.parametrize("seed", [31, 32])
def test_random_tool_parameters_are_followed(tiny_server, seed):
    """Forced calls among 1 to 3 tools of random `parameters`, streamed or not: each call's
    arguments validate against its own tool's schema, and `parallel_tool_calls: false` gives one."""
    rng = random.Random(seed)
    problems, ended = [], 0
    with tiny_server.http(timeout=120) as http:
        for i in range(40):
            tools = [{"type": "function", "function": {"name": f"t{j}", "parameters": _schema(rng)}}
                     for j in range(rng.randint(1, 3))]
            parallel, stream = rng.random() < 0.5, rng.random() < 0.4
            choice = rng.choice(["required", {"type": "function", "function": {"name": "t0"}}])
            r = http.post("/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "Call a tool."}], "max_tokens": 200,
                "temperature": 1, "seed": i, "tools": tools, "tool_choice": choice,
                "parallel_tool_calls": parallel, "stream": stream})
            if r.status_code == 400:
                assert r.json()["error"]["param"].startswith("tools["), r.text
                continue
            assert r.status_code == 200, r.text
            calls, finish = _calls(r.text) if stream else _calls_of(r.json()["choices"][0])
            if finish not in ("stop", "tool_calls"):
                continue
            ended += 1
            if not calls or (not parallel and len(calls) > 1):
                problems.append(f"{len(calls)} calls, parallel_tool_calls {parallel}")
            for name, arguments in calls:
                schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == name)
                if why := _follows(arguments, schema):
                    problems.append(f"{json.dumps(schema)} -> {arguments}: {why}")
    assert not problems, "\n".join(problems[:5])
    assert ended >= 20, f"only {ended} answers ended: too few to check"


def _calls_of(choice: dict) -> tuple[list[tuple[str, str]], str]:
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"].get("tool_calls") or ()]
    return calls, choice["finish_reason"]


def _calls(sse: str) -> tuple[list[tuple[str, str]], str | None]:
    """A streamed choice's calls, joined from their pieces, and its finish reason."""
    calls: dict[int, list[str]] = {}
    finish = None
    for line in sse.splitlines():
        if not line.startswith("data: {"):
            continue
        for choice in json.loads(line[6:]).get("choices", ()):
            finish = choice.get("finish_reason") or finish
            for piece in (choice.get("delta") or {}).get("tool_calls") or ():
                call = calls.setdefault(piece["index"], ["", ""])
                call[0] += (piece.get("function") or {}).get("name") or ""
                call[1] += (piece.get("function") or {}).get("arguments") or ""
    return [tuple(calls[i]) for i in sorted(calls)], finish
