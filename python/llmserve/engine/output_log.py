"""--enable-log-outputs: what each generation answered, logged when it ends (vLLM's flag).

The Core hands the event loop wire-ready bytes, so each choice's output is read back from
what the request sent: a non-streamed answer's body, or a stream's frames. Only requests of a
server started with the flag keep their bytes for this."""

from __future__ import annotations

import orjson

# A stream's last Responses event, which holds the whole response.
_RESPONSE_ENDS = ("response.completed", "response.incomplete", "response.failed")


class Answer:
    """One choice's output: its text, a reasoning model's thinking, and its tool calls
    (`name(arguments)`); or, from the tokens-in, tokens-out route, its token ids."""

    def __init__(self) -> None:
        self.text = ""
        self.reasoning = ""
        self.calls: dict[int, list[str]] = {}     # call index -> [name, arguments]
        self.ids: list[int] | None = None

    def call(self, index: int, name: str | None = None, arguments: str | None = None) -> None:
        parts = self.calls.setdefault(index, ["", ""])
        parts[0] += name or ""
        parts[1] += arguments or ""

    def describe(self, max_len: int | None) -> str:
        def cut(text: str) -> str:
            return text if max_len is None else text[:max_len]
        if self.ids is not None:
            return f"output token_ids: {self.ids if max_len is None else self.ids[:max_len]}"
        line = f"reasoning: {cut(self.reasoning)!r}, " if self.reasoning else ""
        line += f"output: {cut(self.text)!r}"
        if self.calls:
            line += ", tool_calls: [" + ", ".join(f"{n}({a})" for n, a in self.calls.values()) + "]"
        return line


def answers(endpoint: str, streamed: bool, sent: bytes) -> list[Answer]:
    """Each choice's output (in choice order) from all the bytes a request of `endpoint`
    ("chat", "completion", "responses", "messages", "generate") sent."""
    if not streamed:
        try:
            body = orjson.loads(sent)
        except orjson.JSONDecodeError:
            return []
        return _from_body(endpoint, body) if isinstance(body, dict) else []
    found: dict[int, Answer] = {}
    for event in _events(sent):
        if endpoint == "responses":
            if event.get("type") in _RESPONSE_ENDS and isinstance(event.get("response"), dict):
                return _from_body(endpoint, event["response"])
        elif endpoint == "messages":
            _message_event(found.setdefault(0, Answer()), event)
        else:
            for choice in event.get("choices") or ():
                answer = found.setdefault(choice.get("index", 0), Answer())
                if endpoint == "generate":
                    answer.ids = (answer.ids or []) + (choice.get("token_ids") or [])
                    continue
                if endpoint == "completion":
                    answer.text += choice.get("text") or ""
                    continue
                delta = choice.get("delta") or {}
                answer.text += delta.get("content") or ""
                answer.reasoning += delta.get("reasoning_content") or ""
                _chat_calls(answer, delta.get("tool_calls"))
    return [found[i] for i in sorted(found)]


def _chat_calls(answer: Answer, calls: list | None) -> None:
    """Chat's `tool_calls` (a message's whole calls, or a delta's pieces, which name their
    call's `index`) into `answer`."""
    for i, call in enumerate(calls or ()):
        function = call.get("function") or {}
        answer.call(call.get("index", i), function.get("name"), function.get("arguments"))


def _events(sent: bytes):
    """The JSON objects of a stream's `data:` lines (not `[DONE]`)."""
    for line in sent.split(b"\n"):
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            try:
                event = orjson.loads(line[6:])
            except orjson.JSONDecodeError:
                continue
            if isinstance(event, dict):
                yield event


def _message_event(answer: Answer, event: dict) -> None:
    """An Anthropic stream's event, into its one answer (a block's index is its call's)."""
    index = event.get("index", 0)
    if event.get("type") == "content_block_start":
        block = event.get("content_block") or {}
        if block.get("type") == "tool_use":
            answer.call(index, block.get("name"))
    elif event.get("type") == "content_block_delta":
        delta = event.get("delta") or {}
        if delta.get("type") == "text_delta":
            answer.text += delta.get("text") or ""
        elif delta.get("type") == "thinking_delta":
            answer.reasoning += delta.get("thinking") or ""
        elif delta.get("type") == "input_json_delta":
            answer.call(index, arguments=delta.get("partial_json"))


def _from_body(endpoint: str, body: dict) -> list[Answer]:
    """Each choice's output from a whole answer."""
    if endpoint in ("chat", "completion", "generate"):
        out = []
        for choice in sorted(body.get("choices") or (), key=lambda c: c.get("index", 0)):
            answer = Answer()
            if endpoint == "generate":
                answer.ids = choice.get("token_ids") or []
            elif endpoint == "completion":
                answer.text = choice.get("text") or ""
            else:
                message = choice.get("message") or {}
                answer.text = message.get("content") or ""
                answer.reasoning = message.get("reasoning_content") or ""
                _chat_calls(answer, message.get("tool_calls"))
            out.append(answer)
        return out
    answer = Answer()
    if endpoint == "responses":
        for item in body.get("output") or ():
            if item.get("type") in ("message", "reasoning"):
                for part in item.get("content") or ():
                    if part.get("type") == "output_text":
                        answer.text += part.get("text") or ""
                    elif part.get("type") == "reasoning_text":
                        answer.reasoning += part.get("text") or ""
            elif item.get("type") == "function_call":
                answer.call(len(answer.calls), item.get("name"), item.get("arguments"))
    else:   # messages
        for block in body.get("content") or ():
            if block.get("type") == "text":
                answer.text += block.get("text") or ""
            elif block.get("type") == "thinking":
                answer.reasoning += block.get("thinking") or ""
            elif block.get("type") == "tool_use":
                answer.call(len(answer.calls), block.get("name"), orjson.dumps(block.get("input")).decode())
    return [answer]


def log_lines(request_id: str, endpoint: str, streamed: bool, sent: bytes, ends: list[tuple[str, int]] | None,
              max_len: int | None) -> list[str]:
    """The lines --enable-log-outputs logs for a request that ended: one per choice (its id
    `<id>-<i>` when there are several), with its finish reason and token count from `ends`."""
    found = answers(endpoint, streamed, sent)
    ends = ends or []
    lines = []
    for i, answer in enumerate(found):
        name = f"{request_id}-{i}" if len(found) > 1 else request_id
        line = f"Generated response {name}: {answer.describe(max_len)}"
        if i < len(ends):
            line += f", finish_reason: {ends[i][0]}, completion_tokens: {ends[i][1]}"
        lines.append(line)
    return lines
