"""RequestStream, the event loop's side of one request: what reaches it after it ended."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

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
    prepared = SimpleNamespace(id="cmpl-1", stream=True, background=False, headers=[], user=None, prompt_tokens=3,
                               prompt_lens=[3], n=1, returned_n=1, max_tokens=8)
    stream = RequestStream(engine, prepared)
    engine._open.add(stream)
    return stream


def test_output_of_a_step_in_flight_after_an_abort_is_dropped():
    """A client that leaves aborts its request at once, but a step that held it may still be
    running: that step's output must not reach the queue nor count another inter-token gap
    (audit 10 counted 80 gaps for 78; its tokens are not counted either: AsyncEngine._dispatch
    counts only open requests')."""
    engine = _Engine()
    stream = _stream(engine)
    stream._push(b"data: a\n\n", None, False, 1)
    stream._push(b"data: b\n\n", None, False, 1)
    assert len(engine.gaps) == 1
    engine._finished(stream, "abort")              # AsyncEngine.abort
    stream._push(b"data: c\n\n", None, False, 1)
    stream._push(b"data: d\n\n", "length", False, 1)
    assert len(engine.gaps) == 1
    assert engine.finished == ["abort"] and len(stream._items) == 2


def test_a_request_that_finishes_counts_once():
    engine = _Engine()
    stream = _stream(engine)
    stream._push(b"data: a\n\n", "stop", False, 1)
    stream._push(b"data: late\n\n", "stop", False, 1)
    assert engine.finished == ["stop"]


def test_frames_waiting_together_are_read_as_one_piece_and_the_end_after_them():
    """A reader that fell behind (a busy event loop) takes every waiting frame in one read,
    so it catches up in one write; the end of the stream still comes after them, and a
    reader with nothing to read waits, with or without a keep-alive timeout."""
    async def run():
        engine = _Engine()
        engine._loop = asyncio.get_running_loop()
        stream = _stream(engine)
        with pytest.raises(TimeoutError):
            await stream.next(timeout=0.01)        # nothing yet
        stream._push(b"data: a\n\n", None, False, 1)
        stream._push(b"data: b\n\n", None, False, 1)
        assert await stream.next(timeout=1.0) == b"data: a\n\ndata: b\n\n"
        reading = asyncio.ensure_future(stream.next())
        await asyncio.sleep(0)
        assert not reading.done()                  # waits for the engine
        stream._push(b"data: c\n\n", "stop", False, 1)
        assert await reading == b"data: c\n\n"
        assert await stream.next() is None
        assert engine.finished == ["stop"]

    asyncio.run(run())
