"""vLLM's `SamplingParams` and per-choice outputs, for code written against vLLM's `LLM`.

`LLM.generate(prompts, SamplingParams(temperature=0.8, max_tokens=64))` runs as it would on
vLLM: a `SamplingParams` stands for the request fields of the HTTP API that hold the same
values (vLLM's defaults included: 16 `max_tokens`, `temperature` 1.0), so what it asks is
validated, and reported when it does nothing, exactly as a request to the server. Each
`Result` then also reads as vLLM's `RequestOutput`: `result.outputs[0].text`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

# vLLM's fields that shape its own outputs or callbacks, not the tokens (and its logits
# processors, which the request refuses): sent only when they ask for something; the request
# then reports them as fields without effect (and the call warns), or refuses them.
_INERT_DEFAULTS = {"detokenize": True, "spaces_between_special_tokens": True, "logits_processors": None,
                   "extra_args": None, "output_kind": None}


@dataclass
class SamplingParams:
    """vLLM's `SamplingParams`, field for field with its defaults; each holds what the request
    field of the same name holds (docs/FIELDS.md). `logprobs` k is completions' integer
    `logprobs`, and on chat `logprobs: true` with `top_logprobs: k`."""

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logits_processors: list[Any] | None = None
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = None
    structured_outputs: dict[str, Any] | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    extra_args: dict[str, Any] | None = None
    # (vLLM's RequestOutputKind: how a streaming engine hands out outputs; a call here returns
    # each output whole, so any value is reported)
    output_kind: Any = None

    def clone(self) -> SamplingParams:
        """A deep copy, as vLLM's `SamplingParams.clone()` (its lists and dicts are the copy's
        own)."""
        return copy.deepcopy(self)

    def request_fields(self, endpoint: str) -> dict[str, Any]:
        """The request fields that ask what these params ask, on `endpoint` ("completion" or
        "chat"); every choice's token ids come back too (`return_token_ids`), as vLLM's
        outputs hold them, and logprobs name their tokens by id (`return_tokens_as_token_ids`),
        which `CompletionOutput.logprobs` is keyed by."""
        fields: dict[str, Any] = {"return_token_ids": True}
        for name in ("n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p",
                     "top_k", "min_p", "ignore_eos", "min_tokens", "skip_special_tokens",
                     "include_stop_str_in_output"):
            fields[name] = getattr(self, name)
        for name in ("best_of", "seed", "stop", "stop_token_ids", "bad_words", "max_tokens", "prompt_logprobs",
                     "truncate_prompt_tokens", "structured_outputs", "logit_bias", "allowed_token_ids"):
            if (value := getattr(self, name)) is not None:
                fields[name] = value
        if self.logprobs is not None:
            fields["return_tokens_as_token_ids"] = True
            if endpoint == "chat":
                fields.update(logprobs=True, top_logprobs=self.logprobs)
            else:
                fields["logprobs"] = self.logprobs
        for name, default in _INERT_DEFAULTS.items():
            if (value := getattr(self, name)) != default and value not in ([], {}):
                fields[name] = _as_json(value)
        return fields


def _as_json(value: Any) -> Any:
    """A value JSON can carry, for a field the request only reports or refuses: a callable (a
    logits processor) by its name, another object (an enum member) as its text."""
    if isinstance(value, (list, tuple)):
        return [_as_json(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _as_json(v) for k, v in value.items()}
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return value.__qualname__ if callable(value) and hasattr(value, "__qualname__") else str(value)


@dataclass(frozen=True)
class CompletionOutput:
    """One choice, as vLLM's `CompletionOutput` names it: its `text`, `token_ids` (when the
    request returned them: always under `SamplingParams`; else None), `finish_reason`, `stop_reason`
    (the stop string or token id that ended it, if one did), `cumulative_logprob`, the sum
    of its tokens' logprobs when the request asked for logprobs (else None, as in vLLM), and
    `logprobs`, vLLM's per-token form of them when `SamplingParams.logprobs` asked (else None):
    a dict per generated token, from its id and its likeliest alternatives' ids to
    `Logprob(logprob, rank, decoded_token)`, the sampled token first. An alternative's rank is
    its place among them (1: the likeliest); the sampled token's is known when it is one of
    them, else None (vLLM counts it over the vocabulary; the engine does not return it)."""

    index: int
    text: str
    finish_reason: str | None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None


@dataclass(frozen=True)
class Logprob:
    """A token's logprob as vLLM's `Logprob` holds it: the value, its rank among the vocabulary
    (1: the likeliest) and the token's text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def prompt_logprobs(entries: list[dict[str, Any] | None] | None) -> list[dict[int, Logprob] | None] | None:
    """A body's `prompt_logprobs` (None for the first token, then token id text -> `{logprob,
    rank, decoded_token}`) as vLLM's `RequestOutput.prompt_logprobs`: keyed by int ids."""
    if entries is None:
        return None
    return [None if e is None else {int(k): Logprob(v["logprob"], v.get("rank"), v.get("decoded_token"))
                                    for k, v in e.items()} for e in entries]


