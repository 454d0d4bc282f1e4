"""Findings of a black-box audit against vLLM's behaviour, each pinned over HTTP:

- an assistant turn with `content: null` + `tool_calls` renders on SmolLM2's template (which
  concatenates `content`), so the OpenAI tool round trip works; a failing render names
  `messages`;
- `stop_token_ids` with `include_stop_str_in_output` keep the stopping token's text;
- `min_tokens` holds stop strings back (streamed or not);
- out-of-range integers (`seed`, `max_tokens`) and the prompt-alone context message read right;
- unknown message keys and tools the template never reads are reported (400 under
  `--strict-fields`); an empty parts list is a 400;
- `/tokenize` and `/detokenize` take vLLM's fields and report unknown ones.

The tiny server (its ChatML template reads no `tools`) serves most; the default SmolLM2
model serves the tool round trip; `--strict-fields` runs in process.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from server import ServerProcess
from test_contract_templates import _run

MSG = [{"role": "user", "content": "Hello"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
UNDESCRIBED = [{"type": "function", "function": {k: v for k, v in TOOLS[0]["function"].items() if k != "description"}}]


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": "tiny", **body}, timeout=60)


def _ok(server, path: str, body: dict) -> httpx.Response:
    r = _post(server, path, body)
    assert r.status_code == 200, r.text
    return r


def _error(r: httpx.Response) -> dict:
    assert r.status_code == 400, r.text
    return r.json()["error"]


def _ignored(r: httpx.Response) -> set[str]:
    return {f.strip() for f in r.headers.get("llmserve-ignored-fields", "").split(",") if f.strip()}


def _token(server, text: str) -> int:
    ids = _ok(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert len(ids) == 1, (text, ids)
    return ids[0]


def _stream_text(server, path: str, body: dict) -> tuple[str, list[dict]]:
    """Concatenated `text` of a streamed completion, and its chunks."""
    chunks = []
    with httpx.stream("POST", server.url + path, json={"model": "tiny", **body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
    return "".join(c["choices"][0]["text"] for c in chunks if c["choices"]), chunks


# -- 1. null content in a tool round trip, on SmolLM2's template ------------------------------

@pytest.fixture(scope="module")
def smol_server():
    server = ServerProcess(None, "--max-model-len", "1024", "--kv-cache-memory", "128MiB")
    yield server
    server.stop()


def test_tool_round_trip_with_null_content(smol_server):
    with openai.OpenAI(base_url=smol_server.url + "/v1", api_key="x") as client:
        model = client.models.list().data[0].id
        messages = [
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c", "content": "20C"},
        ]
        r = client.chat.completions.create(model=model, messages=messages, max_tokens=2, temperature=0)
        assert r.choices[0].finish_reason in ("length", "stop")
        # No `content` at all is the same as null.
        del messages[1]["content"]
        r = client.chat.completions.create(model=model, messages=messages, max_tokens=1, temperature=0)
        assert r.usage.completion_tokens == 1


def test_smollm2_template_reads_no_tools(smol_server):
    # SmolLM2's template never reads `tools` and has no tool-call format: 'auto' ignores them.
    r = httpx.post(smol_server.url + "/v1/chat/completions/render",
                   json={"model": "SmolLM2-135M-Instruct", "messages": MSG, "tools": TOOLS}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["ignored_fields"] == ["tools"]
    assert _ignored(r) == {"tools"}
    # the header a chat response names its template with, as the body does
    template = r.json()["template"]
    assert r.headers["llmserve-chat-template"] == f"{template['origin']} {template['hash']}"


# -- 2. stop_token_ids with include_stop_str_in_output ----------------------------------------

def test_stop_token_text_is_kept_with_include_stop_str(tiny_server):
    dot = _token(tiny_server, ".")
    body = {"prompt": "Numbers", "logit_bias": {str(dot): 100}, "stop_token_ids": [dot], "max_tokens": 5,
            "ignore_eos": True, "temperature": 0}
    r = _ok(tiny_server, "/v1/completions", body).json()["choices"][0]
    assert (r["text"], r["finish_reason"], r["stop_reason"]) == ("", "stop", dot)
    r = _ok(tiny_server, "/v1/completions", {**body, "include_stop_str_in_output": True}).json()["choices"][0]
    assert (r["text"], r["finish_reason"], r["stop_reason"]) == (".", "stop", dot)
    text, _ = _stream_text(tiny_server, "/v1/completions", {**body, "include_stop_str_in_output": True})
    assert text == "."
    # An eos is special: skipped unless skip_special_tokens is false.
    eos = _token(tiny_server, "<|im_end|>")
    eos_body = {"prompt": "Numbers", "logit_bias": {str(eos): 100}, "max_tokens": 5, "include_stop_str_in_output": True}
    assert _ok(tiny_server, "/v1/completions", eos_body).json()["choices"][0]["text"] == ""
    r = _ok(tiny_server, "/v1/completions", {**eos_body, "skip_special_tokens": False}).json()["choices"][0]
    assert r["text"] == "<|im_end|>"


# -- 3. min_tokens holds stop strings back -----------------------------------------------------

def test_min_tokens_holds_stop_strings_back(tiny_server):
    dot = _token(tiny_server, ".")
    body = {"prompt": "Numbers", "logit_bias": {str(dot): 100}, "stop": ["."], "max_tokens": 12,
            "ignore_eos": True, "temperature": 0}
    r = _ok(tiny_server, "/v1/completions", body).json()
    assert (r["choices"][0]["text"], r["usage"]["completion_tokens"]) == ("", 1)
    # The first 5 dots are within min_tokens; the 6th stops (and is trimmed).
    r = _ok(tiny_server, "/v1/completions", {**body, "min_tokens": 5}).json()
    c = r["choices"][0]
    assert (c["text"], c["finish_reason"], c["stop_reason"]) == (".....", "stop", ".")
    assert r["usage"]["completion_tokens"] == 6
    text, chunks = _stream_text(tiny_server, "/v1/completions", {**body, "min_tokens": 5})
    assert text == "....."
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
    r = _ok(tiny_server, "/v1/completions", {**body, "min_tokens": 5, "include_stop_str_in_output": True}).json()
    assert r["choices"][0]["text"] == "......"


# -- 4. error wording --------------------------------------------------------------------------

def test_out_of_range_integers_and_context_wording(tiny_server):
    err = _error(_post(tiny_server, "/v1/chat/completions", {"messages": MSG, "seed": 2**70}))
    assert (err["code"], err["param"]) == ("invalid_value", "seed")
    assert "64 bits" in err["message"]
    for seed in (2**64 - 1, -(2**63)):
        _ok(tiny_server, "/v1/chat/completions", {"messages": MSG, "seed": seed, "max_tokens": 1})
    err = _error(_post(tiny_server, "/v1/chat/completions", {"messages": MSG, "max_tokens": 10**30}))
    assert (err["code"], err["param"]) == ("invalid_value", "max_tokens")
    assert "must be an integer that fits in 32 bits" in err["message"] and "floating" not in err["message"]
    long = [{"role": "user", "content": "Hello " * 5000}]
    err = _error(_post(tiny_server, "/v1/chat/completions", {"messages": long}))
    assert err["code"] == "context_length_exceeded" and "the messages have" in err["message"]
    err = _error(_post(tiny_server, "/v1/completions", {"prompt": "Hello " * 5000}))
    assert "the prompt has" in err["message"]


# -- 5. message keys and empty parts -----------------------------------------------------------

def test_unknown_message_keys_are_reported(tiny_server):
    msgs = [{"role": "system", "content": "Be brief", "name": "sys", "refusal": None},
            {"role": "user", "content": "Hi", "weird": 1}]
    r = _ok(tiny_server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 1})
    # ChatML never reads `name` either: OpenAI's key, but here it changes nothing (audit 2)
    assert _ignored(r) == {"messages[0].name", "messages[1].weird"}
    err = _error(_post(tiny_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": []}]}))
    assert (err["code"], err["param"]) == ("invalid_value", "messages[0].content")


# -- 6. tools the template never reads ---------------------------------------------------------

def test_tools_the_template_never_reads_are_reported(tiny_server):
    for choice in (None, "auto", "none"):
        body = {"messages": MSG, "tools": TOOLS, "max_tokens": 1}
        if choice:
            body["tool_choice"] = choice
        # (an "auto" sent chooses between calls and an answer: with no calls, it chooses nothing)
        expected = {"tools", "tool_choice"} if choice == "auto" else {"tools"}
        assert _ignored(_ok(tiny_server, "/v1/chat/completions", body)) == expected, choice
    # Forced calls are grammar-constrained: the tools are used, but their descriptions never
    # reach the model through a template that does not show tools.
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = _ok(tiny_server, "/v1/chat/completions/render", {"messages": MSG, "tools": TOOLS, "tool_choice": choice})
        assert r.json()["ignored_fields"] == ["tools[0].function.description"]
        r = _ok(tiny_server, "/v1/chat/completions/render", {"messages": MSG, "tools": UNDESCRIBED,
                                                             "tool_choice": choice})
        assert r.json()["ignored_fields"] == [] and "llmserve-ignored-fields" not in r.headers


def test_tool_fields_without_effect_are_reported(tiny_server):
    """`parallel_tool_calls: false` without tools (or with tool_choice "none") calls nothing; a
    response_format beside a forced tool_choice shapes no text, since the output is the call.
    OpenAI accepts both: they are reported, not refused."""
    r = _ok(tiny_server, "/v1/chat/completions", {"messages": MSG, "parallel_tool_calls": False, "max_tokens": 1})
    assert _ignored(r) == {"parallel_tool_calls"}
    r = _ok(tiny_server, "/v1/chat/completions", {"messages": MSG, "tools": TOOLS, "tool_choice": "none",
                                                  "parallel_tool_calls": False, "max_tokens": 1})
    assert _ignored(r) == {"tools", "parallel_tool_calls"}
    # (`true`, OpenAI's default that clients send on every request, asks for nothing)
    r = _ok(tiny_server, "/v1/chat/completions", {"messages": MSG, "parallel_tool_calls": True, "max_tokens": 1})
    assert _ignored(r) == set()
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    r = _ok(tiny_server, "/v1/chat/completions", {"messages": MSG, "tools": TOOLS, "tool_choice": "required",
                                                  "parallel_tool_calls": False, "response_format": fmt,
                                                  "max_tokens": 40, "temperature": 0})
    assert _ignored(r) == {"response_format", "tools[0].function.description"}
    message = r.json()["choices"][0]["message"]
    assert message["content"] is None and message["tool_calls"][0]["function"]["name"] == "get_weather"
    # still validated: a malformed one is a 400
    err = _error(_post(tiny_server, "/v1/chat/completions", {"messages": MSG, "tools": TOOLS, "tool_choice": "required",
                                                             "response_format": {"type": "json_schema"}}))
    assert err["param"] == "response_format.json_schema"


def test_field_names_reach_the_header_as_printable_ascii_and_bounded(tiny_server):
    """A field name a header cannot carry (beyond latin-1, or holding CR/LF) was a 500 after
    generating; hundreds of names (900 messages' `name`s) made a header Node's fetch refuses.
    Now names are escaped and the list is cut at 4 KiB, on every route that sends it."""
    for path, body in (("/v1/chat/completions", {"messages": MSG, "max_tokens": 1}),
                       ("/v1/completions", {"prompt": "Hi", "max_tokens": 1}),
                       ("/tokenize", {"prompt": "Hi"})):
        r = _ok(tiny_server, path, {**body, "東京": 1, "a\r\nX-Evil: 1": 2})
        assert r.headers["llmserve-ignored-fields"] == "a\\u000d\\u000aX-Evil: 1, \\u6771\\u4eac", path
        assert "x-evil" not in r.headers
        # a name with a blank end made a header value the HTTP layer refused to send: the
        # connection dropped without a response (audit 52-1); its edge spaces are escaped
        r = _ok(tiny_server, path, {**body, "zz ": 1, "": 2})
        assert r.headers["llmserve-ignored-fields"] == '"", zz\\u0020', path
    r = _ok(tiny_server, "/tokenize", {"prompt": "Hi", "東京": 1})
    assert r.json()["ignored_fields"] == ["東京"]           # the body lists names as sent
    many = {f"field_{i:04}": 1 for i in range(900)}
    r = _ok(tiny_server, "/v1/chat/completions/render", {"messages": MSG, **many})
    value = r.headers["llmserve-ignored-fields"]
    assert len(value) <= 4096 and value.endswith(" more)"), value[-60:]
    assert len(r.json()["ignored_fields"]) == 900


# -- 7. /tokenize and /detokenize ----------------------------------------------------------------

def test_tokenize_and_detokenize_take_vllms_fields(tiny_server, tiny_model):
    from tokenizers import Tokenizer

    ref = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    r = _ok(tiny_server, "/tokenize", {"prompt": "Hello world", "return_token_strs": True,
                                       "add_special_tokens": True}).json()
    assert r["token_strs"] == [ref.id_to_token(i) for i in r["tokens"]]
    assert r["count"] == len(r["tokens"])
    ids = _ok(tiny_server, "/tokenize", {"prompt": "<|im_start|>Hi", "add_special_tokens": False}).json()["tokens"]
    assert _ok(tiny_server, "/detokenize", {"tokens": ids}).json()["prompt"] == "<|im_start|>Hi"
    r = _ok(tiny_server, "/detokenize", {"tokens": ids, "skip_special_tokens": True})
    assert r.json()["prompt"] == "Hi"
    # Unknown fields are reported as on the generation routes, not refused.
    r = _ok(tiny_server, "/tokenize", {"prompt": "Hi", "wibble": 1})
    assert _ignored(r) == {"wibble"} and r.json()["ignored_fields"] == ["wibble"]
    r = _ok(tiny_server, "/detokenize", {"tokens": ids, "wobble": 2})
    assert _ignored(r) == {"wobble"}
    r = _ok(tiny_server, "/tokenize", {"messages": [{"role": "user", "content": "Hi", "weird": 1}]})
    assert _ignored(r) == {"messages[0].weird"}
    assert "llmserve-ignored-fields" not in _ok(tiny_server, "/tokenize", {"prompt": "Hi"}).headers


# -- --strict-fields, in process -----------------------------------------------------------------

def test_strict_fields_refuse_what_would_be_ignored(tiny_model):
    results = _run(tiny_model, True, [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi", "weird": 1}], "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": MSG, "tools": TOOLS, "max_tokens": 1}),
        ("/tokenize", {"prompt": "Hi", "wibble": 1}),
        ("/detokenize", {"tokens": [1], "wobble": 1}),
        ("/tokenize", {"prompt": "Hi", "return_token_strs": True, "add_special_tokens": False}),
        ("/v1/chat/completions/render", {"messages": MSG, "tools": UNDESCRIBED, "tool_choice": "required"}),
        ("/v1/chat/completions/render", {"messages": MSG, "tools": TOOLS, "tool_choice": "required"}),
    ])
    for r, param in zip(results[:4], ("messages[0].weird", "tools", "wibble", "wobble")):
        err = _error(r)
        assert (err["code"], err["param"]) == ("unsupported_parameter", param)
    assert results[4].status_code == 200 and "token_strs" in results[4].json()
    assert results[5].status_code == 200, results[5].text
    err = _error(results[6])
    assert (err["code"], err["param"]) == ("unsupported_parameter", "tools[0].function.description")
