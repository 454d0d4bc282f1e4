"""`llmserve run [MODEL]`: the command line, generated from the config dataclasses."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import re
import signal
import sys
import types
import typing
from fractions import Fraction
from pathlib import Path

from llmserve.config import VLLM_SUFFIXES, Config

_ENV_API_KEY = "LLMSERVE_API_KEY"
_ENV_ADMIN_API_KEY = "LLMSERVE_ADMIN_API_KEY"
_ENV_LOG_LEVEL = "LLMSERVE_LOG_LEVEL"
# vLLM's variable for its keys: read when neither --api-key nor LLMSERVE_API_KEY gives any, so
# a deployment moved over from vLLM does not serve open.
_ENV_VLLM_API_KEY = "VLLM_API_KEY"
# vLLM's switch for POST /v1/load_lora_adapter and /v1/unload_lora_adapter ("1" or "true").
_ENV_VLLM_RUNTIME_LORA = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
# vLLM's filesystem LoRA resolver's folder (--lora-resolver-dir).
_ENV_VLLM_LORA_RESOLVER = "VLLM_LORA_RESOLVER_CACHE_DIR"

# vLLM's `--api-key K1 K2` puts its second key where llmserve reads MODEL (never echoed)
_ONE_KEY = "--api-key takes one key: repeat the flag for each (--api-key K1 --api-key K2)"

# `vllm serve` flags that mean nothing here: accepted, each saying why it has no effect.
_VLLM_NO_OPS = {
    "--trust-remote-code": "llmserve runs no code from model repositories; it serves the architectures "
                           "README.md lists",
    "--enable-auto-tool-choice": "tool_choice \"auto\" is always on (the tool-call format comes from the chat "
                                 "template or --tool-call-format)",
    "--enable-lora": "LoRA adapters are served whenever --lora-modules names some",
    "--fully-sharded-loras": "llmserve runs a model on one device",
    "--disable-log-stats": "nothing is logged periodically (the stats are /metrics and /load)",
    "--enable-chunked-prefill": "prompts longer than a step's token budget (--max-num-batched-tokens) are always "
                                "prefilled in chunks",
    "--enable-prompt-tokens-details": "usage always has prompt_tokens_details (cached_tokens)",
    "--enable-server-load-tracking": "the load is always tracked (GET /load, /metrics)",
    "--disable-fastapi-docs": "llmserve serves no API docs pages",
    "--disable-custom-all-reduce": "llmserve runs a model on one device",
    "--disable-frontend-multiprocessing": "the HTTP server and the engine always share one process (the engine "
                                          "on its own thread)",
    "--log-error-stack": "an unexpected error (a 500) is always logged with its stack; other errors are "
                         "answers to the client, not the server's faults",
    "--exclude-tools-when-tool-choice-none": "under tool_choice \"none\" the tools are never rendered",
    "--enable-reasoning": "the reasoning parser is on whenever the chat template opens <think> (or "
                          "--reasoning-parser think says so)",
    "--enable-expert-parallel": "llmserve runs a model on one device",
    "--use-tqdm-on-load": "the start logs what it loads, without progress bars",
    "--disable-cascade-attn": "llmserve has no cascade attention",
    "--disable-mm-preprocessor-cache": "llmserve serves text models: there is no multimodal preprocessor",
    "--skip-mm-profiling": "llmserve serves text models: nothing multimodal is profiled",
    "--disable-chunked-mm-input": "llmserve serves text models: there is no multimodal input to chunk",
    "--disable-hybrid-kv-cache-manager": "one KV-cache manager serves every layer (sliding-window layers keep "
                                         "their blocks as the others do)",
    "--enable-offline-docs": "llmserve serves no API docs pages",
    "--calculate-kv-scales": "an fp8 KV cache (`--kv-cache-dtype fp8`) stores values unscaled (vLLM's default "
                             "scale of 1.0): there are no scales to calculate",
}
# ... and those that take a value (a size or count that only bounds what vLLM serves).
_VLLM_VALUE_NO_OPS = {
    "--max-lora-rank": "adapters of any rank are served (each is checked against the model at start)",
    "--max-cpu-loras": "every LoRA adapter served is held in memory at once (--max-loras bounds how many run "
                       "at once)",
    "--swap-space": "a sequence preempted when the KV cache runs out recomputes its tokens: nothing is swapped "
                    "to CPU memory",
    "--guided-decoding-backend": "structured output always runs on llguidance (response_format, structured_outputs, "
                                 "forced tool calls)",
    "--max-parallel-loading-workers": "the weights are read in one pass",
    "--prefix-caching-hash-algo": "a cached block is reused only when its tokens, and every token before "
                                  "them, match exactly: the hash only finds the candidates",
    "--mm-processor-cache-gb": "llmserve serves text models: there is no multimodal preprocessor cache",
    "--code-revision": "llmserve runs no code from model repositories",
}
# ... and those accepted only with the value that asks for what llmserve does anyway (any other
# value stops it with the flag's _VLLM_HINTS line).
_VLLM_NEUTRAL = {
    "--tensor-parallel-size": "1", "-tp": "1", "--pipeline-parallel-size": "1",
    "--lora-dtype": "auto", "--load-format": "auto", "--tokenizer-mode": "auto",
    "--response-role": "assistant",
    "--data-parallel-size": "1", "--preemption-mode": "recompute", "--logprobs-mode": "raw_logprobs",
    "--num-scheduler-steps": "1",
    # (every model serves generation and pooling alike: /v1/embeddings, /score and /rerank pool
    # its hidden states, --pooling says how)
    "--runner": ("auto", "generate", "pooling"), "--convert": ("auto", "none", "embed"),
    "--task": ("auto", "generate", "embed", "embedding"),
}
# NOTE: --model-impl, --api-server-count and --config-format stop it even at vLLM's defaults:
# taken, they would change what argparse reads an abbreviation as (`--model` would be
# --model-impl, `--api` ambiguous, `--conf` too).
# `vllm serve` flags llmserve does not take, and what to do instead (said when one is given).
_VLLM_HINTS = {
    "--tensor-parallel-size": "llmserve runs a model on one device",
    "-tp": "llmserve runs a model on one device",
    "--pipeline-parallel-size": "llmserve runs a model on one device",
    "--quantization": "GGUF files are served in their own blocks (K-quant/Q5 ones converted to Q8_0/Q4_1 at load); there is no switch",
    "--lora-dtype": "LoRA adapters compute in the model's dtype (--dtype)",
    "--load-format": "the weights are read in the format of the model's files (safetensors or GGUF)",
    "--no-enable-chunked-prefill": "prompts longer than --max-num-batched-tokens are always prefilled in "
                                   "chunks; raise it to prefill them whole",
    "--tokenizer-mode": "the model's own tokenizer.json runs in HF tokenizers (Rust)",
    "--response-role": "an answer's role is always OpenAI's `assistant`",
    "--tool-parser-plugin": "the tool-call parsers are built in (Hermes, Qwen3-Coder XML, Llama-3 JSON, "
                            "Mistral): --tool-call-format picks one",
    "--disable-sliding-window": "sliding-window layers attend over their window, as the model was trained; "
                                "to keep every token in reach, set --max-model-len to the window (what "
                                "vLLM's flag does)",
    "--data-parallel-size": "one process serves one model on one device: run replicas behind a load balancer "
                            "(GET /ready and /load are for it)",
    "--api-server-count": "one HTTP server shares the process with the engine: run replicas behind a load "
                          "balancer for more",
    "--model-impl": "the architectures README.md lists run llmserve's own model code",
    "--config-format": "a model folder's config.json (or a GGUF file's metadata) is read",
    "--preemption-mode": "a sequence preempted when the KV cache runs out recomputes its tokens",
    "--logprobs-mode": "logprobs are the model's raw ones, before logit_bias, penalties and temperature "
                       "(vLLM's raw_logprobs)",
    "--num-scheduler-steps": "each step is planned on its own (--async-scheduling plans one ahead)",
    "--enable-sleep-mode": "there is no sleep mode: stop the server to free its memory (it starts again in "
                           "seconds for small models)",
    "--trust-request-chat-template": "a request never brings its own chat template: set the server's with "
                                     "--chat-template",
    "--reasoning-config": "the thinking is read between <think> and </think> (--reasoning-parser); "
                          "thinking_token_budget closes it after as many tokens",
    "--structured-outputs-config": "structured output always runs on llguidance, with no options",
    "--cpu-offload-gb": "the weights stay on the device: --dtype, or a GGUF file's quantization, makes them smaller",
    "--middleware": "mount llmserve's ASGI app in your own and add the middleware there",
    "--allowed-local-media-path": "llmserve serves text models: images, audio and video in a request are a 400",
    "--limit-mm-per-prompt": "llmserve serves text models: images, audio and video in a request are a 400",
    "--mm-processor-kwargs": "llmserve serves text models: images, audio and video in a request are a 400",
    "--compilation-config": "nothing is compiled with torch.compile; CUDA decode steps replay CUDA graphs unless "
                            "--enforce-eager",
    "-O": "nothing is compiled with torch.compile; CUDA decode steps replay CUDA graphs unless --enforce-eager",
    "--enable-prompt-embeds": "prompts are text or token ids",
    "--kv-transfer-config": "one process prefills and decodes; there is no KV transfer between instances",
    "--otlp-traces-endpoint": "there is no tracing: /metrics has Prometheus metrics, --enable-log-requests logs "
                              "each request",
    "--num-gpu-blocks-override": "--num-kv-blocks sets how many KV-cache blocks there are",
    "--scheduler-cls": "the scheduler is built in; --scheduling-policy picks fcfs or priority",
    "--max-num-partial-prefills": "prompts are prefilled side by side as --max-num-batched-tokens allows; "
                                  "--long-prefill-token-threshold caps one prompt's share of a step",
    "--hf-token": "set HF_TOKEN in the environment (huggingface_hub reads it)",
    "--tool-server": "built-in tools (web search, code interpreter, ...) are not run here: clients run "
                     "function tools",
    "--max-seq-len-to-capture": "CUDA graphs capture decode steps of up to --max-num-seqs sequences",
    "--log-config-file": "LLMSERVE_LOG_LEVEL sets the log level, --uvicorn-log-level uvicorn's",
    "--runner": "every model serves generation (chat, completions) and pooling (/v1/embeddings, /score, "
                "/rerank, pooled as --pooling says) at once; there is no draft model",
    "--convert": "/v1/embeddings pools any model's final hidden states (--pooling); there are no "
                 "classification or reward heads",
    "--task": "every model serves generation (chat, completions) and pooling (/v1/embeddings, /score, "
              "/rerank) at once; there are no classification, reward or transcription heads",
    "--headless": "the engine and the HTTP server run in one process: there is no engine without it",
    "--attention-backend": "attention runs on llmserve's own kernels on CUDA (csrc/) and torch on CPU",
    "--logits-processors": "there are no logits-processor plugins: logit_bias, allowed_token_ids, bad_words "
                           "and structured output shape the logits",
    "--reasoning-parser-plugin": "the reasoning parser is built in (--reasoning-parser think)",
    "--max-long-partial-prefills": "long prompts are prefilled in chunks of --max-num-batched-tokens",
    "--enable-tokenizer-info-endpoint": "POST /tokenize and /detokenize serve the tokenizer; GET /v1/models "
                                        "gives max_model_len",
    "--kv-offloading-size": "the KV cache stays on the device; a preempted sequence recomputes",
    "--kv-offloading-backend": "the KV cache stays on the device; a preempted sequence recomputes",
    "--skip-tokenizer-init": "the tokenizer always loads: prompts are rendered and answers detokenized here",
    "--tokens-only": "the tokenizer always loads; POST /inference/v1/generate (tokens in, tokens out) is "
                     "always served",
    "--distributed-executor-backend": "llmserve runs a model on one device, in one process",
    "--mamba-ssm-cache-dtype": "llmserve serves no Mamba models",
    "--mamba-cache-dtype": "llmserve serves no Mamba models",
    "--pooler-config": "--pooling says how /v1/embeddings pools (last or mean)",
}


def _base_type(tp):
    """int | None -> int; tuple[str, ...] -> str."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _base_type(args[0])
    if origin is tuple:
        return typing.get_args(tp)[0]
    return tp


