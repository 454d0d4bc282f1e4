"""--enable-log-outputs reads each choice's output back from the bytes a request sent
(engine/output_log.py): a non-streamed body, or a stream's frames, of every generating route."""

from __future__ import annotations

import json

from llmserve.engine.output_log import answers, log_lines


def _sse(*events, event_names: bool = False) -> bytes:
    frames = []
    for e in events:
        head = f"event: {e['type']}\n" if event_names else ""
        frames.append(f"{head}data: {json.dumps(e)}\n\n")
    return "".join(frames).encode() + (b"data: [DONE]\n\n" if not event_names else b"")


def _seen(found):
    return [(a.text, list(map(tuple, a.calls.values()))) for a in found]


def _thought(found):
    return [a.reasoning for a in found]


def test_chat_bodies_and_streams_give_each_choice_its_text_and_calls():
    body = {"choices": [
        {"index": 1, "message": {"content": "second", "reasoning_content": "hm"}},
        {"index": 0, "message": {"content": None, "tool_calls": [
            {"function": {"name": "f", "arguments": "{\"a\": 1}"}}]}}]}
    assert _seen(answers("chat", False, json.dumps(body).encode())) == [("", [("f", '{"a": 1}')]), ("second", [])]
    assert _thought(answers("chat", False, json.dumps(body).encode())) == ["", "hm"]
    stream = _sse(
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"index": 0, "delta": {"reasoning_content": "so"}}]},
        {"choices": [{"index": 0, "delta": {"content": "Hel"}}, {"index": 1, "delta": {"tool_calls": [
            {"index": 0, "id": "c", "function": {"name": "f", "arguments": ""}}]}}]},
        {"choices": [{"index": 0, "delta": {"content": "lo"}}, {"index": 1, "delta": {"tool_calls": [
            {"index": 0, "function": {"arguments": "{\"a\""}}]}}]},
        {"choices": [{"index": 1, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}}]},
        {"choices": [], "usage": {"completion_tokens": 5}})
    assert _seen(answers("chat", True, stream)) == [("Hello", []), ("", [("f", '{"a": 1}')])]
    assert _thought(answers("chat", True, stream)) == ["so", ""]


def test_completions_responses_and_messages():
    assert _seen(answers("completion", True, _sse({"choices": [{"index": 0, "text": "a"}]},
                                                  {"choices": [{"index": 0, "text": "b"}]}))) == [("ab", [])]
    response = {"output": [{"type": "reasoning", "content": [{"type": "reasoning_text", "text": "think"}]},
                           {"type": "message", "content": [{"type": "output_text", "text": "Hi"}]},
                           {"type": "function_call", "name": "f", "arguments": "{}"}]}
    assert _seen(answers("responses", False, json.dumps(response).encode())) == [("Hi", [("f", "{}")])]
    assert _thought(answers("responses", False, json.dumps(response).encode())) == ["think"]
    stream = _sse({"type": "response.created", "response": {"output": []}},
                  {"type": "response.output_text.delta", "delta": "H"},
                  {"type": "response.incomplete", "response": response}, event_names=True)
    assert _seen(answers("responses", True, stream)) == [("Hi", [("f", "{}")])]
    message = {"content": [{"type": "thinking", "thinking": "t", "signature": ""}, {"type": "text", "text": "Sure"}, {"type": "tool_use", "name": "w", "input": {"c": "P"}}]}
    assert _seen(answers("messages", False, json.dumps(message).encode())) == [("Sure", [("w", '{"c":"P"}')])]
    assert _thought(answers("messages", False, json.dumps(message).encode())) == ["t"]
    stream = _sse({"type": "message_start", "message": {}},
                  {"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": ""}},
                  {"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "t"}},
                  {"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}},
                  {"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "Su"}},
                  {"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "re"}},
                  {"type": "content_block_start", "index": 2, "content_block": {"type": "tool_use", "name": "w"}},
                  {"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta",
                                                                        "partial_json": "{\"c\": "}},
                  {"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta",
                                                                        "partial_json": "\"P\"}"}},
                  {"type": "message_stop"}, event_names=True)
    assert _seen(answers("messages", True, stream)) == [("Sure", [("w", '{"c": "P"}')])]
    assert _thought(answers("messages", True, stream)) == ["t"]


def test_lines_name_each_choice_and_bound_the_text():
    body = {"choices": [{"index": 0, "text": "abcdef"}, {"index": 1, "text": "xyz"}]}
    lines = log_lines("cmpl-1", "completion", False, json.dumps(body).encode(), [("length", 6), ("stop", 2)], 4)
    assert lines == ["Generated response cmpl-1-0: output: 'abcd', finish_reason: length, completion_tokens: 6",
                     "Generated response cmpl-1-1: output: 'xyz', finish_reason: stop, completion_tokens: 2"]
    one = log_lines("cmpl-2", "completion", False, json.dumps({"choices": [{"index": 0, "text": "q"}]}).encode(),
                    [("stop", 1)], None)
    assert one == ["Generated response cmpl-2: output: 'q', finish_reason: stop, completion_tokens: 1"]
    assert log_lines("x", "chat", False, b"not json", None, None) == []
    thought = {"choices": [{"index": 0, "message": {"content": "yes", "reasoning_content": "abcdef"}}]}
    assert log_lines("c", "chat", False, json.dumps(thought).encode(), [("stop", 9)], 3) == [
        "Generated response c: reasoning: 'abc', output: 'yes', finish_reason: stop, completion_tokens: 9"]


def test_generate_answers_are_their_token_ids():
    body = {"request_id": "generate-tokens-1", "choices": [
        {"index": 1, "token_ids": [7, 8], "finish_reason": "length"},
        {"index": 0, "token_ids": [5], "finish_reason": "stop"}]}
    found = answers("generate", False, json.dumps(body).encode())
    assert [a.ids for a in found] == [[5], [7, 8]]
    stream = _sse(
        {"request_id": "r", "choices": [{"index": 0, "token_ids": [5, 6]}]},
        {"request_id": "r", "choices": [{"index": 0, "token_ids": [7], "finish_reason": "length"}]},
        {"request_id": "r", "choices": [], "usage": {"completion_tokens": 3}})
    (answer,) = answers("generate", True, stream)
    assert answer.ids == [5, 6, 7]
    assert log_lines("r", "generate", True, stream, [("length", 3)], 2) == [
        "Generated response r: output token_ids: [5, 6], finish_reason: length, completion_tokens: 3"]
