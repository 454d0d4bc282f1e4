"""Configuration: one frozen dataclass per concern, defaults written once.

The CLI (`llmserve run --help`) is generated from these fields: each field's metadata holds
its help text, and flag names follow vLLM's where the meaning is the same. Environment
variables are read for two things only: the API key (LLMSERVE_API_KEY) and the log level
(LLMSERVE_LOG_LEVEL), both in cli.py.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import types
import typing
import urllib.parse
from dataclasses import dataclass, field


# The largest integer a flag without a bound of its own takes.
_MOST = 2**31 - 1

# generation_config.json's sampling keys that --override-generation-config may set: a check of
# the value and what it must be (a request's range for the field it is the default of).
_GENERATION_KEYS = {
    "temperature": (lambda v: 0 <= v <= 2, "a number from 0 to 2"),
    "top_p": (lambda v: 0 <= v <= 1, "a number from 0 to 1"),
    "top_k": (lambda v: isinstance(v, int) and (v == -1 or v >= 0), "an integer, -1 or 0 for off"),
    "min_p": (lambda v: 0 <= v <= 1, "a number from 0 to 1"),
    "repetition_penalty": (lambda v: v > 0, "a finite number above 0"),
    "max_new_tokens": (lambda v: isinstance(v, int) and 1 <= v <= _MOST, f"an integer from 1 to {_MOST}"),
}


def _f(default, help: str, **meta):
    """A dataclass field whose metadata carries its CLI help, and what a value must be:
    `choices`, `min` (inclusive), `max` (inclusive), `above` (exclusive lower bound), with
    `memory` the bounds apply to the size the text names (`parse_bytes`); tuples' items
    must not be empty, begin or end with whitespace, or repeat. None (not set) is always allowed where it is the
    default."""
    if isinstance(default, (list, tuple)):
        return field(default=tuple(default), metadata={"help": help, **meta})
    return field(default=default, metadata={"help": help, **meta})


def _json_object(text: str | None, flag: str, example: str) -> dict:
    """A flag's JSON object as a dict ({} when the flag is not given); ValueError naming the
    flag otherwise."""
    if text is None:
        return {}
    try:
        values = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{flag} must be a JSON object: {exc}") from None
    if not isinstance(values, dict):
        raise ValueError(f"{flag} must be a JSON object such as '{example}'")
    return values


def _kind_error(value: object, tp: object) -> str | None:
    """What `value` should have been, if it is not of the field type `tp` (`int | None`,
    `tuple[str, ...]`, ...): ints pass as floats, bools never as numbers."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        tp = args[0]
    if typing.get_origin(tp) is tuple or tp is tuple:
        item = (typing.get_args(tp) or (object,))[0]
        if not isinstance(value, tuple):
            return "a tuple"
        return next((f"a tuple whose items are each {what}" for v in value if (what := _kind_error(v, item))), None)
    if tp is bool:
        return None if isinstance(value, bool) else "a boolean"
    if isinstance(value, bool):
        return {int: "an integer", float: "a number", str: "a string"}.get(tp)  # type: ignore[call-overload]
    if tp is int:
        return None if isinstance(value, int) else "an integer"
    if tp is float:
        return None if isinstance(value, (int, float)) else "a number"
    if tp is str:
        return None if isinstance(value, str) else "a string"
    return None


# vLLM's values of flags llmserve has that llmserve serves under its own name: taken as it,
# and said so (a vLLM command line starts unchanged).
_VLLM_VALUES = {
    ("reasoning_parser", "deepseek_r1"): "think",
    ("reasoning_parser", "qwen3"): "think",
}
# vLLM's other names for a value, which mean exactly it: taken as it.
_SYNONYMS = {
    ("dtype", "half"): "float16",
    ("dtype", "float"): "float32",
    ("generation_config", "vllm"): "none",   # (no file: the defaults of the server, OpenAI's here)
}


