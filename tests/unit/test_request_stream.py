"""RequestStream, the event loop's side of one request: what reaches it after it ended."""

from __future__ import annotations

from types import SimpleNamespace

from llmserve.engine.async_engine import RequestStream


class _Engine:
    """What a RequestStream reads of its AsyncEngine."""

    def __init__(self) -> None:
        self._open: set = set()
        self.gaps: list[float] = []
        self.finished: list[str] = []
        self.metrics = SimpleNamespace(on_tokens=self.gaps.append)

    def _finished(self, stream, reason: str, ends: list | None = None) -> None:
        self._open.discard(stream)
        self.finished.append(reason)


def _stream(engine: _Engine) -> RequestStream:
    prepared = SimpleNamespace(id="cmpl-1", stream=True, headers=[], user=None, prompt_tokens=3,
                               prompt_lens=[3], n=1, max_tokens=8)
    stream = RequestStream(engine, prepared)
    engine._open.add(stream)
    return stream


def test_output_of_a_step_in_flight_after_an_abort_is_dropped():
    """A client that leaves aborts its request at once, but a step that held it may still be
    running: that step's output must not reach the queue nor count another inter-token gap
    or token (audit 10 counted 80 gaps for 78)."""
    engine = _Engine()
    stream = _stream(engine)
    stream._push(b"data: a\n\n", None, False, 1)
    stream._push(b"data: b\n\n", None, False, 1)
    assert len(engine.gaps) == 1 and stream.generated == 2
    engine._finished(stream, "abort")              # AsyncEngine.abort
    stream._push(b"data: c\n\n", None, False, 1)
    stream._push(b"data: d\n\n", "length", False, 1)
    assert len(engine.gaps) == 1 and stream.generated == 2
    assert engine.finished == ["abort"] and stream._queue.qsize() == 2


def test_a_request_that_finishes_counts_once():
    engine = _Engine()
    stream = _stream(engine)
    stream._push(b"data: a\n\n", "stop", False, 1)
    stream._push(b"data: late\n\n", "stop", False, 1)
    assert engine.finished == ["stop"] and stream.generated == 1
