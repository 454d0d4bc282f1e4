"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) end to end,
with the official `anthropic` SDK.

A Messages request is the chat request it means: the same greedy answer, from the same
prompt tokens, as /v1/chat/completions gives for the translated messages, tools and stops.
Streamed, its events are accumulated by the SDK's own `messages.stream()` helper (which raises
on events out of order) and add up to the non-streamed `message`.
"""

from __future__ import annotations

import json
import re

import anthropic
import httpx
import jsonschema
import pytest
from openai import NotFoundError as OpenAINotFoundError
from openai import OpenAI

from server import ServerProcess
from test_reasoning import _build as build_think_model
from test_tool_formats import HERMES, WEATHER
from tiny import build_tiny_llama

MODEL = "SmolLM2-135M-Instruct"
# ("What is the capital of France?" is a near tie between answers, which a CPU's arithmetic
# settles: README, Talk to it)
ASK = [{"role": "user", "content": "Name the capital of France."}]
# (the SDK has no `temperature` argument any more: sampling fields go as extra_body)
GREEDY = {"temperature": 0}


def _client(server, key: str = "x") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def client(smol):
    with _client(smol) as c:
        yield c


@pytest.fixture(scope="module")
def openai_client(smol):
    with OpenAI(base_url=smol.url + "/v1", api_key="x", max_retries=0, timeout=120) as c:
        yield c


def _input(usage) -> int:
    """All the prompt's tokens: Anthropic counts those the cache held apart."""
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


def _streamed(client, **req):
    """The raw events of a streamed request, and the message the SDK's helper sums them to."""
    events = list(client.messages.create(**req, stream=True))
    with client.messages.stream(**req) as stream:
        for _ in stream:
            pass
        final = stream.get_final_message()
    return events, final


def test_text_answer_is_the_chat_answer(client, openai_client):
    m = client.messages.create(model=MODEL, max_tokens=32, messages=ASK, extra_body=GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_") and m.model == MODEL
    assert [b.type for b in m.content] == ["text"]
    assert m.content[0].text == "The capital of France is Paris."
    assert m._request_id == m.id   # (the `request-id` header, Anthropic's name for it)
    assert (m.stop_reason, m.stop_sequence) == ("end_turn", None)
    chat = openai_client.chat.completions.create(model=MODEL, messages=ASK, max_completion_tokens=32, temperature=0)
    assert m.content[0].text == chat.choices[0].message.content
    assert (_input(m.usage), m.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert m.usage.cache_creation_input_tokens == 0


def test_stream_events_add_up_to_the_message(client):
    req = dict(model=MODEL, max_tokens=32, system="Answer in one sentence.", messages=ASK, extra_body=GREEDY)
    m = client.messages.create(**req)
    events, final = _streamed(client, **req)
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1] == "content_block_start" and kinds[-3] == "content_block_stop"
    assert set(kinds[2:-3]) == {"content_block_delta"}
    start = events[0].message
    assert start.content == [] and start.stop_reason is None and start.id.startswith("msg_")
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == m.content[0].text == final.content[0].text
    assert (final.stop_reason, final.stop_sequence) == (m.stop_reason, m.stop_sequence)
    assert (_input(final.usage), final.usage.output_tokens) == (_input(m.usage), m.usage.output_tokens)


def test_stop_sequences_and_max_tokens(client):
    stopped = client.messages.create(model=MODEL, max_tokens=32, messages=ASK, stop_sequences=["Paris"],
                                     extra_body=GREEDY)
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "Paris")
    assert stopped.content[0].text == "The capital of France is "
    events, final = _streamed(client, model=MODEL, max_tokens=32, messages=ASK, stop_sequences=["Paris"],
                              extra_body=GREEDY)
    assert (final.stop_reason, final.stop_sequence, final.content[0].text) == (
        "stop_sequence", "Paris", "The capital of France is ")
    cut = client.messages.create(model=MODEL, max_tokens=3, messages=ASK, extra_body=GREEDY)
    assert (cut.stop_reason, cut.usage.output_tokens) == ("max_tokens", 3)