class _Checked:
    """Checks each field against its metadata when a section is built (from the CLI or by an
    embedding application), so a bad value fails at once with the flag's name instead of
    leaving a server that reports ready and fails every request."""

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value, meta = getattr(self, f.name), f.metadata
            if value is None:
                continue
            flag = "--" + f.name.replace("_", "-")
            if meta.get("memory"):
                ok = isinstance(value, (str, int)) and not isinstance(value, bool)
                what = None if ok else "a size such as '2GiB', or a number of bytes"
            else:
                what = _kind_error(value, hints[f.name])
            if what is not None:
                got = f"a {type(value).__name__}" if meta.get("secret") else repr(value)
                raise TypeError(f"{flag} ({f.name}) must be {what}; got {got}")
            if isinstance(value, tuple):
                if any(not str(v).strip() for v in value):
                    raise ValueError(f"{flag} must not be empty")
                # NOTE: a name or key with blank ends could never match what a client sends
                # (HTTP trims header values; clients trim names), and a repeat is a typo.
                # (a secret's value stays out of the message: it would reach the logs)
                def shown(v: object) -> str:
                    return "a value" if meta.get("secret") else repr(v)
                if blank := next((v for v in value if str(v) != str(v).strip()), None):
                    raise ValueError(f"{flag} must not begin or end with whitespace; got {shown(blank)}")
                # (a newline or escape in a name splits log lines, and no route can name it;
                # an invisible one cannot be told apart when typed)
                if odd := next((v for v in value if not str(v).isprintable()), None):
                    raise ValueError(f"{flag} must hold no control or invisible characters; got {shown(odd)}")
                if len(set(value)) < len(value):
                    twice = next(v for i, v in enumerate(value) if v in value[:i])
                    if meta.get("secret"):
                        raise ValueError(f"{flag}: the same value is given more than once")
                    raise ValueError(f"{flag} {shown(twice)} is given more than once")
                continue
            if (f.name, value) in _SYNONYMS:
                value = _SYNONYMS[f.name, value]
                object.__setattr__(self, f.name, value)
            elif (f.name, value) in _VLLM_VALUES:
                ours = _VLLM_VALUES[f.name, value]
                logging.getLogger("llmserve").info("%s %s: vLLM's name; served as %s here", flag, value, ours)
                value = ours
                object.__setattr__(self, f.name, value)
            choices = meta.get("choices")
            if choices is not None and value not in choices:
                hint = ""
                if meta.get("bare") and ("/" in str(value) or str(value).endswith(".gguf")):
                    # (`--flag MODEL`: the flag took the model)
                    hint = f" ({flag} alone is {meta['bare']}: give the model before it)"
                # (a vLLM user typed the flag's vLLM name: say both)
                named = f"{flag} ({meta['alias']})" if meta.get("alias") else flag
                raise ValueError(f"{named} must be one of {', '.join(map(str, choices))}; got {value!r}{hint}")
            if meta.get("memory"):
                try:
                    value = parse_bytes(value)
                except ValueError as exc:
                    raise ValueError(f"{flag}: {exc}") from None
            low, high, above = meta.get("min"), meta.get("max"), meta.get("above")
            if (high is None and isinstance(value, int) and not isinstance(value, bool) and not meta.get("memory")
                    and value > _MOST):
                # (counts and sizes go to the Rust core as 32-bit or machine integers)
                raise ValueError(f"{flag} must be at most {_MOST}; got {value}")
            if ((low is not None and value < low) or (high is not None and value > high)
                    or (above is not None and not value > above)):
                bounds = [f"at least {low}"] if low is not None else []
                bounds += [f"greater than {above}"] if above is not None else []
                bounds += [f"at most {high}"] if high is not None else []
                got = getattr(self, f.name)
                shown = f"{got} ({value} bytes)" if meta.get("memory") and got != value else f"{got}"
                raise ValueError(f"{flag} must be {' and '.join(bounds)}; got {shown}")


