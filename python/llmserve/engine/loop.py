"""The engine loop: schedule -> execute -> commit, on one dedicated thread.

`step()` is the whole loop body and is shared by the serving thread and the offline `LLM`.
With `plan_ahead` the serving thread overlaps instead (`EngineThread._step_ahead`): while
the model runs step N it plans step N+1 (`Core.schedule_ahead`) and queues it behind N, then
waits for N alone and commits it while N+1 runs.
A step that raises fails only the requests it touched (each gets a 500, or an SSE error
frame if its stream had begun); the loop goes on. If the loop itself dies, `alive` turns
false and /health answers 503.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator

import numpy as np
import orjson

from llmserve._core import ApiError, Router

log = logging.getLogger("llmserve.engine")

# (handle, bytes, finished, error, new_tokens, ends), as Core.commit returns them; `finished`
# is None while the request runs, then how it ended ("stop", "length", "tool_calls", "error",
# ...); `ends`, once it ended normally, each choice's (finish reason, completion tokens).
# A request this thread fails itself (Core.add refused it, or the loop died) gets the
# exception in place of the bytes, and None for `ends`.
Output = tuple[int, bytes | BaseException, str | None, bool, int, list[tuple[str, int]] | None]


FAILED = "The engine failed while running this request."


def step(core, runner, on_scheduled: Callable[[], None] | None = None) -> tuple[list[Output], bool]:
    """Run one step. Returns the outputs and whether any work was scheduled. `on_scheduled`
    runs once the step's plan is made, before the model runs it."""
    plan = core.schedule()
    if plan is None:
        return [], False
    if on_scheduled is not None:
        on_scheduled()
    try:
        # (a step whose samples the Core refuses, their sizes not the plan's, failed too:
        # Core.commit refuses before it applies anything)
        return commit(core, runner.execute(plan)), True
    except Exception:  # noqa: BLE001 - any model failure becomes a 500 for this step only
        log.exception("model step failed; failing the %d sequences it held", plan.num_seqs)
        return core.fail_plan(FAILED), True


def run_to_end(core, runner, prepared: list) -> Iterator[tuple[int, bytes, bool, bool]]:
    """Adds the `prepared` requests to `core` and steps the engine on the calling thread until
    each has ended, yielding their outputs as (index in `prepared`, data, finished, error); an
    error output ends its request. Closed early (an error here or in the caller, Ctrl-C), the
    step in flight is dropped and the requests still running are aborted, so the engine is as
    before (the offline API and `run-batch` share this)."""
    running: dict[int, int] = {}   # handle -> index
    try:
        for i, p in enumerate(prepared):
            running[core.add(p)] = i
        while running:
            with _OFFLINE_STEPS.stepping():
                outputs, ran = step(core, runner)
            if not ran and not core.has_work():
                raise RuntimeError("the engine stopped with requests still pending")
            for handle, data, finished, error, *_ in outputs:
                i = running.get(handle)
                if i is None:
                    continue
                if finished or error:
                    del running[handle]
                yield i, data, finished, error
    finally:
        if running:
            core.fail_plan("the call was interrupted")
            for handle in running:
                core.abort(handle)


def commit(core, out) -> list[Output]:
    """Hand a step's samples (a SampleOutput) to the Core: the oldest plan awaiting commit."""
    prompt: tuple[np.ndarray, ...] = ()
    if getattr(out, "prompt_logprobs", None) is not None:
        # Prompt-token logprobs (completions echo with logprobs, prompt_logprobs): the plan
        # listed them.
        prompt = (np.ascontiguousarray(out.prompt_logprobs, dtype=np.float32),
                  np.ascontiguousarray(out.prompt_top_ids, dtype=np.int64),
                  np.ascontiguousarray(out.prompt_top_logprobs, dtype=np.float32))
        if getattr(out, "prompt_ranks", None) is not None:
            prompt += (np.ascontiguousarray(out.prompt_ranks, dtype=np.int64),)
    pooled = getattr(out, "pooled", None)
    return core.commit(
        np.ascontiguousarray(out.tokens, dtype=np.int64),
        np.ascontiguousarray(out.logprobs, dtype=np.float32),
        np.ascontiguousarray(out.top_ids, dtype=np.int64),
        np.ascontiguousarray(out.top_logprobs, dtype=np.float32),
        *prompt,
        pooled=None if pooled is None else np.ascontiguousarray(pooled, dtype=np.float32),
    )


# Every EngineThread started (a running thread keeps its own alive through its target).
_STARTED: weakref.WeakSet[EngineThread] = weakref.WeakSet()