class _Several(argparse.Action):
    """`--flag a b` and `--flag a --flag b` alike (vLLM's nargs="+"); also keeps each
    occurrence's values (`<dest>/groups`), so a model written after the names can be told."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, [*(getattr(namespace, self.dest) or []), *values])
        groups = getattr(namespace, self.dest + "/groups", None) or []
        setattr(namespace, self.dest + "/groups", [*groups, list(values)])


def _human_int(text: str) -> int:
    """An integer, or one with vLLM's suffixes: k/m/g/t are powers of 1000, K/M/G/T of 1024 (25.6k
    is 25600)."""
    m = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)([kmgtKMGT]?)", text)
    value = Fraction(m.group(1)) * VLLM_SUFFIXES.get(m.group(2), 1) if m else None   # (exact: 32.2k is 32200)
    if value is None or value.denominator != 1:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a whole number (such as 4096, 32k or 32K)")
    return int(value)


def _add_section(parser: argparse.ArgumentParser, section: str, cls) -> None:
    group = parser.add_argument_group(section)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        meta = f.metadata
        tp = _human_int if meta.get("human") else _base_type(hints[f.name])
        dest = f"{section}.{f.name}"
        help_text = meta.get("help", "")
        if meta.get("positional"):
            group.add_argument(dest, nargs="?", default=f.default, metavar=f.name.upper(), help=help_text)
            continue
        flag = "--" + f.name.replace("_", "-")
        flags = (flag, meta["alias"]) if meta.get("alias") else (flag,)
        if meta.get("bare"):   # (`--flag` alone gives `bare`, `--no-flag` "off")
            group.add_argument(flag, dest=dest, nargs="?", const=meta["bare"], type=tp, default=f.default,
                               metavar=f.name.upper(), help=help_text + f" (default: {f.default}; alone: "
                               f"{meta['bare']})")
            group.add_argument("--no-" + flag[2:], dest=dest, action="store_const", const="off",
                               help=f"{flag} off")
        elif tp is bool:
            on_off = "" if f.default is None else f" (default: {'on' if f.default else 'off'})"
            group.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction,
                               default=f.default, help=help_text + on_off)
            if meta.get("off_alias"):   # (vLLM's name for `--no-flag`)
                group.add_argument(meta["off_alias"], dest=dest, action="store_const", const=False,
                                   default=f.default, help=f"--no-{flag[2:]} (vLLM's name for it)")
        elif meta.get("several"):   # (`--flag a b`, as vLLM's nargs="+", and `--flag a --flag b`)
            group.add_argument(flag, dest=dest, action=_Several, nargs="+", type=tp, default=None,
                               metavar=f.name.upper(), help=help_text)
        elif meta.get("append"):
            group.add_argument(flag, dest=dest, action="append", type=tp, default=None,
                               metavar=f.name.upper(), help=help_text)
        else:
            default_text = "" if f.default is None else f" (default: {f.default})"
            alias_text = f" ({meta['alias']}, vLLM's name, is the same flag)" if meta.get("alias") else ""
            group.add_argument(*flags, dest=dest, type=tp, default=f.default, metavar=f.name.upper(),
                               help=help_text + default_text + alias_text)


def build_parser() -> argparse.ArgumentParser:
    from llmserve import __version__

    parser = argparse.ArgumentParser(prog="llmserve", description="OpenAI-compatible LLM server")
    parser.add_argument("--version", action="version", version=f"llmserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    # Defaults are written into each flag's help (none for flags without one).
    # (a short usage line: the generated one lists every flag, some 90 lines above each error)
    # (`serve`: vLLM's verb, which its users type)
    run = sub.add_parser("run", aliases=["serve"], help="Serve a model over HTTP (OpenAI API).",
                         usage="llmserve run [MODEL] [flags]   (llmserve run --help lists them)")
    batch = sub.add_parser(
        "run-batch", help="Run a file of OpenAI batch requests (JSONL) offline, as vllm run-batch.",
        usage="llmserve run-batch [MODEL] -i FILE -o FILE [flags]   (llmserve run-batch --help lists them)",
        description="Each input line is {\"custom_id\", \"method\": \"POST\", \"url\", \"body\"} for "
                    "/v1/chat/completions, /v1/completions, /v1/embeddings, /v1/score or /v1/rerank; each output "
                    "line answers the input line at the same place with {\"id\", \"custom_id\", \"response\": "
                    "{\"status_code\", \"request_id\", \"body\"}, \"error\"}. The model and engine flags are `run`'s.")
    batch.add_argument("-i", "--input-file", required=True, help="The requests, one JSON object a line ('-': stdin).")
    batch.add_argument("-o", "--output-file", required=True, help="Where the answers go ('-': stdout).")
    hints = typing.get_type_hints(Config)
    for command in (run, batch):
        command.set_defaults(run_parser=command)
        # (read by `_config_file` before parsing; listed here for --help)
        command.add_argument("--config", metavar="FILE.yaml",
                             help="vLLM's: flags from a YAML mapping of flag names to values (`port: 8001`, "
                                  "`served-model-name: [a, b]`, `async-scheduling: false`); the command line's "
                                  "own flags win")
        # (the file's `model`, taken when the command line names none)
        command.add_argument("--config-model", help=argparse.SUPPRESS)
        command.add_argument("--model", dest="model_flag", metavar="MODEL",
                             help="vLLM's spelling of the MODEL argument (its Docker image's, and its API "
                                  "server module's): the same model")
        for f in dataclasses.fields(Config):
            _add_section(command, f.name, hints[f.name])
        vllm = command.add_argument_group("vLLM's flags that have no effect here (accepted, and said so)")
        for flag, why in _VLLM_NO_OPS.items():
            vllm.add_argument(flag, dest="vllm_no_ops", action="append_const", const=flag, help=why)
        for flag, why in _VLLM_VALUE_NO_OPS.items():
            vllm.add_argument(flag, dest=f"vllm_value/{flag}", metavar="N", help=why)
        for flag, value in _VLLM_NEUTRAL.items():
            taken = _taken(flag)
            metavar = taken[0].upper() if len(taken) == 1 else "{" + ",".join(taken) + "}"
            vllm.add_argument(flag, dest=f"vllm_neutral/{flag}", metavar=metavar,
                              help=f"only {_neutral(flag)}: {_VLLM_HINTS[flag]}")
    return parser


def _spread(values: list[str] | None) -> list[str] | None:
    """--allowed-origins (-methods, -headers) values, vLLM's JSON list form
    ('["https://a.example"]') spread out."""
    out = []
    for value in values or ():
        listed = None
        if value.lstrip().startswith("["):
            try:
                listed = json.loads(value)
            except ValueError:
                pass
        ok = isinstance(listed, list) and all(isinstance(v, str) for v in listed)
        out.extend(listed if ok else [value])
    return out or None


def config_from_args(ns: argparse.Namespace) -> Config:
    values = vars(ns)
    for key in ("server.allowed_origins", "server.allowed_methods", "server.allowed_headers"):
        values[key] = _spread(values.get(key))
    hints = typing.get_type_hints(Config)
    sections = {}
    for f in dataclasses.fields(Config):
        cls = hints[f.name]
        kwargs = {}
        for sf in dataclasses.fields(cls):
            v = values.get(f"{f.name}.{sf.name}", sf.default)
            if sf.metadata.get("append"):
                v = tuple(v) if v else sf.default
            kwargs[sf.name] = v
        sections[f.name] = cls(**kwargs)
    cfg = Config(**sections)
    if cfg.model.model is None:
        # `llmserve run --served-model-name a MODEL`: the flag takes several names, so a model
        # written after them is one more name, and the default model would be served under it
        for group in values.get("model.served_model_name/groups") or ():
            for name in group[1:]:
                if name.endswith(".gguf") or os.path.exists(name) or "/" in name:
                    raise ValueError(f"--served-model-name took {name!r} as a second name; if it is the model, "
                                     "give it first (llmserve run MODEL --served-model-name NAME ...), else "
                                     "repeat the flag for each name (--served-model-name a --served-model-name b)")
    if (admin := _env_keys(_ENV_ADMIN_API_KEY, "--admin-api-key", cfg.server.admin_api_key)) is not None:
        cfg = dataclasses.replace(cfg, server=dataclasses.replace(cfg.server, admin_api_key=admin))
    if (keys := _env_keys(_ENV_API_KEY, "--api-key", cfg.server.api_key)) is not None:
        cfg = dataclasses.replace(cfg, server=dataclasses.replace(cfg.server, api_key=keys))
    elif not cfg.server.api_key and (vllm_key := os.environ.get(_ENV_VLLM_API_KEY, "")):
        # one key, as vLLM reads it (empty: none, as there)
        if vllm_key.strip() != vllm_key or not vllm_key.isprintable():
            raise ValueError(f"{_ENV_VLLM_API_KEY} must hold no surrounding whitespace or control characters")
        logging.getLogger("llmserve").info("API key from %s (vLLM's variable; llmserve's is %s)",
                                           _ENV_VLLM_API_KEY, _ENV_API_KEY)
        cfg = dataclasses.replace(cfg, server=dataclasses.replace(cfg.server, api_key=(vllm_key,)))
    if set(cfg.server.admin_api_key) & set(cfg.server.api_key):
        raise ValueError("an --admin-api-key must be a key of its own, not also an --api-key")
    resolver = os.environ.get(_ENV_VLLM_LORA_RESOLVER, "")
    if resolver and cfg.model.lora_resolver_dir is None:
        logging.getLogger("llmserve").info("LoRA adapters resolved from %s (%s; llmserve's flag is "
                                           "--lora-resolver-dir)", resolver, _ENV_VLLM_LORA_RESOLVER)
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, lora_resolver_dir=resolver))
    runtime_lora = os.environ.get(_ENV_VLLM_RUNTIME_LORA, "").strip().lower()
    if runtime_lora in ("1", "true") and not cfg.model.allow_runtime_lora_updating:
        logging.getLogger("llmserve").info("runtime LoRA updating on: %s is set (vLLM's variable; llmserve's "
                                           "flag is --allow-runtime-lora-updating)", _ENV_VLLM_RUNTIME_LORA)
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, allow_runtime_lora_updating=True))
    return cfg


def vllm_off(name: str, value: object) -> bool:
    """Whether `value` of vLLM's engine option `name`, one llmserve does not take
    (`quantization`, `cpu_offload_gb`, `enable_sleep_mode`), turns it off (None, False, 0),
    asking for nothing that llmserve does not do."""
    flag = "--" + name.replace("_", "-")
    return flag in _VLLM_HINTS and flag not in _VLLM_NEUTRAL and (value is None or value is False or (
        isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0))


def vllm_option(name: str, value: object) -> str:
    """vLLM's engine option `name` (an `LLM(...)` keyword: a flag's name with underscores) that
    has no effect here, as its flag has none on `llmserve run`: why not. ValueError for a value
    that asks for what llmserve does not do (`tensor_parallel_size=2`), and TypeError for a
    vLLM option llmserve does not take (`quantization`), each with what to do instead."""
    flag = "--" + name.replace("_", "-")
    if flag in _VLLM_NO_OPS:
        return _VLLM_NO_OPS[flag]
    if flag in _VLLM_VALUE_NO_OPS:
        return _VLLM_VALUE_NO_OPS[flag]
    if flag in _VLLM_NEUTRAL:
        if str(value).lower() not in _taken(flag):
            raise ValueError(f"{name}={value!r}: {_VLLM_HINTS[flag]} (only {_neutral(flag)} "
                             f"{'is' if len(_taken(flag)) == 1 else 'are'} taken)")
        return _VLLM_HINTS[flag]
    if flag in _VLLM_HINTS:
        raise TypeError(f"option {name!r} is vLLM's: {_VLLM_HINTS[flag]}")
    raise TypeError(f"unknown option {name!r}")


def _taken(flag: str) -> tuple[str, ...]:
    """The values of a _VLLM_NEUTRAL flag that are taken."""
    neutral = _VLLM_NEUTRAL[flag]
    return (neutral,) if isinstance(neutral, str) else neutral


def _neutral(flag: str) -> str:
    """The values of a _VLLM_NEUTRAL flag that are taken, as the help and errors write them."""
    return ", ".join(_taken(flag))


def _refuse_unknown(parser: argparse.ArgumentParser, argv: list[str], unknown: list[str]) -> None:
    """Exit (status 2) naming what was not understood, with what to do instead of each vLLM
    flag among it. A key given after another --api-key is never echoed."""
    if any(a in unknown for a in _after_keys(argv)):
        parser.error(_ONE_KEY)
    lines = [f"unrecognized arguments: {' '.join(unknown)}"]
    for arg in unknown:
        flag = arg.split("=", 1)[0]
        if re.fullmatch(r"-O[0-9]", flag):   # (vLLM's -O3: the level joined to the flag)
            flag = "-O"
        if flag in _VLLM_HINTS:
            lines.append(f"  {flag} is vLLM's: {_VLLM_HINTS[flag]}")
    parser.error("\n".join(lines))


def _dashed(argv: list[str]) -> list[str]:
    """Flag names written with underscores (`--max_model_len 4096`, `--max_model_len=4096`) in
    their dashed form, as vLLM's parser takes them; values and words after `--` as given."""
    out = []
    for i, a in enumerate(argv):
        if a == "--":
            return out + argv[i:]
        if a.startswith("--") and "_" in a.partition("=")[0]:
            name, eq, value = a.partition("=")
            a = name.replace("_", "-") + eq + value
        out.append(a)
    return out


