"""An EngineThread driven directly (no HTTP): post requests, collect what it delivers.
Shared by the plan-ahead tests on CPU (tests/unit) and CUDA (tests/gpu)."""

from __future__ import annotations

import dataclasses
import threading

import orjson

from llmserve.engine.loop import EngineThread

# A mix of requests whose steps can be planned ahead (greedy, seeded, logprobs, stops, echo)
# and ones whose steps make the loop plan after the commit instead (n > 1, penalties, a
# regex grammar).
BODIES = [
    {"prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0},
    {"prompt": "Hello, world!", "max_tokens": 9, "temperature": 0, "logprobs": 3},
    {"prompt": "Numbers: 0 1 2", "max_tokens": 20, "temperature": 1.0, "seed": 7},
    {"prompt": "def add(a, b):", "max_tokens": 15, "temperature": 0.8, "top_p": 0.9, "seed": 3},
    {"prompt": "user assistant", "max_tokens": 30, "temperature": 0, "stop": ["e"]},
    {"prompt": "Café naïve", "max_tokens": 6, "temperature": 0, "echo": True, "logprobs": 2},
    {"prompt": "The end", "max_tokens": 1, "temperature": 0},
    {"prompt": "stop the", "max_tokens": 10, "temperature": 1.0, "seed": 5, "n": 2},
    {"prompt": "models and tokens", "max_tokens": 10, "temperature": 1.0, "seed": 9,
     "presence_penalty": 0.5},
    {"prompt": "Hello", "max_tokens": 8, "temperature": 0, "min_tokens": 4, "ignore_eos": True},
    {"prompt": "Answer:", "max_tokens": 12, "temperature": 0,
     "response_format": {"type": "regex", "regex": "[0-9]{3}-[0-9]{2}"}},
    {"prompt": "A long one: " + "the lazy dog " * 20, "max_tokens": 25, "temperature": 0},
]



class Spy:
    """Wraps a runner: counts launches of plans made ahead, and can fail one launch, or make
    one step's samples a token short of its plan (`short_at`: the Core refuses them)."""

    def __init__(self, runner, fail_at: int | None = None, short_at: int | None = None):
        self.runner, self.fail_at, self.short_at = runner, fail_at, short_at
        self.launches = self.ahead = 0

    def launch(self, plan, prev=None):
        self.launches += 1
        self.ahead += int((plan.input_ids < 0).any())
        if self.launches == self.fail_at:
            raise RuntimeError("injected step failure")
        launched = self.runner.launch(plan, prev)
        return _Short(launched) if self.launches == self.short_at else launched

    def execute(self, plan):
        return self.launch(plan).result()


class _Short:
    """A launched step whose samples lack their last row."""

    def __init__(self, launched):
        self.launched = launched

    def result(self):
        out = self.launched.result()
        return dataclasses.replace(out, tokens=out.tokens[:-1], logprobs=out.logprobs[:-1],
                                   top_ids=out.top_ids[:-1], top_logprobs=out.top_logprobs[:-1])


def serve(engine, bodies, abort_after: dict | None = None, fail_at: int | None = None,
          short_at: int | None = None):
    """Post every body at once to an EngineThread over `engine`; returns ({index: body or
    error}, the runner spy). `abort_after[i] = k`: abort request i once it has sent k chunks."""
    results: dict[int, list] = {i: [] for i in range(len(bodies))}
    done = threading.Event()
    finished: set[int] = set()
    spy = Spy(engine.runner, fail_at, short_at)
    thread: EngineThread

    def deliver(outputs):
        for token, data, fin, error, *_ in outputs:
            results[token].append((data, error))
            if abort_after and len(results[token]) == abort_after.get(token):
                thread.post(("abort", token))
                finished.add(token)
            if fin:
                finished.add(token)
        if len(finished) == len(bodies):
            done.set()

    thread = EngineThread(engine.core, spy, deliver, plan_ahead=engine.plan_ahead)
    thread.start()
    try:
        for i, body in enumerate(bodies):
            prepared = engine.router.prepare("completion", orjson.dumps({"model": engine.model_name, **body}))
            thread.post(("add", prepared, i))
        assert done.wait(120), f"unfinished: {set(range(len(bodies))) - finished}"
    finally:
        thread.stop()
    out = {}
    for i, chunks in results.items():
        if chunks and chunks[-1][1]:
            out[i] = ("error", chunks[-1][0])
        elif bodies[i].get("stream"):
            out[i] = b"".join(d for d, _ in chunks)
        elif i not in (abort_after or {}):
            body = orjson.loads(b"".join(d for d, _ in chunks))
            out[i] = {"choices": body["choices"], "usage": body["usage"]}
    return out, spy
