"""How a CPU step computes: which steps read GGUF blocks, how prompt tokens keep the same
numerics whatever the prefix cache held, and how the engine's CPU threads are shared between
torch and llmserve's Rust kernels.

CONTRACT: the same prompt and parameters give the same tokens run after run. The second run
of a prompt finds its first blocks in the prefix cache and computes only the tail, in a step
of another shape; and since the quantized GEMV rounds activations to int8, a last-bit
difference anywhere upstream can move a rounded value by a whole step and change the answer.
So every prompt token must be computed bit-identically however its prompt was split:
- Prompt tokens' layers never read GGUF blocks, however few: only decode steps of generated
  tokens (at most QUANT_MAX_TOKENS sequences, each computing the one token it sampled last)
  do. (The LM head's rows that sample a token read them in every step but big decode steps:
  each row is computed alone, so that cannot depend on the split; see below.)
- fp32 matmuls (those not run in bf16, below) run on MKL in its strict reproducible mode
  (MKL_CBWR=AUTO,STRICT, set when llmserve is imported; `reproducible_blas`), where a row of a
  GEMM is the same bits for any M. MKL's default mode is not: on an AVX512 CPU with AMX, rows
  of GEMMs under 16 rows differ from larger ones, and at 2 threads so do M of 57-199 when K is
  1536; on an AVX2 CPU only M that are not a multiple of 4 (below a threshold that grows with
  the thread count) did. As a second guard, steps that hold prompt tokens still pad their fp32
  matmuls with zero rows to a multiple of GEMM_ROW_MULTIPLE rows.
  (tests/unit/test_row_invariance.py checks this property of the installed BLAS.)
- Attention on CPU float32 runs every token as its own row of the Rust kernel (worker/
  attention.py), whose result depends only on that token and its context.

The Rust kernels (quantized GEMV, paged decode attention) run on their own persistent
thread pool (rust/kernels/src/pool.rs). torch's OpenMP workers spin for a while after every
parallel op, so when a step interleaves many small torch ops with kernel calls, the two
pools' workers fight for the same cores: on 2 cores, SmolLM2 single-stream decode with
2 torch threads and 2 kernel threads ran several times slower than with 1 and 1.

`llmserve run` also shortens how long those workers spin before sleeping (cli.py:
_short_openmp_spin), which gave the kernels their cores back sooner.

A step that holds prompt tokens and at most QUANT_MAX_TOKENS generated ones (a request
arriving while others generate) runs as two: the generated tokens as the decode step they
would be alone, the prompt tokens as a prompt step (runner.py: ModelRunner._execute_split).
A decode step that holds LoRA adapter rows beside base-model ones runs as two the same way
(the base rows on the Rust layers, the adapter rows on the torch layers), and the float matmuls
of quantized decode steps (LoRA deltas, an LM head without blocks) are padded as a prompt
step's are. A sequence that recomputes its tokens (preempted, or a beam that gave up its
blocks) computes those past its prompt as decode rows on the Rust layers, as its decode steps
did (the prefix cache takes none of them: `decoded_from` in the scheduler). So while at most
QUANT_MAX_TOKENS sequences decode, a generated token computes the same bits whatever else the
server is doing, the KV cache running out included, and greedy or seeded output does not
depend on it.

So the steps whose layers read GGUF blocks (decode steps of at most QUANT_MAX_TOKENS
generated tokens, where the quantized GEMV carries the linears) run torch single-threaded and
give the kernels all the engine's threads: `benches/quant_decode.py` measures the effect.
Other steps keep torch at full width (its fp32 GEMMs dominate) and the attention kernel
shares the cores with it.

Steps the quantized GEMV does not take (prompts, decode steps of more than QUANT_MAX_TOKENS
sequences) are bound by compute. On a CPU with native bf16 (`native_bf16`), a GGUF model's
layer matmuls in those steps run in bfloat16 (layers.Linear.bf16_weight), about 2x faster
than fp32. Without AMX, oneDNN computes a row of a bf16 GEMM to the same bits for any M >= 2
(M = 1 takes a GEMV whose sums differ), so a lone row is padded to two. With AMX its kernels
treat the rows past the last whole tile differently, so a row's bits depend on M and on where
the row sits; but GEMMs of one fixed M compute each row alone. So on such CPUs steps with
prompt tokens run their bf16 matmuls in calls of exactly BF16_TILE_ROWS rows (the last
padded with zeros; `bf16_tile_rows`). Either way prompt tokens keep the invariance above
(test_row_invariance.py checks both the property and the model). The LM
head of those decode steps runs in bf16 too (~25 ms of a 64-sequence step saved); in steps
of fewer sequences it reads its Q8_0 blocks with int8 activations, which round as much, and
so does the token a prompt step samples (computed as the tokens after it are). Prompt
logprobs keep the fp32 head, so they do not round.

The running step's flags are per thread (each engine runs its steps on its own thread; several
engines can share a process).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform
import sys
import threading
from contextlib import contextmanager
from typing import Iterator

import numpy as np
import torch

# Decode steps of at most this many tokens read a linear's GGUF blocks when it has them (and
# run all layers in one CpuDecoder call): small steps are bound by reading weights (BENCH.md),
# and Q4_1 is ~6x smaller than fp32. Larger steps are bound by compute, where a GEMM on the
# dequantized copy wins. Measured on SmolLM2 offline, N sequences x 96 tokens, 2 cores,
# against the bf16 GEMMs (native-bf16 CPU): this path 304 vs 158 tok/s at N = 12, 337/310
# vs 277/249 at 24, 286/329 vs 303/287 at 32, even at 48 (339 vs 337). 8 was the crossover
# against fp32 GEMMs, before the bf16 path and the CpuDecoder.
QUANT_MAX_TOKENS = 24

# The engine's CPU thread count (torch's at startup); None until a ModelRunner is built.
_engine_threads: int | None = None

# fp32 matmuls in steps with prompt tokens get a multiple of this many rows (module doc).
GEMM_ROW_MULTIPLE = 4

# On CPUs with AMX, steps with prompt tokens run bf16 matmuls in calls of this many rows
# (module doc). SmolLM2's four layer matmuls at 2 threads, whole vs in 64-row calls vs fp32:
# 5 rows 0.44 / 1.04 / ~1 ms, 512 rows 5.9 / 6.2 / 19 ms, 2048 rows 9.9 / 27 / ~76 ms;
# 32-row calls cost 42 ms at 2048 rows, 128-row ones 2.2 ms at 5.
BF16_TILE_ROWS = 64

# MKL's conditional numerical reproducibility (mkl_service.h): all settings, and the strict bit.
_MKL_CBWR_ALL, _MKL_CBWR_STRICT = -1, 0x10000

log = logging.getLogger(__name__)

# `.flags` = (holds_prompt_tokens, quantized) of the step this thread is running; absent
# outside a runner's step: a linear called alone then decides by its token count and pads
# nothing.
_step = threading.local()


def holds_prompt_tokens(plan) -> bool:
    """Whether some token of `plan` is a prompt token: anything but every sequence computing
    the one token it sampled in an earlier step (and, with speculation, the drafts after it),
    each token sampled by one row of its own."""
    n = len(plan.input_ids)
    gen = plan.gen_index
    if not (n > 0 and len(plan.logits_indices) == n and len(gen) == n and int(min(gen)) >= 1):
        return True
    return len(plan.query_start_loc) != n + 1 and not np.array_equal(plan.logits_indices, np.arange(n))


def _flags() -> tuple[bool, bool] | None:
    return getattr(_step, "flags", None)


def quantized_step_allowed(num_tokens: int) -> bool:
    """Whether a linear over `num_tokens` rows may read its GGUF blocks in the current step."""
    flags = _flags()
    return num_tokens <= QUANT_MAX_TOKENS and (flags is None or flags[1])


def in_prompt_step() -> bool:
    """Whether this thread is running a runner's step that holds prompt tokens."""
    flags = _flags()
    return flags is not None and flags[0]