def cumulative_logprob(logprobs: dict[str, Any] | None, prompt_tokens: int) -> float | None:
    """The sum of a choice's generated tokens' logprobs, from its OpenAI `logprobs` (chat's
    `content` entries, or completions' `token_logprobs`, past the `prompt_tokens` an `echo`
    lists first: their first entry, the prompt's first token, has none); None without them."""
    if not logprobs:
        return None
    if "content" in logprobs:
        return float(sum(entry["logprob"] for entry in logprobs["content"] or ()))
    values = logprobs.get("token_logprobs") or []
    if values and values[0] is None:
        values = values[prompt_tokens:]
    return float(sum(values))


def token_logprobs(logprobs: dict[str, Any] | None, prompt_tokens: int, token_text: Callable[[int], str],
                   k: int) -> list[dict[int, Logprob]] | None:
    """A choice's OpenAI `logprobs` as vLLM's `CompletionOutput.logprobs` (see there), when
    their tokens are named by id (`token_id:<id>`, as `SamplingParams` asks for them); else
    None. `token_text(id)` is a token's text, each Logprob's `decoded_token`; `k` the
    alternatives asked for (completions' `top_logprobs` also hold the sampled token when it is
    not among them: it is then no alternative, and its rank unknown)."""
    if not logprobs:
        return None
    if "content" in logprobs:
        steps = [(e["token"], e["logprob"], [(t["token"], t["logprob"]) for t in e.get("top_logprobs") or ()])
                 for e in logprobs["content"] or ()]
    else:
        named = zip(logprobs.get("tokens") or (), logprobs.get("token_logprobs") or (),
                    logprobs.get("top_logprobs") or ())
        steps = [(token, lp, list((top or {}).items())) for token, lp, top in named]
        if steps and steps[0][1] is None:
            steps = steps[prompt_tokens:]       # (an echoed prompt's entries come first)
    out = []
    for token, lp, top in steps:
        sampled = _token_id(token)
        if sampled is None:
            return None
        likeliest = sorted(top, key=lambda t: -t[1])[:k]
        ranks = {_token_id(t): rank for rank, (t, _) in enumerate(likeliest, 1)}
        entry = {sampled: Logprob(float(lp), ranks.get(sampled), token_text(sampled))}
        for rank, (t, alt_lp) in enumerate(likeliest, 1):
            alt = _token_id(t)
            if alt is not None and alt not in entry:
                entry[alt] = Logprob(float(alt_lp), rank, token_text(alt))
        out.append(entry)
    return out


def _token_id(token: str) -> int | None:
    """The id in a logprobs token named `token_id:<id>`; None for a token named by its text."""
    prefix, _, rest = token.partition(":")
    return int(rest) if prefix == "token_id" and rest.isdigit() else None


@dataclass
class BeamSearchParams:
    """vLLM's `BeamSearchParams` for `LLM.beam_search`, field for field with its defaults: the
    request fields `use_beam_search` with `n` beams (`beam_width`), `max_tokens`,
    `ignore_eos`, `length_penalty` and `include_stop_str_in_output` (docs/FIELDS.md). Beams
    are ranked by logprobs alone, so a `temperature` other than 0 (vLLM's default) or 1 is
    reported as a field without effect, as the route reports it."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def request_fields(self) -> dict[str, Any]:
        """The completion request fields of this search; its beams' token ids and logprobs
        come back too (for `BeamSearchSequence`)."""
        fields: dict[str, Any] = {"use_beam_search": True, "n": self.beam_width, "max_tokens": self.max_tokens,
                                  "ignore_eos": self.ignore_eos, "length_penalty": self.length_penalty,
                                  "include_stop_str_in_output": self.include_stop_str_in_output,
                                  "return_token_ids": True, "logprobs": 0}
        if self.temperature != 0.0:
            fields["temperature"] = self.temperature
        return fields


@dataclass(frozen=True)
class BeamSearchSequence:
    """One returned beam, as vLLM's `BeamSearchSequence`: `tokens` (the prompt's then the
    beam's), `text` (all of them decoded, special tokens included, as vLLM decodes them),
    `cum_logprob` (the beam's tokens' raw logprobs summed), `finish_reason` and
    `stop_reason`."""

    tokens: list[int]
    text: str
    cum_logprob: float
    finish_reason: str | None
    stop_reason: str | int | None = None


@dataclass(frozen=True)
class BeamSearchOutput:
    """One prompt's search, as vLLM's `BeamSearchOutput`: its best beams, best first."""

    sequences: list[BeamSearchSequence]