@dataclass(frozen=True)
class ModelConfig(_Checked):
    model: str | None = _f(
        None,
        "Model to serve: a Hugging Face model folder, a .gguf file, or a hub id. "
        "Omitted: the embedded default SmolLM2-135M-Instruct.",
        positional=True,
    )
    served_model_name: tuple[str, ...] = _f(
        (), "Name(s) clients use in `model`, every one an alias: several after the flag (as vLLM takes "
        "them; give the model first then) or the flag repeated.", append=True, several=True
    )
    lora_modules: tuple[str, ...] = _f(
        (), "LoRA adapters (PEFT folders) served beside the model, each under its own name: NAME=PATH, "
        "or vLLM's JSON form {\"name\": NAME, \"path\": PATH} (several after the flag, or the flag "
        "repeated). A request whose `model` is NAME runs through that adapter; requests for different "
        "adapters and the base model share steps (up to --max-loras adapters).", append=True, several=True
    )
    max_loras: int = _f(
        0, "Most LoRA adapters among the sequences running at once (vLLM's flag; a step runs one "
        "pass per adapter in it): a request for another adapter waits until one drains, and requests for "
        "adapters behind it wait too so it is not starved (the base model's do not). 0 (the default, unlike "
        "vLLM's 1): no bound, since every adapter is held in memory anyway.", min=0
    )
    allow_runtime_lora_updating: bool = _f(
        False, "Open vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter, which load and unload "
        "LoRA adapters while the server runs (VLLM_ALLOW_RUNTIME_LORA_UPDATING=true also does). A client "
        "with the API key can then make the server read any adapter folder it can see, or fetch one from "
        "the Hugging Face Hub."
    )
    lora_resolver_dir: str | None = _f(
        None, "A folder of PEFT LoRA adapters, one per subfolder named as clients name the adapter: a request "
        "whose `model` is no served name but a subfolder here whose adapter_config.json says it is made for "
        "this model (base_model_name_or_path: a served name, or the model as given) loads it first, and it "
        "is served from then on (vLLM's filesystem LoRA resolver; VLLM_LORA_RESOLVER_CACHE_DIR also sets it)."
    )
    max_logprobs: int = _f(
        20, "Most alternatives a request's logprobs may ask for (`top_logprobs`, completions' `logprobs`, "
        "`prompt_logprobs`): a larger k is a 400. 20 is OpenAI's and vLLM's; -1: the vocabulary (vLLM's).",
        min=-1,
    )
    max_model_len: int | None = _f(None, "Context length (prompt + output); default: the model's. As vLLM "
                                   "takes it, 32k is 32000 and 32K 32768; at least 2 (a prompt token and "
                                   "an output).", min=2, human=True)
    dtype: str = _f(
        "auto", "Weight dtype: auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16, float16.",
        choices=("auto", "float32", "bfloat16", "float16"),
    )
    chat_template: str | None = _f(
        None, "Chat template: a file path or the template text; overrides the model's own."
    )
    chat_template_content_format: str = _f(
        "auto",
        "Message content shape the template expects: 'string' (list-of-parts content is joined "
        "with newlines), 'openai' (string content is passed as one text part), or 'auto' (detected from the template; a "
        "template detected as walking parts gets string content as sent if it shows it, else as one part).",
        choices=("auto", "string", "openai"),
    )
    parse_special_tokens_in_messages: bool = _f(
        False, "A special token's text in a chat message (such as '<|im_end|>') is that token, as "
        "transformers and vLLM tokenize a rendered chat. By default it is text, as OpenAI reads message "
        "content: a message cannot end its turn or open another role's.")
    generation_config: str = _f(
        "auto",
        "Sampling defaults: 'auto' uses the model's generation_config.json, 'none' (vLLM's 'vllm') "
        "ignores it, or a folder: its generation_config.json in place of the model's (vLLM's flag). Its "
        "sampling keys are read (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens); "
        "the model's EOS ids stay the model's.",
    )
    override_generation_config: str | None = _f(
        None, "Sampling defaults as JSON, vLLM's flag ('{\"temperature\": 0.5, \"max_new_tokens\": 256}'): "
        "generation_config.json's keys (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens), "
        "over the model's file (or alone, with --generation-config none). Request values still win.")
    default_chat_template_kwargs: str | None = _f(
        None, "chat_template_kwargs every chat request renders with, as a JSON object (vLLM's flag): "
        "'{\"enable_thinking\": false}' turns a Qwen3-style model's thinking off unless a request "
        "turns it on. A request's own chat_template_kwargs win key by key.")
    revision: str | None = _f(None, "Hub revision when MODEL is a hub id.")
    tokenizer_revision: str | None = _f(None, "Hub revision of --tokenizer when it is a hub id (vLLM's flag).")
    hf_overrides: str | None = _f(
        None, "config.json keys to replace, as a JSON object (vLLM's flag), before the model is built: "
        "'{\"max_position_embeddings\": 4096}', '{\"rope_scaling\": {...}}'. Each key replaces the model's "
        "whole value (a GGUF file's config, made from its metadata, too).")
    tokenizer: str | None = _f(
        None, "Serve the model with another folder's (or hub id's) tokenizer, as vLLM's flag: its "
        "tokenizer.json, chat template and special tokens (the model's EOS stays). Mostly for a GGUF "
        "file, with the tokenizer of the model it was made from; its vocabulary must be the model's.")
    download_dir: str | None = _f(
        None, "Where a hub MODEL is fetched and cached (vLLM's flag); default: huggingface_hub's cache "
        "(HF_HUB_CACHE or HF_HOME set it too).")
    tool_call_format: str | None = _f(
        None,
        "How the model writes tool calls: 'hermes' (<tool_call>{json}</tool_call>), "
        "'llama3_json' ([<|python_tag|>]{\"name\", \"parameters\"}, several joined by '; '), "
        "'mistral' ([TOOL_CALLS][{\"name\", \"arguments\"}, ...]), 'qwen3_xml' (alias "
        "'qwen3_coder': <tool_call><function=NAME><parameter=KEY>VALUE</parameter></function>"
        "</tool_call>) or 'json' (a bare {\"name\", \"arguments\"} object, or an array of them). "
        "Default: detected from the chat template ('qwen3_xml' if it mentions <function=, else "
        "'hermes' for <tool_call>, else 'mistral' for [TOOL_CALLS], else "
        "'llama3_json' for <|python_tag|>, 'Environment: ipython' or '\"parameters\": '); "
        "otherwise 'json' for forced tool_choice and plain text under 'auto'.",
        choices=("hermes", "llama3_json", "mistral", "qwen3_xml", "qwen3_coder", "json"),
        alias="--tool-call-parser",   # vLLM's name (the same values)
    )
    reasoning_parser: str | None = _f(
        None,
        "How chat output's reasoning is split out: 'think' (text between <think> and </think> "
        "goes to reasoning and reasoning_content, not content) or 'none'. Default: 'think' when the chat "
        "template mentions <think>, else none. vLLM's 'deepseek_r1' and 'qwen3' are taken as 'think'.",
        choices=("think", "none"),
    )
    fim: bool = _f(
        True,
        "Serve /v1/completions' `suffix` (fill-in-the-middle) when the vocabulary has a FIM "
        "token set (<|fim_prefix|>/<|fim_suffix|>/<|fim_middle|>: Qwen2.5-Coder, CodeGemma; "
        "<fim_prefix>/...: StarCoder2, Granite Code; DeepSeek-Coder's): the prompt is laid out "
        "prefix, suffix, middle and the model writes the middle. Off: `suffix` is a 400.",
    )
    pooling: str | None = _f(
        None,
        "How /v1/embeddings pools the model's final (normed) hidden states: 'last' (the last "
        "token's, what decoder embedding models are trained for) or 'mean' (every token's). "
        "Default: the model folder's sentence-transformers pooling (modules.json), else 'last'.",
        choices=("last", "mean"),
    )
    quantized_decode: bool = _f(
        True,
        "GGUF models on CPU in float32: decode steps of at most 24 sequences read the file's "
        "weights as Q8_0/Q4_0/Q4_1 blocks instead of their float32 copies (about 6x less memory "
        "traffic per token; K-quant and Q5 blocks are converted at load, Q4_K to Q4_1 and the "
        "others to Q8_0, and every step then computes with the converted values); other steps "
        "(prompts, bigger decode batches) run their layer matmuls in bfloat16 on CPUs with "
        "native bf16 (AVX512_BF16 or AMX: about 2x faster; the LM head too in those decode "
        "batches, float32 in prompt steps), else in float32. Off: the file's own values in "
        "float32 in every step.",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        names = [name for name, _, _ in self.lora_adapters()]
        if twice := next((n for n in names if names.count(n) > 1), None):
            raise ValueError(f"--lora-modules names {twice!r} twice: each name must say which adapter a request "
                             "runs through")
        if clash := next((n for n in names if n in self.served_model_name), None):
            raise ValueError(f"--lora-modules names {clash!r}, which is also a --served-model-name: each name must "
                             "say which model a request runs on")
        if self.lora_resolver_dir is not None and not os.path.isdir(self.lora_resolver_dir):
            raise ValueError(f"--lora-resolver-dir {self.lora_resolver_dir!r} is not a folder")
        t = self.chat_template
        # NOTE: text without any Jinja markup would render every conversation as that text:
        # it is a path that does not exist (a typo), not a template.
        if t is not None and not os.path.isfile(t) and not any(m in t for m in ("{{", "{%", "{#")):
            raise ValueError(f"--chat-template {t!r} is neither a readable file nor a Jinja template")
        self.generation_file()        # (checked now: a bad one stops the start, not a request)
        self.generation_overrides()
        self.config_overrides()
        self.template_kwargs()
        if t is not None and os.path.isfile(t):
            # read now, so a bad file is named before the model loads, not after
            try:
                with open(t, encoding="utf-8") as fh:
                    fh.read()
            except (OSError, UnicodeDecodeError) as exc:
                raise ValueError(f"--chat-template {t!r} cannot be read as UTF-8 text: {exc}") from None


    def config_overrides(self) -> dict:
        """--hf-overrides as a dict (ValueError unless it is a JSON object)."""
        return _json_object(self.hf_overrides, "--hf-overrides", '{"max_position_embeddings": 4096}')

    def template_kwargs(self) -> dict:
        """--default-chat-template-kwargs as a dict (ValueError unless it is a JSON object)."""
        return _json_object(self.default_chat_template_kwargs, "--default-chat-template-kwargs",
                            '{"enable_thinking": false}')

    def generation_file(self) -> dict | None:
        """The generation_config.json of the folder --generation-config names, as a dict; None
        for 'auto' and 'none' (ValueError naming what is wrong with the folder or its file)."""
        folder = self.generation_config
        if folder in ("auto", "none"):
            return None
        flag = "--generation-config"
        if not os.path.isdir(folder):
            raise ValueError(f"{flag} must be auto, none or a folder holding a generation_config.json; "
                             f"{folder!r} is not a folder")
        path = os.path.join(folder, "generation_config.json")
        try:
            with open(path, encoding="utf-8") as fh:
                values = json.load(fh)
        except FileNotFoundError:
            raise ValueError(f"{flag}: the folder {folder!r} has no generation_config.json") from None
        except (OSError, ValueError) as exc:
            raise ValueError(f"{flag}: {path!r} cannot be read as JSON: {exc}") from None
        if not isinstance(values, dict):
            raise ValueError(f"{flag}: {path!r} must hold a JSON object")
        return values

    def generation_overrides(self) -> dict:
        """--override-generation-config as a dict of generation_config.json keys, each value
        in the range a request's field takes (ValueError naming what is wrong otherwise)."""
        flag = "--override-generation-config"
        values = _json_object(self.override_generation_config, flag, '{"temperature": 0.5}')
        for key, value in values.items():
            check = _GENERATION_KEYS.get(key)
            if check is None:
                raise ValueError(f"{flag}: {key!r} is not one of {', '.join(_GENERATION_KEYS)}")
            number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if not number or not check[0](value):
                raise ValueError(f"{flag}: {key} must be {check[1]}, got {value!r}")
        return values

    def lora_adapters(self) -> list[tuple[str, str, str | None]]:
        """--lora-modules as (name, path, base model name) triples, in the order given (an
        adapter's index in a step is its place here plus one); the base model name (the JSON
        form's `base_model_name`, which /v1/models shows as the adapter's `parent`) or None."""
        out = []
        for spec in self.lora_modules:
            if spec.startswith("{"):
                try:
                    entry = json.loads(spec)
                    name, path, parent = entry["name"], entry["path"], entry.get("base_model_name")
                except (ValueError, KeyError, TypeError, AttributeError):
                    raise ValueError(f"--lora-modules {spec!r}: the JSON form is {{\"name\": NAME, \"path\": "
                                     "PATH}") from None
                if not all(isinstance(v, str) for v in (name, path, parent or "")):
                    raise ValueError(f"--lora-modules {spec!r}: `name`, `path` and `base_model_name` must be "
                                     "strings")
                if set(entry) - {"name", "path", "base_model_name"}:
                    raise ValueError(f"--lora-modules {spec!r}: only `name`, `path` and `base_model_name` "
                                     "are read")
            else:
                (name, sep, path), parent = spec.partition("="), None
                if not sep:
                    raise ValueError(f"--lora-modules {spec!r}: give NAME=PATH (the name clients send as "
                                     "`model`, then the adapter's folder); if it is the model, give it first "
                                     "(llmserve run MODEL --lora-modules NAME=PATH ...)")
            if not name.strip() or not path.strip() or name != name.strip():
                raise ValueError(f"--lora-modules {spec!r}: the name and the path must not be empty or "
                                 "begin or end with whitespace")
            out.append((name, path, parent))
        return out


@dataclass(frozen=True)
class CacheConfig(_Checked):
    block_size: int = _f(16, "Tokens per KV-cache block.", min=1)
    kv_cache_memory: str | None = _f(
        None, "Memory for the KV cache (512MiB, 4GiB, or bytes: 4G and 4g are vLLM's 2^30 and 10^9 "
        "times 4) when --num-kv-blocks is not given. Default: 2GiB on CPU; on CUDA what "
        "--gpu-memory-utilization leaves, which a size given here replaces.",
        memory=True, above=0, alias="--kv-cache-memory-bytes",
    )
    num_kv_blocks: int | None = _f(None, "KV-cache blocks (overrides --kv-cache-memory).", min=1)
    kv_cache_dtype: str = _f(
        "auto", "What the KV cache holds: auto (the model's dtype), or, on CPU, bfloat16, fp8 (E4M3), "
        "fp8_e4m3 or fp8_e5m2: the same memory then holds 2x (bfloat16) or 4x (fp8, against float32) "
        "the tokens, and decode attention reads less, at some precision (values are rounded with no "
        "scale, as vLLM's default of 1.0).",
        choices=("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"),
    )
    gpu_memory_utilization: float = _f(
        0.9,
        "CUDA only: fraction of the GPU's memory this server may use (weights, activations, "
        "KV cache); the KV cache gets what is left. --num-kv-blocks overrides.",
        above=0, max=1,
    )
    enable_prefix_caching: bool = _f(True, "Reuse KV blocks of shared prompt prefixes.")


# The KV cache on CPU when --kv-cache-memory is not given (on CUDA, --gpu-memory-utilization
# sizes it).
DEFAULT_CPU_KV_CACHE = "2GiB"

# The step token budget when --max-num-batched-tokens is not given. NOTE: 2048 keeps a CPU step
# (two cores) short enough to interleave prompts with decoding; on a GPU a step of 2048 tokens
# admits two ~1,000-token prompts at a time, which starves a burst of new requests.
DEFAULT_BATCHED_TOKENS = {"cpu": 2048, "cuda": 8192}


@dataclass(frozen=True)
class SchedulerConfig(_Checked):
    max_num_seqs: int = _f(64, "Most sequences in one step.", min=1)
    max_num_batched_tokens: int | None = _f(
        None, "Most tokens in one step (long prompts are chunked); default: 2048 on CPU, 8192 on CUDA "
        "(vLLM's for an API server on H100-class GPUs).", min=1)
    long_prefill_token_threshold: int = _f(
        0, "Most of one prompt's tokens a step computes (vLLM's flag): a long prompt then takes several "
        "steps of this many, and the rest of each step's --max-num-batched-tokens goes to the other prompts "
        "waiting, which start (and answer their first token) beside it rather than after it. 0: a prompt "
        "takes all the step has room for (fastest for the long prompt).", min=0)
    max_waiting: int = _f(
        2048, "Sequences waiting to start (one per prompt, sampled choice or embeddings input), beyond the "
        "step's free slots (--max-num-seqs less those running), that new requests may not push past: they "
        "get 503 + Retry-After (400 if one request alone needs more than this plus --max-num-seqs), and the "
        "room a refused request lacked is held 3 s for its retry. The "
        "default takes one request of OpenAI's most embeddings inputs (2048).", min=1)
    scheduling_policy: str = _f(
        "priority", "fcfs or priority (the request field `priority`; lower runs first).",
        choices=("fcfs", "priority"),
    )
    async_scheduling: str = _f(
        "auto",
        "Plan each step while the model runs the one before, and commit it while the next "
        "runs: on, off, or auto (on for CUDA; off on CPU, where the model already has the "
        "cores and there is nothing to overlap).",
        choices=("auto", "on", "off"),
        bare="on",   # (`--async-scheduling` alone, and `--no-async-scheduling`, as vLLM's flag)
    )
    stream_interval: int = _f(
        1, "Streams send a chunk once this many tokens have come since the last one (vLLM's flag): "
        "a stream's first tokens and its end go at once, and a step's tokens always go together, one "
        "chunk per choice. More than 1 sends fewer, larger chunks: less server work per token at many "
        "streams, at a coarser pace.", min=1)
    speculative_config: str | None = _f(
        None, "Speculative decoding as JSON, vLLM's flag, with its n-gram (prompt lookup) method: "
        "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, "
        "\"prompt_lookup_min\": 2}'. A decoding sequence whose last n tokens (n from max down to min; "
        "both 5 when neither is given, one copies the other) occurred before in its prompt or output "
        "drafts the up to num_speculative_tokens (at most 64) that followed them, and one step checks them "
        "all: each draft the model's own sample confirms saves a step. Each token is sampled as decoding "
        "would sample it (the same output bit for bit on CPU with a GGUF model, such as the default); it "
        "pays off where the output repeats its input (edits, extraction, code), for few streams at a time. A grammar (response_format, "
        "forced tools) and thinking_token_budget mask each draft row after the drafts before it; beam "
        "search decodes without drafts. No draft model: other methods are refused.")

    def __post_init__(self) -> None:
        super().__post_init__()
        self.speculation()   # (checked now: a bad one stops the start)

    def speculation(self) -> dict | None:
        """--speculative-config as {"num_tokens", "lookup_min", "lookup_max"}, or None when it
        is not given; ValueError naming what is wrong otherwise (vLLM's rules for the n-gram
        method)."""
        flag = "--speculative-config"
        values = _json_object(self.speculative_config, flag, '{"method": "ngram", "num_speculative_tokens": 4}')
        if not values:
            return None
        method, model = values.get("method"), values.get("model")
        if method is None and model in ("ngram", "[ngram]"):
            method = "ngram"      # (vLLM's older form)
        elif model is not None:
            raise ValueError(f"{flag}: `model` {model!r}: there is no draft model; the n-gram method drafts "
                             "from the sequence's own tokens")
        if method is None:
            raise ValueError(f"{flag}: `method` is required: \"ngram\" (prompt lookup), the one method served")
        if method != "ngram":
            raise ValueError(f"{flag}: `method` {method!r}: only \"ngram\" (prompt lookup) is served; there is "
                             "no draft model (eagle, medusa, mtp, ...)")
        if unread := set(values) - {"method", "model", "num_speculative_tokens", "prompt_lookup_max",
                                    "prompt_lookup_min"}:
            raise ValueError(f"{flag}: {', '.join(sorted(unread))}: the n-gram method reads only method, "
                             "num_speculative_tokens, prompt_lookup_max and prompt_lookup_min")

        def whole(key: str, most: int = _MOST) -> int | None:
            v = values.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= most):
                raise ValueError(f"{flag}: {key} must be a whole number from 1 to {most}, got {v!r}")
            return v

        # (at most 64 drafts: a step checks them all)
        num = whole("num_speculative_tokens", 64)
        if num is None:
            raise ValueError(f"{flag}: num_speculative_tokens is required (how many drafts a step checks)")
        high, low = whole("prompt_lookup_max"), whole("prompt_lookup_min")
        if high is None and low is None:
            high = low = 5
        high, low = high or low, low or high
        if low > high:
            raise ValueError(f"{flag}: prompt_lookup_min={low} must be <= prompt_lookup_max={high}")
        return {"num_tokens": num, "lookup_min": low, "lookup_max": high}


