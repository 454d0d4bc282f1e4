"""Background responses (`POST /v1/responses` with `background: true`).

Each runs as a task on the event loop whether or not a client reads it, and keeps its events,
so a client can stream them, leave, and read them again from any point
(`GET /v1/responses/{id}?stream=true&starting_after=N`).

What a background response is (queued, in progress, its final object, cancelled, failed) is
the router's response store's to say: `GET /v1/responses/{id}` reads it there. This registry
only runs them and holds their events: a run's `events[i]` is its event whose
`sequence_number` is i.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref

from .._core import ApiError
from ..engine.async_engine import RequestStream

log = logging.getLogger("llmserve.server")

# How long a finished run's events stay to be streamed again, and the bytes all finished
# runs' events may hold (the oldest finished go first past it).
KEEP_EVENTS_S = 600.0
KEEP_EVENTS_BYTES = 64 << 20


class Run:
    """One background response's generation, and its events so far."""

    def __init__(self, stream: RequestStream) -> None:
        self.id = stream.id
        self.stream = stream
        self.events: list[bytes] = []
        self.bytes = 0
        # time.monotonic() when it ended; None while it runs
        self.ended: float | None = None
        self._changed = asyncio.get_running_loop().create_future()
        self.task = asyncio.ensure_future(self._run())
        # (a task cancelled before its first step never runs `_run`, nor its `finally`: a
        # `request_id` sent twice at once replaces a run that has not started)
        self.task.add_done_callback(lambda _: self._end())

    async def _run(self) -> None:
        try:
            while (data := await self.stream.next()) is not None:
                # (several steps' frames may come as one piece; each event is one frame)
                for frame in data.split(b"\n\n"):
                    if frame.startswith(b"event: "):   # (not a mid-stream error frame: the
                        self.events.append(frame + b"\n\n")   # store says it failed)
                        self.bytes += len(frame) + 2
                self._wake()
        except ApiError:
            pass   # ended before any output (a shutdown): the store holds it as failed
        except Exception:
            log.exception("background response %s failed", self.id)
        finally:
            self._end()

    def _end(self) -> None:
        """Its generation is aborted if it still runs (its KV blocks freed), and readers see
        the end."""
        if self.ended is None:
            self.stream.close()
            self.ended = time.monotonic()
            self._wake()

    def _wake(self) -> None:
        self._changed.set_result(None)
        self._changed = asyncio.get_running_loop().create_future()

    async def wait(self, timeout: float | None) -> None:
        """Until its next events, or its end (TimeoutError after `timeout` seconds)."""
        await asyncio.wait_for(asyncio.shield(self._changed), timeout)


class Reader:
    """A client's read of a run's events after sequence number `after`, as
    `routes.EventStreamResponse` pumps a request's stream; a reader that leaves does not stop
    the run."""

    def __init__(self, run: Run, after: int) -> None:
        self.run, self.at, self.started = run, after + 1, False

    async def next(self, timeout: float | None = None) -> bytes | None:
        while self.at >= len(self.run.events):
            if self.run.ended is not None:
                return None
            await self.run.wait(timeout)
        part = b"".join(self.run.events[self.at:])
        self.at = len(self.run.events)
        return part

    async def aclose(self) -> None:
        pass


class Backgrounds:
    """The background responses an engine runs, and the events of those that ended lately.
    One per engine (`of`): every app mounted on the engine serves the same runs, as they all
    read one response store."""

    _of: "weakref.WeakKeyDictionary[object, Backgrounds]" = weakref.WeakKeyDictionary()

    def __init__(self) -> None:
        self._runs: dict[str, Run] = {}

    @classmethod
    def of(cls, engine: object) -> "Backgrounds":
        """The engine's registry (made at its first app)."""
        found = cls._of.get(engine)
        if found is None:
            found = cls._of[engine] = cls()
        return found

    def start(self, stream: RequestStream) -> Run:
        self._prune()
        old = self._runs.get(stream.id)
        if old is not None:   # (a `request_id` sent again: the store now holds the new one)
            old.task.cancel()
        run = self._runs[stream.id] = Run(stream)
        return run

    def get(self, response_id: str) -> Run | None:
        self._prune()
        return self._runs.get(response_id)

    def stop(self, response_id: str) -> None:
        """Stops the generation of `response_id` if it runs here (its KV blocks are freed)."""
        run = self._runs.get(response_id)
        if run is not None and run.ended is None:
            run.task.cancel()

    def stop_all(self) -> int:
        """Stops every run (a shutdown: the store they would finish in goes with the process,
        so nothing waits for them); they are stored `failed`. Returns how many ran."""
        running = [run for run in self._runs.values() if run.ended is None]
        for run in running:
            run.task.cancel()
        return len(running)

    def _prune(self) -> None:
        now = time.monotonic()
        ended = sorted((r for r in self._runs.values() if r.ended is not None), key=lambda r: r.ended)
        held = sum(r.bytes for r in ended)
        for run in ended:
            if now - run.ended < KEEP_EVENTS_S and held <= KEEP_EVENTS_BYTES:
                break
            held -= run.bytes
            del self._runs[run.id]