# How long an exit waits for a running step (a long prompt on a CPU takes seconds; a step
# that never ends must not hang the exit).
EXIT_STEP_WAIT_S = 120.0


class _OfflineSteps:
    """The steps `run_to_end` runs now, on any thread. At exit no new one starts (a daemon
    thread that would start one waits there for good) and the exit waits for those running:
    a step runs inside torch, and an interpreter that finalizes around it aborts the process
    (an offline `LLM.generate` on a daemon thread when the program ends)."""

    def __init__(self) -> None:
        self.running = 0
        self.exiting = False
        self.changed = threading.Condition()

    @contextlib.contextmanager
    def stepping(self) -> Iterator[None]:
        with self.changed:
            while self.exiting:
                self.changed.wait()   # (for good: the process is ending)
            self.running += 1
        try:
            yield
        finally:
            with self.changed:
                self.running -= 1
                self.changed.notify_all()

    def stop(self, timeout: float) -> bool:
        """No step starts from now on; whether those running ended within `timeout` seconds."""
        with self.changed:
            self.exiting = True
            return self.changed.wait_for(lambda: self.running == 0, timeout)


_OFFLINE_STEPS = _OfflineSteps()


@atexit.register
def _stop_at_exit() -> None:
    """Stop the engine loops an application left running (an AsyncEngine it never drained,
    an offline call on a daemon thread), each once its step ends: a loop runs inside torch,
    and an interpreter that finalizes around such a thread aborts the process."""
    stops = [thread.stop for thread in list(_STARTED)] + [_OFFLINE_STEPS.stop]
    for stop in stops:
        if stop(0.5):
            continue
        log.warning("waiting up to %.0f s for the engine's step to end before exiting", EXIT_STEP_WAIT_S)
        if not stop(EXIT_STEP_WAIT_S):
            # (finalizing around it would abort the process: end it here instead)
            log.error("the engine's step did not end within %.0f s; exiting without it", EXIT_STEP_WAIT_S)
            hard_exit(1)