def _after_keys(argv: list[str]) -> list[str]:
    """The words right after an --api-key flag's value in `argv` that are no flag (vLLM's
    `--api-key K1 K2` puts its second key there), for each spelling argparse takes:
    `--api-key K`, `--api-key=K` and their unambiguous abbreviations (`--api K`)."""
    words = []
    for i, a in enumerate(argv):
        name, eq, _ = a.partition("=")
        if len(name) < 5 or not "--api-key".startswith(name):
            continue
        j = i + 1 if eq else i + 2
        if j < len(argv) and not argv[j].startswith("-"):
            words.append(argv[j])
    return words


def _short_openmp_spin() -> None:
    """Before torch loads: torch's OpenMP workers wait 100k spins (not libgomp's default
    300k) before sleeping after each parallel op, unless the environment says otherwise.

    NOTE: the Rust kernels (attention, the quantized GEMV) run between torch's ops on their
    own threads, and a worker still spinning holds the core one of them needs; one that
    sleeps too soon makes each of a step's torch ops wait for it to wake. Measured on SmolLM2
    on 2 cores (2026-12-05, alternating runs, bf16 matmuls in steps of more than 24
    sequences): 64 streams x 128 tokens over HTTP ~600 tok/s with 100k spins, ~555 with
    300k, ~490 with 10k (offline 513/551 vs 492/514 vs 410/406); 16 streams, single-stream
    decode and a 1,000-token prompt within noise of each other (prompts ~3% slower than with
    10k). 10k was best on 2026-11-30, before those steps ran bf16 matmuls. Only the CLI sets
    it: an embedding application owns its process's environment (and has usually loaded
    torch already)."""
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", "100000")