@dataclass(frozen=True)
class DeviceConfig(_Checked):
    device: str = _f("auto", "auto, cpu or cuda.", choices=("auto", "cpu", "cuda"))
    threads: int | None = _f(None, "Torch CPU threads for the engine (default: all cores).", min=1)
    seed: int = _f(0, "Seed of the engine's random stream (requests without `seed`).", min=0, max=2**63 - 1)
    batch_invariant: bool = _f(
        False,
        "CPU float32 only: a request's output no longer depends on what else is in the batch "
        "(other requests, its row, how its prompt is chunked). Costs prompt throughput: every "
        "linear runs row by row and every prompt token attends alone (README.md: measured "
        "cost).",
    )
    enforce_eager: bool = _f(
        False,
        "CUDA only: run every step eagerly, capturing no CUDA graphs (vLLM's flag): a faster "
        "start and less GPU memory, slower steps.",
    )
    cudagraph_capture_sizes: tuple[int, ...] = _f(
        (), "CUDA only: the decode batch sizes captured as CUDA graphs (vLLM's flag; several after the flag, "
        "or the flag repeated); a decode step runs at the smallest one that holds its sequences, padded, "
        "and one of more sequences than the largest runs eagerly. Default: 1, 2, 4, 8, then every 16 up "
        "to --max-cudagraph-capture-size.", append=True, several=True,
    )
    max_cudagraph_capture_size: int | None = _f(
        None, "CUDA only: the largest decode batch the default sizes capture (vLLM's flag); larger steps "
        "run eagerly. Default: --max-num-seqs.", min=1,
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in self.cudagraph_capture_sizes):
            raise ValueError(f"--cudagraph-capture-sizes must be whole numbers of at least 1; got "
                             f"{list(self.cudagraph_capture_sizes)}")

    def capture_sizes(self, max_num_seqs: int) -> list[int] | None:
        """The decode batch sizes to capture: those --cudagraph-capture-sizes names up to
        `max_num_seqs` (no step holds more; empty when none is), else None for the default sizes
        up to --max-cudagraph-capture-size (or `max_num_seqs`)."""
        if self.cudagraph_capture_sizes:
            return sorted(b for b in self.cudagraph_capture_sizes if b <= max_num_seqs)
        if self.max_cudagraph_capture_size is None:
            return None
        return default_capture_sizes(min(self.max_cudagraph_capture_size, max_num_seqs))


