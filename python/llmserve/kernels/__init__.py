"""llmserve's CUDA ops (csrc/) as Python functions: the one wrapper module.

    from llmserve import kernels
    if kernels.available():            # CUDA device + nvcc + ninja (or a prebuilt library); builds nothing
        kernels.load()                 # compile on first use (cached), register the ops
        kernels.write_kv_cache(k, v, k_cache, v_cache, slot_mapping)
        kernels.paged_attention_decode(out, q, k_cache, v_cache, block_tables, seq_lens, scale)

The ops live in the `llmserve` torch namespace (torch.ops.llmserve.*) with schemas in
csrc/ops.cpp and fake implementations here, so they trace under torch.compile and capture in
CUDA graphs. Importing this module imports torch but builds and loads nothing.

Served sizes: fp16/bf16, head_dim 64/128, block_size 16, at most 8 query heads per kv head.
`supports(...)` answers whether a model fits; the ops reject everything else with a clear error.

The fused decoder-layer ops (csrc/layer_ops.cu: `rms_norm`, `fused_add_rms_norm`,
`silu_and_mul`, `rotary_embedding`) each replace several eager torch kernels of a layer and
round where that torch code rounds; `fused_unserved(...)` says whether a model's sizes fit them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch

from llmserve.kernels.build import KernelsUnavailable, missing_toolchain

__all__ = ["KernelsUnavailable", "available", "load", "load_library", "supports",
           "paged_attention_decode", "write_kv_cache", "choose_num_splits", "check_fake_impls",
           "fused_unserved", "rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding"]

HEAD_DIMS = (64, 128)
BLOCK_SIZE = 16
MAX_GROUP_SIZE = 8
DTYPES = (torch.float16, torch.bfloat16)
PARTITION_MULTIPLE = 64        # split-K partitions hold whole 64-token chunks (csrc/paged_attention.h)
MAX_SPLITS = 65535             # a grid's z extent

_lock = threading.Lock()
_loaded = False
_fakes_registered = False


def available() -> bool:
    """True when the extension can be built and run here (it may still need compiling)."""
    return missing_toolchain() is None


def supports(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
             dtype: torch.dtype) -> str | None:
    """None when the kernels serve this shape, else the reason they do not."""
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} (served: {HEAD_DIMS})"
    if block_size != BLOCK_SIZE:
        return f"block_size {block_size} (served: {BLOCK_SIZE})"
    if dtype not in DTYPES:
        return f"dtype {dtype} (served: float16, bfloat16)"
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        return f"{num_heads} heads over {num_kv_heads} kv heads"
    if num_heads // num_kv_heads > MAX_GROUP_SIZE:
        return f"{num_heads // num_kv_heads} query heads per kv head (served: up to {MAX_GROUP_SIZE})"
    return None


def fused_unserved(hidden_size: int, intermediate_sizes: Iterable[int], head_dim: int,
                   dtype: torch.dtype) -> str | None:
    """None when the fused layer ops serve a model of these sizes (`intermediate_sizes`: its
    gated MLPs'), else the reason they do not: fp16/bf16 only, and rows of whole 16-byte vectors
    (hidden and intermediate sizes multiples of 8, a head of whole 8-element halves)."""
    if dtype not in DTYPES:
        return f"dtype {dtype} (served: float16, bfloat16)"
    sizes = [("hidden_size", hidden_size, 8), ("head_dim", head_dim, 16)]
    sizes += [("intermediate_size", n, 8) for n in intermediate_sizes]
    for what, n, unit in sizes:
        if n % unit:
            return f"{what} {n} is not a multiple of {unit}"
    return None


def load(verbose: bool = False) -> None:
    """Build (first time on this machine) and load the extension; idempotent and thread-safe."""
    global _loaded
    with _lock:
        if _loaded:
            return
        from llmserve.kernels.build import build_and_load

        build_and_load(verbose=verbose)
        _register_fakes()
        _loaded = True


def load_library(path: str) -> None:
    """Load an already built extension library (benches/compile_check.sh builds one by hand)."""
    global _loaded
    with _lock:
        torch.ops.load_library(path)
        _register_fakes()
        _loaded = True


def _register_fakes() -> None:
    """Shape-only implementations for FakeTensor / meta tracing. Both ops write in place and
    return nothing, so the fakes only check what the CUDA side would check first."""
    global _fakes_registered
    if _fakes_registered:
        return

    @torch.library.register_fake("llmserve::paged_attention_decode")
    def _paged_attention_decode_fake(out, query, key_cache, value_cache, block_tables, seq_lens,
                                     scale, num_splits, pipeline=0):
        # the checks of csrc/paged_attention.cpp that shapes, dtypes and arguments decide
        what = "paged_attention_decode"
        torch._check(query.dim() == 3 and out.shape == query.shape,
                     lambda: f"{what}: out must be shaped like query [S, H, D]")
        torch._check(key_cache.dim() == 4 and key_cache.shape == value_cache.shape,
                     lambda: f"{what}: caches must both be [num_blocks, block_size, kv_heads, head_dim]")
        torch._check(key_cache.shape[1] == BLOCK_SIZE,
                     lambda: f"{what}: block_size {key_cache.shape[1]} is not supported (16 only)")
        torch._check(key_cache.shape[3] == query.shape[2] and query.shape[2] in HEAD_DIMS,
                     lambda: f"{what}: head_dim {query.shape[2]} (cache {key_cache.shape[3]}) is not supported "
                             "(64 or 128 only)")
        kvh = key_cache.shape[2]
        torch._check(kvh > 0 and query.shape[1] % kvh == 0 and query.shape[1] // kvh <= MAX_GROUP_SIZE,
                     lambda: f"{what}: {query.shape[1]} query heads over {kvh} kv heads "
                             f"(at most {MAX_GROUP_SIZE} per kv head)")
        torch._check(query.dtype in DTYPES and out.dtype == query.dtype and key_cache.dtype == query.dtype
                     and value_cache.dtype == query.dtype,
                     lambda: f"{what}: query, out and caches must share one dtype, float16 or bfloat16")
        torch._check(block_tables.dtype == torch.int32 and block_tables.dim() == 2
                     and block_tables.shape[0] == query.shape[0] and block_tables.stride(1) == 1,
                     lambda: f"{what}: block_tables must be int32 [S, W] with contiguous rows")
        torch._check(seq_lens.dtype == torch.int32 and seq_lens.dim() == 1 and seq_lens.shape[0] == query.shape[0]
                     and seq_lens.is_contiguous(),
                     lambda: f"{what}: seq_lens must be a contiguous int32 [S]")
        torch._check(pipeline in (0, 1), lambda: f"{what}: pipeline must be 0 or 1, got {pipeline}")
        torch._check(0 <= num_splits <= MAX_SPLITS,
                     lambda: f"{what}: num_splits {num_splits} must be in [0, {MAX_SPLITS}]")
        return None

    @torch.library.register_fake("llmserve::write_kv_cache")
    def _write_kv_cache_fake(key, value, key_cache, value_cache, slot_mapping):
        torch._check(key.shape == value.shape and key.dim() == 3,
                     lambda: "write_kv_cache: key/value must be [T, KVH, D]")
        torch._check(slot_mapping.dim() == 1 and slot_mapping.shape[0] == key.shape[0],
                     lambda: "write_kv_cache: slot_mapping must be [T]")
        return None

    def _rows(what, *tensors):
        for t in tensors:
            torch._check(t.dim() == 2, lambda: f"{what}: tensors must be 2-D [tokens, width]")

    def _norm_shapes(what, name, other, input, weight):
        """The norm ops' shapes: `other` (called `name`) like input [T, H], weight [H]."""
        _rows(what, other, input)
        torch._check(other.shape == input.shape and weight.shape == input.shape[-1:],
                     lambda: f"{what}: {name} must be shaped like input [T, H], weight [H]")

    @torch.library.register_fake("llmserve::rms_norm")
    def _rms_norm_fake(out, input, weight, eps):
        _norm_shapes("rms_norm", "out", out, input, weight)
        return None

    @torch.library.register_fake("llmserve::fused_add_rms_norm")
    def _fused_add_rms_norm_fake(input, residual, weight, eps):
        _norm_shapes("fused_add_rms_norm", "residual", residual, input, weight)
        return None

    @torch.library.register_fake("llmserve::silu_and_mul")
    def _silu_and_mul_fake(out, input):
        _rows("silu_and_mul", out, input)
        torch._check(out.shape[0] == input.shape[0] and input.shape[1] == 2 * out.shape[1],
                     lambda: "silu_and_mul: input must be [T, 2I] for out [T, I]")
        return None

    @torch.library.register_fake("llmserve::rotary_embedding")
    def _rotary_embedding_fake(x, heads, cos, sin):
        _rows("rotary_embedding", x, cos, sin)
        torch._check(cos.shape == sin.shape and cos.shape[0] == x.shape[0]
                     and heads * 2 * cos.shape[1] <= x.shape[1],
                     lambda: "rotary_embedding: cos/sin must be [T, head_dim / 2] and the heads fit x [T, W]")
        return None

    _fakes_registered = True


def _require_loaded() -> None:
    if not _loaded:
        load()


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key/value [T, KVH, D] -> key_cache/value_cache [N, 16, KVH, D] at slot_mapping [T]
    (int64, block * block_size + offset; -1 skips the row)."""
    _require_loaded()
    torch.ops.llmserve.write_kv_cache(key, value, key_cache, value_cache, slot_mapping)


# Which decode kernel runs: "1" the software-pipelined one (csrc/paged_attention_kernels.cuh,
# kPipelined), "0" the one that loads each chunk and then computes it (the default until a GPU
# run has measured the other: benches/kernel_bench.py times both).
PIPELINE_ENV = "LLMSERVE_DECODE_PIPELINE"
_pipeline: bool | None = None


def decode_pipeline() -> bool:
    """What LLMSERVE_DECODE_PIPELINE asks for (read once; default off)."""
    global _pipeline
    if _pipeline is None:
        from llmserve.config import env_switch

        _pipeline = env_switch(PIPELINE_ENV)
    return _pipeline


def paged_attention_decode(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
                           value_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float,
                           num_splits: int | None = None, pipeline: bool | None = None) -> torch.Tensor:
    """One query token per sequence over its paged context; writes and returns `out`.

    out, query [S, H, D]; caches [N, 16, KVH, D]; block_tables [S, W] int32; seq_lens [S] int32
    (tokens of context including this step's, <= W * 16; 0 marks a padding row, whose output is
    zeros). num_splits: split-K partitions per sequence, each an even share of that sequence's
    own context in whole 64-token chunks (0 or 1: no split); None picks it from the batch shape
    (`choose_num_splits`). pipeline: run the software-pipelined kernel (None:
    LLMSERVE_DECODE_PIPELINE)."""
    _require_loaded()
    if num_splits is None:
        num_splits = choose_num_splits(query.shape[0], key_cache.shape[2],
                                       block_tables.shape[1] * key_cache.shape[1])
    pipe = decode_pipeline() if pipeline is None else pipeline
    torch.ops.llmserve.paged_attention_decode(out, query, key_cache, value_cache, block_tables,
                                              seq_lens, float(scale), int(num_splits), int(pipe))
    return out


def rms_norm(out: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """out [T, H] <- RMSNorm(input [T, H]) * weight [H] (input's dtype: rounded before the
    multiply, as Llama's; float32: after, as Gemma's)."""
    _require_loaded()
    torch.ops.llmserve.rms_norm(out, input, weight, float(eps))


def fused_add_rms_norm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """residual [T, H] += input; then input <- RMSNorm(residual) * weight [H]. Both in place."""
    _require_loaded()
    torch.ops.llmserve.fused_add_rms_norm(input, residual, weight, float(eps))


def silu_and_mul(out: torch.Tensor, input: torch.Tensor) -> None:
    """out [T, I] <- silu(input[:, :I]) * input[:, I:] for input [T, 2I]."""
    _require_loaded()
    torch.ops.llmserve.silu_and_mul(out, input)


def rotary_embedding(x: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """x [T, W]: rotate-half RoPE in place on its first `heads` heads; cos/sin [T, head_dim / 2]
    of x's dtype."""
    _require_loaded()
    torch.ops.llmserve.rotary_embedding(x, int(heads), cos, sin)


_num_sms: int | None = None


def _sm_count() -> int:
    global _num_sms
    if _num_sms is None:
        _num_sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return _num_sms


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context: int,
                      num_sms: int | None = None) -> int:
    """Split-K partitions per sequence so that num_seqs * num_kv_heads * splits CTAs fill about
    two waves of the GPU; 0 (no split) when the batch alone does, or no context can be long
    (`max_context`: the block table's width in tokens).

    NOTE: depends only on the batch shape, never on the current lengths (the kernel cuts each
    sequence's own context into these many partitions on the device), so a CUDA graph captured
    for a batch size serves every context, short or long."""
    sms = num_sms if num_sms is not None else _sm_count()
    ctas = max(1, num_seqs * num_kv_heads)
    target = 2 * sms
    if ctas >= target or max_context <= 2 * PARTITION_MULTIPLE:
        return 0
    splits = min(-(-target // ctas), -(-max_context // PARTITION_MULTIPLE), MAX_SPLITS)
    return splits if splits > 1 else 0


def check_fake_impls() -> None:
    """Call every op on meta tensors (no GPU needed): schemas and fakes must agree."""
    meta = torch.device("meta")
    s, h, kvh, d, n, w, t = 3, 8, 2, 128, 10, 4, 5
    cache = torch.empty(n, BLOCK_SIZE, kvh, d, dtype=torch.bfloat16, device=meta)
    q = torch.empty(s, h, d, dtype=torch.bfloat16, device=meta)
    out = torch.empty_like(q)
    tables = torch.empty(s, w, dtype=torch.int32, device=meta)
    lens = torch.empty(s, dtype=torch.int32, device=meta)
    torch.ops.llmserve.paged_attention_decode(out, q, cache, cache.clone(), tables, lens, 0.1, 0)
    for bad in (dict(tables=tables.long()), dict(splits=-1), dict(q=q.float(), out=out.float())):
        try:
            torch.ops.llmserve.paged_attention_decode(bad.get("out", out), bad.get("q", q), cache, cache.clone(),
                                                      bad.get("tables", tables), lens, 0.1, bad.get("splits", 4))
        except RuntimeError:
            pass
        else:
            raise AssertionError(f"paged_attention_decode's fake accepted {sorted(bad)} the op refuses")
    kv = torch.empty(t, kvh, d, dtype=torch.bfloat16, device=meta)
    slots = torch.empty(t, dtype=torch.int64, device=meta)
    torch.ops.llmserve.write_kv_cache(kv, kv.clone(), cache, cache.clone(), slots)
    try:
        torch.ops.llmserve.write_kv_cache(kv, kv.clone(), cache, cache.clone(), slots[:2])
    except RuntimeError:
        pass
    else:
        raise AssertionError("write_kv_cache's fake accepted a slot_mapping of the wrong length")
    hidden = torch.empty(t, 64, dtype=torch.bfloat16, device=meta)
    weight = torch.empty(64, dtype=torch.bfloat16, device=meta)
    torch.ops.llmserve.rms_norm(torch.empty_like(hidden), hidden, weight, 1e-5)
    torch.ops.llmserve.fused_add_rms_norm(hidden, hidden.clone(), weight, 1e-5)
    torch.ops.llmserve.silu_and_mul(torch.empty(t, 32, dtype=torch.bfloat16, device=meta), hidden)
    half = torch.empty(t, d // 2, dtype=torch.bfloat16, device=meta)
    torch.ops.llmserve.rotary_embedding(torch.empty(t, 3 * d, dtype=torch.bfloat16, device=meta), 3, half, half)
    try:
        torch.ops.llmserve.silu_and_mul(torch.empty(t, 64, dtype=torch.bfloat16, device=meta), hidden)
    except RuntimeError:
        pass
    else:
        raise AssertionError("silu_and_mul's fake accepted an out as wide as its input")
