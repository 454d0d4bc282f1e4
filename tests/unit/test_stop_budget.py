"""`llmserve run`'s stop fits in Kubernetes' default 30 s grace period: the wait for the
engine's step in progress is cut to what is left of the budget that started at the signal."""

import time
from types import SimpleNamespace

from llmserve.server import app


def test_the_step_wait_is_cut_to_what_is_left_of_the_stop_budget():
    now = time.monotonic()
    state = SimpleNamespace(stop_timeout=app.ENGINE_STOP_TIMEOUT_S, stop_deadline=None)
    assert app._step_wait(state) == app.ENGINE_STOP_TIMEOUT_S          # no signal: the bound
    state.stop_deadline = now + app.STOP_BUDGET_S                       # a signal just now
    assert app._step_wait(state) == app.ENGINE_STOP_TIMEOUT_S
    state.stop_deadline = time.monotonic() + 3                          # the drain took 26 s
    assert 2 < app._step_wait(state) <= 3
    state.stop_deadline = now - 5                                       # nothing left: a moment
    assert app._step_wait(state) == 0.5
    embedded = SimpleNamespace(stop_timeout=None, stop_deadline=None)   # a mounted app waits
    assert app._step_wait(embedded) is None


def test_the_longest_drain_leaves_the_step_some_of_the_budget():
    assert app.DRAIN_TIMEOUT_S + app.CLOSE_TIMEOUT_S < app.STOP_BUDGET_S < 30
