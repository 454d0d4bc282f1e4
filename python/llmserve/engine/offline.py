"""The offline API: `LLM(model).generate(prompts, params)` and `LLM(model).chat(messages)`.

Requests go through exactly the path the server uses (Router.prepare -> Core -> runner ->
commit), run to completion on the calling thread, and come back as OpenAI response bodies
wrapped in a small `Result`. `params` take the OpenAI field names (`max_tokens`,
`temperature`, `stop`, `seed`, `n`, `logprobs`, the extensions such as `top_k`, ...), or are
vLLM's `SamplingParams` (sampling_params.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import json
import math
import numbers
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Union, overload

import numpy as np
import orjson

from llmserve._core import ApiError, Router
from llmserve.config import Config, ServerConfig
from llmserve.engine.build import Engine, build_engine
from llmserve.engine.loop import core_error, run_to_end
from llmserve.engine.pooling import (EmbeddingOutput, EmbeddingRequestOutput, PoolingParams, ScoringOutput,
                                     ScoringRequestOutput)
from llmserve.engine.sampling_params import (BeamSearchOutput, BeamSearchParams, BeamSearchSequence, CompletionOutput,
                                             Logprob, SamplingParams, cumulative_logprob, prompt_logprobs,
                                             token_logprobs)
from llmserve.engine.tokenizer import Tokenizer, integer, token_ids


@dataclass(frozen=True)
class Result:
    """One request's response: `text` is the first choice, `texts` every choice.
    `ignored_fields` names the request's fields that had no effect (the server's
    `llmserve-ignored-fields` header; each call also warns about them). `prompt`: the text
    `generate` was given for it (None for token ids and conversations), as vLLM's
    `RequestOutput.prompt`."""

    texts: list[str]
    finish_reasons: list[str | None]
    usage: dict[str, Any]
    body: dict[str, Any] = field(repr=False)
    ignored_fields: tuple[str, ...] = ()
    prompt: str | None = None
    # (a token's text, for `outputs`' per-token logprobs: the LLM's detokenizer; and the
    # alternatives per token the request asked for)
    token_text: Callable[[int], str] | None = field(default=None, repr=False, compare=False)
    logprobs_k: int = field(default=0, repr=False, compare=False)
    # (the request as the engine ran it: its id and prompts' token ids, for the pooling outputs)
    engine_id: str = field(default="", repr=False, compare=False)
    prompt_token_lists: list[list[int]] = field(default_factory=list, repr=False, compare=False)

    @property
    def text(self) -> str:
        return self.texts[0]

    @property
    def finish_reason(self) -> str | None:
        return self.finish_reasons[0]

    @property
    def prompt_token_ids(self) -> list[int] | None:
        """The prompt's token ids, as vLLM's `RequestOutput` holds them, when the request
        returned them (`return_token_ids`: always under SamplingParams); else None."""
        choices = self.body.get("choices") or [{}]
        return self.body.get("prompt_token_ids", choices[0].get("prompt_token_ids"))

    @property
    def request_id(self) -> str | None:
        """The response's `id`, as vLLM's `RequestOutput.request_id` names the request."""
        return self.body.get("id")

    # (an offline call answers when every choice is done, as vLLM's `LLM` does)
    finished = True

    @property
    def prompt_logprobs(self) -> list[dict[int, Logprob] | None] | None:
        """The prompt's logprobs when `prompt_logprobs` asked for them, as vLLM's
        `RequestOutput.prompt_logprobs`: None for the first token, then each token's id ->
        `Logprob(logprob, rank, decoded_token)`, the prompt's own token and its likeliest
        alternatives; else None."""
        choices = self.body.get("choices") or [{}]
        return prompt_logprobs(self.body.get("prompt_logprobs", choices[0].get("prompt_logprobs")))

    @property
    def outputs(self) -> list[CompletionOutput]:
        """Every choice as vLLM's `RequestOutput.outputs` holds it (`outputs[0].text`)."""
        prompt_tokens = self.usage.get("prompt_tokens", 0)
        return [CompletionOutput(c.get("index", i), text, c.get("finish_reason"), c.get("stop_reason"),
                                 c.get("token_ids"), cumulative_logprob(c.get("logprobs"), prompt_tokens),
                                 None if self.token_text is None
                                 else token_logprobs(c.get("logprobs"), prompt_tokens, self.token_text, self.logprobs_k))
                for i, (c, text) in enumerate(zip(self.body.get("choices", []), self.texts))]


