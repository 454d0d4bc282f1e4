"""OpenAI's Responses API (`POST /v1/responses`) end to end, with the official SDK.

A Responses request is the chat request it means: the same greedy answer, from the same
prompt tokens, as /v1/chat/completions gives for the translated messages, tools and format.
Streamed, its events follow OpenAI's order (checked by the SDK's own stream accumulator,
which raises on any inconsistency) and add up to the non-streamed `response`.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import jsonschema
import pytest
from openai import BadRequestError, NotFoundError, OpenAI

from server import ServerProcess, tiny_template_server
from test_reasoning import _build as build_think_model
from test_tool_formats import HERMES, TIME, WEATHER

MODEL = "SmolLM2-135M-Instruct"


def _client(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def client(smol):
    with _client(smol) as c:
        yield c


def _events(client, **req) -> list:
    return list(client.responses.create(**req, stream=True))


def _check_stream_matches(events, whole) -> None:
    """The events are numbered in order, follow OpenAI's sequence, and sum to `whole`."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    final = events[-1]
    assert {e.response.id for e in (events[0], events[1], final)} == {final.response.id}
    assert final.type == ("response.incomplete" if whole.status == "incomplete" else "response.completed")
    assert final.response.status == whole.status
    assert final.response.incomplete_details == whole.incomplete_details
    got = [(o.type, getattr(o, "status", None)) for o in final.response.output]
    assert got == [(o.type, getattr(o, "status", None)) for o in whole.output]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == final.response.output_text
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == "".join(o.arguments for o in whole.output if o.type == "function_call")
    assert final.response.usage.output_tokens == whole.usage.output_tokens
    assert final.response.usage.input_tokens == whole.usage.input_tokens


def test_text_answer_is_the_chat_answer(client):
    # ("What is the capital of France?" is a near tie between answers, which a CPU's arithmetic
    # settles: README, Talk to it)
    r = client.responses.create(model=MODEL, input="Name the capital of France.", temperature=0,
                                max_output_tokens=32)
    assert r.object == "response" and r.id.startswith("resp_") and r.status == "completed"
    assert r.output_text == "The capital of France is Paris."
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert item.id.startswith("msg_") and item.content[0].type == "output_text"
    assert r.store is True and r.max_output_tokens == 32 and r.temperature == 0
    chat = client.chat.completions.create(model=MODEL, temperature=0, max_completion_tokens=32,
                                          messages=[{"role": "user", "content": "Name the capital of France."}])
    assert r.output_text == chat.choices[0].message.content
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_stream_events_add_up_to_the_response(client):
    req = dict(model=MODEL, input="Name three colors.", temperature=0, max_output_tokens=40)
    whole = client.responses.create(**req)
    events = _events(client, **req)
    _check_stream_matches(events, whole)
    kinds = [e.type for e in events]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert "[DONE]" not in json.dumps([e.model_dump() for e in events])
    # the SDK's accumulating helper raises on any inconsistent event
    with client.responses.stream(**req) as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    assert final.output_text == whole.output_text and final.status == "completed"