def in_runner_step() -> bool:
    """Whether this thread is running a runner's step (layers.linear may then run a GGUF
    model's matmuls in bfloat16: see `native_bf16`)."""
    return _flags() is not None


@functools.cache
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (Linux; empty elsewhere)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break   # (the first processor's block ends)
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


@functools.cache
def _cpu_flags() -> frozenset[str]:
    """The x86 CPU's feature flags (/proc/cpuinfo); empty elsewhere."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return frozenset()
    return frozenset(_cpuinfo().get("flags", "").split())


# The x86 feature flags by which MKL, oneDNN and torch pick their CPU kernels (`cpu_signature`).
_KERNEL_FLAG_PREFIXES = ("avx", "amx", "fma", "f16c", "sse", "ssse", "bmi")
# What caps or steers the instruction sets those libraries pick (read when they first compute).
_KERNEL_ENV = ("MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ONEDNN_CPU_ISA_HINTS",
               "DNNL_CPU_ISA_HINTS", "ATEN_CPU_CAPABILITY")


def cpu_signature() -> str:
    """What a CPU step's bits depend on beside the code and the thread count: the processor
    (x86: vendor, family, model and the vector instruction sets; Arm: implementer, part and
    features), from which MKL (whose reproducible mode holds only per processor), oneDNN and
    torch pick their kernels; and what they picked or were told: torch's capability, MKL's
    reproducibility setting and code branch, the environment variables that cap the others.
    Part of `system_fingerprint`: two hosts (or settings) that differ in these may sum
    differently, so a seeded answer there can differ too."""
    info = _cpuinfo()
    if "flags" in info:   # x86
        ident = [info.get(k, "?") for k in ("vendor_id", "cpu family", "model")]
        features = sorted(f for f in set(info["flags"].split()) if f.startswith(_KERNEL_FLAG_PREFIXES))
    else:                 # Arm lists "Features"; elsewhere, the machine's name alone
        ident = [platform.machine(), *(info.get(k, "?") for k in ("CPU implementer", "CPU part") if info)]
        features = sorted(set(info.get("Features", "").split()))
    mkl = []
    get = _mkl_cbwr_get()
    if get is not None:
        mkl.append(f"cbwr={get(_MKL_CBWR_ALL):#x}")
        branch = _mkl_auto_branch()
        if branch is not None:
            mkl.append(f"branch={branch()}")
    env = [f"{k}={os.environ[k]}" for k in _KERNEL_ENV if k in os.environ]
    return " ".join([*ident, torch.backends.cpu.get_cpu_capability(), *mkl, *env, *features])


def native_bf16() -> bool:
    """Whether this CPU has bfloat16 dot-product instructions (AVX512_BF16 or AMX).

    With them oneDNN's bf16 GEMM is ~2x MKL's fp32 one at SmolLM2's layer shapes for 8-128 rows
    (`benches/bf16_gemm.py`), ~5x at 512 with AMX; without them torch emulates bf16 and its
    GEMMs are many times slower than fp32 (BENCH.md), so nothing runs in bf16 there."""
    return bool(_cpu_flags() & {"avx512_bf16", "amx_bf16"})


def bf16_tile_rows() -> int:
    """Rows per bf16 matmul call in steps with prompt tokens: BF16_TILE_ROWS on CPUs with AMX,
    0 (one call, a lone row padded to two) elsewhere (module doc)."""
    return BF16_TILE_ROWS if "amx_bf16" in _cpu_flags() else 0


def reproducible_blas() -> bool | None:
    """Whether torch's MKL runs in its strict reproducible mode (module doc); None where torch
    has no MKL whose mode can be read. Logs a warning once when it is off: MKL reads MKL_CBWR
    at its first computation, so a process that used torch before importing llmserve, or an
    environment that sets another mode, keeps that mode."""
    get = _mkl_cbwr_get()
    if get is None:
        return None
    strict = bool(get(_MKL_CBWR_ALL) & _MKL_CBWR_STRICT)
    if not strict:
        _warn_not_strict()
    return strict


@functools.cache
def _warn_not_strict() -> None:
    log.warning("MKL is not in its strict reproducible mode (MKL_CBWR=%s; MKL reads it when it first "
                "computes, which may have been before llmserve was imported): a prompt may compute "
                "differently when the prefix cache holds its start; set MKL_CBWR=AUTO,STRICT before "
                "the process first uses torch", os.environ.get("MKL_CBWR", "unset"))


def _mkl_function(name: str, argtypes: list):
    """An MKL service function (returning int) from the MKL linked into torch, or None."""
    if not (torch.backends.mkl.is_available() and sys.platform.startswith("linux")):
        return None
    try:
        fn = getattr(ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = argtypes
    fn.restype = ctypes.c_int
    return fn


@functools.cache
def _mkl_cbwr_get():
    """MKL's `mkl_cbwr_get`, or None."""
    return _mkl_function("mkl_serv_cbwr_get", [ctypes.c_int])