class OneResult(list):
    """`LLM.chat`'s answer to one conversation: the list of its one `Result`, as vLLM's
    `LLM.chat` answers every call (`outputs[0].outputs[0].text`, `for out in outputs`), which
    also reads as that `Result` (`llm.chat(messages).text`)."""

    def __getattr__(self, name: str) -> Any:
        if not self or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self[0], name)


# The options whose flags take a JSON object (which vLLM's `LLM` takes as a dict).
_JSON_OPTIONS = frozenset({"hf_overrides", "override_generation_config", "default_chat_template_kwargs",
                           "speculative_config"})


def make_config(model: str | None = None, **options: Any) -> Config:
    """A Config with `options` given by field name (`max_model_len=...`, `num_kv_blocks=...`),
    or by vLLM's name for one (`kv_cache_memory_bytes`); an option given as None keeps its
    default, as vLLM reads None. The JSON flags (`hf_overrides`, ...) take a dict, as vLLM's
    `LLM` does, or its JSON text. vLLM's options that have no effect here, as their `llmserve
    run` flags have none (`trust_remote_code`, `tensor_parallel_size=1`, ...), are taken with a
    warning saying why, and those llmserve does not have, at the value that turns them off
    (`quantization=None`, `cpu_offload_gb=0`, `enable_sleep_mode=False`), quietly; TypeError
    for an unknown one."""
    from llmserve.cli import vllm_off, vllm_option

    cfg = Config()
    sections = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    fields = {f.name: (sname, f) for sname, section in sections.items() for f in dataclasses.fields(section)}
    aliases = {f.metadata["alias"].removeprefix("--").replace("-", "_"): name
               for name, (_, f) in fields.items() if "alias" in f.metadata}
    no_effect = []
    for name, value in {"model": model, **options}.items():
        name = aliases.get(name, name)
        if value is None or (name not in fields and vllm_off(name, value)):
            continue
        if name not in fields:
            no_effect.append(f"{name} ({vllm_option(name, value)})")
            continue
        sname = fields[name][0]
        section = sections[sname]
        bare = fields[name][1].metadata.get("bare")
        if type(value).__name__ == "dtype" and type(value).__module__ == "torch":
            value = str(value).removeprefix("torch.")   # (vLLM's LLM takes a torch.dtype too)
        elif bare and isinstance(value, bool):
            # (vLLM's option is a boolean where the flag is ours, on/off/auto: True is the bare
            # flag, False its `--no-` form, as on the command line)
            value = bare if value else "off"
        elif isinstance(getattr(section, name), tuple) and isinstance(value, (list, str)):
            value = tuple([value] if isinstance(value, str) else value)
        elif name in _JSON_OPTIONS and isinstance(value, dict):
            value = json.dumps(value)
        sections[sname] = dataclasses.replace(section, **{name: value})
    if no_effect:
        warnings.warn(f"llmserve: these options have no effect: {'; '.join(no_effect)}", stacklevel=3)
    return Config(**sections)


Prompt = Union[str, list[int]]
Message = dict[str, Any]
# A request's fields by OpenAI's names (`max_tokens`, `temperature`, ...), vLLM's
# SamplingParams, or None for none.
Params = Union[dict[str, Any], SamplingParams, None]

# Options of the server alone: offline calls run on the caller's thread, with no HTTP, no
# stream, no stored response, no queue limit and no step planned ahead. Of the server's section
# only the router's reading of a request applies.
SERVER_ONLY = frozenset(
    {f.name for f in dataclasses.fields(ServerConfig)} - {"strict_fields", "return_tokens_as_token_ids"}
    | {"max_waiting", "async_scheduling"})


