"""Tool-call formats end to end on a tiny random model, with templates we write in the
shapes of Hermes (Qwen2.5) and Qwen3-Coder (XML). The format is detected from each
template's text; forced calls are grammar-constrained into that format, parsed back into
`tool_calls`, and streamed as a name chunk then argument fragments that concatenate to the
non-streamed arguments. History with assistant tool calls and tool results renders through
each template (arguments sent as JSON strings reach the template as objects).
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from openai import OpenAI

from server import ServerProcess
from tiny import build_tiny_llama

_TURNS = (
    "{% for message in messages %}"
    "{% if message.role == 'assistant' and message.tool_calls %}"
    "{{ '<|im_start|>assistant\n' }}{% for call in message.tool_calls %}CALL{% endfor %}{{ '<|im_end|>\n' }}"
    "{% elif message.role == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
HERMES = (
    "{% if tools %}{{ '<|im_start|>system\nFor each call write <tool_call>\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>\n<tools>' }}"
    "{% for t in tools %}{{ t | tojson }}{% endfor %}{{ '</tools><|im_end|>\n' }}{% endif %}"
    + _TURNS.replace("CALL", "{{ '<tool_call>\n{\"name\": ' + call.function.name | tojson + ', \"arguments\": ' "
                             "+ call.function.arguments | tojson + '}\n</tool_call>' }}")
)
XML = (
    "{% if tools %}{{ '<|im_start|>system\nCall a function as <tool_call>\n<function=NAME>\n"
    "<parameter=KEY>\nVALUE\n</parameter>\n</function>\n</tool_call>\n<tools>' }}"
    "{% for t in tools %}{{ t | tojson }}{% endfor %}{{ '</tools><|im_end|>\n' }}{% endif %}"
    + _TURNS.replace("CALL", "{{ '<tool_call>\n<function=' + call.function.name + '>\n' }}"
                             "{% for k, v in call.function.arguments | items %}"
                             "{{ '<parameter=' + k + '>\n' + v | string + '\n</parameter>\n' }}{% endfor %}"
                             "{{ '</function>\n</tool_call>' }}")
)
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"], "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # Tool definitions render long in the tiny tokenizer: room for them.
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-tools"), max_position_embeddings=2048)


@pytest.fixture(scope="module", params=[("hermes", HERMES), ("qwen3_xml", XML)], ids=["hermes", "qwen3_xml"])
def fmt_server(request, model_dir, tmp_path_factory):
    name, template = request.param
    path = tmp_path_factory.mktemp("tpl") / f"{name}.jinja"
    path.write_text(template)
    server = ServerProcess(str(model_dir), "--served-model-name", "tiny", "--chat-template", str(path),
                           "--num-kv-blocks", "400")
    server.format = name
    yield server
    server.stop()


@pytest.fixture
def client(fmt_server):
    with OpenAI(base_url=fmt_server.url + "/v1", api_key="x", max_retries=0, timeout=120) as c:
        yield c


def _valid(calls, names):
    assert calls
    for call in calls:
        # (`call_` and 24 hex digits; the Mistral format's are 9 characters, all its templates take)
        assert (call.id.startswith("call_") or (len(call.id) == 9 and call.id.isalnum())) and call.type == "function"
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_format_is_detected_from_the_template(fmt_server):
    r = httpx.post(fmt_server.url + "/v1/chat/completions/render", timeout=30,
                   json={"model": "tiny", "messages": ASK, "tools": [WEATHER], "tool_choice": "required"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tool_call_format"] == fmt_server.format
    assert body["grammar"].startswith("lark:")
    assert '"get_weather"' in body["prompt"]


def test_forced_calls_stream_as_they_are_generated(client):
    req = dict(model="tiny", messages=ASK, tools=[WEATHER, TIME], max_tokens=200, temperature=0,
               tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = client.chat.completions.create(**req)
    choice = whole.choices[0]
    assert choice.finish_reason == "stop", choice  # a named function forced: "stop", as OpenAI
    assert not choice.message.content
    _valid(choice.message.tool_calls, {"get_weather"})
    assert len(choice.message.tool_calls) == 1

    pieces, content, finish = [], "", None
    for chunk in client.chat.completions.create(**req, stream=True):
        for c in chunk.choices:
            content += c.delta.content or ""
            pieces.extend(c.delta.tool_calls or [])
            finish = c.finish_reason or finish
    assert finish == "stop" and content == ""
    head, rest = pieces[0], pieces[1:]
    assert head.index == 0 and head.id.startswith("call_") and head.function.name == "get_weather"
    assert all(p.index == 0 and p.id is None for p in rest)
    fragments = [p.function.arguments for p in rest]
    assert len(fragments) > 1, "arguments should arrive as they are generated"
    assert "".join(fragments) == choice.message.tool_calls[0].function.arguments


def test_required_calls_validate(client):
    for parallel in (True, False):
        r = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, TIME], max_tokens=300,
                                           temperature=1.0, seed=7, tool_choice="required",
                                           parallel_tool_calls=parallel)
        choice = r.choices[0]
        assert choice.finish_reason in ("tool_calls", "length"), choice
        if choice.finish_reason == "tool_calls":
            _valid(choice.message.tool_calls, {"get_weather", "get_time"})
        if not parallel:
            assert choice.finish_reason == "tool_calls"
            assert len(choice.message.tool_calls) == 1


def test_history_with_tool_calls_renders_through_the_template(fmt_server, client):
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    r = httpx.post(fmt_server.url + "/v1/chat/completions/render", timeout=30,
                   json={"model": "tiny", "messages": messages, "tools": [WEATHER]})
    assert r.status_code == 200, r.text
    prompt = r.json()["prompt"]
    if fmt_server.format == "hermes":
        call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
    else:
        call = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>")
    assert call in prompt
    assert "<tool_response>\nsunny\n</tool_response>" in prompt
    # The model answers the tool result (any text or call; the server keeps serving).
    out = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER],
                                         max_tokens=8, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")


def _marker_tokens(fmt_server) -> dict:
    """A logit_bias that pushes the tokens of the call marker (the tiny model would rarely
    write them; pushed, it writes them in random order)."""
    r = httpx.post(fmt_server.url + "/tokenize", timeout=30, json={"model": "tiny", "prompt": "<tool_call>"})
    return {str(t): 100 for t in r.json()["tokens"]}


def test_strict_tools_under_auto_follow_their_schemas(fmt_server, client):
    """The grammar's two branches are checked token by token in the router's unit tests
    (`auto_grammars_allow_an_answer_or_calls_that_follow_their_schemas`); here it is applied
    end to end: whatever the model writes, no call markup reaches the content and any call
    validates."""
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    req = dict(model="tiny", messages=ASK, tools=[strict], max_tokens=60, temperature=1.0,
               parallel_tool_calls=False, logit_bias=_marker_tokens(fmt_server))
    render = httpx.post(fmt_server.url + "/v1/chat/completions/render", timeout=30, json=req).json()
    # (both formats open a call with `<tool_call>`, which the answer is kept from writing)
    assert render["grammar"].startswith("lark:")
    loose = httpx.post(fmt_server.url + "/v1/chat/completions/render", timeout=30,
                       json={**req, "tools": [WEATHER]}).json()
    assert loose["grammar"] is None  # no strict tool, no response_format: free
    for seed in range(3):
        r = client.chat.completions.with_raw_response.create(**req, seed=seed)
        assert "llmserve-ignored-fields" not in r.headers
        choice = r.parse().choices[0]
        assert "<tool_call>" not in (choice.message.content or ""), choice
        if choice.message.tool_calls:
            _valid(choice.message.tool_calls, {"get_weather"})


def test_response_format_beside_tools_under_auto(fmt_server, client):
    req = dict(model="tiny", messages=ASK, tools=[WEATHER], max_tokens=60, temperature=1.0,
               response_format={"type": "json_object"}, parallel_tool_calls=False)
    render = httpx.post(fmt_server.url + "/v1/chat/completions/render", timeout=30, json=req).json()
    assert render["grammar"].startswith("lark:")  # a call, or the JSON answer
    for seed in range(3):
        choice = client.chat.completions.create(**req, seed=seed).choices[0]
        if choice.message.tool_calls:
            # the tool is not strict: its arguments are any JSON object (in the XML format,
            # whose calls write the properties their schema lists, they follow the schema)
            (call,) = choice.message.tool_calls
            assert call.function.name == "get_weather"
            if choice.finish_reason == "tool_calls":  # (else cut by max_tokens)
                assert isinstance(json.loads(call.function.arguments), dict)
        elif choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
        else:
            assert choice.finish_reason == "length" and choice.message.content.startswith("{"), choice


def test_a_structural_tag_that_spells_the_calls_is_read_for_them(fmt_server, client):
    """vLLM's use of `structural_tag`: the client writes the model's call format as tags; under
    `tool_choice` "auto" the output follows the tag and its calls come back as `tool_calls`."""
    if fmt_server.format != "hermes":
        pytest.skip("the tag spells Hermes calls")
    schema = SCHEMAS["get_weather"]
    tag = {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<tool_call>"], "at_least_one": True, "stop_after_first": True,
        "tags": [{"begin": '<tool_call>\n{"name": "get_weather", "arguments": ',
                  "content": {"type": "json_schema", "json_schema": schema}, "end": "}\n</tool_call>"}]}}
    req = dict(model="tiny", messages=ASK, tools=[WEATHER], max_tokens=200, temperature=1.0, response_format=tag)
    render = httpx.post(fmt_server.url + "/v1/chat/completions/render", timeout=30, json=req).json()
    assert render["grammar"].startswith("structural_tag:")
    ended = 0
    for seed in range(3):
        choice = client.chat.completions.create(**req, seed=seed).choices[0]
        if choice.finish_reason == "length":
            continue
        ended += 1
        assert choice.finish_reason == "tool_calls" and not choice.message.content, choice
        _valid(choice.message.tool_calls, {"get_weather"})
    assert ended, "no answer ended within max_tokens"


def test_deprecated_functions_are_answered_as_function_call(fmt_server, client):
    """OpenAI's deprecated `functions` / `function_call`, sent by the SDK's own parameters:
    run as the tools they became (the same prompt and call as `tools`), answered as
    `message.function_call` (streamed: `delta.function_call` pieces), one call at most."""
    functions = [WEATHER["function"], TIME["function"]]
    named = dict(model="tiny", messages=ASK, max_tokens=200, temperature=0)
    legacy = client.chat.completions.create(**named, functions=functions, function_call={"name": "get_weather"})
    modern = client.chat.completions.create(**named, tools=[WEATHER, TIME],
                                            tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = legacy.choices[0]
    assert choice.finish_reason == "stop", choice  # forced by name, as a named tool_choice
    assert choice.message.tool_calls is None and not choice.message.content
    call = choice.message.function_call
    assert call.name == "get_weather"
    assert call.arguments == modern.choices[0].message.tool_calls[0].function.arguments
    jsonschema.validate(json.loads(call.arguments), SCHEMAS["get_weather"])
    assert legacy.usage.prompt_tokens == modern.usage.prompt_tokens

    pieces, finish = [], None
    for chunk in client.chat.completions.create(**named, functions=functions, function_call={"name": "get_weather"},
                                                stream=True):
        for c in chunk.choices:
            assert not c.delta.tool_calls
            if c.delta.function_call:
                pieces.append(c.delta.function_call)
            finish = c.finish_reason or finish
    assert finish == "stop"
    assert pieces[0].name == "get_weather" and all(p.name is None for p in pieces[1:])
    assert "".join(p.arguments for p in pieces) == call.arguments

    # under "auto" the random model may write anything: never `tool_calls`, and a call it
    # makes finishes "function_call" (the builder's own tests push one: protocol_functions.rs)
    for seed in range(2):
        c = client.chat.completions.create(model="tiny", messages=ASK, functions=functions, function_call="auto",
                                           max_tokens=30, temperature=1.0, seed=seed).choices[0]
        assert c.message.tool_calls is None
        assert c.finish_reason == ("function_call" if c.message.function_call else c.finish_reason)
        assert c.finish_reason in ("stop", "length", "function_call")
    # the history a call makes renders as the tools' would
    history = ASK + [{"role": "assistant", "content": None, "function_call": {"name": "get_weather",
                                                                              "arguments": call.arguments}},
                     {"role": "function", "name": "get_weather", "content": "sunny"}]
    as_tools = ASK + [{"role": "assistant", "content": None, "tool_calls": [
                          {"id": "call00001", "type": "function",
                           "function": {"name": "get_weather", "arguments": call.arguments}}]},
                      {"role": "tool", "tool_call_id": "call00001", "content": "sunny"}]
    render = lambda body: httpx.post(fmt_server.url + "/v1/chat/completions/render", timeout=30,  # noqa: E731
                                     json={"model": "tiny", **body}).json()
    assert render({"messages": history, "functions": functions})["prompt"] == \
        render({"messages": as_tools, "tools": [WEATHER, TIME]})["prompt"]
    # both at once ask for the same thing twice
    r = httpx.post(fmt_server.url + "/v1/chat/completions", timeout=30,
                   json={**named, "functions": functions, "tools": [WEATHER]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "functions", r.text


def test_allowed_tools_restrict_the_calls(fmt_server, client):
    """`tool_choice: {"type": "allowed_tools"}`: the model sees every tool (the same prompt),
    and only the listed ones can be called; "required" forces a call among them in any
    format, whatever the sampling draws."""
    def allowed(mode, *names):
        return {"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": [
            {"type": "function", "function": {"name": n}} for n in names]}}

    req = dict(model="tiny", messages=ASK, tools=[WEATHER, TIME], max_tokens=200, temperature=1.0)
    made = 0
    for seed in range(3):
        choice = client.chat.completions.create(**req, seed=seed, tool_choice=allowed("required", "get_time"),
                                                logit_bias=_marker_tokens(fmt_server)).choices[0]
        if choice.finish_reason == "tool_calls":
            _valid(choice.message.tool_calls, {"get_time"})
            made += 1
    assert made, "the forced calls end within max_tokens"
    render = lambda choice: httpx.post(fmt_server.url + "/v1/chat/completions/render", timeout=30,  # noqa: E731
                                       json={**req, "tool_choice": choice}).json()
    assert render(allowed("auto", "get_time"))["prompt"] == render("auto")["prompt"]
    # an answer, or calls to the allowed tool only: the grammar of both
    assert render(allowed("auto", "get_time"))["grammar"].startswith("lark:")
    for seed in range(3):
        choice = client.chat.completions.create(**req, seed=seed, tool_choice=allowed("auto", "get_time"),
                                                logit_bias=_marker_tokens(fmt_server)).choices[0]
        assert "<tool_call>" not in (choice.message.content or ""), choice
        if choice.message.tool_calls and choice.finish_reason == "tool_calls":
            _valid(choice.message.tool_calls, {"get_time"})
    r = httpx.post(fmt_server.url + "/v1/chat/completions", timeout=30,
                   json={**req, "tool_choice": allowed("required", "get_news")})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice.allowed_tools.tools[0].function.name"


# Mistral's calls open with `[TOOL_CALLS]` (or a bare array), llama3's with `<|python_tag|>` or
# a bare `{"name"` object: under "auto" with a strict tool, the answer branch may write
# neither, so whatever the model writes is a valid call or text the parser leaves alone.
MISTRAL = ("{% if tools %}{{ '[AVAILABLE_TOOLS]' + tools | tojson + '[/AVAILABLE_TOOLS]' }}{% endif %}"
           "{{ 'Call tools as [TOOL_CALLS][{\"name\": ..., \"arguments\": {...}}]\n' }}"
           + _TURNS.replace("CALL", "[TOOL_CALLS]"))
LLAMA3 = ("{% if tools %}{{ 'Environment: ipython\nCall a function as {\"name\": NAME, \"parameters\": ARGS}\n'"
          " + tools | tojson }}{% endif %}" + _TURNS.replace("CALL", "<|python_tag|>"))


@pytest.fixture(scope="module", params=[("mistral", MISTRAL, "["), ("llama3_json", LLAMA3, '{"name": "')],
                ids=["mistral", "llama3_json"])
def marked_server(request, model_dir, tmp_path_factory):
    name, template, opening = request.param
    path = tmp_path_factory.mktemp("tpl") / f"{name}.jinja"
    path.write_text(template)
    server = ServerProcess(str(model_dir), "--served-model-name", "tiny", "--chat-template", str(path),
                           "--num-kv-blocks", "400")
    server.format, server.opening = name, opening
    yield server
    server.stop()


def test_strict_tools_under_auto_in_the_mistral_and_llama3_formats(marked_server):
    tokens = httpx.post(marked_server.url + "/tokenize", timeout=30,
                        json={"model": "tiny", "prompt": marked_server.opening}).json()["tokens"]
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    req = dict(model="tiny", messages=ASK, tools=[strict], max_tokens=80, temperature=1.0,
               parallel_tool_calls=False, logit_bias={str(t): 8 for t in tokens})
    render = httpx.post(marked_server.url + "/v1/chat/completions/render", timeout=30, json=req).json()
    assert render["tool_call_format"] == marked_server.format
    assert render["grammar"].startswith("lark:")
    with OpenAI(base_url=marked_server.url + "/v1", api_key="x", max_retries=0, timeout=120) as client:
        calls = 0
        for seed in range(4):
            r = client.chat.completions.with_raw_response.create(**req, seed=seed)
            assert "llmserve-ignored-fields" not in r.headers
            choice = r.parse().choices[0]
            content = choice.message.content or ""
            assert not content.lstrip().startswith(marked_server.opening[0]), choice
            assert "[TOOL_CALLS]" not in content and '{"name"' not in content, choice
            if choice.message.tool_calls and choice.finish_reason == "tool_calls":
                _valid(choice.message.tool_calls, {"get_weather"})
                calls += 1
        # (the pushed opening makes calls likely; each one validates)
        assert calls, "some seed made a call"