@dataclass(frozen=True)
class ServerConfig(_Checked):
    host: str = _f("127.0.0.1", "Address to bind.")
    port: int = _f(8000, "Port to bind (0: any free port).", min=0, max=65535)
    uds: str | None = _f(
        None, "Serve on this Unix domain socket instead of --host/--port (vLLM's flag): for a proxy or "
        "sidecar on the same machine. Created at start (a stale socket file left there is replaced), "
        "mode 0666 as uvicorn makes it, and removed at exit.")
    api_key: tuple[str, ...] = _f(
        (), "API key(s) required on every route but /health, /ready, /metrics (repeatable; also "
        "LLMSERVE_API_KEY, comma separated, or vLLM's VLLM_API_KEY, one key).",
        append=True, secret=True,
    )
    admin_api_key: tuple[str, ...] = _f(
        (), "Mount the admin routes (POST /reset_prefix_cache) behind these key(s) of their own "
        "(repeatable; also LLMSERVE_ADMIN_API_KEY, comma separated): an --api-key does not open them, nor "
        "do they open the API. Without one the routes do not exist.",
        append=True, secret=True,
    )
    max_body_bytes: int = _f(8 * 1024 * 1024, "Largest request body accepted (413 above).", min=1)
    strict_fields: bool = _f(False, "Reject accepted-but-inert and unknown fields with 400.")
    enable_force_include_usage: bool = _f(
        False, "Every streamed chat and completion ends with its usage chunk, as `stream_options: "
        "{\"include_usage\": true}` asks (vLLM's flag).")
    return_tokens_as_token_ids: bool = _f(
        False, "Logprobs name each token `token_id:<id>` unless a request's `return_tokens_as_token_ids` says "
        "otherwise (vLLM's flag).")
    responses_store_mib: int = _f(
        64, "MiB of /v1/responses answers kept in memory for previous_response_id and GET "
        "/v1/responses/{id} (oldest forgotten first), and as much again for /v1/conversations and for "
        "chat completions kept by `store: true`; 0 keeps none.", min=0,
    )
    sse_keep_alive: float | None = _f(
        None, "Send an SSE comment on a stream idle this many seconds (at least 0.1).", min=0.1
    )
    access_log: bool = _f(True, "Log one line per request (with `user` when sent).",
                          off_alias="--disable-uvicorn-access-log")
    disable_access_log_for_endpoints: str | None = _f(
        None, "Paths whose requests the access log leaves out, comma separated and matched exactly, without "
        "the query (vLLM's flag): '/health,/metrics,/ping' for a load balancer's probes.")
    enable_log_requests: bool = _f(
        False, "Log what each generation request asks for, as vLLM's flag does: its id, prompt text, resolved "
        "sampling parameters, prompt token ids and the model name it asked for (at INFO, logger llmserve.requests). Prompts are "
        "private data: off by default.", off_alias="--disable-log-requests")
    enable_log_outputs: bool = _f(
        False, "With --enable-log-requests, also log what each generation answered when it ends (vLLM's flag): "
        "each choice's text and tool calls, its finish reason and token count (logger llmserve.requests; "
        "--max-log-len bounds the text).")
    max_log_len: int | None = _f(
        None, "With --enable-log-requests, log at most this many characters of a prompt and this many of its "
        "token ids (vLLM's flag); unset: all.", min=0)
    uvicorn_log_level: str | None = _f(
        None, "uvicorn's own log level (vLLM's flag; default warning); llmserve's is LLMSERVE_LOG_LEVEL. "
        "Given as warning or above, it also quiets the access log's lines, as it quiets uvicorn's "
        "access log under vLLM.",
        choices=("critical", "error", "warning", "info", "debug", "trace"),
    )
    root_path: str = _f(
        "", "The path prefix a reverse proxy serves llmserve under and strips before passing requests on "
        "(ASGI's root_path, as vLLM's flag sets it)")
    ssl_certfile: str | None = _f(None, "Serve HTTPS with this certificate (PEM; vLLM's flag).")
    ssl_keyfile: str | None = _f(None, "The certificate's private key (PEM), when --ssl-certfile does not hold it.")
    ssl_ca_certs: str | None = _f(None, "CA certificates (PEM) that client certificates are checked against.")
    ssl_cert_reqs: int = _f(
        0, "Client certificates: 0 not asked for, 1 checked when sent, 2 required (Python's ssl.CERT_*).",
        choices=(0, 1, 2),
    )
    allowed_origins: tuple[str, ...] = _f(
        (), "Origins whose web pages may call the API (CORS; repeatable; '*' for any; 'null' for "
        "file:// pages). As browsers send them: scheme://host[:port], lowercase. None by "
        "default: browsers then refuse other origins' pages the responses.", append=True,
    )
    allowed_methods: tuple[str, ...] = _f(
        (), "HTTP methods those pages may use (CORS; repeatable; '*' for any; vLLM's flag). Default: GET, POST "
        "and DELETE, the methods of llmserve's routes.", append=True,
    )
    allowed_headers: tuple[str, ...] = _f(
        (), "Request headers those pages may send (CORS; repeatable; vLLM's flag). Default: any ('*').",
        append=True,
    )
    allow_credentials: bool = _f(False, "Let those pages send cookies and HTTP authentication (CORS; vLLM's flag).")
    enable_request_id_headers: bool = _f(
        False, "Every response carries an `x-request-id` header (vLLM's flag): the client's own "
        "`X-Request-Id` when it sent a plain one (generations too), else the response id or a fresh "
        "id. Without it, generation and error responses carry one (the response id), and other "
        "routes none.")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.enable_log_outputs and not self.enable_log_requests:
            raise ValueError("--enable-log-outputs needs --enable-log-requests (as vLLM's does)")
        if self.ssl_certfile is None and (self.ssl_keyfile or self.ssl_ca_certs or self.ssl_cert_reqs):
            raise ValueError("--ssl-keyfile, --ssl-ca-certs and --ssl-cert-reqs need --ssl-certfile (the "
                             "server's certificate)")
        if self.uds == "":
            raise ValueError("--uds must name the socket's path (left out, the server listens on --host/--port)")
        if self.ssl_cert_reqs and self.ssl_ca_certs is None:
            # (without them no client certificate checks out: every handshake would fail)
            raise ValueError(f"--ssl-cert-reqs {self.ssl_cert_reqs} needs --ssl-ca-certs: the CA certificates "
                             "client certificates are checked against")
        for flag, path in (("--ssl-certfile", self.ssl_certfile), ("--ssl-keyfile", self.ssl_keyfile),
                           ("--ssl-ca-certs", self.ssl_ca_certs)):
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"{flag} {path!r} is not a file")
        for method in self.allowed_methods:
            if method != "*" and not (method.isalpha() and method.isupper()):
                raise ValueError(f"--allowed-methods {method!r} is not an HTTP method (GET, POST, ...) or '*'")
        for origin in self.allowed_origins:
            if origin not in ("*", "null") and (canonical := _as_origin(origin)) != origin:
                hint = f"; did you mean {canonical!r}?" if canonical else ""
                raise ValueError(
                    f"--allowed-origins {origin!r} is not an origin as browsers send it (scheme://host or "
                    f"scheme://host:port, lowercase, no path or default port){hint}")
        for path in self.quiet_paths():
            if not path.startswith("/") or "?" in path:
                raise ValueError(f"--disable-access-log-for-endpoints {path!r} is not a path (such as /health; "
                                 "matched without the query)")

    def logs_access(self) -> bool:
        """Whether requests get access-log lines: --access-log, unless --uvicorn-log-level was
        given at warning or above (vLLM's access lines are uvicorn's, at info)."""
        return self.access_log and self.uvicorn_log_level in (None, "info", "debug", "trace")

    def quiet_paths(self) -> frozenset[str]:
        """The paths the access log leaves out (--disable-access-log-for-endpoints)."""
        text = self.disable_access_log_for_endpoints or ""
        return frozenset(p.strip() for p in text.split(",") if p.strip())


