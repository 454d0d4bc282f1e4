"""The offline API: `LLM(model).generate(prompts, params)` and `LLM(model).chat(messages)`.

Requests go through exactly the path the server uses (Router.prepare -> Core -> runner ->
commit), run to completion on the calling thread, and come back as OpenAI response bodies
wrapped in a small `Result`. `params` take the OpenAI field names (`max_tokens`,
`temperature`, `stop`, `seed`, `n`, `logprobs`, the extensions such as `top_k`, ...).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import orjson

from llmserve.config import Config
from llmserve.engine.build import build_engine
from llmserve.engine.loop import step


@dataclass(frozen=True)
class Result:
    """One request's response: `text` is the first choice, `texts` every choice."""

    texts: list[str]
    finish_reasons: list[str | None]
    usage: dict
    body: dict = field(repr=False)

    @property
    def text(self) -> str:
        return self.texts[0]

    @property
    def finish_reason(self) -> str | None:
        return self.finish_reasons[0]


def make_config(model: str | None = None, **options: Any) -> Config:
    """A Config with `options` given by field name (`max_model_len=...`, `num_kv_blocks=...`)."""
    cfg = Config()
    sections = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    options = {"model": model, **options}
    for name, value in options.items():
        for sname, section in sections.items():
            if name in {f.name for f in dataclasses.fields(section)}:
                if isinstance(getattr(section, name), tuple) and isinstance(value, (list, str)):
                    value = tuple([value] if isinstance(value, str) else value)
                sections[sname] = dataclasses.replace(section, **{name: value})
                break
        else:
            raise TypeError(f"unknown option {name!r}")
    return Config(**sections)


class LLM:
    """Offline generation on the calling thread."""

    def __init__(self, model: str | None = None, **options: Any) -> None:
        self.engine = build_engine(make_config(model, **options))
        self.model_name = self.engine.model_name

    def generate(self, prompts, params: dict | None = None) -> list[Result]:
        """Complete each prompt (a string or a list of token ids)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        bodies = [{**(params or {}), "model": self.model_name, "prompt": p} for p in prompts]
        return self._run("completion", bodies)

    def chat(self, messages, params: dict | None = None) -> Result | list[Result]:
        """Answer one conversation (a list of messages) or several (a list of such lists)."""
        many = bool(messages) and isinstance(messages[0], list)
        convs = messages if many else [messages]
        bodies = [{**(params or {}), "model": self.model_name, "messages": m} for m in convs]
        results = self._run("chat", bodies)
        return results if many else results[0]

    def _run(self, endpoint: str, bodies: list[dict]) -> list[Result]:
        core, runner, router = self.engine.core, self.engine.runner, self.engine.router
        handles = []
        for body in bodies:
            if body.get("stream"):
                raise ValueError("the offline API does not stream; drop `stream`")
            handles.append(core.add(router.prepare(endpoint, orjson.dumps(body))))
        buffers: dict[int, list[bytes]] = {h: [] for h in handles}
        pending = set(handles)
        while pending:
            outputs, ran = step(core, runner)
            if not ran and not core.has_work():
                raise RuntimeError("the engine stopped with requests still pending")
            for handle, data, finished, error, *_ in outputs:
                if error:
                    raise RuntimeError(f"request failed: {data.decode(errors='replace')}")
                buffers[handle].append(data)
                if finished:
                    pending.discard(handle)
        return [_result(endpoint, orjson.loads(b"".join(buffers[h]))) for h in handles]


def _result(endpoint: str, body: dict) -> Result:
    choices = body["choices"]
    if endpoint == "chat":
        texts = [c["message"].get("content") or "" for c in choices]
    else:
        texts = [c["text"] for c in choices]
    return Result(texts, [c.get("finish_reason") for c in choices], body.get("usage", {}), body)