def hard_exit(code: int) -> None:
    """End the process now (os._exit), its logs and standard streams flushed first."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


class EngineThread:
    """Owns the Core and the runner; everything else talks to it through `post`.

    `post(op)` queues ("add", prepared, token) or ("abort", token); the thread applies them
    between steps, so the Core is only ever touched from this thread. `deliver` receives each
    step's outputs as a list of (token, bytes, finished, error, new_tokens, ends) in one call
    (the requests Core.add refused, in a call of their own before the step);
    `on_first_scheduled(tokens, when)`, the requests a plan holds for the first time.
    `plan_ahead`: overlap planning and committing with the model (the runner must have
    `launch`, as ModelRunner does). ("retire", index) hands over an unloaded LoRA adapter:
    `adapters` (engine/adapters.py) frees its weights once no request holds it, and a request
    naming an index whose weights are gone fails with a 404. ("reset_prefix_cache", done)
    empties the prefix cache and calls `done` with how many blocks it held (None: the loop
    stopped first).
    """

    def __init__(self, core, runner, deliver: Callable[[list], None],
                 on_stats: Callable[[dict, float], None] | None = None,
                 on_first_scheduled: Callable[[list, float], None] | None = None,
                 plan_ahead: bool = False, adapters=None, router=None):
        self._core = core
        self._runner = runner
        self._deliver = deliver
        self._on_stats = on_stats
        self._on_first_scheduled = on_first_scheduled
        self._inbox: list[tuple] = []
        # Sequences of the requests in the inbox, and of those handed to the Core since
        # `stats` was last read from it: both wait, and /load and --max-waiting count them.
        self._posted_seqs = 0
        self._unpublished_seqs = 0
        # The sequences of each request posted and not yet scheduled (token -> count), and of
        # those whose client left while they waited (counted as waiting until the Core has
        # dropped them and `stats` says so; `_dropped`: those whose abort the Core has applied).
        # A client gone from the queue frees its place at once, not once the step running ends.
        self._unstarted: dict[object, int] = {}
        self._abandoned: dict[object, int] = {}
        self._dropped: list[object] = []
        self._cv = threading.Condition()
        self._stopping = False
        self._handles: dict[object, int] = {}
        self._tokens: dict[int, object] = {}
        self.alive = False
        self.plan_ahead = plan_ahead
        # The step launched and not yet committed (plan_ahead only).
        self._launched = None
        self._adapters, self._router = adapters, router
        self._retired: set[int] = set()   # (unloaded LoRA indices whose weights are still on the model)
        self.stats: dict = core.stats()
        self._thread = threading.Thread(target=self._run, name="llmserve-engine", daemon=True)

    def start(self) -> None:
        self.alive = True
        _STARTED.add(self)
        self._thread.start()

    def post(self, op: tuple) -> None:
        with self._cv:
            if op[0] == "abort" and self._forget_waiting(op[1]):
                return
            self._inbox.append(op)
            if op[0] == "add":
                self._posted_seqs += op[1].num_seqs
                self._unstarted[op[2]] = op[1].num_seqs
            self._cv.notify()

    def _forget_waiting(self, token) -> bool:
        """(under the lock) A request whose client left: one still in the inbox leaves it
        (nothing is left to abort: True); one waiting in the Core stops counting as waiting."""
        seqs = self._unstarted.pop(token, None)
        if seqs is None:
            return False
        at = next((i for i, op in enumerate(self._inbox) if op[0] == "add" and op[2] == token), None)
        if at is not None:
            del self._inbox[at]
            self._posted_seqs -= seqs
            return True
        self._abandoned[token] = seqs
        return False

    def snapshot(self) -> tuple[dict, int]:
        """`stats`, and the sequences waiting that `stats` does not count yet: those of
        requests posted and not yet handed to the Core, or handed over since `stats` was last
        read (counted as the Core counts its waiting ones; queued aborts do not count), less
        those of waiting requests whose clients left (the Core drops them after its step: so
        the count may be negative, and only its sum with `stats["waiting"]` is a count).
        Read together, so no sequence is counted twice or missed while the engine thread hands
        requests over or publishes."""
        with self._cv:
            return self.stats, self._posted_seqs + self._unpublished_seqs - sum(self._abandoned.values())

    def stop(self, timeout: float | None = None) -> bool:
        """Stop the loop once its current step ends, waiting up to `timeout` seconds (None:
        until it has). Whether the thread has ended."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def running(self) -> bool:
        """Whether the thread is still running (a stop waits for the step in progress)."""
        return self._thread.is_alive()

    def _apply(self, ops: list[tuple]) -> list:
        failed = []
        for op in ops:
            if op[0] == "add":
                _, prepared, token = op
                if prepared.lora and self._adapters is not None and not self._adapters.installed(prepared.lora):
                    # (validated just before its adapter was unloaded, and the weights are gone)
                    failed.append((token, Router.error("model_not_found", prepared.model), "error", True, 0, None))
                    continue
                try:
                    handle = self._core.add(prepared)
                except Exception as exc:  # an ApiError from Core.add (e.g. priority under fcfs)
                    failed.append((token, exc, "error", True, 0, None))
                    with self._cv:
                        self._unstarted.pop(token, None)
                    continue
                self._handles[token] = handle
                self._tokens[handle] = token
            elif op[0] == "retire":
                self._retired.add(op[1])
            elif op[0] == "reset_prefix_cache":
                op[1](self._core.reset_prefix_cache())
                self._publish(0.0)
            else:
                handle = self._handles.pop(op[1], None)
                if handle is not None:
                    self._tokens.pop(handle, None)
                    self._core.abort(handle)
                with self._cv:
                    self._unstarted.pop(op[1], None)
                    if op[1] in self._abandoned:
                        self._dropped.append(op[1])
        return failed

    def _scheduled(self) -> None:
        """A plan was made: refresh the counts, and say which requests it started."""
        started = [t for h in self._core.first_scheduled() if (t := self._tokens.get(h)) is not None]
        self._publish(0.0, started)
        if self._on_first_scheduled is not None and started:
            self._on_first_scheduled(started, time.perf_counter())

    def _publish(self, step_seconds: float, started: list = (), ended: list = ()) -> None:
        """Refresh the counts /load reads, and the metrics (`step_seconds` 0: no step time);
        `started`: the requests the plan just made runs for the first time, no longer waiting;
        `ended`: those the step finished (one that never started, failed, is forgotten too)."""
        stats = self._core.stats()
        with self._cv:
            self.stats = stats
            self._unpublished_seqs = 0
            for token in ended:
                self._unstarted.pop(token, None)
            for token in started:
                self._unstarted.pop(token, None)
                # (its client left as the plan took it: it runs until the abort applies)
                self._abandoned.pop(token, None)
            for token in self._dropped:
                self._abandoned.pop(token, None)
            self._dropped.clear()
        if self._on_stats is not None:
            self._on_stats(self.stats, step_seconds)
        if self._retired:
            # (a request still in the step launched ahead, and gone from the Core, is one
            # whose rows are thrown away: its adapter's weights may go)
            for index in self._retired - set(stats.get("loras_in_use", ())):
                self._retired.discard(index)
                self._adapters.free(self._router, index)

    def _step_ahead(self) -> tuple[list[Output], bool]:
        """One step, overlapped: while the model runs step N, plan step N+1 and queue it
        behind N (its placeholder tokens are read from N's samples where they are); then wait
        for N alone and commit it while N+1 runs. Falls back to `step`'s order whenever the
        Core cannot plan ahead (Core.schedule_ahead says when)."""
        core, runner = self._core, self._runner
        if self._launched is None:
            plan = core.schedule()
            if plan is None:
                return [], False
            self._scheduled()
            try:
                self._launched = runner.launch(plan)
            except Exception:  # noqa: BLE001 - as in step()
                log.exception("model step failed; failing the %d sequences it held", plan.num_seqs)
                return core.fail_plan(FAILED), True
        launched, self._launched = self._launched, None
        following = core.schedule_ahead()
        queued, failed_next = None, False
        if following is not None:
            self._scheduled()
            try:
                queued = runner.launch(following, launched)
            except Exception:  # noqa: BLE001
                log.exception("model step failed; failing the %d sequences it held", following.num_seqs)
                failed_next = True
        try:
            outputs = commit(core, launched.result())
        except Exception:  # noqa: BLE001 - fails this step's requests and the next's
            log.exception("model step failed; failing the sequences of the steps in flight")
            return core.fail_plan(FAILED), True
        if failed_next:
            outputs += core.fail_plan(FAILED)
        self._launched = queued
        return outputs, True

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not (self._inbox or self._stopping or self._core.has_work()
                               or self._launched is not None):
                        self._cv.wait()
                    if self._stopping:
                        return
                    ops, self._inbox = self._inbox, []
                    self._unpublished_seqs += self._posted_seqs
                    self._posted_seqs = 0
                failed = self._apply(ops)
                if failed:
                    self._deliver(failed)
                if ops and not self._core.has_work() and self._launched is None:
                    # Aborts can empty the engine without another step: refresh /load now.
                    self._publish(0.0)
                    continue
                t0 = time.perf_counter()
                # The counts as scheduled, before the model runs: a request in its (maybe
                # long) first prefill step is running, not missing from /load and /metrics.
                if self.plan_ahead:
                    outputs, ran = self._step_ahead()
                else:
                    outputs, ran = step(self._core, self._runner, self._scheduled)
                if not ran:
                    # Work exists but none could be scheduled this instant; don't spin.
                    time.sleep(0.001)
                    continue
                mapped, ended = [], []
                for handle, data, finished, error, ntok, ends in outputs:
                    token = self._tokens.get(handle)
                    if token is None:
                        continue
                    if finished:
                        del self._tokens[handle]
                        self._handles.pop(token, None)
                        ended.append(token)
                    mapped.append((token, data, finished, error, ntok, ends))
                # the counts first: a client that got its answer must not see itself running
                self._publish(time.perf_counter() - t0, ended=ended)
                if mapped:
                    self._deliver(mapped)
        except BaseException:
            log.exception("the engine loop died")
            raise
        finally:
            self.alive = False
            with self._cv:
                orphans = list(self._tokens.values()) + [op[2] for op in self._inbox if op[0] == "add"]
                resets = [op[1] for op in self._inbox if op[0] == "reset_prefix_cache"]
                self._inbox = []
                self._posted_seqs = 0
                self._unstarted.clear()
                self._abandoned.clear()
            self._release()
            for done in resets:
                done(None)
            died = RuntimeError("the engine loop stopped")
            if orphans:
                self._deliver([(t, died, "error", True, 0, None) for t in orphans])

    def _release(self) -> None:
        """The loop has ended: drop the step queued ahead and every sequence the Core still
        holds, so a stopped engine holds no KV blocks and /load and the metrics read 0."""
        try:
            self._launched = None
            self._core.fail_plan("the engine stopped")
            for handle in list(self._tokens):
                self._core.abort(handle)
            self._tokens.clear()
            self._handles.clear()
            self._publish(0.0)
        except Exception:  # noqa: BLE001 - the loop may have died of a broken Core
            log.exception("could not release the engine's sequences")


def core_error(body: bytes) -> ApiError:
    """The Core's error body as the ApiError that answers with it: a 400 where the request is
    at fault (its grammar ran past the grammar engine's limits while generating:
    `invalid_value` at its field), else a 500 with the Core's message."""
    try:
        err = orjson.loads(body)["error"]
        if err.get("type") == "invalid_request_error" and err.get("code") == "invalid_value":
            return Router.error("invalid_request", err["message"], err.get("param"))
        message = err.get("message")
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
        message = None
    return Router.error("internal", message if isinstance(message, str) and message
                        else "The engine failed while running this request.")