def test_instructions_and_items_are_the_chat_messages(client):
    instructions = "You are a pirate. Answer in one sentence."
    items = [
        {"role": "user", "content": "Hi"},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Ahoy!", "annotations": []}]},
        {"role": "user", "content": [{"type": "input_text", "text": "Where is the treasure?"}]},
    ]
    r = client.responses.create(model=MODEL, instructions=instructions, input=items, temperature=0,
                                max_output_tokens=24)
    messages = [{"role": "system", "content": instructions}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Ahoy!"}, {"role": "user", "content": "Where is the treasure?"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_completion_tokens=24)
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.output_text == chat.choices[0].message.content
    assert r.instructions == instructions


def test_max_output_tokens_makes_an_incomplete_response(client):
    req = dict(model=MODEL, input="Write a long story about the sea.", temperature=0, max_output_tokens=5)
    r = client.responses.create(**req)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete" and r.usage.output_tokens == 5
    _check_stream_matches(_events(client, **req), r)


def test_json_schema_format_is_enforced(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "country": {"enum": ["France", "Italy"]}},
              "required": ["city", "country"], "additionalProperties": False}
    r = client.responses.create(model=MODEL, input="Describe Paris as JSON.", temperature=0, max_output_tokens=60,
                                text={"format": {"type": "json_schema", "name": "city", "schema": schema,
                                                 "strict": True}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"


def test_logprobs_come_with_the_text(client):
    req = dict(model=MODEL, input="Say hi.", temperature=0, max_output_tokens=8,
               include=["message.output_text.logprobs"], top_logprobs=2)
    r = client.responses.create(**req)
    lps = r.output[0].content[0].logprobs
    assert "".join(lp.token for lp in lps) == r.output_text
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in lps)
    assert lps[0].top_logprobs[0].logprob >= lps[0].top_logprobs[1].logprob
    events = _events(client, **req)
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [(lp.token, lp.logprob) for lp in streamed] == [(lp.token, lp.logprob) for lp in lps]
    # without them, the part says nothing of logprobs
    plain = client.responses.create(model=MODEL, input="Say hi.", temperature=0, max_output_tokens=8)
    assert plain.output[0].content[0].logprobs is None
    # read back, the stored response shows them when `include` asks, as OpenAI's retrieve does;
    # query keys the route does not read are reported
    assert client.responses.retrieve(r.id).output[0].content[0].logprobs is None
    asked = client.responses.retrieve(r.id, include=["message.output_text.logprobs"])
    assert asked.output[0].content[0].logprobs == lps
    raw = httpx.get(f"{client.base_url}responses/{r.id}", params={"foo": "1", "stream": "false"}, timeout=30)
    assert (raw.status_code, raw.headers["llmserve-ignored-fields"]) == (200, "foo")
    follow = client.responses.create(model=MODEL, previous_response_id=r.id, input="Again.", max_output_tokens=1)
    listed = client.responses.input_items.list(follow.id, order="asc", include=["message.output_text.logprobs"])
    assert listed.data[1].content[0].logprobs == lps
    assert client.responses.input_items.list(follow.id, order="asc").data[1].content[0].logprobs is None


def test_fields_without_effect_are_reported(smol, client):
    raw = client.responses.with_raw_response.create(
        model=MODEL, input="Hi", max_output_tokens=4, store=True, reasoning={"effort": "low"},
        text={"verbosity": "low"}, include=["reasoning.encrypted_content"])
    assert raw.headers["llmserve-ignored-fields"] == "include[0], reasoning.effort, text.verbosity"
    assert raw.parse().store is True
    r = httpx.post(smol.url + "/v1/responses", timeout=60,
                   json={"model": MODEL, "input": "Hi", "max_output_tokens": 4, "store": False})
    assert r.status_code == 200 and "llmserve-ignored-fields" not in r.headers
    # what every response echoes, and agent SDKs send for an agent without tools, asks for nothing
    raw = client.responses.with_raw_response.create(model=MODEL, input="Hi", max_output_tokens=4, tools=[],
                                                    tool_choice="auto", parallel_tool_calls=True, top_logprobs=0,
                                                    truncation="disabled")
    assert "llmserve-ignored-fields" not in raw.headers, raw.headers["llmserve-ignored-fields"]
    assert raw.parse().usage.input_tokens_details.cache_write_tokens == 0


@pytest.mark.parametrize("body, param, code", [
    ({"messages": [{"role": "user", "content": "Hi"}]}, "messages", "unsupported_parameter"),
    ({"input": "Hi", "max_tokens": 5}, "max_tokens", "unsupported_parameter"),
    ({"input": "Hi", "conversation": 1}, "conversation", "invalid_type"),
    ({"input": "Hi", "background": True, "store": False}, "background", "invalid_value"),
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools[0].type", "unsupported_parameter"),
    ({"input": [{"type": "item_reference", "id": "msg_never_stored"}]}, "input[0].id", "item_not_found"),
    ({"input": [{"type": "item_reference"}]}, "input[0].id", "missing_required_parameter"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type", "unsupported_parameter"),
    ({"input": [{"role": "robot", "content": "Hi"}]}, "input[0].role", "invalid_value"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id",
     "missing_required_parameter"),
    ({}, "input", "missing_required_parameter"),
    ({"input": []}, "input", "invalid_value"),
    ({"input": "Hi", "temperature": 3}, "temperature", "invalid_value"),
    ({"input": "Hi", "top_logprobs": 21}, "top_logprobs", "invalid_value"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
     "text.format.schema", "invalid_value"),
    ({"input": "Hi", "tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name", "invalid_value"),
    ({"input": "Hi", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}},
     "tool_choice.name", "invalid_value"),
])
def test_errors_name_the_responses_field(smol, body, param, code):
    r = httpx.post(smol.url + "/v1/responses", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"], err["type"]) == (param, code, "invalid_request_error"), err


def test_context_overflow_names_max_output_tokens(client):
    with pytest.raises(BadRequestError) as e:
        client.responses.create(model=MODEL, input="Hi", max_output_tokens=5000)
    err = e.value.body
    assert err["code"] == "context_length_exceeded" and err["param"] == "max_output_tokens"
    assert "`max_output_tokens`" in err["message"]


def test_truncation_auto_drops_the_first_turns(client):
    """A history too long for the context: a 400 as sent, and with `truncation="auto"` the
    answer to its last turns, as if only those had been sent (the counts say how many fit)."""
    turn = "Tell me about the history of the city of Paris. " * 20          # ~200 tokens
    history = [item for k in range(12) for item in ({"role": "user", "content": f"{k}: {turn}"},
                                                    {"role": "assistant", "content": turn})]
    history.append({"role": "user", "content": "What is the capital of France?"})
    with pytest.raises(BadRequestError) as e:
        client.responses.create(model=MODEL, input=history, max_output_tokens=16, temperature=0)
    assert e.value.body["code"] == "context_length_exceeded"
    auto = client.responses.create(model=MODEL, input=history, max_output_tokens=16, temperature=0,
                                   truncation="auto")
    assert auto.truncation == "auto" and auto.status in ("completed", "incomplete")
    assert auto.usage.input_tokens + 16 <= 2048
    # the turns kept are the last that fit: one more would not
    def fits(k: int) -> bool:
        return client.responses.input_tokens.count(model=MODEL, input=history[k:]).input_tokens + 16 <= 2048

    kept = next(k for k in range(2, len(history), 2) if fits(k))
    # a history past the context is counted all the same (what a client trims by); with
    # truncation="auto" counting truncates alike (for the prompt alone: it takes no max_output_tokens)
    assert client.responses.input_tokens.count(model=MODEL, input=history).input_tokens > 2048
    counted = client.responses.input_tokens.count(model=MODEL, input=history, truncation="auto").input_tokens
    assert auto.usage.input_tokens <= counted < 2048
    alone = client.responses.create(model=MODEL, input=history[kept:], max_output_tokens=16, temperature=0)
    assert (auto.output_text, auto.usage.input_tokens) == (alone.output_text, alone.usage.input_tokens)


def test_compaction_is_a_404_not_a_405(client):
    with pytest.raises(NotFoundError) as e:
        client.responses.compact(model=MODEL, input="Hi")
    assert "compact" in e.value.body["message"]


def test_unknown_model_and_unknown_responses_are_404(client):
    with pytest.raises(NotFoundError) as e:
        client.responses.create(model="nope", input="Hi")
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(NotFoundError) as e:
        client.responses.retrieve("resp_123")
    assert e.value.body["code"] == "not_found"
    with pytest.raises(NotFoundError):
        client.responses.delete("resp_123")
    with pytest.raises(NotFoundError):
        client.responses.input_items.list("resp_123")


def test_stored_responses_are_read_back_and_continued(client):
    first = client.responses.create(model=MODEL, instructions="Answer in one short sentence.",
                                    input="What is the capital of France?", temperature=0, max_output_tokens=24)
    assert first.store is True
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    items = client.responses.input_items.list(first.id)
    assert [i.content[0].text for i in items.data] == ["What is the capital of France?"]
    assert items.data[0].id.startswith("msg_")   # (instructions are not an item, as OpenAI's)

    # a streamed response is stored as its final event says
    events = _events(client, model=MODEL, input="Hi", temperature=0, max_output_tokens=8)
    final = events[-1].response
    assert client.responses.retrieve(final.id).output_text == final.output_text

    # previous_response_id: the conversation so far, then the new input (not the old instructions)
    second = client.responses.create(model=MODEL, previous_response_id=first.id, input="And of Italy?",
                                     temperature=0, max_output_tokens=24)
    assert second.previous_response_id == first.id
    by_hand = client.responses.create(model=MODEL, temperature=0, max_output_tokens=24, store=False, input=[
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And of Italy?"},
    ])
    assert (second.output_text, second.usage.input_tokens) == (by_hand.output_text, by_hand.usage.input_tokens)
    listed = client.responses.input_items.list(second.id, order="asc")
    assert [i.type for i in listed.data] == ["message", "message", "message"]

    # bad pages and streamed reads are 400s; an assistant turn sent as a string is listed in
    # OpenAI's shape
    r = httpx.get(f"{client.base_url}responses/{second.id}/input_items", params={"limit": "-1"}, timeout=30)
    assert (r.status_code, r.json()["error"]["param"]) == (400, "limit")
    with pytest.raises(BadRequestError):
        client.responses.retrieve(second.id, stream=True)
    raw = httpx.get(f"{client.base_url}responses/{second.id}/input_items", params={"order": "asc"}, timeout=30)
    assert raw.json()["data"][1]["content"] == [{"type": "output_text", "text": first.output_text,
                                                 "annotations": []}]

    # item references: stored items (an input of one response, the output of another) sent
    # by id are the items themselves, and are listed under their own ids
    referenced = client.responses.create(model=MODEL, temperature=0, max_output_tokens=24, input=[
        {"type": "item_reference", "id": items.data[0].id},
        {"type": "item_reference", "id": first.output[0].id},
        {"role": "user", "content": "And of Italy?"},
    ])
    assert (referenced.output_text, referenced.usage.input_tokens) == (by_hand.output_text, by_hand.usage.input_tokens)
    ids = [i.id for i in client.responses.input_items.list(referenced.id, order="asc").data]
    assert ids[:2] == [items.data[0].id, first.output[0].id]
    with pytest.raises(BadRequestError) as e:
        client.responses.create(model=MODEL, input=[{"type": "item_reference", "id": "msg_nope"}])
    assert (e.value.body["code"], e.value.body["param"]) == ("item_not_found", "input[0].id")
    # a reference may leave its type out (OpenAI's schema: an `id` alone)
    typeless = client.responses.create(model=MODEL, temperature=0, max_output_tokens=24, store=False, input=[
        {"id": items.data[0].id}, {"id": first.output[0].id}, {"role": "user", "content": "And of Italy?"}])
    assert typeless.output_text == referenced.output_text

    # input_tokens counts what a create with the same body reads
    counted = client.responses.input_tokens.count(model=MODEL, previous_response_id=first.id, input="And of Italy?")
    assert counted.input_tokens == second.usage.input_tokens

    # store: false is not kept; deleted is gone
    with pytest.raises(NotFoundError):
        client.responses.retrieve(by_hand.id)
    client.responses.delete(first.id)
    with pytest.raises(NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(BadRequestError) as e:
        client.responses.create(model=MODEL, previous_response_id=first.id, input="Hi")
    assert (e.value.body["code"], e.value.body["param"]) == ("previous_response_not_found", "previous_response_id")


def _running(server) -> int:
    return httpx.get(server.url + "/load", timeout=30).json()["running"]


def _until(check, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_background_responses_run_without_their_client(smol, client):
    """`background: true`: the request returns at once with the response queued, and the
    response runs on: it is polled to its end, its events are read again from any point after
    the client left, and it can be cancelled (its sequences stop at once)."""
    ask = dict(model=MODEL, input="What is the capital of France?", temperature=0, max_output_tokens=24)
    queued = client.responses.create(**ask, background=True)
    assert (queued.status, queued.background, queued.output) == ("queued", True, [])
    _until(lambda: client.responses.retrieve(queued.id).status not in ("queued", "in_progress"))
    done = client.responses.retrieve(queued.id)
    foreground = client.responses.create(**ask, store=False)
    assert (done.status, done.background, done.output_text) == (foreground.status, True, foreground.output_text)
    assert done.usage.output_tokens == foreground.usage.output_tokens
    assert [i.content[0].text for i in client.responses.input_items.list(done.id).data] == [ask["input"]]
    # done, it can be continued
    client.responses.create(model=MODEL, previous_response_id=done.id, input="And of Italy?", max_output_tokens=4)

    # streamed: the client reads a few events and leaves; the rest are read later, by number
    long = dict(model=MODEL, input="Write a long story about a dragon.", temperature=0, max_output_tokens=48,
                extra_body={"ignore_eos": True})
    stream = client.responses.create(**long, background=True, stream=True)
    first = []
    for event in stream:
        first.append(event)
        if len(first) == 6:
            break
    stream.close()
    assert [e.type for e in first[:3]] == ["response.created", "response.queued", "response.in_progress"]
    response_id = first[0].response.id
    _until(lambda: client.responses.retrieve(response_id).status == "incomplete")
    rest = list(client.responses.retrieve(response_id, stream=True, starting_after=first[-1].sequence_number))
    events = first + rest
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type == "response.incomplete"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    stored = client.responses.retrieve(response_id)
    assert text == stored.output_text == events[-1].response.output_text
    assert stored.usage.output_tokens == 48
    # (the whole run again, from the start)
    again = list(client.responses.retrieve(response_id, stream=True))
    assert [e.type for e in again] == [e.type for e in events]

    # cancelled while it runs: it says so, stays so, and holds no sequence any longer
    endless = client.responses.create(**{**long, "max_output_tokens": 1500}, background=True)
    _until(lambda: client.responses.retrieve(endless.id).status == "in_progress")
    assert _running(smol) == 1
    # while it runs, its object shows the output so far, which grows; the greedy text is the
    # foreground answer's beginning
    _until(lambda: len(client.responses.retrieve(endless.id).output_text) > 20)
    so_far = client.responses.retrieve(endless.id)
    assert so_far.status == "in_progress" and so_far.output[-1].status == "in_progress"
    _until(lambda: len(client.responses.retrieve(endless.id).output_text) > len(so_far.output_text))
    cancelled = client.responses.cancel(endless.id)
    assert cancelled.status == "cancelled"
    # it keeps what it wrote, the message it was writing `incomplete`
    assert cancelled.output_text.startswith(so_far.output_text) and cancelled.output[-1].status == "incomplete"
    assert stored.output_text.startswith(cancelled.output_text) or cancelled.output_text.startswith(stored.output_text)
    _until(lambda: _running(smol) == 0)
    assert client.responses.retrieve(endless.id).status == "cancelled"
    assert client.responses.cancel(endless.id).status == "cancelled"
    # a running one cannot be continued; deleted, it stops too
    busy = client.responses.create(**{**long, "max_output_tokens": 1500}, background=True)
    with pytest.raises(BadRequestError) as e:
        client.responses.create(model=MODEL, previous_response_id=busy.id, input="Go on.")
    assert e.value.body["param"] == "previous_response_id"
    client.responses.delete(busy.id)
    _until(lambda: _running(smol) == 0)
    with pytest.raises(NotFoundError):
        client.responses.retrieve(busy.id)

    # what did not run in the background cannot be cancelled or streamed again
    kept = client.responses.create(**ask)
    for call in (lambda: client.responses.cancel(kept.id), lambda: client.responses.retrieve(kept.id, stream=True)):
        with pytest.raises(BadRequestError):
            call()
    r = httpx.get(f"{smol.url}/v1/responses/{response_id}", params={"stream": "true", "starting_after": "x"},
                  timeout=30)
    assert (r.status_code, r.json()["error"]["param"]) == (400, "starting_after")


def test_a_background_request_id_sent_twice_at_once_runs_once(smol, client):
    """Background responses sent at once under one `request_id`: each replaces the one before,
    whose generation stops even if it had not started yet (it ran on, out of reach of cancel);
    the cancel then stops the one left."""
    body = dict(model=MODEL, input="Write a long story about a dragon.", max_output_tokens=1500, background=True,
                ignore_eos=True, request_id="twice")

    async def send_all() -> list[int]:
        async with httpx.AsyncClient(base_url=smol.url, timeout=60) as c:
            sent = await asyncio.gather(*(c.post("/v1/responses", json=body) for _ in range(5)))
        return [r.status_code for r in sent]

    assert asyncio.run(send_all()) == [200] * 5
    assert client.responses.cancel("resp_twice").status == "cancelled"
    _until(lambda: _running(smol) == 0, timeout=30)
    assert httpx.get(smol.url + "/load", timeout=30).json()["kv_blocks_used"] == 0


def test_conversations_hold_the_turns_of_their_responses(client):
    """OpenAI's Conversations API (`client.conversations`): a response with `conversation`
    reads the conversation's items before its input, and its input and output items join
    the conversation when it is done, streamed or not."""
    conv = client.conversations.create(items=[{"type": "message", "role": "user",
                                               "content": "What is the capital of France?"}],
                                       metadata={"topic": "capitals"})
    assert conv.object == "conversation" and conv.id.startswith("conv_") and conv.metadata == {"topic": "capitals"}
    assert client.conversations.retrieve(conv.id).model_dump() == conv.model_dump()
    first = client.responses.create(model=MODEL, conversation=conv.id, input="Answer in one short sentence.",
                                    temperature=0, max_output_tokens=24)
    assert first.conversation.id == conv.id
    events = _events(client, model=MODEL, conversation={"id": conv.id}, input="And of Italy?", temperature=0,
                     max_output_tokens=24)
    second = events[-1].response
    by_hand = client.responses.create(model=MODEL, temperature=0, max_output_tokens=24, store=False, input=[
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "user", "content": "Answer in one short sentence."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And of Italy?"},
    ])
    assert (second.output_text, second.usage.input_tokens) == (by_hand.output_text, by_hand.usage.input_tokens)

    # the items, oldest first: the created one, then each response's input and output
    items = list(client.conversations.items.list(conv.id, order="asc", limit=2))   # (the SDK pages by `after`)
    assert [(i.type, i.role) for i in items] == [("message", "user"), ("message", "user"), ("message", "assistant"),
                                                 ("message", "user"), ("message", "assistant")]
    assert [i.id for i in items][2] == first.output[0].id and items[4].content[0].text == second.output_text
    newest = client.conversations.items.list(conv.id, limit=1)
    assert [i.id for i in newest.data] == [items[4].id] and newest.has_more
    # a stored response lists the conversation it answered: the items before it, then its input
    answered = [i.id for i in client.responses.input_items.list(second.id, order="asc")]
    assert answered == [i.id for i in items[:4]]

    # items added by hand, read and deleted by id; a conversation item can be referenced
    added = client.conversations.items.create(conv.id, items=[{"type": "message", "role": "user", "content": "x"}])
    (new,) = added.data
    assert client.conversations.items.retrieve(new.id, conversation_id=conv.id).content[0].text == "x"
    referenced = client.responses.create(model=MODEL, temperature=0, max_output_tokens=8, store=False,
                                         input=[{"type": "item_reference", "id": new.id}])
    plain = client.responses.create(model=MODEL, temperature=0, max_output_tokens=8, store=False, input="x")
    assert referenced.output_text == plain.output_text
    assert client.conversations.items.delete(new.id, conversation_id=conv.id).id == conv.id
    with pytest.raises(NotFoundError):
        client.conversations.items.retrieve(new.id, conversation_id=conv.id)

    # errors: both ways of continuing at once, an unknown conversation, more than 20 items
    with pytest.raises(BadRequestError) as e:
        client.responses.create(model=MODEL, conversation=conv.id, previous_response_id=first.id, input="Hi")
    assert e.value.body["param"] == "conversation"
    with pytest.raises(NotFoundError):
        client.responses.create(model=MODEL, conversation="conv_nope", input="Hi")
    with pytest.raises(BadRequestError) as e:
        client.conversations.create(items=[{"role": "user", "content": "a"}] * 21)
    assert e.value.body["param"] == "items"

    # output logprobs are kept, and listed when `include` asks for them (as OpenAI's)
    scored = client.responses.create(model=MODEL, conversation=conv.id, input="Thanks!", temperature=0,
                                     max_output_tokens=4, include=["message.output_text.logprobs"])
    assert scored.output[0].content[0].logprobs
    (plain_item,) = client.conversations.items.list(conv.id, limit=1).data
    (scored_item,) = client.conversations.items.list(conv.id, limit=1, include=["message.output_text.logprobs"]).data
    assert plain_item.content[0].logprobs is None
    assert [lp.token for lp in scored_item.content[0].logprobs] == [lp.token for lp in scored.output[0].content[0].logprobs]
    # an item id is in a conversation once
    with pytest.raises(BadRequestError) as e:
        client.conversations.items.create(conv.id, items=[{"type": "message", "role": "user", "content": "y",
                                                           "id": scored.output[0].id}])
    assert e.value.body["param"] == "items[0].id"

    assert client.conversations.update(conv.id, metadata={"topic": "x"}).metadata == {"topic": "x"}
    deleted = client.conversations.delete(conv.id)
    assert (deleted.id, deleted.deleted, deleted.object) == (conv.id, True, "conversation.deleted")
    with pytest.raises(NotFoundError):
        client.conversations.retrieve(conv.id)


def test_stored_chat_completions_are_read_back(client):
    """OpenAI's stored chat completions (`store: true`, `client.chat.completions.list/retrieve/
    update/delete` and `.messages.list`): a completion is kept as its non-streamed body, streamed
    or not, with its request's messages and metadata."""
    question = [{"role": "user", "content": "Name the capital of France."}]
    kept = client.chat.completions.create(model=MODEL, messages=question, temperature=0, max_tokens=12,
                                          store=True, metadata={"run": "e2e"})
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=question, temperature=0,
                                                           max_tokens=12, store=True, metadata={"run": "e2e"})
    assert raw.headers.get("llmserve-ignored-fields") is None   # (both do what they say)
    got = client.chat.completions.retrieve(kept.id)
    assert got.choices[0].message.content == kept.choices[0].message.content == "The capital of France is Paris."
    assert got.metadata == {"run": "e2e"} and got.usage == kept.usage
    chunks = list(client.chat.completions.create(model=MODEL, messages=question, temperature=0, max_tokens=12,
                                                 store=True, stream=True, metadata={"run": "stream"}))
    streamed = client.chat.completions.retrieve(chunks[0].id)
    assert streamed.choices[0].message.content == kept.choices[0].message.content
    assert streamed.choices[0].finish_reason == kept.choices[0].finish_reason

    listed = [c.id for c in client.chat.completions.list(metadata={"run": "e2e"})]
    assert listed[0] == kept.id and raw.parse().id in listed and chunks[0].id not in listed
    (message,) = client.chat.completions.messages.list(kept.id).data
    assert (message.role, message.content) == ("user", "Name the capital of France.")
    assert client.chat.completions.update(kept.id, metadata={"run": "x"}).metadata == {"run": "x"}
    assert client.chat.completions.delete(kept.id).deleted
    with pytest.raises(NotFoundError):
        client.chat.completions.retrieve(kept.id)
    unkept = client.chat.completions.create(model=MODEL, messages=question, max_tokens=1)
    with pytest.raises(NotFoundError):
        client.chat.completions.retrieve(unkept.id)


def test_the_sdks_pages_follow_a_client_that_deletes_what_it_lists(client):
    """The SDK's paginators name the last id of a page as the next page's `after`: a loop that
    deletes (or edits out of its filter) each item it is given still sees every item once."""
    question = [{"role": "user", "content": "Hi"}]
    made = [client.chat.completions.create(model=MODEL, messages=question, max_tokens=1, store=True,
                                           metadata={"sweep": "pending"}).id for _ in range(5)]
    marked = []
    for c in client.chat.completions.list(metadata={"sweep": "pending"}, limit=2):
        client.chat.completions.update(c.id, metadata={"sweep": "done"})
        marked.append(c.id)
    assert marked == made
    deleted = []
    for c in client.chat.completions.list(metadata={"sweep": "done"}, limit=2, order="desc"):
        client.chat.completions.delete(c.id)
        deleted.append(c.id)
    assert deleted == made[::-1]

    conv = client.conversations.create(items=[{"type": "message", "role": "user", "content": str(i)}
                                              for i in range(5)])
    texts = []
    for item in client.conversations.items.list(conv.id, limit=2):
        client.conversations.items.delete(item.id, conversation_id=conv.id)
        texts.append(item.content[0].text)
    assert texts == ["4", "3", "2", "1", "0"]
    assert not client.conversations.items.list(conv.id).data


# --- tools, on a tiny model whose template is in Hermes' shape ---------------------------

def _flat(tool: dict) -> dict:
    return {"type": "function", **tool["function"]}


@pytest.fixture(scope="module")
def hermes(tmp_path_factory):
    server = tiny_template_server(tmp_path_factory, "responses", HERMES)
    yield server
    server.stop()


def test_forced_calls_are_function_call_items(hermes):
    with _client(hermes) as client:
        req = dict(model="tiny", input="Weather in Paris?", tools=[_flat(WEATHER), _flat(TIME)], temperature=0,
                   max_output_tokens=200, tool_choice={"type": "function", "name": "get_weather"})
        r = client.responses.create(**req)
        assert r.status == "completed", r
        calls = [o for o in r.output if o.type == "function_call"]
        assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].status == "completed"
        assert calls[0].id.startswith("fc_") and calls[0].call_id.startswith("call_")
        jsonschema.validate(json.loads(calls[0].arguments), WEATHER["function"]["parameters"])
        # the same call as chat's, from the same prompt
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Weather in Paris?"}],
                                              tools=[WEATHER, TIME], temperature=0, max_completion_tokens=200,
                                              tool_choice={"type": "function", "function": {"name": "get_weather"}})
        assert chat.choices[0].message.tool_calls[0].function.arguments == calls[0].arguments
        assert chat.usage.prompt_tokens == r.usage.input_tokens
        # a streamed chat call kept by `store` is kept as the non-streamed body: the same call,
        # and every token's logprob (call markup included)
        call_req = dict(model="tiny", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER, TIME],
                        temperature=0, max_completion_tokens=200, logprobs=True,
                        tool_choice={"type": "function", "function": {"name": "get_weather"}})
        whole = client.chat.completions.create(**call_req).choices[0]
        chunks = list(client.chat.completions.create(**call_req, store=True, stream=True))
        kept = client.chat.completions.retrieve(chunks[0].id).choices[0]
        assert kept.message.tool_calls[0].function == chat.choices[0].message.tool_calls[0].function
        assert (kept.message.content, kept.finish_reason) == (chat.choices[0].message.content,
                                                              chat.choices[0].finish_reason)
        assert [t.token for t in kept.logprobs.content] == [t.token for t in whole.logprobs.content]
        assert r.tools[0].name == "get_weather" and r.tool_choice.name == "get_weather"

        events = _events(client, **req)
        _check_stream_matches(events, r)
        added = [e for e in events if e.type == "response.output_item.added"]
        assert [a.item.type for a in added] == ["function_call"]
        assert added[0].item.name == "get_weather" and added[0].item.arguments == ""
        deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
        assert len(deltas) > 1, "arguments should arrive as they are generated"
        done = next(e for e in events if e.type == "response.function_call_arguments.done")
        assert done.arguments == calls[0].arguments
        with client.responses.stream(**req) as stream:
            for _ in stream:
                pass
            final = stream.get_final_response()
        assert [o.type for o in final.output] == ["function_call"]


def test_call_history_is_the_chat_history(hermes):
    with _client(hermes) as client:
        args = '{"city": "Paris", "days": 2}'
        items = [
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": args},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        ]
        r = client.responses.create(model="tiny", input=items, tools=[_flat(WEATHER)], temperature=0,
                                    max_output_tokens=8)
        messages = [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ]
        render = httpx.post(hermes.url + "/v1/chat/completions/render", timeout=30,
                            json={"model": "tiny", "messages": messages, "tools": [WEATHER]}).json()
        assert '"arguments": {"city": "Paris", "days": 2}' in render["prompt"]
        assert r.usage.input_tokens == len(render["prompt_token_ids"])
        chat = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER], temperature=0,
                                              max_completion_tokens=8)
        got = r.output_text or "".join(o.arguments for o in r.output if o.type == "function_call")
        want = chat.choices[0].message.content or "".join(
            c.function.arguments for c in chat.choices[0].message.tool_calls or [])
        assert got == want