def test_max_tokens_0_warms_the_prompt_cache(client):
    """Anthropic's `max_tokens: 0` runs the prompt into the cache and generates nothing; the
    same prompt then reads it from the cache."""
    long_ask = [{"role": "user", "content": "Tell me, in one word, the colour of the sky at noon on a clear day. " * 6}]
    warm = client.messages.create(model=MODEL, max_tokens=0, messages=long_ask)
    assert (warm.content, warm.stop_reason, warm.usage.output_tokens) == ([], "max_tokens", 0)
    assert warm.usage.input_tokens > 60       # (the template's system prompt may be cached already)
    events, final = _streamed(client, model=MODEL, max_tokens=0, messages=long_ask)
    assert (final.content, final.stop_reason) == ([], "max_tokens")
    assert [e.type for e in events] == ["message_start", "message_delta", "message_stop"]
    tool = {"name": "f", "input_schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}
    forced = client.messages.create(model=MODEL, max_tokens=0, messages=long_ask, tools=[tool],
                                    tool_choice={"type": "tool", "name": "f"})
    assert (forced.content, forced.stop_reason) == ([], "max_tokens")     # (no call was generated)
    answer = client.messages.create(model=MODEL, max_tokens=2, messages=long_ask)
    assert answer.usage.cache_read_input_tokens >= warm.usage.cache_read_input_tokens + 48
    assert _input(answer.usage) == _input(warm.usage)


def test_a_last_assistant_message_is_continued(smol, client):
    prefill = [*ASK, {"role": "assistant", "content": "The capital of France is"}]
    m = client.messages.create(model=MODEL, max_tokens=8, messages=prefill, extra_body=GREEDY)
    # only what came after the prefill, as Anthropic answers it
    assert m.content[0].text.startswith(" Paris"), m.content
    render = httpx.post(smol.url + "/v1/chat/completions/render", timeout=30, json={
        "model": MODEL, "messages": prefill, "continue_final_message": True, "add_generation_prompt": False}).json()
    assert render["prompt"].endswith("The capital of France is")
    assert _input(m.usage) == len(render["prompt_token_ids"])


def test_output_format_is_enforced(client):
    """`output_config.format` is chat's json_schema response_format: the text block is JSON
    that validates, even from a 135M model."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer"}},
              "required": ["city", "population"], "additionalProperties": False}
    m = client.messages.create(model=MODEL, max_tokens=60, messages=[
        {"role": "user", "content": "Give the largest city of France and its population as JSON."}],
        output_config={"format": {"type": "json_schema", "schema": schema}}, extra_body=GREEDY)
    assert m.stop_reason == "end_turn", m
    jsonschema.validate(json.loads(m.content[0].text), schema)


def test_count_tokens_is_the_prompt_a_message_reads(client):
    req = dict(model=MODEL, system="Be brief.", messages=ASK)
    raw = client.messages.with_raw_response.count_tokens(**req)
    counted = raw.parse()
    m = client.messages.create(**req, max_tokens=1, extra_body=GREEDY)
    assert counted.input_tokens == _input(m.usage) > 0
    # named as every Messages answer is (the SDK's `_request_id`)
    assert raw.headers["request-id"] == raw.headers["x-request-id"] == counted._request_id
    assert counted._request_id.startswith("req_")


def test_fields_without_effect_are_reported(client):
    raw = client.messages.with_raw_response.create(
        model=MODEL, max_tokens=4, extra_body=GREEDY, metadata={"user_id": "u-1"},
        messages=[{"role": "user", "content": [
            {"type": "text", "text": "Hello", "cache_control": {"type": "ephemeral"}}]}],
        thinking={"type": "enabled", "budget_tokens": 1024})
    # (SmolLM2 does not think; `cache_control` asks for what the prefix cache does anyway)
    assert raw.headers["llmserve-ignored-fields"] == "thinking"
    assert raw.parse().stop_reason in ("end_turn", "max_tokens")


@pytest.mark.parametrize("body, status, kind, param", [
    ({"messages": ASK}, 400, "invalid_request_error", "max_tokens"),
    ({"max_tokens": 4, "messages": ASK, "stop": ["x"]}, 400, "invalid_request_error", "stop"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "AA=="}}]}]}, 400, "invalid_request_error",
     "messages[0].content[0].type"),
    ({"max_tokens": 4, "messages": ASK, "tools": [{"name": "f", "input_schema": {"type": "object"}}],
      "tool_choice": {"type": "tool", "name": "g"}}, 400, "invalid_request_error", "tool_choice.name"),
    ({"max_tokens": 4000, "messages": ASK}, 400, "invalid_request_error", "max_tokens"),
    ({"model": "claude-sonnet-4-5", "max_tokens": 4, "messages": ASK}, 404, "not_found_error", "model"),
    # Anthropic's conversation rules: a call must be answered, so it is never a prefill
    ({"max_tokens": 4, "tools": [{"name": "f", "input_schema": {"type": "object"}}], "messages": [
        *ASK, {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]}]},
     400, "invalid_request_error", "messages[1].content[0]"),
    ({"max_tokens": 4, "messages": [*ASK, {"role": "assistant", "content": "It is "}]}, 400,
     "invalid_request_error", "messages[1].content"),
    ({"max_tokens": 4, "messages": ASK, "thinking": {"type": "enabled"}}, 400, "invalid_request_error",
     "thinking.budget_tokens"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "text", "text": " \n"}]}]}, 400,
     "invalid_request_error", "messages[0].content[0].text"),
])
def test_errors_have_anthropics_shape(smol, body, status, kind, param):
    r = httpx.post(smol.url + "/v1/messages", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()
    assert error["type"] == "error" and set(error) == {"type", "error", "request_id"}
    assert error["request_id"] == r.headers["request-id"]   # (as Anthropic's bodies name it)
    anthropic.types.ErrorResponse.model_validate(error)
    assert (error["error"]["type"], error["error"]["param"]) == (kind, param)
    assert error["error"]["message"]
    # the SDK raises it as the status's error, with the message it carries (sent as it is: the
    # SDK's `messages.create` refuses some of these bodies itself)
    with _client(smol) as client, pytest.raises(anthropic.APIStatusError) as raised:
        client.post("/v1/messages", cast_to=anthropic.types.Message, body={"model": MODEL, **body})
    assert raised.value.status_code == status
    assert raised.value.body["error"]["message"] == error["error"]["message"]
    assert raised.value.request_id.startswith("req_")


def test_a_messages_route_not_served_answers_in_anthropics_shape(client):
    """Anthropic's Message Batches are not served: the SDK gets a 404 in Anthropic's shape."""
    with pytest.raises(anthropic.NotFoundError) as raised:
        client.messages.batches.retrieve("msgbatch_1")
    assert raised.value.body["type"] == "error" and raised.value.body["error"]["type"] == "not_found_error"
    assert raised.value.body["request_id"] == raised.value.request_id


def test_both_sdks_list_the_models(client, openai_client):
    """GET /v1/models is one page that both SDKs read: OpenAI's list, Anthropic's page."""
    listed = list(client.models.list())
    assert [m.id for m in listed] == [m.id for m in openai_client.models.list().data] == [MODEL]
    assert listed[0].type == "model" and listed[0].display_name == MODEL and listed[0].created_at.year >= 2025
    assert listed[0].max_input_tokens == listed[0].max_tokens == 2048   # (--max-model-len)
    assert client.models.retrieve(MODEL).id == MODEL
    # (the SDK builds its objects without validating them: each has every field it requires)
    raw = client.models.with_raw_response.retrieve(MODEL).http_response.json()
    assert anthropic.types.ModelInfo.model_validate(raw).lifecycle == "active"
    # an unknown id is a 404 in Anthropic's shape for Anthropic's SDK (it sends anthropic-version),
    # in OpenAI's for OpenAI's
    with pytest.raises(anthropic.NotFoundError) as raised:
        client.models.retrieve("nope")
    body = raised.value.body
    assert body["type"] == "error" and body["error"]["type"] == "not_found_error"
    assert body["request_id"] == raised.value.request_id is not None
    with pytest.raises(OpenAINotFoundError) as missing:
        openai_client.models.retrieve("nope")
    assert missing.value.body["code"] == "model_not_found" and "request_id" not in missing.value.response.json()


def test_context_overflow_in_anthropics_words(client):
    """An overflow reads as Anthropic's API words it, which clients match on (LangChain's
    ChatAnthropic raises ContextOverflowError on "prompt is too long"), with both counts and
    the limit; the code stays context_length_exceeded."""
    with pytest.raises(anthropic.BadRequestError) as raised:
        client.messages.create(model=MODEL, max_tokens=4000, messages=ASK)
    error = raised.value.body["error"]
    prompt = client.messages.count_tokens(model=MODEL, messages=ASK).input_tokens
    assert error["code"] == "context_length_exceeded" and error["message"] == (
        f"input length and `max_tokens` exceed context limit: {prompt} + 4000 > 2048, decrease input length or "
        "`max_tokens` and try again")
    long = [{"role": "user", "content": "hello " * 2100}]
    with pytest.raises(anthropic.BadRequestError) as raised:
        client.messages.create(model=MODEL, max_tokens=8, messages=long)
    # (count_tokens counts a prompt past the context too: the count a client trims by)
    prompt = client.messages.count_tokens(model=MODEL, messages=long).input_tokens
    assert prompt > 2048
    assert raised.value.body["error"]["message"] == f"prompt is too long: {prompt} tokens > 2048 maximum"


def test_the_sdks_tool_runner_works_without_threads(client):
    """anthropic's `beta.messages.tool_runner` threads its turns by default: each later turn
    would send only its new messages. The server refuses `thread` with the `error.details` the
    runner reads, so it sends the whole history instead and the loop completes (audit 78). The
    `thread` helper, which does not fall back, gets that 400."""
    from anthropic import beta_tool

    calls = []

    @beta_tool
    def get_weather(city: str) -> str:
        """Get the weather for a city."""
        calls.append(city)
        return "sunny"

    turns = list(client.beta.messages.tool_runner(
        model=MODEL, max_tokens=40, max_iterations=2, messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[get_weather], tool_choice={"type": "any"}, extra_body=GREEDY))
    assert [t.stop_reason for t in turns][0] == "tool_use" and len(turns) == 2 and calls
    thread = client.beta.messages.thread(model=MODEL, max_tokens=4, extra_body=GREEDY)
    with pytest.raises(anthropic.BadRequestError) as refused:
        thread.send({"role": "user", "content": "Hello"})
    error = refused.value.body["error"]
    assert (error["param"], error["details"]["error_code"]) == ("thread", "thread_unsupported_request")


# --- tools and keys, on a tiny model with a Hermes template --------------------------------

KEY = "anthropic-test-key"
TOOL = {"name": "get_weather", "description": "The weather", "input_schema": WEATHER["function"]["parameters"]}
# the same tool as chat's
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather",
                                              "parameters": WEATHER["function"]["parameters"]}}


@pytest.fixture(scope="module")
def hermes(tmp_path_factory):
    folder = build_tiny_llama(tmp_path_factory.mktemp("tiny-messages"), max_position_embeddings=2048)
    template = tmp_path_factory.mktemp("tpl") / "hermes.jinja"
    template.write_text(HERMES)
    server = ServerProcess(str(folder), "--served-model-name", "tiny", "--chat-template", str(template),
                           "--num-kv-blocks", "400", "--api-key", KEY)
    yield server
    server.stop()


def test_keys_are_read_from_x_api_key(hermes):
    with _client(hermes, KEY) as client:
        assert client.messages.count_tokens(model="tiny", messages=ASK).input_tokens > 0
    with _client(hermes, "wrong") as client, pytest.raises(anthropic.AuthenticationError) as raised:
        client.messages.create(model="tiny", max_tokens=2, messages=ASK)
    assert raised.value.body["type"] == "error"
    assert raised.value.body["error"]["type"] == "authentication_error"


def test_forced_tool_calls_are_tool_use_blocks(hermes):
    with _client(hermes, KEY) as client, OpenAI(base_url=hermes.url + "/v1", api_key=KEY) as oai:
        ask = [{"role": "user", "content": "Weather in Paris?"}]
        req = dict(model="tiny", max_tokens=200, messages=ask, tools=[TOOL],
                   tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
        m = client.messages.create(**req)
        assert m.stop_reason == "tool_use"
        (use,) = [b for b in m.content if b.type == "tool_use"]
        # (Anthropic's id shape: `toolu_` and 24 hex digits here)
        assert use.name == "get_weather" and re.fullmatch(r"toolu_[0-9a-f]{24}", use.id)
        jsonschema.validate(use.input, TOOL["input_schema"])
        # the same call as chat's, from the same prompt
        chat = oai.chat.completions.create(model="tiny", messages=ask, tools=[CHAT_TOOL], temperature=0,
                                           max_completion_tokens=200,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
        assert json.loads(chat.choices[0].message.tool_calls[0].function.arguments) == use.input
        assert chat.usage.prompt_tokens == _input(m.usage)
        events, final = _streamed(client, **req)
        starts = [e.content_block for e in events if e.type == "content_block_start"]
        assert [s.type for s in starts] == ["tool_use"] and starts[0].input == {}
        assert re.fullmatch(r"toolu_[0-9a-f]{24}", starts[0].id)
        pieces = [e for e in events if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
        assert len(pieces) > 1, "the input should arrive as it is generated"
        assert final.stop_reason == "tool_use"
        assert [b.input for b in final.content if b.type == "tool_use"] == [use.input]


def test_the_tool_loop_is_the_chat_history(hermes):
    """The loop clients write: the answer's blocks go back as they are, with each call's
    result; the prompt is the chat history it means."""
    with _client(hermes, KEY) as client:
        ask = [{"role": "user", "content": "Weather in Paris?"}]
        first = client.messages.create(model="tiny", max_tokens=200, messages=ask, tools=[TOOL],
                                       tool_choice={"type": "any"}, extra_body=GREEDY)
        uses = [b for b in first.content if b.type == "tool_use"]
        assert uses
        history = [*ask, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                   {"role": "user", "content": [
                       {"type": "tool_result", "tool_use_id": u.id, "content": "sunny"} for u in uses]}]
        raw = client.messages.with_raw_response.create(model="tiny", max_tokens=8, messages=history, tools=[TOOL],
                                                       extra_body=GREEDY)
        again = raw.parse()
        # (this template reads neither a result's id nor a call's `id`: chat reports them)
        assert "llmserve-ignored-fields" not in raw.headers or all(
            f.endswith(".tool_use_id") for f in raw.headers["llmserve-ignored-fields"].split(", "))
        chat_history = [*ask, {"role": "assistant", "content": None, "tool_calls": [
            {"id": u.id, "type": "function", "function": {"name": u.name, "arguments": json.dumps(u.input)}}
            for u in uses]}]
        chat_history += [{"role": "tool", "tool_call_id": u.id, "name": u.name, "content": "sunny"} for u in uses]
        render = httpx.post(hermes.url + "/v1/chat/completions/render", timeout=30,
                            headers={"authorization": f"Bearer {KEY}"},
                            json={"model": "tiny", "messages": chat_history, "tools": [CHAT_TOOL]}).json()
        assert _input(again.usage) == len(render["prompt_token_ids"])
        assert client.messages.count_tokens(model="tiny", messages=history, tools=[TOOL]).input_tokens == _input(
            again.usage)


# --- thinking, on a tiny model whose template opens a think block ---------------------------

@pytest.fixture(scope="module")
def think(tmp_path_factory):
    folder, _ = build_think_model(tmp_path_factory.mktemp("tiny-think-messages"))
    server = ServerProcess(str(folder), "--served-model-name", "tiny", "--num-kv-blocks", "100")
    yield server
    server.stop()


def test_thinking_is_a_thinking_block(think):
    with _client(think) as client, OpenAI(base_url=think.url + "/v1", api_key="x") as oai:
        chat = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}],
                                           max_completion_tokens=24, temperature=1.0, seed=3)
        req = dict(model="tiny", max_tokens=24, messages=[{"role": "user", "content": "Hello"}],
                   extra_body={"temperature": 1.0, "seed": 3})
        m = client.messages.create(**req)
        msg = chat.choices[0].message
        thinking = [b.thinking for b in m.content if b.type == "thinking"]
        assert (thinking[0] if thinking else None) == msg.reasoning_content
        assert "".join(b.text for b in m.content if b.type == "text") == (msg.content or "")
        assert m.usage.output_tokens_details.thinking_tokens == chat.usage.completion_tokens_details.reasoning_tokens
        events, final = _streamed(client, **req)
        thought = "".join(e.delta.thinking for e in events
                          if e.type == "content_block_delta" and e.delta.type == "thinking_delta")
        assert thought == (msg.reasoning_content or "")
        assert [b.type for b in final.content] == [b.type for b in m.content]
        # `thinking: disabled` switches this template's `enable_thinking` off, as chat's kwarg does
        off = client.messages.with_raw_response.create(**req, thinking={"type": "disabled"})
        assert "llmserve-ignored-fields" not in off.headers
        off = off.parse()
        plain = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}],
                                            max_completion_tokens=24, temperature=1.0, seed=3,
                                            extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert [b.type for b in off.content if b.type == "thinking"] == []
        assert "".join(b.text for b in off.content if b.type == "text") == (plain.choices[0].message.content or "")
        assert _input(off.usage) == plain.usage.prompt_tokens


def test_thinking_budget_tokens_bounds_the_thinking(think):
    # as chat's thinking_token_budget: the block is closed for the model once it is spent (the
    # bias keeps this random model from closing it itself)
    close = str(httpx.post(think.url + "/tokenize", json={"model": "tiny", "prompt": "</think>"}).json()["tokens"][0])
    ask = [{"role": "user", "content": "Hello"}]
    sampling = {"temperature": 0, "ignore_eos": True, "logit_bias": {close: -100}}
    with _client(think) as client, OpenAI(base_url=think.url + "/v1", api_key="x") as oai:
        chat = oai.chat.completions.create(model="tiny", messages=ask, max_completion_tokens=12,
                                           extra_body={**sampling, "thinking_token_budget": 5})
        raw = client.messages.with_raw_response.create(model="tiny", max_tokens=12, messages=ask,
                                                       thinking={"type": "enabled", "budget_tokens": 5},
                                                       extra_body=sampling)
        assert "llmserve-ignored-fields" not in raw.headers
        m = raw.parse()
        msg = chat.choices[0].message
        assert chat.usage.completion_tokens_details.reasoning_tokens == 5
        assert m.usage.output_tokens_details.thinking_tokens == 5
        assert [b.thinking for b in m.content if b.type == "thinking"] == [msg.reasoning_content]
        assert "".join(b.text for b in m.content if b.type == "text") == msg.content != ""