def _as_origin(text: str) -> str | None:
    """`text` as a browser serializes an origin (what the Origin header holds, and what CORS
    compares byte for byte), or None when it names no origin at all."""
    try:
        u = urllib.parse.urlsplit(text)
        port = u.port
    except ValueError:
        return None
    if not u.scheme or not u.hostname or u.username is not None or u.password is not None:
        return None
    scheme = u.scheme.lower()
    host = f"[{u.hostname}]" if ":" in u.hostname else u.hostname
    default = {"http": 80, "https": 443}.get(scheme)
    return f"{scheme}://{host}" + (f":{port}" if port is not None and port != default else "")


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    server: ServerConfig = field(default_factory=ServerConfig)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            want = f.default_factory   # (the section's class)
            if not isinstance(getattr(self, f.name), want):
                raise TypeError(f"Config.{f.name} must be a {want.__name__} (llmserve.config), "
                                f"got {type(getattr(self, f.name)).__name__}")


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
# vLLM's one-letter size suffixes (its human_readable_int): powers of 1000 in lower case, of 1024
# in upper case.
VLLM_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """The decode batch sizes CUDA graphs capture by default: 1, 2, 4, 8, then every 16 up to
    max_num_seqs (padding wastes at most 15 rows)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


def env_switch(name: str) -> bool:
    """An on/off environment variable of ours: "1" on; "0", empty or unset off; anything else
    a ValueError naming it (the GPU path's experimental switches, LLMSERVE_FUSED_OPS and the like)."""
    value = os.environ.get(name, "").strip() or "0"
    if value not in ("0", "1"):
        raise ValueError(f"{name}={value!r}: expected 0 or 1")
    return value == "1"


def parse_bytes(text: str | int) -> int:
    """'2GiB' -> 2147483648. Plain numbers are bytes (also as an int); vLLM's one-letter suffixes
    are powers of 1000 in lower case (4g) and of 1024 in upper case (4G)."""
    if isinstance(text, int):
        return text
    if m := re.fullmatch(r"\s*([0-9]*\.?[0-9]+)([kmgtKMGT])\s*", text):
        return int(float(m.group(1)) * VLLM_SUFFIXES[m.group(2)])
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a memory size: {text!r} (try 512MiB or 4GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