# --- reasoning, on a tiny model whose template opens a think block ------------------------

@pytest.fixture(scope="module")
def think(tmp_path_factory):
    folder, _ = build_think_model(tmp_path_factory.mktemp("tiny-think-responses"))
    server = ServerProcess(str(folder), "--served-model-name", "tiny", "--num-kv-blocks", "100")
    yield server
    server.stop()


def test_thinking_is_a_reasoning_item(think):
    with _client(think) as client:
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}],
                                              max_completion_tokens=24, temperature=1.0, seed=3)
        req = dict(model="tiny", input="Hello", max_output_tokens=24, temperature=1.0, extra_body={"seed": 3},
                   include=["message.output_text.logprobs"])
        r = client.responses.create(**req)
        reasoning = [o for o in r.output if o.type == "reasoning"]
        msg = chat.choices[0].message
        assert (reasoning[0].content[0].text if reasoning else None) == msg.reasoning_content
        assert r.output_text == (msg.content or "")
        assert r.usage.output_tokens_details.reasoning_tokens == chat.usage.completion_tokens_details.reasoning_tokens
        events = _events(client, **req)
        _check_stream_matches(events, r)
        thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        assert thought == (msg.reasoning_content or "")
        # the message's logprobs are its own tokens', not the thinking's (which has none)
        message = [o for o in r.output if o.type == "message"]
        if message:
            assert "".join(lp.token for lp in message[0].content[0].logprobs) == r.output_text
        streamed = [lp.token for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
        assert "".join(streamed) == r.output_text


def test_agent_loop_sends_the_output_items_back(hermes):
    """The loop clients write: the response's output items go back as they are (the SDK's
    models), with each call's result, and nothing they carry is reported as ignored but the
    results' `call_id`, which this template never reads (chat reports its `tool_call_id`)."""
    with _client(hermes) as client:
        tools = [_flat(WEATHER)]
        items: list = [{"role": "user", "content": "Weather in Paris?"}]
        r = client.responses.create(model="tiny", input=items, tools=tools, tool_choice="required",
                                    max_output_tokens=200, temperature=0)
        calls = [o for o in r.output if o.type == "function_call"]
        assert calls, r.output
        items += r.output
        items += [{"type": "function_call_output", "call_id": c.call_id, "output": "sunny"} for c in calls]
        unread = ", ".join(f"input[{len(items) - len(calls) + i}].call_id" for i in range(len(calls)))
        raw = client.responses.with_raw_response.create(model="tiny", input=items, tools=tools,
                                                        max_output_tokens=8, temperature=0)
        assert raw.headers["llmserve-ignored-fields"] == unread
        again = raw.parse()
        assert again.status in ("completed", "incomplete")
        # the same turn as the chat history it means
        history = [{"role": "user", "content": "Weather in Paris?"},
                   {"role": "assistant", "content": None, "tool_calls": [
                       {"id": c.call_id, "type": "function",
                        "function": {"name": c.name, "arguments": c.arguments}} for c in calls]}]
        history += [{"role": "tool", "tool_call_id": c.call_id, "content": "sunny"} for c in calls]
        chat = client.chat.completions.create(model="tiny", messages=history, tools=[WEATHER],
                                              max_completion_tokens=8, temperature=0)
        assert chat.usage.prompt_tokens == again.usage.input_tokens
        # and as plain dicts (model_dump), as clients that store them send them
        dumped = [i if isinstance(i, dict) else i.model_dump() for i in items]
        raw = client.responses.with_raw_response.create(model="tiny", input=dumped, tools=tools,
                                                        max_output_tokens=8, temperature=0)
        assert raw.headers["llmserve-ignored-fields"] == unread
        assert raw.parse().usage.input_tokens == again.usage.input_tokens