def _env_keys(variable: str, flag: str, given: tuple[str, ...]) -> tuple[str, ...] | None:
    """The comma-separated keys `variable` holds, unless the flag already gave some (None then,
    or when it is unset; set but empty, it is refused as one holding only commas is: an empty
    variable is a secret that was not filled in, not a wish to serve without keys)."""
    value = os.environ.get(variable)
    if value is None:
        return None
    if given:
        logging.getLogger("llmserve").warning("%s is set, but %s is given: only the flag's keys are used",
                                              variable, flag)
        return None
    keys = tuple(k.strip() for k in value.split(",") if k.strip())
    if not keys:
        # NOTE: an operator who set it asked for keys: serving without any would be open.
        raise ValueError(f"{variable} is set but holds no key (keys are comma separated; unset it to serve "
                         "without keys)")
    if len(set(keys)) < len(keys):
        raise ValueError(f"{variable} holds a key more than once")
    if not all(k.isprintable() for k in keys):
        # (as the flag's own check says it, with the variable's name)
        raise ValueError(f"{variable} must hold no control or invisible characters")
    return keys


def _negations() -> set[str]:
    """The flags that have a `--no-` form (`_add_section` gives one to boolean and `bare`
    fields), for --config's `false`."""
    out = set()
    for cls in typing.get_type_hints(Config).values():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.metadata.get("bare") or (_base_type(hints[f.name]) is bool and not f.metadata.get("human")):
                out.add("--" + f.name.replace("_", "-"))
    return out


