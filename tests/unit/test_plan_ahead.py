"""--async-scheduling: the engine thread plans step N+1 while the model runs step N
(Core.schedule_ahead, ModelRunner.launch with the previous step's tokens). On the tiny model
in batch-invariant mode, where a request's tokens cannot depend on what else runs, the
outputs must be the same bytes as with the plain loop, for a mix of requests that plan ahead
(greedy, seeded, logprobs, stops, echo) and requests that make the loop fall back (n > 1,
penalties, grammars); aborts and failing steps must leave no KV blocks behind."""

from __future__ import annotations

import pytest
from _engine_thread import BODIES, serve

from llmserve.engine.build import build_engine
from llmserve.engine.offline import make_config


@pytest.fixture(scope="module")
def engines(tiny_model):
    def build(ahead: bool):
        return build_engine(make_config(
            str(tiny_model), batch_invariant=True, num_kv_blocks=120, max_num_seqs=6,
            max_num_batched_tokens=48, async_scheduling="on" if ahead else "off"))
    return build(False), build(True)


def test_planning_ahead_gives_the_same_bytes(engines):
    sync, ahead = engines
    assert (sync.plan_ahead, ahead.plan_ahead) == (False, True)
    expected, spy_sync = serve(sync, BODIES)
    got, spy_ahead = serve(ahead, BODIES)
    assert spy_sync.ahead == 0
    assert spy_ahead.ahead >= 10, f"only {spy_ahead.ahead} of {spy_ahead.launches} steps planned ahead"
    for i in range(len(BODIES)):
        assert got[i] == expected[i], f"request {i}: {BODIES[i]}"
    assert expected[4]["choices"][0]["finish_reason"] in ("stop", "length")
    for engine in engines:
        assert engine.core.stats()["used_blocks"] == 0
        assert not engine.core.has_work()


def test_aborts_while_planning_ahead_free_everything(engines):
    _, ahead = engines
    bodies = [{"prompt": f"The quick brown fox {i}", "max_tokens": 40, "temperature": 0,
               "ignore_eos": True, "stream": True} for i in range(8)]
    out, spy = serve(ahead, bodies, abort_after={0: 2, 3: 5, 5: 1, 6: 9})
    assert spy.ahead > 0
    for i in (1, 2, 4, 7):
        assert out[i].endswith(b"data: [DONE]\n\n") and b'"finish_reason":"length"' in out[i]
    assert ahead.core.stats()["used_blocks"] == 0 and not ahead.core.has_work()
    # and the engine still serves
    again, _ = serve(ahead, BODIES[:2])
    assert again[0]["choices"][0]["text"]


@pytest.mark.parametrize(("fail_at", "short_at", "planned_ahead"),
                         [(1, None, True), (3, None, True), (6, None, True), (None, 3, True), (None, 3, False)])
def test_a_failing_step_fails_only_the_steps_in_flight(engines, fail_at, short_at, planned_ahead):
    """A step that raises, or whose samples the Core refuses (a token short of its plan: a
    runner's bug, not a client's), fails the requests it held; the loop serves on."""
    sync, ahead = engines
    engine = ahead if planned_ahead else sync
    expected, _ = serve(sync, BODIES[:4])
    out, spy = serve(engine, BODIES[:4], fail_at=fail_at, short_at=short_at)
    # (a request the failing step did not hold yet succeeds: its result is a body, not an error)
    errors = [i for i, r in out.items() if isinstance(r, tuple) and r[0] == "error"]
    assert errors, "the injected failure reached some request"
    assert all(b"failed" in out[i][1] for i in errors)
    for i in set(out) - set(errors):
        assert out[i] == expected[i]
    assert engine.core.stats()["used_blocks"] == 0 and not engine.core.has_work()
    again, _ = serve(engine, BODIES[:2])
    assert again == {i: expected[i] for i in range(2)}


def test_placeholders_are_filled_from_the_step_before():
    """A plan made ahead names the previous step's rows; the CPU runner fills them on the
    host, the CUDA runner on the device (fill_placeholders_, checked here on CPU tensors)."""
    import numpy as np
    import torch

    from llmserve.worker.runner import fill_placeholders_, has_placeholders, resolve_placeholders

    class Plan:
        input_ids = np.array([7, -2, 9, -1, -3], np.int64)
        positions = np.arange(5)

    prev = np.array([40, 41, 42], np.int64)
    assert has_placeholders(Plan) and not has_placeholders(type("P", (), {"input_ids": np.array([1, 0])}))
    resolved = resolve_placeholders(Plan, prev)
    assert resolved.input_ids.tolist() == [7, 41, 9, 40, 42]
    assert resolved.positions is Plan.positions           # every other column read through
    ids = torch.from_numpy(Plan.input_ids.copy())
    assert fill_placeholders_(ids, torch.from_numpy(prev)).tolist() == [7, 41, 9, 40, 42]
    with pytest.raises(ValueError):
        resolve_placeholders(Plan, None)
