"""Configuration: one frozen dataclass per concern, defaults written once.

The CLI (`llmserve run --help`) is generated from these fields: each field's metadata holds
its help text, and flag names follow vLLM's where the meaning is the same. Environment
variables are read for two things only: the API key (LLMSERVE_API_KEY) and the log level
(LLMSERVE_LOG_LEVEL), both in cli.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field


def _f(default, help: str, **meta):
    """A dataclass field whose metadata carries its CLI help."""
    if isinstance(default, (list, tuple)):
        return field(default=tuple(default), metadata={"help": help, **meta})
    return field(default=default, metadata={"help": help, **meta})


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = _f(
        None,
        "Model to serve: a Hugging Face model folder, a .gguf file, or a hub id. "
        "Omitted: the embedded default SmolLM2-135M-Instruct.",
        positional=True,
    )
    served_model_name: tuple[str, ...] = _f(
        (), "Name(s) clients use in `model` (repeatable; every one is an alias).", append=True
    )
    max_model_len: int | None = _f(None, "Context length (prompt + output); default: the model's.")
    dtype: str = _f(
        "auto", "Weight dtype: auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16, float16."
    )
    chat_template: str | None = _f(
        None, "Chat template: a file path or the template text; overrides the model's own."
    )
    chat_template_content_format: str = _f(
        "auto",
        "Message content shape the template expects: 'string' (list-of-parts content is joined "
        "with newlines), 'openai' (parts passed as sent), or 'auto' (detected from the template).",
    )
    generation_config: str = _f(
        "auto",
        "Sampling defaults: 'auto' uses the model's generation_config.json, 'none' ignores it.",
    )
    revision: str | None = _f(None, "Hub revision when MODEL is a hub id.")
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
    )
    reasoning_parser: str | None = _f(
        None,
        "How chat output's reasoning is split out: 'think' (text between <think> and </think> "
        "goes to reasoning_content, not content) or 'none'. Default: 'think' when the chat "
        "template mentions <think>, else none.",
    )
    quantized_decode: bool = _f(
        True,
        "GGUF models on CPU in float32: decode steps of at most 24 sequences read the file's "
        "Q8_0/Q4_0/Q4_1 weights directly instead of their float32 copies (about 6x less memory "
        "traffic per token); other steps (prompts, bigger decode batches) run their layer "
        "matmuls in bfloat16 on CPUs with native bf16 (AVX512_BF16 or AMX: about 2x faster; "
        "the LM head stays float32), else in float32.",
    )


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = _f(16, "Tokens per KV-cache block.")
    kv_cache_memory: str = _f(
        "2GiB", "Memory for the KV cache (e.g. 512MiB, 4GiB) when --num-kv-blocks is not given."
    )
    num_kv_blocks: int | None = _f(None, "KV-cache blocks (overrides --kv-cache-memory).")
    gpu_memory_utilization: float = _f(
        0.9,
        "CUDA only: fraction of the GPU's memory this server may use (weights, activations, "
        "KV cache); the KV cache gets what is left. --num-kv-blocks overrides.",
    )
    enable_prefix_caching: bool = _f(True, "Reuse KV blocks of shared prompt prefixes.")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = _f(64, "Most sequences in one step.")
    max_num_batched_tokens: int = _f(2048, "Most tokens in one step (long prompts are chunked).")
    max_waiting: int = _f(1024, "Waiting requests beyond which new ones get 503 + Retry-After.")
    scheduling_policy: str = _f(
        "priority", "fcfs or priority (the request field `priority`; lower runs first)."
    )


@dataclass(frozen=True)
class DeviceConfig:
    device: str = _f("auto", "auto, cpu or cuda.")
    threads: int | None = _f(None, "Torch CPU threads for the engine (default: all cores).")
    seed: int = _f(0, "Seed of the engine's random stream (requests without `seed`).")
    batch_invariant: bool = _f(
        False,
        "CPU float32 only: a request's output no longer depends on what else is in the batch "
        "(other requests, its row, how its prompt is chunked). Costs prompt throughput: every "
        "linear runs row by row and every prompt token attends alone (README.md: measured "
        "cost).",
    )


@dataclass(frozen=True)
class ServerConfig:
    host: str = _f("127.0.0.1", "Address to bind.")
    port: int = _f(8000, "Port to bind.")
    api_key: tuple[str, ...] = _f(
        (), "API key(s) required on every route but /health, /ready, /metrics (repeatable).",
        append=True,
    )
    max_body_bytes: int = _f(8 * 1024 * 1024, "Largest request body accepted (413 above).")
    strict_fields: bool = _f(False, "Reject accepted-but-inert and unknown fields with 400.")
    sse_keep_alive: float | None = _f(
        None, "Send an SSE comment on a stream idle this many seconds."
    )
    access_log: bool = _f(True, "Log one line per request (with `user` when sent).")


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    server: ServerConfig = field(default_factory=ServerConfig)


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(text: str) -> int:
    """'2GiB' -> 2147483648. Plain numbers are bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a memory size: {text!r} (try 512MiB or 4GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
