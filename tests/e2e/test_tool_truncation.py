"""Forced tool calls at their edges, end to end: cut off by `max_tokens`, named, and among
more tools than the grammar engine can choose between.

- A forced call (`tool_choice` required or named) is a call as soon as its name is
  generated: cut off after that it keeps its name and the arguments generated so far
  (finish `length`); its JSON or markup is never returned as content, streamed or not.
- A second call cut off before its name is complete is dropped (no `<tool_call>` content,
  no empty call).
- A named `tool_choice` finishes `stop`, as OpenAI's does; required finishes `tool_calls`.
- 2000 tools under `required` are more than llguidance's 2000-items-per-row limit allows:
  a 400 naming the limit, param `tools`, instead of an answer cut short at its first token.

The default SmolLM2 server (whose template knows no tool format: the json format) is the
audit's setup; the Hermes cases run on a tiny random model with a Hermes-shaped template.
"""

from __future__ import annotations

import json

import openai
import pytest
from openai import OpenAI

from server import tiny_template_server
from test_tool_formats import ASK, HERMES, TIME, WEATHER

SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}}


def tools(n: int) -> list[dict]:
    return [{"type": "function", "function": {"name": f"f{i}", "parameters": SCHEMA}} for i in range(n)]


@pytest.fixture(scope="module")
def smol_client(smol):
    with OpenAI(base_url=smol.url + "/v1", api_key="x", max_retries=0, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def hermes(tmp_path_factory):
    server = tiny_template_server(tmp_path_factory, "trunc", HERMES)
    with OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120) as client:
        yield client
    server.stop()


def model_of(client: OpenAI) -> str:
    return client.models.list().data[0].id


def collect(stream):
    """(content, [(id, name, arguments)], finish_reason) of a streamed choice 0."""
    content, calls, finish = "", [], None
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            for t in c.delta.tool_calls or []:
                if t.id:
                    assert t.index == len(calls)
                    calls.append([t.id, t.function.name, ""])
                calls[t.index][2] += t.function.arguments or ""
            finish = c.finish_reason or finish
    return content, calls, finish


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "f1"}}],
                         ids=["required", "named"])
def test_forced_call_cut_off_keeps_its_name(smol_client, choice):
    named = isinstance(choice, dict)
    req = dict(model=model_of(smol_client), messages=[{"role": "user", "content": "Call a function."}],
               tools=tools(20), tool_choice=choice, temperature=0)
    # Cut before the name is complete: nothing at all (the JSON is not content either), and
    # content null as for any forced turn, as the stream's deltas (none) sum to. A named
    # call in the default JSON format is its arguments alone: the call is there from the start.
    early = smol_client.chat.completions.create(**req, max_tokens=2).choices[0]
    assert (early.finish_reason, early.message.content) == ("length", None)
    if named:
        assert [t.function.name for t in early.message.tool_calls] == ["f1"]
        assert early.message.tool_calls[0].function.arguments.startswith("{")
    else:
        assert early.message.tool_calls is None
    # the audit's cut: just after the name (a named call's arguments: inside them)
    req["max_tokens"] = 4 if named else 16
    whole = smol_client.chat.completions.create(**req).choices[0]
    assert whole.finish_reason == "length", whole
    assert not whole.message.content, whole.message.content
    assert whole.message.tool_calls, whole
    call = whole.message.tool_calls[0]
    assert call.id.startswith("call_") and call.function.name in {f"f{i}" for i in range(20)}
    if named:
        assert call.function.name == "f1"
    # Whatever was generated of the arguments is a prefix of an arguments object.
    assert call.function.arguments == "" or call.function.arguments.startswith("{")

    content, calls, finish = collect(smol_client.chat.completions.create(**req, stream=True))
    assert (content, finish) == ("", "length")
    assert [(n, a) for _, n, a in calls] == [(t.function.name, t.function.arguments)
                                             for t in whole.message.tool_calls]


def test_named_choice_finishes_stop(smol_client):
    req = dict(model=model_of(smol_client), messages=[{"role": "user", "content": "Call f3."}], tools=tools(5),
               tool_choice={"type": "function", "function": {"name": "f3"}}, max_tokens=200, temperature=0)
    whole = smol_client.chat.completions.create(**req).choices[0]
    assert whole.finish_reason == "stop", whole
    assert [t.function.name for t in whole.message.tool_calls] == ["f3"]
    json.loads(whole.message.tool_calls[0].function.arguments)
    _, calls, finish = collect(smol_client.chat.completions.create(**req, stream=True))
    assert finish == "stop" and [c[1] for c in calls] == ["f3"]
    # (arguments the grammar bounds: a free string lets this model write on to max_tokens
    # on some CPUs, whose kernels tip its near-ties)
    digit = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
             "required": ["a"]}
    req.update(tool_choice="required", parallel_tool_calls=False,
               tools=[{"type": "function", "function": {"name": f"f{i}", "parameters": digit}} for i in range(5)])
    assert smol_client.chat.completions.create(**req).choices[0].finish_reason == "tool_calls"


def test_too_many_tools_for_a_forced_call_is_a_400(smol_client):
    model = model_of(smol_client)
    with pytest.raises(openai.BadRequestError) as e:
        smol_client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                     tools=tools(2000), tool_choice="required", max_tokens=16)
    err = e.value.body
    assert err["param"] == "tools" and err["code"] == "invalid_value", err
    assert "2000" in err["message"], err
    # Auto does not constrain: the tools are fine there.
    r = smol_client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                     tools=tools(2000), max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_hermes_second_call_cut_off_leaves_no_markup(hermes):
    """Cuts of a forced parallel output from the end of its first call into its second
    (`\n<tool_call>\n{"name": "get_...`): the calls so far, never markup as content."""
    req = dict(model="tiny", messages=ASK, tools=[WEATHER, TIME], tool_choice="required", temperature=1.0,
               seed=0, parallel_tool_calls=True)
    full = hermes.chat.completions.create(**req, max_tokens=300, logprobs=True)
    full_calls = full.choices[0].message.tool_calls
    assert len(full_calls) >= 2, "a second call to cut off"
    # The token count at which the first call's block has closed.
    text, first_end = "", None
    for i, t in enumerate(full.choices[0].logprobs.content):
        text += t.token
        if first_end is None and "</tool_call>" in text:
            first_end = i + 1
    assert first_end is not None, text
    names = {"get_weather", "get_time"}
    for k in [1, 8, *range(first_end, first_end + 16)]:
        choice = hermes.chat.completions.create(**req, max_tokens=k).choices[0]
        content = choice.message.content or ""
        assert "<tool" not in content and "{" not in content, (k, content)
        calls = choice.message.tool_calls or []
        assert all(c.function.name in names for c in calls), (k, calls)
        assert choice.finish_reason == "length", (k, choice)
        # A cut output's calls are the full output's, the last possibly shorter.
        assert len(calls) <= len(full_calls)
        for got, want in zip(calls, full_calls):
            assert (got.function.name, got.id.startswith("call_")) == (want.function.name, True)
            assert want.function.arguments.startswith(got.function.arguments), (k, got, want)
        if k >= first_end:
            assert calls and calls[0].function.arguments == full_calls[0].function.arguments, k