class LLM:
    """Offline generation on the calling thread. Calls from several threads run one at a
    time. `params` take the OpenAI field names and defaults: without `max_tokens` a request
    may run to the end of the context, as on the server. `close()` (or leaving a `with`
    block) releases the model and its KV cache at once, rather than when the last reference
    to the LLM goes."""

    def __init__(self, model: str | None = None, **options: Any) -> None:
        config = make_config(model, **options)
        if unused := [name for name in options if name in SERVER_ONLY]:
            warnings.warn(f"llmserve: these options have no effect offline: {', '.join(unused)}", stacklevel=2)
        self._engine: Engine | None = build_engine(config)
        self.model_name = self._engine.model_name
        self._lock = threading.Lock()

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            raise RuntimeError("this LLM was closed")
        return self._engine

    def close(self) -> None:
        """Release the model, its KV cache and its tokenizer now (a call in progress on
        another thread ends first); later calls raise RuntimeError. Closing twice is fine."""
        with self._lock:
            self._engine = None
        gc.collect()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(self, prompts: Prompt | list[str] | list[list[int]], params: Params | list[Params] = None, *,
                 sampling_params: Params | list[Params] = None, use_tqdm: bool = True,
                 lora_request: Any = None, priority: list[int] | None = None) -> list[Result]:
        """Complete each prompt (a string or token ids: a list, tuple or 1-D array of integers).
        `params` apply to every prompt, or (a list, as vLLM takes one `SamplingParams` per
        prompt) one to each; None is vLLM's default, `get_default_sampling_params()` (16
        tokens); vLLM's keyword for them, `sampling_params`, is taken too. So is `use_tqdm`,
        vLLM's progress bar, which draws nothing here, and vLLM's `lora_request` and
        `priority` (see `_routing`)."""
        prompts = _prompt_list(prompts)
        params = _fields(self._or_defaults(_one_of(params, sampling_params)), "completion")
        each = _params_each(params, len(prompts), "prompt")
        routing = _routing(self.model_name, lora_request, priority, len(prompts), "prompt")
        bodies = [{**r, **q, "prompt": p} for p, q, r in zip(prompts, each, routing)]
        # Homogeneous prompts with shared params are also a valid single request (the server's
        # shape), whose errors name the prompt as the server would (`prompt[2]`, `prompt[2][1]`).
        same_kind = (len({isinstance(p, str) for p in prompts}) == 1 and not isinstance(params, (list, tuple))
                     and lora_request is None and priority is None)
        whole = {"model": self.model_name, **(params or {}), "prompt": prompts} if same_kind else None
        results = self._run("completion", bodies, whole)
        return [dataclasses.replace(r, prompt=p) if isinstance(p, str) else r for r, p in zip(results, prompts)]

    def beam_search(self, prompts: Prompt | list[str] | list[list[int]], params: BeamSearchParams, *,
                    use_tqdm: bool = False, lora_request: Any = None) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search`: each prompt's best `params.beam_width` beams, best first,
        as a completion request with `use_beam_search` finds them (docs/FIELDS.md); prompts as
        `generate` takes them (vLLM's `{"prompt": ...}` dicts too), and `lora_request` as it
        does. `use_tqdm` draws nothing."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams; got {type(params).__name__}")
        try:
            results = self.generate(prompts, params.request_fields(), lora_request=lora_request)
        except ApiError as err:
            if err.param == "n":
                err.add_note("(BeamSearchParams.beam_width is the request's `n`)")
            raise
        tokenizer = self.get_tokenizer()
        outputs = []
        for result in results:
            seqs = [(result.prompt_token_ids or []) + (out.token_ids or []) for out in result.outputs]
            outputs.append(BeamSearchOutput([
                BeamSearchSequence(tokens, text, out.cumulative_logprob or 0.0, out.finish_reason, out.stop_reason)
                for tokens, text, out in zip(seqs, tokenizer.batch_decode(seqs), result.outputs)]))
        return outputs

    @overload
    def chat(self, messages: list[Message], params: Params = None, *, sampling_params: Params = None,
             use_tqdm: bool = True, chat_template: str | None = None, chat_template_content_format: str = "auto",
             add_generation_prompt: bool | None = None, continue_final_message: bool | None = None,
             tools: list[dict[str, Any]] | None = None, documents: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None, lora_request: Any = None,
             priority: list[int] | None = None) -> OneResult: ...

    @overload
    def chat(self, messages: list[list[Message]], params: Params | list[Params] = None, *,
             sampling_params: Params | list[Params] = None, use_tqdm: bool = True, chat_template: str | None = None,
             chat_template_content_format: str = "auto", add_generation_prompt: bool | None = None,
             continue_final_message: bool | None = None, tools: list[dict[str, Any]] | None = None,
             documents: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None, lora_request: Any = None,
             priority: list[int] | None = None) -> list[Result]: ...

    def chat(self, messages: list[Message] | list[list[Message]], params: Params | list[Params] = None, *,
             sampling_params: Params | list[Params] = None, use_tqdm: bool = True,
             chat_template: str | None = None, chat_template_content_format: str = "auto",
             add_generation_prompt: bool | None = None, continue_final_message: bool | None = None,
             tools: list[dict[str, Any]] | None = None, documents: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None, lora_request: Any = None,
             priority: list[int] | None = None) -> OneResult | list[Result]:
        """Answer one conversation (a list of messages) or several (a list of such lists), each
        with a `Result` in a list, as vLLM's `LLM.chat` answers (one conversation's list also
        reads as its `Result`: `llm.chat(messages).text`);
        `params` apply to every conversation, or (a list) one to each. vLLM's keyword arguments
        of `LLM.chat` are taken: `sampling_params` (the params), `use_tqdm` (draws nothing),
        and the template's (`add_generation_prompt`, `continue_final_message`, `tools`,
        `documents`, `chat_template_kwargs`), each sent as the chat request field of its name,
        and `lora_request` and `priority` as `generate` takes them; not `chat_template` or a
        `chat_template_content_format` other than "auto" (ValueError: the template is the
        LLM's, `LLM(chat_template=...)`, as a server's is its `--chat-template`).
        Calls the model writes with `tools` come back parsed, as the chat route returns them
        (in `body`'s `tool_calls`; vLLM's `LLM.chat` leaves them in the text)."""
        if chat_template_content_format != "auto":
            raise ValueError("chat_template_content_format is the LLM's: LLM(..., chat_template_content_format="
                             f"{chat_template_content_format!r})")
        if chat_template is not None:
            raise ValueError("chat_template is the LLM's, set when it is made: LLM(model, chat_template=...) (a "
                             "file or the template's text)")
        fields = {name: value for name, value in (
            ("add_generation_prompt", add_generation_prompt),
            ("continue_final_message", continue_final_message), ("tools", tools), ("documents", documents),
            ("chat_template_kwargs", chat_template_kwargs)) if value is not None}
        many = bool(messages) and isinstance(messages[0], list)
        convs = messages if many else [messages]
        params = self._or_defaults(_one_of(params, sampling_params))
        each = _params_each(_fields(params, "chat"), len(convs), "messages", "conversation")
        for q in each:
            for name in fields:
                _own_argument(q, name, "keyword")
        routing = _routing(self.model_name, lora_request, priority, len(convs), "conversation")
        bodies = [{**r, **q, **fields, "messages": m} for m, q, r in zip(convs, each, routing)]
        results = self._run("chat", bodies)
        return results if many else OneResult(results)

    def embed(self, prompts: Prompt | list[str] | list[list[int]], params: PoolingParams | dict[str, Any] | None = None,
              *, pooling_params: PoolingParams | dict[str, Any] | None = None,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              lora_request: Any = None) -> list[EmbeddingRequestOutput]:
        """Embed each prompt (a string or token ids, or vLLM's prompt dicts), as /v1/embeddings
        does, answering as vLLM's `LLM.embed`: an `EmbeddingRequestOutput` per prompt, in
        order (`outputs.embedding`; `np.asarray(result)` is them all, float32 [N, D]).
        `params` (or vLLM's keyword `pooling_params`): a `PoolingParams` or a dict of that
        route's fields (`normalize`, `dimensions`, `truncate_prompt_tokens`, ...); vLLM's
        `truncate_prompt_tokens` keyword is that field too; `use_tqdm` draws nothing;
        `lora_request` names the model as `generate`'s does."""
        prompts = _prompt_list(prompts)
        fields = _pooling_fields(params, pooling_params, truncate_prompt_tokens, "input")
        fields = {**_routing(self.model_name, lora_request, None, 1, "call")[0], **fields, "encoding_format": "float"}
        # One request per kind of input: a request may not mix strings and token ids. (No
        # input at all is one request too, which the route refuses as empty.)
        kinds = [isinstance(p, str) for p in prompts]
        if len(set(kinds)) <= 1:
            bodies = [{**fields, "input": prompts}]
        else:
            bodies = [{**fields, "input": [p]} for p in prompts]
        outputs = []
        for result in self._run("embeddings", bodies):
            for item in result.body["data"]:
                i = item["index"]
                outputs.append(EmbeddingRequestOutput(f"{result.engine_id}-{i}", EmbeddingOutput(item["embedding"]),
                                                      result.prompt_token_lists[i]))
        return outputs

    def score(self, text_1: str | list[str], text_2: str | list[str],
              params: PoolingParams | dict[str, Any] | None = None, *,
              pooling_params: PoolingParams | dict[str, Any] | None = None,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              lora_request: Any = None) -> list[ScoringRequestOutput]:
        """vLLM's `LLM.score` for an embedding model, as /score answers: the cosine similarity
        of `text_1`'s embedding with each `text_2`'s (one text against each), or pair by pair
        (two lists of one length); a `ScoringRequestOutput` per pair (`outputs.score`), with
        the pair's token ids (the first text's, then the second's). Keywords as `embed`'s."""
        fields = _pooling_fields(params, pooling_params, truncate_prompt_tokens, "text_1")
        _own_argument(fields, "text_2", "second")
        fields = {**_routing(self.model_name, lora_request, None, 1, "call")[0], **fields}
        result = self._run("score", [{**fields, "text_1": text_1, "text_2": text_2}])[0]
        ids = result.prompt_token_lists
        firsts = 1 if isinstance(text_1, str) else len(text_1)
        outputs = []
        for item in result.body["data"]:
            i = item["index"]
            pair = ids[0 if firsts == 1 else i] + ids[firsts + i]
            outputs.append(ScoringRequestOutput(f"{result.engine_id}-{i}", ScoringOutput(item["score"]), pair))
        return outputs

    def rerank(self, query: str, documents: list[str],
               params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """The documents ranked by relevance to `query`, as /rerank answers: `{"index",
        "document": {"text"}, "relevance_score"}` each, best first (`params`: `top_n`, ...)."""
        _own_argument(params, "query")
        _own_argument(params, "documents", "second")
        body = {"model": self.model_name, **(params or {}), "query": query, "documents": documents}
        return self._run("rerank", [body])[0].body["results"]

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's `LLM.get_default_sampling_params()`: a `SamplingParams` holding the model's
        sampling defaults (its generation_config.json, and `override_generation_config` over
        it: `temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty`, `max_tokens`), vLLM's
        defaults for the rest; what a request that leaves them out samples with, here and on the
        server."""
        fields = {f.name for f in dataclasses.fields(SamplingParams)}
        return SamplingParams(**{k: v for k, v in self.engine.generation_defaults.items() if k in fields})

    def _or_defaults(self, params: object) -> object:
        """`params`, with None (no params given, or one prompt's in a list) as vLLM reads it:
        `get_default_sampling_params()`, whose 16 `max_tokens` bound an output that a request
        without `max_tokens` would run to the end of the context."""
        if params is None:
            return self.get_default_sampling_params()
        if isinstance(params, (list, tuple)):
            return [self.get_default_sampling_params() if p is None else p for p in params]
        return params

    def get_tokenizer(self) -> Tokenizer:
        """The engine's tokenizer and chat template, with the calls code written for vLLM makes
        on its `get_tokenizer()` (transformers' `encode`, `decode`, `batch_decode`,
        `apply_chat_template`, `eos_token_id` and the other named special tokens): a prompt built
        with it is the one the engine builds."""
        return Tokenizer(self.engine.router, self.model_name, self.engine.special_tokens, _encode)

    def reset_prefix_cache(self) -> int:
        """Empty the prefix cache, as vLLM's `LLM.reset_prefix_cache` (a cold-cache run after
        warm ones); how many blocks it held."""
        with self._lock:
            return self.engine.core.reset_prefix_cache()

    def _run(self, endpoint: str, bodies: list[dict[str, Any]],
             whole: dict[str, Any] | None = None) -> list[Result]:
        core, runner, router = self.engine.core, self.engine.runner, self.engine.router
        for body in bodies:
            if body.get("stream"):
                raise ValueError("the offline API does not stream; drop `stream`")
        # Every request is checked before any is queued: one bad prompt fails the call alone.
        prepared = []
        for i, body in enumerate(bodies):
            try:
                prepared.append(router.prepare(endpoint, _encode(router, body)))
            except ApiError as err:
                if len(bodies) > 1:
                    _name_the_request(router, endpoint, err, i, whole, bodies)
                raise
        ignored = [tuple(p.ignored_fields) for p in prepared]
        for fields in sorted(set(ignored)):
            if fields:
                warnings.warn(f"llmserve: these request fields had no effect: {', '.join(fields)}", stacklevel=3)
        buffers: list[list[bytes]] = [[] for _ in prepared]
        ran = [(p.id, p.prompt_token_ids) for p in prepared]
        # (interrupted, by an error or Ctrl-C, the call's other requests are aborted)
        with self._lock:
            self.engine   # (raises if it was closed while this call waited)
            with contextlib.closing(run_to_end(core, runner, prepared)) as outputs:
                for i, data, _, error in outputs:
                    if error:
                        raise core_error(data)
                    buffers[i].append(data)
        tokenizer = self.get_tokenizer()
        token_text = functools.lru_cache(maxsize=None)(lambda i: str(tokenizer.decode(i)))
        asked = "top_logprobs" if endpoint == "chat" else "logprobs"
        return [_result(endpoint, orjson.loads(b"".join(parts)), fields, token_text, body.get(asked) or 0, ran_as)
                for parts, fields, body, ran_as in zip(buffers, ignored, bodies, ran)]


def _encode(router: Router, body: dict[str, Any]) -> bytes:
    """`body` as JSON, as a client sends it. JSON has no NaN or infinity, and orjson writes them
    as null, which the Router would read as an absent field (a NaN temperature sampling at the
    default one). Over HTTP they cannot arrive (the server refuses them as invalid JSON); here
    they are refused by name. Integer keys are written as strings (`logit_bias={5: 1.0}`), numpy
    ones too (`{np.int64(5): 1.0}`, as a key taken from an array is)."""
    try:
        data = orjson.dumps(body, option=orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY)
    except TypeError as exc:
        # orjson writes no integer beyond 64 bits (`max_tokens=2**70`) and no lone surrogate:
        # the standard library writes both, so the Router names the field and what is wrong
        # with it, as over HTTP. (It writes non-finite floats as NaN/Infinity; those are refused
        # by name below.)
        try:
            data = json.dumps(_plain_keys(body), separators=(",", ":"), default=_numpy_value).encode()
        except (TypeError, ValueError) as why:   # (the json module's message names the type)
            raise TypeError(f"params must hold JSON values (str, int, float, bool, None, lists, dicts): {why}") from None
    if b"null" in data or b"NaN" in data or b"Infinity" in data:
        found = _non_finite(body, "")
        if found is not None:
            path, value = found
            raise router.error("invalid_request", f"`{path}` must be a finite number; got {value}.", path)
    return data


def _plain_keys(value: Any) -> Any:
    """`value` with numpy numbers as dict keys made Python's (neither JSON writer takes them)."""
    if isinstance(value, dict):
        return {(k.item() if isinstance(k, np.generic) else k): _plain_keys(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain_keys(v) for v in value]
    return value


def _numpy_value(value: Any) -> Any:
    """numpy's numbers and arrays as Python's (the json module's `default`)."""
    if isinstance(value, (np.generic, np.ndarray)):
        return value.tolist()
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _non_finite(value: Any, path: str) -> tuple[str, float] | None:
    """The path (as the Router names params: `a.b[2]`) and value of the first NaN or infinite
    float in `value`, or None."""
    if isinstance(value, (float, np.floating)):
        return None if math.isfinite(value) else (path, float(value))
    if isinstance(value, dict):
        items = ((f"{path}.{k}" if path else str(k), v) for k, v in value.items())
    elif isinstance(value, (list, tuple, np.ndarray)):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    for sub, v in items:
        if (found := _non_finite(v, sub)) is not None:
            return found
    return None


def _name_the_request(router: Router, endpoint: str, err: ApiError, index: int,
                      whole: dict[str, Any] | None, bodies: list[dict[str, Any]]) -> None:
    """Request `index` of a call's `bodies` failed with `err`, whose `param` speaks of that
    request alone. Raise the error the call's prompts give as one request (it names the prompt:
    `prompt[2]`), or else note which request it was (unless the error is about a field every
    request shares, such as one `temperature` for all)."""
    field = None if err.param is None else err.param.split("[")[0].split(".")[0]
    if field is not None and field not in ("prompt", "messages"):
        if all(body.get(field) == bodies[index].get(field) for body in bodies):
            return
    elif whole is not None:
        try:
            router.prepare(endpoint, _encode(router, whole))
        except ApiError as named:
            if named.param is not None and named.param.startswith(f"prompt[{index}]"):
                named.add_note(f"(in prompt {index} of the call, counting from 0)")
                raise named from None
    kind = "conversation" if endpoint == "chat" else "prompt"
    err.add_note(f"(in {kind} {index} of the call, counting from 0)")


def _prompt_list(prompts: object) -> list[str | list[int]]:
    """`generate`'s prompts as a list of prompts: one prompt (a str, token ids, or vLLM's
    `{"prompt": str}` / `{"prompt_token_ids": ids}`), or a list of them. TypeError naming the
    first that is none of these."""
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, dict):
        return [_vllm_prompt(prompts, "prompts")]
    if isinstance(prompts, np.ndarray) and prompts.ndim == 1 and prompts.dtype.kind not in "UO":
        # one prompt (an empty one is refused as the server refuses it)
        if (ids := token_ids(prompts)) is None:
            raise TypeError(f"token ids must be integers; got an array of {prompts.dtype}")
        return [ids]
    if isinstance(prompts, np.ndarray) and prompts.ndim == 1:
        prompts = prompts.tolist()   # (strs: a list of prompts, as a DataFrame column gives them)
    if not isinstance(prompts, (list, tuple, np.ndarray)) or (isinstance(prompts, np.ndarray) and prompts.ndim != 2):
        kind = f"a {prompts.ndim}-d array" if isinstance(prompts, np.ndarray) else type(prompts).__name__
        raise TypeError(f"prompts must be a str, token ids, a vLLM prompt dict, or a list of these; got {kind}")
    if len(prompts) and (ids := token_ids(prompts)) is not None:
        return [ids]
    if len(prompts) and all(isinstance(t, numbers.Number) for t in prompts):
        i, t = next((i, t) for i, t in enumerate(prompts) if not integer(t))
        raise TypeError(f"token ids must be integers; prompts[{i}] is {type(t).__name__}")
    if any(map(integer, prompts)):
        i = next(i for i, t in enumerate(prompts) if integer(t))
        raise TypeError(f"prompts mixes token ids with other items (prompts[{i}] is an integer): give one "
                        "prompt's token ids (integers only), or a list of prompts (strs or lists of token ids)")
    out: list[str | list[int]] = []
    for i, p in enumerate(prompts):
        if isinstance(p, dict):
            out.append(_vllm_prompt(p, f"prompts[{i}]"))
            continue
        item = p if isinstance(p, str) else token_ids(p)
        if item is None:
            kind = type(p).__name__
            if isinstance(p, (list, tuple)):
                kind = next(f"a {type(p).__name__} holding a {type(t).__name__}" for t in p if not integer(t))
            raise TypeError(f"prompts[{i}] must be a str, token ids (integers) or a vLLM prompt dict; got {kind}")
        out.append(item)
    return out


def _vllm_prompt(p: dict, where: str) -> str | list[int]:
    """vLLM's TextPrompt (`{"prompt": str}`) or TokensPrompt (`{"prompt_token_ids": ids}`)."""
    if set(p) == {"prompt"} and isinstance(p["prompt"], str):
        return p["prompt"]
    if set(p) == {"prompt_token_ids"} and (ids := token_ids(p["prompt_token_ids"])) is not None:
        return ids
    raise TypeError(f"{where} must be {{'prompt': str}} or {{'prompt_token_ids': token ids}} (vLLM's text and "
                    f"tokens prompts; other keys, such as multi_modal_data, are not taken); got keys {sorted(p)}")


def _fields(params: object, endpoint: str) -> object:
    """`params` with each SamplingParams as the request fields it stands for (see
    SamplingParams.request_fields); anything else as it is, for _params_each to check."""
    if isinstance(params, SamplingParams):
        return params.request_fields(endpoint)
    if isinstance(params, (list, tuple)):
        return [p.request_fields(endpoint) if isinstance(p, SamplingParams) else p for p in params]
    return params


def _params_each(params: object, count: int, name: str, item: str = "prompt") -> list[dict[str, Any]]:
    """The params of each of `count` requests: `params` for all, or a list of one per request
    (each a dict or None). TypeError for anything else, or a list of another length."""
    def checked(p: object, where: str) -> dict[str, Any]:
        if p is not None and not isinstance(p, dict):
            raise TypeError(f"params{where} must be a dict of request fields by OpenAI's names (max_tokens, "
                            f"temperature, ...), a SamplingParams or None; got {type(p).__name__}")
        _own_argument(p, name)
        return p or {}
    if isinstance(params, (list, tuple)):
        if len(params) != count:
            raise TypeError(f"params is a list of {len(params)} for {count} {item}s: give one per {item}, or one "
                            f"for all")
        return [checked(p, f"[{i}]") for i, p in enumerate(params)]
    return [checked(params, "")] * count


def _routing(model: str, lora_request: Any, priority: Any, count: int, item: str) -> list[dict[str, Any]]:
    """Each request's `model` and `priority` from vLLM's keywords: `lora_request` (None, a
    `LoRARequest` or anything with its `lora_name`, or a list of one per request) runs a
    request on the LoRA adapter of that name, as the `model` field names one (served from
    `LLM(lora_modules=[...])`, or found in its `lora_resolver_dir`; any other name fails as
    the route's 404 does); `priority` (a list of one integer per request) is the request's
    `priority` field."""
    def per_request(value: Any, name: str) -> list[Any]:
        if isinstance(value, (list, tuple)):
            if len(value) != count:
                raise ValueError(f"{name} is a list of {len(value)} for {count} {item}s: give one per {item}")
            return list(value)
        return [value] * count
    out = []
    for lora, rank in zip(per_request(lora_request, "lora_request"), per_request(priority, "priority")):
        body: dict[str, Any] = {"model": model}
        if lora is not None:
            name = getattr(lora, "lora_name", None) or getattr(lora, "name", None)
            if not isinstance(name, str):
                raise TypeError(f"lora_request must be a LoRARequest (with its lora_name) or None; got "
                                f"{type(lora).__name__}")
            body["model"] = name
        if rank is not None:
            body["priority"] = rank
        out.append(body)
    return out


def _own_argument(params: dict[str, Any] | None, name: str, position: str = "first") -> None:
    """`params` may not also carry what the call's `position` argument gives."""
    if params and name in params:
        raise TypeError(f"pass the {name} as the {position} argument, not as params[{name!r}]")


def _pooling_fields(params: object, pooling_params: object, truncate_prompt_tokens: int | None,
                    first: str) -> dict[str, Any]:
    """The request fields of `embed`'s or `score`'s params (a `PoolingParams` or a dict, given
    as `params` or by vLLM's keyword `pooling_params`) and vLLM's `truncate_prompt_tokens`
    keyword; `first` names the call's first argument, which the params may not also carry."""
    params = _one_of(params, pooling_params, "pooling_params")
    if isinstance(params, PoolingParams):
        params = params.request_fields()
    if params is not None and not isinstance(params, dict):
        raise TypeError(f"params must be a PoolingParams, a dict of request fields or None; got {type(params).__name__}")
    fields = dict(params or {})
    _own_argument(fields, first)
    if truncate_prompt_tokens is not None:
        _own_argument(fields, "truncate_prompt_tokens", "keyword")
        fields["truncate_prompt_tokens"] = truncate_prompt_tokens
    return fields


def _one_of(params: object, keyword: object, name: str = "sampling_params") -> object:
    """The call's params, given as `params` or by vLLM's keyword for them (`name`), not both."""
    if params is not None and keyword is not None:
        raise TypeError(f"pass the params once: as params or as {name} (vLLM's name), not both")
    return keyword if params is None else params


def _result(endpoint: str, body: dict[str, Any], ignored: tuple[str, ...],
            token_text: Callable[[int], str] | None = None, logprobs_k: int = 0,
            ran_as: tuple[str, list[list[int]]] = ("", [])) -> Result:
    """The Result of one request's response `body`; `ran_as`: the engine's id of the request and
    its prompts' token ids."""
    choices = body.get("choices", [])
    if endpoint == "chat":
        texts = [c["message"].get("content") or "" for c in choices]
    else:
        texts = [c["text"] for c in choices]
    return Result(texts, [c.get("finish_reason") for c in choices], body.get("usage", {}), body, ignored,
                  token_text=token_text, logprobs_k=logprobs_k, engine_id=ran_as[0], prompt_token_lists=ran_as[1])