def _config_file(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """`argv` with vLLM's `--config FILE` read into it: the YAML file's keys are flag names
    (`port: 8001`, `served-model-name: [a, b]`, `async-scheduling: false`; `_` may stand for
    `-`; `model` is MODEL), placed before the command line's own flags, which win. A list gives
    the flag once per item, a mapping its JSON, `true` the bare flag, `false` its `--no-` form
    (where it has one)."""
    given = [i for i, a in enumerate(argv) if a == "--config" or a.startswith("--config=")]
    if not given:
        return argv
    if len(given) > 1:
        parser.error("--config is given more than once: put every flag in one file")
    at = given[0]
    path = argv[at].partition("=")[2] if "=" in argv[at] else (argv[at + 1] if at + 1 < len(argv) else None)
    rest = argv[:at] + argv[at + (1 if "=" in argv[at] else 2):]
    if not path:
        parser.error("--config needs a YAML file")
    import yaml

    try:
        with open(path, encoding="utf-8") as fh:
            values = yaml.safe_load(fh)
    except (OSError, yaml.YAMLError) as exc:
        parser.error(f"--config {path}: {exc}")
    if not isinstance(values, dict):
        parser.error(f"--config {path}: the file must hold a mapping of flag names to values")
    command = next((i for i, a in enumerate(rest) if a in ("run", "serve", "run-batch")), None)
    if command is None:
        parser.error("--config goes with a command: llmserve run --config FILE")
    options = _negations()
    words: list[str] = []
    for key, value in values.items():
        flag = "--" + str(key).lstrip("-").replace("_", "-")
        if flag in ("--config", "--config-model"):
            parser.error(f"--config {path}: `{key}`: a file cannot name another")
        if value is None or value == [] or value == {}:
            # (`api-key:` left empty would otherwise serve with no key at all)
            parser.error(f"--config {path}: `{key}` holds no value")
        if flag == "--model":
            words += ["--config-model", str(value)]
        elif value is True:
            words.append(flag)
        elif value is False:
            if flag in options:
                words.append(f"--no-{flag[2:]}")
        elif isinstance(value, list):
            for item in value:
                words += [flag, str(item)]
        elif isinstance(value, dict):
            words += [flag, json.dumps(value)]
        elif value is not None:
            words += [flag, str(value)]
    return rest[:command + 1] + words + rest[command + 1:]


def main(argv: list[str] | None = None) -> int:
    """Exit status: 2 for a bad flag or environment value (before anything binds or loads),
    else what `serve` returns."""
    parser = build_parser()
    argv = _dashed(sys.argv[1:] if argv is None else argv)
    argv = _config_file(parser, argv)
    args, unknown = parser.parse_known_args(argv)
    if args.command == "serve":
        args.command = "run"
    if unknown:
        _refuse_unknown(getattr(args, "run_parser", parser), argv, unknown)
    level = os.environ.get(_ENV_LOG_LEVEL, "INFO").upper()
    if level not in logging.getLevelNamesMapping():
        parser.error(f"{_ENV_LOG_LEVEL} must be one of debug, info, warning, error, critical; got {level!r}")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command in ("run", "run-batch"):
        named = vars(args).get("model.model")
        if named is not None and args.model_flag is not None and named != args.model_flag:
            args.run_parser.error(f"two models given: {named} (MODEL) and {args.model_flag} (--model); give one")
        if named is None:
            setattr(args, "model.model", args.model_flag or args.config_model)
        model = vars(args).get("model.model")
        if model and not os.path.exists(model) and "/" not in model and model in _after_keys(argv):
            # `llmserve run --api-key K1 K2`: vLLM's several-keys form put a key where MODEL goes
            args.run_parser.error(_ONE_KEY)
        for flag in _VLLM_NEUTRAL:
            value = vars(args).get(f"vllm_neutral/{flag}")
            if value is not None and value not in _taken(flag):
                args.run_parser.error(f"{flag} {value}: {flag} is vLLM's: {_VLLM_HINTS[flag]} (only {_neutral(flag)} "
                                      f"{'is' if len(_taken(flag)) == 1 else 'are'} taken)")
        try:
            cfg = config_from_args(args)
        except ValueError as exc:
            # (the run command's usage, as argparse's own errors about its flags)
            args.run_parser.error(str(exc))
        for flag in vars(args).get("vllm_no_ops") or ():
            logging.getLogger("llmserve").info("%s has no effect: %s", flag, _VLLM_NO_OPS[flag])
        for flag, why in _VLLM_VALUE_NO_OPS.items():
            if vars(args).get(f"vllm_value/{flag}") is not None:
                logging.getLogger("llmserve").info("%s has no effect: %s", flag, why)
        for flag in _VLLM_NEUTRAL:
            value = vars(args).get(f"vllm_neutral/{flag}")
            if value is not None:
                logging.getLogger("llmserve").info("%s %s has no effect: %s", flag, value, _VLLM_HINTS[flag])
        _short_openmp_spin()
        if args.command == "run-batch":
            for name in _HTTP_ONLY:
                for flag in ("--" + name.replace("_", "-"), "--no-" + name.replace("_", "-")):
                    if any(a == flag or a.startswith(flag + "=") for a in argv):
                        logging.getLogger("llmserve").info("%s has no effect: run-batch serves no HTTP", flag)
            return _run_batch(cfg, args.input_file, args.output_file)
        from llmserve.server.app import serve

        return serve(cfg)
    return 2


# The server section's flags about HTTP itself, which `run-batch` (it binds nothing) names as
# doing nothing; the others (strict fields, usage, logging requests) shape its answers too.
_HTTP_ONLY = ("host", "port", "uds", "api_key", "admin_api_key", "max_body_bytes", "sse_keep_alive", "access_log",
              "disable_access_log_for_endpoints", "uvicorn_log_level", "root_path", "ssl_certfile", "ssl_keyfile",
              "ssl_ca_certs", "ssl_cert_reqs", "allowed_origins", "allowed_methods", "allowed_headers",
              "allow_credentials", "enable_request_id_headers")


class _Terminated(BaseException):
    """SIGTERM, raised where the main thread is, as SIGINT raises KeyboardInterrupt (and, as
    that one, past the engine's `except Exception` that fails a step's sequences)."""


def _terminated(signum, frame) -> None:
    raise _Terminated


def _run_batch(cfg: Config, input_file: str, output_file: str) -> int:
    """`llmserve run-batch`: every line of `input_file` answered in `output_file` (0); 1 when
    the input cannot be read, the output cannot be written or the model cannot be served,
    130 when interrupted (SIGINT), 143 when terminated (SIGTERM: `timeout`, systemd and
    Kubernetes stop a job so). The input is read whole and the files checked before the model
    loads; the output file appears once every line is answered (written beside it, then
    renamed: the input and the output may be one file, and a failed run leaves none)."""
    from llmserve.engine.batch import run_batch
    from llmserve.engine.build import SetupError, build_engine
    from llmserve.loaders import LoadError

    log = logging.getLogger("llmserve")
    partial = None
    on_term = signal.signal(signal.SIGTERM, _terminated)
    try:
        raw = sys.stdin.buffer.read() if input_file == "-" else Path(input_file).read_bytes()
        try:
            lines = raw.decode("utf-8").split("\n")   # (not splitlines: JSON strings may hold U+2028)
        except UnicodeDecodeError as exc:
            line = raw.count(b"\n", 0, exc.start) + 1
            raise LoadError(f"{input_file}: line {line} is not UTF-8 text ({exc.reason})") from None
        if output_file == "-":
            out = sys.stdout
        else:
            if os.path.isdir(output_file):
                raise LoadError(f"{output_file}: is a folder; -o names the file the answers go to")
            partial = f"{output_file}.{os.getpid()}.partial"
            out = os.fdopen(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "w", encoding="utf-8")
        with out if partial else contextlib.nullcontext(out):
            engine = build_engine(cfg)
            counts = {"ok": 0, "failed": 0}
            for answer in run_batch(engine, lines):
                ok = answer["error"] is None and answer["response"]["status_code"] == 200
                counts["ok" if ok else "failed"] += 1
                out.write(json.dumps(answer, ensure_ascii=False) + "\n")
        if partial:
            os.replace(partial, output_file)
            partial = None
    except (OSError, LoadError, SetupError) as exc:
        log.error("run-batch: %s", exc)
        return 1
    except KeyboardInterrupt:
        log.error("run-batch: interrupted; no output written")
        return 130
    except _Terminated:
        log.error("run-batch: terminated; no output written")
        return 143
    finally:
        signal.signal(signal.SIGTERM, on_term)
        if partial:
            with contextlib.suppress(OSError):
                os.unlink(partial)
    answered = counts["ok"] + counts["failed"]
    log.info("run-batch: %d request%s answered, %d of them with an error", answered, "" if answered == 1 else "s",
             counts["failed"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
