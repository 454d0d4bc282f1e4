"""Turn a Config into the three things the engine loop drives: Router, Core and ModelRunner.

Loading order: checkpoint (weights, tokenizer, templates) -> torch model -> KV cache sizing ->
Rust router and core. Every decision that changes what clients see (context length, sampling
defaults, template origin) is logged once here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llmserve._core import Core, Router
from llmserve._core import __version__ as core_version, numerics_revision
from llmserve.config import DEFAULT_BATCHED_TOKENS, DEFAULT_CPU_KV_CACHE, Config, parse_bytes
from llmserve.engine.adapters import Adapters, adapter_fingerprint, read_adapter
from llmserve.loaders.checkpoint import LazyWeights, LoadError
from llmserve.worker.kv_cache import kv_cache_dtype
from llmserve.worker.threads import (QUANT_MAX_TOKENS, bf16_tile_rows, cpu_signature, native_bf16,
                                     reproducible_blas)

log = logging.getLogger("llmserve.engine")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# generation_config.json keys -> our defaults (vLLM applies the same set).
_GEN_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
             "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


@dataclass
class Engine:
    """Everything the loop needs, built once."""

    router: Router
    core: Core
    runner: object
    config: Config
    model_name: str
    max_model_len: int
    num_blocks: int
    device: torch.device
    # Plan step N+1 while the model runs step N (--async-scheduling).
    plan_ahead: bool = False
    # The model's LoRA adapters, loaded and unloaded while it serves (None: a runner built
    # without the build, as tests do).
    adapters: Adapters | None = None
    # The tokenizer's named special tokens (`bos_token`, `eos_token`, `pad_token`, ...: text).
    special_tokens: dict[str, str] = field(default_factory=dict)
    # The sampling defaults a request's fields fall back to (generation_config.json and
    # --override-generation-config), by request field name.
    generation_defaults: dict[str, Any] = field(default_factory=dict)


class SetupError(LoadError, RuntimeError):
    """The flags ask for what this machine or model cannot serve; the message says which and
    what to change (reported without a traceback, as a LoadError is, and caught as one:
    `except llmserve.LoadError` catches every reason an engine cannot be built)."""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise SetupError("--device cuda was given but torch sees no CUDA device")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # NOTE: fp32 is the only fast GEMM path on AVX2 CPUs (BENCH.md); bf16 on GPUs.
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if name not in _DTYPES:
        raise ValueError(f"unknown --dtype {name!r}; use auto, float32, bfloat16 or float16")
    return _DTYPES[name]


def _embeddings(cfg: Config, ck) -> dict | None:
    """RouterConfig.embeddings: how /v1/embeddings pools (--pooling, else the folder's
    sentence-transformers files, else the last token), whether it normalizes (a Normalize
    module; without sentence-transformers files, yes), and the Matryoshka lengths config.json
    declares (`matryoshka_dimensions`, or `is_matryoshka` for any). None turns the route off:
    the files describe embeddings this server cannot make, and no --pooling overrules them."""
    st, hf = ck.sentence_transformers, ck.hf_config
    if "unsupported" in st and cfg.model.pooling is None:
        log.warning("/v1/embeddings is off: %s's sentence-transformers files describe embeddings this "
                    "server cannot make (%s); --pooling last|mean serves its hidden states pooled anyway",
                    ck.name, st["unsupported"])
        return None
    dims = hf.get("matryoshka_dimensions")
    if isinstance(dims, list):
        matryoshka = sorted({int(d) for d in dims})
    else:
        matryoshka = [] if hf.get("is_matryoshka") else None
    return {
        "pooling": cfg.model.pooling or st.get("pooling", "last"),
        "normalize": st.get("normalize", True),
        "hidden_size": int(hf["hidden_size"]),
        "matryoshka": matryoshka,
    }


def _generation_defaults(cfg: Config, gen: dict) -> dict:
    """The sampling defaults: the model's generation_config.json (the folder's that
    --generation-config names, or none), then --override-generation-config's over them (vLLM's
    order)."""
    folder = cfg.model.generation_file()
    if folder is not None:
        gen, source = folder, os.path.join(cfg.model.generation_config, "generation_config.json")
    else:
        gen, source = ({} if cfg.model.generation_config == "none" else dict(gen)), "generation_config.json"
    overrides = cfg.model.generation_overrides()
    gen = {**gen, **overrides}
    out = {ours: gen[theirs] for theirs, ours in _GEN_KEYS.items() if gen.get(theirs) is not None}
    if out:
        source += " and --override-generation-config" if overrides else ""
        log.info("sampling defaults from %s (request values win): %s", source, out)
    return out


def _template_sources(cfg: Config, sources: dict) -> dict:
    sources = dict(sources)
    cli = cfg.model.chat_template
    if cli is not None:
        # (Config checked the file reads as UTF-8 text, before the model loaded)
        sources["cli"] = Path(cli).read_text(encoding="utf-8") if os.path.isfile(cli) else cli
    return sources


def _content_format(name: str) -> str | None:
    return None if name == "auto" else name   # the config checked the choice


def kv_block_bytes(hf_config: dict, block_size: int, dtype: torch.dtype) -> int:
    layers = hf_config["num_hidden_layers"]
    heads = hf_config["num_attention_heads"]
    kv_heads = hf_config.get("num_key_value_heads") or heads
    head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // heads
    return 2 * layers * block_size * kv_heads * head_dim * torch.finfo(dtype).bits // 8


def _check_batch_invariant(device: torch.device, dtype: torch.dtype) -> None:
    """--batch-invariant is only implemented where it can be kept: fail now, not silently."""
    from llmserve.worker import attention

    if device.type != "cpu" or dtype != torch.float32:
        raise SetupError(
            f"--batch-invariant needs --device cpu and --dtype float32 (got {device.type}, "
            f"{str(dtype).removeprefix('torch.')}): the CUDA and reduced-precision kernels "
            "are not batch-invariant")
    if attention._cpu_decode is None or not attention.USE_CPU_DECODE_KERNEL:
        raise SetupError("--batch-invariant needs the CPU decode kernel "
                           "(llmserve._core.paged_decode_attention): rebuild the extension")


def weight_samples(weights: Mapping[str, torch.Tensor]) -> list[bytes]:
    """What `system_fingerprint` hashes of the weights: each tensor's name, shape and dtype and a
    strided sample of its values (cheap, yet another checkpoint differs). Taken before a
    serving build, which takes the tensors over."""
    out = []
    for name in sorted(weights):
        if isinstance(weights, LazyWeights):   # (a GGUF file's: made from the sampled rows only)
            shape, dtype = weights.shape(name), torch.float32
            size = math.prod(shape)
            sample = weights.sample(name, np.arange(0, size, max(1, size // 64))[:64])
        else:
            t = weights[name].detach()
            shape, dtype, flat = tuple(t.shape), t.dtype, t.reshape(-1)
            sample = flat[:: max(1, flat.numel() // 64)][:64]
        out += [f"{name}{shape}{dtype}".encode(), sample.to("cpu", torch.float32).numpy().tobytes()]
    return out


def system_fingerprint(weights: Mapping[str, torch.Tensor] | list[bytes], *numerics) -> str:
    """OpenAI's `system_fingerprint`: "fp_" and 10 hex digits that change with what a seeded
    output depends on besides the request: the build (the package version, the Rust kernels'
    numerics revision and torch's version, whose CPU kernels compute the prompt), the weights
    (`weight_samples`, or the weights to take them from) and `numerics` (device, dtype, compute
    paths, threads)."""
    build = [core_version, numerics_revision, torch.__version__]
    h = hashlib.sha256(json.dumps([*build, *map(str, numerics)]).encode())
    for chunk in weights if isinstance(weights, list) else weight_samples(weights):
        h.update(chunk)
    return "fp_" + h.hexdigest()[:10]


def _attach_lora(cfg: Config, ck, model, dtype: torch.dtype, device: torch.device) -> list[tuple]:
    """Loads --lora-modules' adapters and installs them on `model` (models/lora.py): each
    loaded adapter with its path as given and its parent name (or None), in the order given
    (none: [])."""
    specs = cfg.model.lora_adapters()
    if not specs:
        return []
    from llmserve.models import lora

    try:
        adapters = [(read_adapter(name, path, ck.hf_config), path, parent) for name, path, parent in specs]
        lora.attach(model, [a for a, _, _ in adapters], dtype, device)
    except lora.LoraError as exc:
        raise SetupError(f"--lora-modules: {exc}") from exc
    log.info("LoRA adapters: %s", ", ".join(f"{a.name} (rank {a.rank}, {a.path})" for a, _, _ in adapters))
    return adapters


def _built(ck, build):
    """`build()` the model, with what the checkpoint lacks or has that the model cannot take
    (a config key, an unsupported feature, a tensor missing or of the wrong shape) as a
    LoadError: the folder is the problem, not the server."""
    try:
        return build()
    except KeyError as exc:
        raise LoadError(f"{ck.name}: its config has no {exc.args[0]!r}, which the model needs") from exc
    except ValueError as exc:   # (a tensor of the wrong shape included: fuse_hf_weights names it)
        raise LoadError(f"{ck.name}: {exc}") from exc


def native_positions(hf: dict, model) -> int:
    """The positions a model serves: max_position_embeddings (2048 when the config does not
    say), stretched by a linear RoPE scaling's factor (vLLM's limit too); with YaRN, the original
    context times its factor, as vLLM serves it. llama3's and
    LongRoPE's max_position_embeddings already count the stretched positions, and so does
    Gemma 3's, whose linear factor (4B and up) rescales the global layers' RoPE into them
    (the model's `positions_count_rope_scaling`, as vLLM reads Gemma 3)."""
    native_len = int(hf.get("max_position_embeddings") or 2048)
    scaling = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    scaling = scaling.get("full_attention", scaling)   # (per layer type: the full layers')
    kind = scaling.get("rope_type", scaling.get("type"))
    if (kind == "linear" and scaling.get("factor")
            and not getattr(model, "positions_count_rope_scaling", False)):
        native_len = int(native_len * float(scaling["factor"]))
    if kind == "yarn":
        # as vLLM: YaRN stretches the original context (as transformers fills it) by its factor
        original = int(scaling.get("original_max_position_embeddings") or native_len)
        native_len = int(original * float(scaling.get("factor") or native_len / original))
    return native_len


def _within_the_window(window: int, native_len: int, requested: int | None) -> int:
    """The positions served when our CUDA kernels, which have no sliding window yet, serve a
    model that has one: its window, within which attention is the same as full attention."""
    if requested and requested > window:
        raise SetupError(f"--max-model-len {requested} exceeds the model's sliding window of {window} "
                         f"tokens, which our CUDA kernels do not implement yet: serve {window} tokens or "
                         "fewer, where attention is the same, or serve on CPU")
    if not requested:
        log.info("serving up to the model's sliding window of %d tokens (of %d positions): our CUDA "
                 "kernels do not implement sliding-window attention yet", window, native_len)
    return window


def batched_tokens(cfg: Config, device: torch.device) -> int:
    """The step token budget: --max-num-batched-tokens, else the device's default."""
    given = cfg.scheduler.max_num_batched_tokens
    return given if given is not None else DEFAULT_BATCHED_TOKENS.get(device.type, DEFAULT_BATCHED_TOKENS["cpu"])


def _check_overrides(hf_config: dict, overrides: dict) -> None:
    """--hf-overrides replaces the config's values with values of their kind (an integer's
    with an integer, a number's with a number, ...): another kind fails deep in the build,
    or serves a model other than the one asked for (a size of 0)."""
    def kind(v: object) -> str:
        if isinstance(v, bool) or v is None:
            return type(v).__name__
        return {int: "number", float: "number"}.get(type(v), type(v).__name__)
    for key, value in overrides.items():
        old = hf_config.get(key)
        if old is None or (value is None and isinstance(old, dict)):
            continue   # (a key the config lacks, or a section set to null: `"rope_scaling": null` is none)
        if kind(value) != kind(old) or (isinstance(old, int) and not isinstance(old, bool)
                                         and isinstance(value, float) and not value.is_integer()):
            raise SetupError(f"--hf-overrides {key}: the model's config holds {old!r}; {value!r} is not a value "
                             "of that kind")
        size = key.startswith("num_") or key.endswith(("_size", "_dim", "max_position_embeddings"))
        if size and not isinstance(old, bool) and isinstance(old, int) and not value > 0:
            raise SetupError(f"--hf-overrides {key}: a size or count, {value!r} is not above 0")


def _check_cpu_memory(cfg: Config, size: int) -> None:
    """A CPU KV cache larger than the machine's memory is refused (its pages are mapped
    lazily, so it would start and be killed later, once requests filled it); one larger than
    the memory free now is a warning."""
    flag = "--num-kv-blocks" if cfg.cache.num_kv_blocks else "--kv-cache-memory"
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return
    if size > total:
        raise SetupError(f"the KV cache {flag} asks for takes {size / 2**30:.1f} GiB, more than this machine's "
                         f"{total / 2**30:.1f} GiB of memory: lower {flag}")
    available = _available_memory()
    if available is not None and size > available:
        log.warning("the KV cache (%.1f GiB) is more than the %.1f GiB of memory free now: the server may be "
                    "killed for memory once requests fill it; lower %s", size / 2**30, available / 2**30, flag)


def _available_memory() -> int | None:
    """Linux's MemAvailable in bytes, or None where /proc/meminfo does not say."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def cuda_only_flags_given(cfg: Config) -> list[str]:
    """The flags whose help says "CUDA only" that are set away from their defaults: a CPU
    engine names them as doing nothing, as the CLI names vLLM's flags that do nothing here."""
    given = []
    for section in dataclasses.fields(cfg):
        values = getattr(cfg, section.name)
        for f in dataclasses.fields(values):
            if f.metadata.get("help", "").startswith("CUDA only") and getattr(values, f.name) != f.default:
                given.append("--" + f.name.replace("_", "-"))
    return given


def build_engine(cfg: Config) -> Engine:
    from llmserve.loaders import load_checkpoint
    from llmserve.models import build_model, normalize_config
    from llmserve.worker.runner import ModelRunner

    start = time.perf_counter()
    device = resolve_device(cfg.device.device)
    dtype = resolve_dtype(cfg.model.dtype, device)
    kv_dtype = kv_cache_dtype(cfg.cache.kv_cache_dtype, dtype)
    if device.type != "cpu" and kv_dtype != dtype:
        raise SetupError(f"--kv-cache-dtype {cfg.cache.kv_cache_dtype} is served on CPU only: on "
                         f"{device.type} the KV cache holds the model's dtype "
                         f"({str(dtype).removeprefix('torch.')}), which the attention kernels read")
    if device.type == "cpu":
        for flag in cuda_only_flags_given(cfg):
            log.info("%s has no effect on CPU (CUDA only)", flag)
    if cfg.device.threads:
        cores = len(os.sched_getaffinity(0))
        if device.type == "cpu" and cfg.device.threads > cores:
            # (2 torch threads beside another busy process made a step 8-22x slower: BENCH.md)
            log.warning("--threads %d on %d cores: torch's threads will contend for them, and every step "
                        "runs slower than with --threads %d", cfg.device.threads, cores, cores)
        torch.set_num_threads(cfg.device.threads)
    # NOTE: the seed reaches the runner's own generators, never torch's global RNG: an engine
    # built inside another program leaves that program's random stream as it was.

    # (the quantized GEMV runs float32 CPU steps only: a GGUF file's other block types are
    # converted for it then, and the weights are the converted blocks' values)
    blocks = cfg.model.quantized_decode and device.type == "cpu" and dtype == torch.float32
    ck = load_checkpoint(cfg.model.model, revision=cfg.model.revision, quantized_decode=blocks,
                         download_dir=cfg.model.download_dir, tokenizer=cfg.model.tokenizer,
                         tokenizer_revision=cfg.model.tokenizer_revision)
    overrides = cfg.model.config_overrides()
    if overrides:
        _check_overrides(ck.hf_config, overrides)
        log.info("config.json keys replaced (--hf-overrides): %s", ", ".join(overrides))
        ck = replace(ck, hf_config={**ck.hf_config, **overrides})
    # (the Llama-named keys this file reads, for a family that names its shape otherwise; a
    # config without the keys they are made from is a LoadError, as in the build)
    ck = replace(ck, hf_config=_built(ck, lambda: normalize_config(ck.hf_config)))
    hf = ck.hf_config
    quantized = ck.quantized if cfg.model.quantized_decode else None
    # (before build_model, which may take the tensors over)
    # (the KV block size orders attention's sums: it moves logprobs, so it is part of it)
    # (MKL's reproducible mode, whether a GGUF model's other steps run bf16 matmuls, and their
    # tiling decide a prompt token's bits on a CPU; and the processor, whose instruction sets
    # pick the kernels)
    blas = (reproducible_blas(), native_bf16(), bf16_tile_rows(), cpu_signature()) if device.type == "cpu" else ()
    # A GGUF model's linears that have no blocks compute in bf16 too, where bf16 is native
    # (llama.py: from_hf `gguf`); --batch-invariant keeps them float32, row by row.
    gguf = ck.gguf_vocab is not None and cfg.model.quantized_decode and not cfg.device.batch_invariant
    samples, has_blocks = weight_samples(ck.weights), bool(quantized)   # (the build takes both over)
    model = _built(ck, lambda: build_model(hf, ck.weights, dtype, device, quantized=quantized, serving=True,
                                           gguf=gguf))
    # (a GGUF file's converted blocks: their values are `samples`, but an exact conversion such
    # as Q5_0 -> Q8_0 moves only which kernel computes, so the conversions count themselves)
    fingerprint = system_fingerprint(samples, device.type, dtype, has_blocks, cfg.device.batch_invariant,
                                     torch.get_num_threads(), cfg.cache.block_size, *blas,
                                     *(("gguf-bf16",) if getattr(model, "bf16_only_linears", False) else ()),
                                     # (prompt steps' bf16 matmuls run as a GGUF model's: layers.py)
                                     *(("bf16-rows",) if dtype == torch.bfloat16 and device.type == "cpu" else ()),
                                     *(ck.conversions if has_blocks else ()),
                                     # (a narrow KV cache rounds every cached key and value)
                                     *((f"kv-cache:{kv_dtype}",) if kv_dtype != dtype else ()),
                                     # (the shape or positions the overrides change move the output)
                                     *((f"hf-overrides:{json.dumps(overrides, sort_keys=True)}",) if overrides else ()))
    log.info("model %s built on %s as %s", ck.name, device, str(dtype).removeprefix("torch."))
    adapters = _attach_lora(cfg, ck, model, dtype, device)
    if cfg.device.batch_invariant:
        _check_batch_invariant(device, dtype)
        model.set_batch_invariant(True)
        log.info("batch-invariant: linears run row by row, every token attends alone")

    native_len = native_positions(hf, model)
    window = getattr(model, "sliding_window", 0)
    if window and window < native_len and device.type == "cuda":
        from llmserve.worker.cuda_graphs import kernels_unused_because

        # (the torch path, which serves a model our kernels do not, attends through windows)
        if kernels_unused_because(model, cfg.cache.block_size, dtype) is None:
            native_len = _within_the_window(window, native_len, cfg.model.max_model_len)
    max_model_len = cfg.model.max_model_len or native_len
    if max_model_len > native_len:
        if getattr(model, "learned_positions", False):
            raise SetupError(f"--max-model-len {max_model_len} exceeds the model's {native_len} positions: "
                             "it has a learned embedding for each position (n_positions) and none past them")
        if hf.get("max_position_embeddings"):
            # as vLLM refuses it: positions past those the model was trained on give garbage
            raise SetupError(f"--max-model-len {max_model_len} exceeds the model's {native_len} positions "
                             "(max_position_embeddings, times a linear RoPE scaling's factor)")
        log.warning("--max-model-len %d exceeds the %d positions assumed for a model that does not say "
                    "how many it has", max_model_len, native_len)

    block_size = cfg.cache.block_size
    per_block = kv_block_bytes(hf, block_size, kv_dtype)
    if cfg.cache.num_kv_blocks:
        num_blocks = cfg.cache.num_kv_blocks
    elif cfg.cache.kv_cache_memory is not None:
        size = parse_bytes(cfg.cache.kv_cache_memory)
        if device.type == "cuda" and size > (free := torch.cuda.mem_get_info(device)[0]):
            raise SetupError(f"--kv-cache-memory {cfg.cache.kv_cache_memory} is more than the {free / 2**30:.1f} "
                             "GiB the GPU has free: lower it, or leave it out to size the cache by "
                             "--gpu-memory-utilization")
        num_blocks = size // per_block
    elif device.type == "cuda":
        from llmserve.worker.cuda_graphs import (activation_reserve_bytes, kv_blocks_from_free_memory,
                                                 piecewise_requested)

        reserve = activation_reserve_bytes(
            hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"],
            batched_tokens(cfg, device), cfg.scheduler.max_num_seqs,
            piecewise=piecewise_requested() and not cfg.device.enforce_eager)
        num_blocks = kv_blocks_from_free_memory(device, per_block, cfg.cache.gpu_memory_utilization,
                                                reserve)
    else:
        num_blocks = parse_bytes(DEFAULT_CPU_KV_CACHE) // per_block
    if device.type == "cpu":
        _check_cpu_memory(cfg, num_blocks * per_block)
    needed = math.ceil(max_model_len / block_size)
    if num_blocks - 1 < needed:
        # the flag that set the size (--num-kv-blocks overrides the others)
        if cfg.cache.num_kv_blocks:
            raise_it = f"--num-kv-blocks to at least {needed + 1}"
        elif device.type == "cuda" and cfg.cache.kv_cache_memory is None:
            raise_it = "--gpu-memory-utilization"
        else:
            raise_it = "--kv-cache-memory"
        raise SetupError(
            f"the KV cache holds {max(0, num_blocks - 1) * block_size} tokens, less than one request of "
            f"--max-model-len {max_model_len}: raise {raise_it} or lower --max-model-len"
        )
    log.info("KV cache: %d blocks of %d tokens (%.0f MiB of %s), max_model_len %d", num_blocks, block_size,
             num_blocks * per_block / 2**20, str(kv_dtype).removeprefix("torch."), max_model_len)

    names = list(cfg.model.served_model_name) or [ck.name]
    if clash := next((a.name for a, _, _ in adapters if a.name in names), None):
        raise SetupError(f"--lora-modules names {clash!r}, the base model's name: serve the model under "
                         "another name (--served-model-name) or name the adapter otherwise")
    generation_defaults = _generation_defaults(cfg, ck.generation_config or {})
    router_config = {
        "served_model_names": names,
        "max_model_len": max_model_len,
        "strict_fields": cfg.server.strict_fields,
        "force_include_usage": cfg.server.enable_force_include_usage,
        "return_tokens_as_token_ids": cfg.server.return_tokens_as_token_ids,
        "max_logprobs": cfg.model.max_logprobs if cfg.model.max_logprobs >= 0 else int(hf["vocab_size"]),
        "responses_store_bytes": cfg.server.responses_store_mib * 2**20,
        "special_tokens": ck.special_tokens,
        "eos_token_ids": list(ck.eos_token_ids),
        "generation_defaults": generation_defaults,
        "tool_call_format": cfg.model.tool_call_format,
        "reasoning_parser": cfg.model.reasoning_parser,
        "default_chat_template_kwargs": cfg.model.template_kwargs(),
        "chat_template_content_format": _content_format(cfg.model.chat_template_content_format),
        "parse_special_tokens_in_messages": cfg.model.parse_special_tokens_in_messages,
        "system_fingerprint": fingerprint,
        "model_root": cfg.model.model or ck.name,
        "embeddings": _embeddings(cfg, ck),
        "fim": cfg.model.fim,
        # (the path as given: a hub id stays one)
        "lora_adapters": [{"name": a.name, "path": path, "parent": parent,
                           "system_fingerprint": adapter_fingerprint(fingerprint, a)}
                          for a, path, parent in adapters],
    }
    try:
        router = Router(
            ck.tokenizer_json,
            # (a GGUF served with --tokenizer has both: the tokenizer.json serves it)
            json.dumps(ck.gguf_vocab) if ck.gguf_vocab is not None and ck.tokenizer_json is None else None,
            json.dumps(_template_sources(cfg, ck.template_sources)),
            json.dumps(router_config),
        )
    except ValueError as exc:  # the tokenizer or a template that does not load
        raise LoadError(f"{ck.name}: {exc}") from exc
    rows = hf.get("vocab_size")
    if isinstance(rows, int) and router.vocab_size > rows:
        # (a larger table, padded as Qwen's are, is fine: every id the tokenizer makes has a row)
        raise LoadError(f"{ck.name}: the tokenizer has {router.vocab_size} tokens but the model only "
                        f"{rows} embedding rows (config vocab_size): some prompts could not be read")
    info, template_names = router.template_info(), router.template_names()
    if info:
        log.info("chat template: %s %s", *info)
    elif template_names:
        log.warning("chat templates %s, none named default: chat requests without tools answer 400 "
                    "until --chat-template is given", ", ".join(template_names))
    else:
        log.warning("no chat template: chat routes answer 400 until --chat-template is given")
    if defaults := cfg.model.template_kwargs():
        try:
            unread = router.unread_default_kwargs()
        except ValueError as exc:
            raise SetupError(str(exc)) from None
        log.info("chat_template_kwargs every chat request renders with (its own win): %s", json.dumps(defaults))
        if unread and template_names:
            log.warning("--default-chat-template-kwargs: the chat template never reads %s: no effect",
                        ", ".join(unread))
    if template_names:
        tool_format, reasoning = router.output_parsing()
        log.info("tool calls: %s; reasoning parser: %s",
                 tool_format or "forced only (json format; 'auto' answers in text)", reasoning)
    if fim := router.fim_tokens():
        log.info("fill-in-the-middle: completions' suffix laid out as %s prompt %s suffix %s", *fim)
    speculation = cfg.scheduler.speculation()
    # (the scheduler is given at least a block of tokens a step)
    step_budget = max(batched_tokens(cfg, device), block_size)
    if batched_tokens(cfg, device) < block_size:
        log.info("--max-num-batched-tokens %d is below --block-size %d: a step computes up to %d tokens",
                 batched_tokens(cfg, device), block_size, block_size)
    # Drafts (n-gram ones, and those of a chat request's `prediction`) fill steps up to this many
    # tokens. NOTE: on CPU a step of more than QUANT_MAX_TOKENS tokens leaves the quantized GEMV
    # (and is bound by arithmetic, not by reading weights, so drafts there cost what they save).
    # On CUDA a step with drafts runs eagerly, its whole batch without the decode graph: there
    # only --speculative-config turns drafts on (a request's `prediction` alone drafts nothing).
    if device.type == "cpu":
        draft_step_tokens = QUANT_MAX_TOKENS
    else:
        draft_step_tokens = step_budget if speculation is not None else 0
    if speculation is not None:
        log.info("speculative decoding: n-gram drafts, up to %d a step (n-grams of %d to %d tokens; steps of up to "
                 "%d tokens)", speculation["num_tokens"], speculation["lookup_min"], speculation["lookup_max"],
                 draft_step_tokens)
    core = Core(router, json.dumps({
        "num_blocks": num_blocks,
        "block_size": block_size,
        "max_num_seqs": cfg.scheduler.max_num_seqs,
        "max_num_batched_tokens": step_budget,
        "long_prefill_token_threshold": cfg.scheduler.long_prefill_token_threshold,
        "max_model_len": max_model_len,
        "enable_prefix_caching": cfg.cache.enable_prefix_caching,
        # NOTE: on CPU a decode step computes K/V with other numerics than a prompt step
        # (worker/threads.py); batch-invariant mode computes both alike.
        "cache_decoded_blocks": device.type != "cpu" or cfg.device.batch_invariant,
        "policy": cfg.scheduler.scheduling_policy,
        "max_loras": cfg.model.max_loras,
        "speculation": speculation,
        "draft_step_tokens": draft_step_tokens,
        "stream_interval": cfg.scheduler.stream_interval,
    }))
    if device.type == "cuda":
        from llmserve.worker.cuda_graphs import make_cuda_runner

        capture_sizes = cfg.device.capture_sizes(cfg.scheduler.max_num_seqs)
        if capture_sizes == []:
            raise SetupError(f"--cudagraph-capture-sizes {' '.join(map(str, cfg.device.cudagraph_capture_sizes))}: "
                             f"none is at most --max-num-seqs {cfg.scheduler.max_num_seqs}, the most sequences a "
                             "step holds")

        runner = make_cuda_runner(model, num_blocks, block_size, dtype, device,
                                  max_num_seqs=cfg.scheduler.max_num_seqs, max_model_len=max_model_len,
                                  max_num_batched_tokens=batched_tokens(cfg, device),
                                  graphs=not cfg.device.enforce_eager,
                                  capture_sizes=capture_sizes, seed=cfg.device.seed)
    else:
        runner = ModelRunner(model, num_blocks, block_size, kv_dtype, device, seed=cfg.device.seed)
    plan_ahead = {"on": True, "off": False}.get(cfg.scheduler.async_scheduling, device.type == "cuda")
    log.info("engine ready in %.1f s (served as %s; async scheduling %s)", time.perf_counter() - start,
             ", ".join(names), "on" if plan_ahead else "off")
    adapters = Adapters(model, ck.hf_config, dtype, device, fingerprint)
    return Engine(router, core, runner, cfg, names[0], max_model_len, num_blocks, device, plan_ahead, adapters,
                  dict(ck.special_tokens), generation_defaults)