@functools.cache
def _mkl_auto_branch():
    """MKL's `mkl_cbwr_get_auto_branch` (the code branch its AUTO setting took), or None."""
    return _mkl_function("mkl_serv_cbwr_get_auto_branch", [])


def in_big_decode_step() -> bool:
    """Whether the current step is a decode step the quantized GEMV does not take (more than
    QUANT_MAX_TOKENS sequences, or no GGUF blocks): its LM head may run in bf16."""
    flags = _flags()
    return flags is not None and not flags[0] and not flags[1]


def pads_small_gemms() -> bool:
    """Whether the current step's matmuls must compute each row as they would alone: a step
    that holds prompt tokens, or a decode step the quantized GEMV takes (its float matmuls: an
    LM head without blocks, LoRA deltas). Their fp32 matmuls are padded to a multiple of
    GEMM_ROW_MULTIPLE rows (MKL computes a lone row as a GEMV, whose sums differ), their bf16
    ones run as `layers._bf16_linear` says."""
    flags = _flags()
    return flags is not None and (flags[0] or flags[1])


def set_engine_threads(n: int) -> None:
    global _engine_threads
    _engine_threads = max(1, n)


def kernel_threads() -> int:
    """Threads a Rust kernel call may use: the engine's count, even while torch runs on one."""
    return _engine_threads or torch.get_num_threads()


@contextmanager
def cpu_step(prompt_tokens: bool, quantized: bool) -> Iterator[None]:
    """Runs one step. `prompt_tokens`: the step holds prompt tokens (holds_prompt_tokens).
    `quantized`: its linears read GGUF blocks and torch runs on one thread (the kernels get
    the engine's threads)."""
    before_step, before_threads = _flags(), torch.get_num_threads()
    _step.flags = (prompt_tokens, quantized)
    if quantized and before_threads > 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        _step.flags = before_step
        if torch.get_num_threads() != before_threads:
            torch.set_num_threads(before_threads)
