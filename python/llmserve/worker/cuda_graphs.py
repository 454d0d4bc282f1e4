"""The CUDA model runner: decode steps replayed as CUDA graphs, KV cache sized from free GPU
memory, greedy sampling on the GPU.

Why graphs: a decode step of a small model is hundreds of tiny kernels; launched one by one
from Python, the GPU idles between them (BENCH.md: a batch-1 step of SmolLM2-135M should take
<= 1.3 ms, its weights read in ~63 us). A graph replays the whole forward with one launch.

How: `DecodeGraphs` owns static input buffers sized for the largest captured batch
(token ids, positions, slot mapping [B]; block tables [B, W] int32 with W covering
max_model_len; seq lens [B] int32). For each captured size b it records the model forward on
the first b rows. A decode-only step of n sequences is padded to the smallest captured b >= n:
padding rows get slot -1 (their K/V is not written) and seq_len 0 (their attention output is
zero), and their hidden states are dropped. The split-K partition of each graph depends only
on b and W, so one graph serves every context length. Steps with prefill chunks run eagerly
with the same CUDA attention path.

Per step the host copies the step's columns in, replays, and reads back the sampled tokens:
sampling runs on the GPU's logits (ModelRunner._execute with worker/sampler.py), so only the
tokens and any logprobs come back (a greedy-only step: one device-to-host sync); top_p rows
whose top candidates hold too little mass add one sync for the radix select.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Sequence

import numpy as np
import torch

from llmserve.worker import cuda_attention
from llmserve.worker.cuda_attention import CudaAttentionMetadata
from llmserve.worker.runner import Launched, ModelRunner, Resolved, fill_placeholders_, has_placeholders
from llmserve.worker.sampler import as_tensor, pinned_for, to_device

log = logging.getLogger("llmserve.worker")


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_num_seqs (padding wastes at most 15 rows)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


class DecodeGraphs:
    """Captured decode forwards for padded batch sizes. With `use_graphs=False` the same
    padded static-buffer path runs eagerly (the reference the graphs are tested against)."""

    def __init__(self, model, kv_cache, block_size: int, max_model_len: int, sizes: Sequence[int],
                 device: torch.device, ops: Any, use_graphs: bool = True):
        self.model, self.kv_cache, self.block_size = model, kv_cache, block_size
        self.sizes = sorted(set(int(b) for b in sizes))
        self.max_size = self.sizes[-1]
        self.width = -(-max_model_len // block_size)   # block-table columns: any context fits
        self.device, self.ops, self.use_graphs = device, ops, use_graphs
        b, i64, i32 = self.max_size, torch.int64, torch.int32
        self.input_ids = torch.zeros(b, dtype=i64, device=device)
        self.positions = torch.zeros(b, dtype=i64, device=device)
        self.slot_mapping = torch.full((b,), -1, dtype=i64, device=device)
        self.block_tables = torch.zeros(b, self.width, dtype=i32, device=device)
        self.seq_lens = torch.zeros(b, dtype=i32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        for rope in (getattr(model, "rope", None), getattr(model, "local_rope", None)):
            if rope is not None:
                # every position a plan can hold: graphs keep reading the tables they were
                # captured with, and eager steps never check positions on the device
                rope.reserve(self.width * block_size)

    def metadata(self, b: int) -> CudaAttentionMetadata:
        """Attention metadata over the first b static rows (all decode, padded)."""
        choose = getattr(self.ops, "choose_partition_size", None)
        part = int(choose(b, self.model.num_kv_heads, self.width * self.block_size)) if choose else 0
        return CudaAttentionMetadata(
            slot_mapping=self.slot_mapping[:b], num_decode=b, decode_token_idx=None,
            block_tables=self.block_tables[:b], seq_lens=self.seq_lens[:b], partition_size=part,
            prefills=(), ops=self.ops)

    def _forward(self, b: int) -> torch.Tensor:
        return self.model.forward(self.input_ids[:b], self.positions[:b], self.metadata(b),
                                  self.kv_cache)

    def capture(self) -> None:
        """Record one graph per size, largest first, sharing one memory pool. The static
        buffers hold padding only (slot -1, seq_len 0), so the warm-up runs write nothing."""
        if not self.use_graphs:
            return
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.inference_mode():
            with torch.cuda.stream(stream):      # warm-up off the default stream, as torch advises
                for b in self.sizes:
                    self._forward(b)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            for b in reversed(self.sizes):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    hidden = self._forward(b)
                self.graphs[b] = (graph, hidden)
        torch.cuda.synchronize(self.device)
        log.info("captured %d decode CUDA graphs (batch sizes %s)", len(self.graphs), self.sizes)

    def padded_size(self, plan) -> int | None:
        """The captured size this plan runs at, or None if it must run eagerly."""
        n = len(plan.seq_lens)
        if n == 0 or n > self.max_size or len(plan.input_ids) != n:
            return None                      # not decode-only, or too large
        if np.asarray(plan.lora_ids).any():
            return None                      # LoRA rows: a graph replays no adapter (models/lora.py)
        tables = np.asarray(plan.block_tables).reshape(n, -1)
        if int(np.asarray(plan.seq_lens).max()) > self.width * self.block_size:
            return None
        if tables.shape[1] > self.width and tables[:, self.width:].any():
            return None
        return next(b for b in self.sizes if b >= n)

    def run(self, plan, b: int) -> torch.Tensor:
        """Fill the static buffers from a decode-only plan padded to b rows; returns the
        final hidden states of the plan's n rows [n, H] (a view of the graph's output)."""
        n = len(plan.seq_lens)
        w = min(self.width, np.asarray(plan.block_tables).reshape(n, -1).shape[1])
        dev = self.device
        self.input_ids[:b].copy_(_padded(plan.input_ids, b, 0, np.int64, dev), non_blocking=True)
        if getattr(plan, "prev_tokens", None) is not None:
            fill_placeholders_(self.input_ids[:b], plan.prev_tokens)
        self.positions[:b].copy_(_padded(plan.positions, b, 0, np.int64, dev), non_blocking=True)
        self.slot_mapping[:b].copy_(_padded(plan.slot_mapping, b, -1, np.int64, dev), non_blocking=True)
        self.seq_lens[:b].copy_(_padded(plan.seq_lens, b, 0, np.int32, dev), non_blocking=True)
        tables = torch.from_numpy(np.ascontiguousarray(np.asarray(plan.block_tables).reshape(n, -1)[:, :w],
                                                       dtype=np.int32))
        self.block_tables[:n, :w].copy_(pinned_for(tables, dev), non_blocking=True)
        if self.use_graphs:
            graph, hidden = self.graphs[b]
            graph.replay()
        else:
            hidden = self._forward(b)
        return hidden[:n]


def _padded(column, b: int, fill: int, dtype, device: torch.device) -> torch.Tensor:
    out = np.full(b, fill, dtype=dtype)
    col = np.asarray(column)
    out[:len(col)] = col
    return pinned_for(torch.from_numpy(out), device)


# Whether the CUDA runner runs the fused layer ops (csrc/layer_ops.cu: RMSNorm with the residual
# add, SwiGLU's product, RoPE in place): "1" on, "0" off (the default until a GPU run has
# checked them: tests/gpu/test_kernels.py, benches/step_profile.py).
FUSED_OPS_ENV = "LLMSERVE_FUSED_OPS"


def fused_ops_requested() -> bool:
    """What LLMSERVE_FUSED_OPS asks for (default off)."""
    value = os.environ.get(FUSED_OPS_ENV, "").strip() or "0"
    if value not in ("0", "1"):
        raise ValueError(f"{FUSED_OPS_ENV}={value!r}: expected 0 or 1")
    return value == "1"


def use_fused_ops(model, ops: Any, dtype: torch.dtype) -> bool:
    """Hand `model` the fused layer ops of `ops` when they serve its sizes; False (logged) when
    they do not, or the model has no fused path."""
    from llmserve.models.layers import GateUpMLP

    if not hasattr(model, "set_fused_ops"):
        log.warning("fused layer ops not used: %s has no fused path", type(model).__name__)
        return False
    inter = {m.intermediate for m in model.modules() if isinstance(m, GateUpMLP)}
    why = ops.fused_unserved(model.config.hidden_size, inter, model.head_dim, dtype)
    if why is not None:
        log.warning("fused layer ops not used: %s", why)
        return False
    model.set_fused_ops(ops)
    log.info("fused layer ops on (%s)", FUSED_OPS_ENV)
    return True


class CudaModelRunner(ModelRunner):
    """ModelRunner on a CUDA device with our kernels: same `execute(plan) -> SampleOutput`."""

    def __init__(self, model, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str, *, seed: int | None = None, max_num_seqs: int = 64,
                 max_model_len: int = 2048, cuda_graphs: bool = True,
                 capture_sizes: Sequence[int] | None = None, ops: Any = None,
                 prefill_attention: str | None = None, fused_ops: bool | None = None):
        """ops: the op provider (default: the compiled llmserve.kernels; tests pass
        llmserve.kernels.reference). cuda_graphs: capture decode graphs (needs a CUDA device).
        prefill_attention: "sdpa" or "varlen" (cuda_attention.py; default: LLMSERVE_PREFILL_ATTENTION).
        fused_ops: run the model's layers with the fused ops of `ops` where they serve it
        (default: LLMSERVE_FUSED_OPS); this sets them on `model`."""
        super().__init__(model, num_blocks, block_size, dtype, device, seed=seed)
        mode = prefill_attention or cuda_attention.prefill_attention()
        if mode not in cuda_attention.PREFILL_MODES:
            raise ValueError(f"prefill_attention {mode!r}: expected one of {cuda_attention.PREFILL_MODES}")
        self.varlen_prefill = mode == "varlen"
        if ops is None:
            from llmserve.worker.cuda_attention import default_ops

            ops = default_ops()
        self.ops = ops
        wanted = fused_ops_requested() if fused_ops is None else fused_ops
        self.fused_ops = wanted and use_fused_ops(model, ops, dtype)
        if not self.fused_ops and hasattr(model, "set_fused_ops"):
            model.set_fused_ops(None)     # (a runner made before may have set them)
        sizes = list(capture_sizes) if capture_sizes else default_capture_sizes(max_num_seqs)
        self.graphs = DecodeGraphs(model, self.kv_cache, block_size, max_model_len, sizes,
                                   self.device, ops, use_graphs=cuda_graphs)
        try:
            self.graphs.capture()
        except RuntimeError as e:
            # NOTE: serving eagerly is slower but correct (the gpu tests check that capture works)
            log.warning("CUDA graph capture failed, decode runs eagerly: %s", e)
            self.graphs.graphs.clear()
            self.graphs.use_graphs = False

    def with_inputs_from(self, plan, prev: Launched | None):
        """Placeholders are filled on the GPU from `prev`'s sampled tokens (run_model), so a
        plan made ahead is queued behind its step without waiting for it."""
        if not has_placeholders(plan):
            return plan
        if prev is None:
            raise ValueError("this plan was made ahead: pass the step before it")
        return Resolved(plan, np.asarray(plan.input_ids), to_device(prev.device_tokens(), self.device))

    def run_model(self, plan) -> torch.Tensor:
        b = self.graphs.padded_size(plan)
        if b is not None:
            return self.graphs.run(plan, b)
        dev = self.device
        input_ids = to_device(as_tensor(plan.input_ids, torch.int64), dev)
        if getattr(plan, "prev_tokens", None) is not None:
            fill_placeholders_(input_ids, plan.prev_tokens)
        positions = to_device(as_tensor(plan.positions, torch.int64), dev)
        slot_mapping = to_device(as_tensor(plan.slot_mapping, torch.int64), dev)
        seq_lens = np.asarray(plan.seq_lens)
        meta = CudaAttentionMetadata.build(
            np.asarray(plan.query_start_loc), seq_lens,
            np.asarray(plan.block_tables).reshape(len(seq_lens), -1), slot_mapping,
            self.block_size, dev, self.model.num_kv_heads, ops=self.ops, varlen=self.varlen_prefill)
        return self.forward(plan, input_ids, positions, meta)


def make_cuda_runner(model, num_blocks: int, block_size: int, dtype: torch.dtype,
                     device: torch.device, *, max_num_seqs: int, max_model_len: int,
                     seed: int | None = None) -> ModelRunner:
    """The runner for a CUDA device: CudaModelRunner when our kernels serve this model here,
    else (with a warning saying why) the torch reference path, which runs on CUDA too."""
    from llmserve import kernels

    why = kernels_unused_because(model, block_size, dtype)
    if why is not None:
        log.warning("CUDA kernels not used (%s): serving with the torch attention path, no CUDA graphs", why)
        return ModelRunner(model, num_blocks, block_size, dtype, device, seed=seed)
    # (an MoE layer reads on the host which experts a step runs: no graph can hold it. LoRA
    # adapters do too, which rows each takes: steps with adapter rows run eagerly, the others
    # replay graphs, DecodeGraphs.padded_size)
    graphs = model.config.moe is None
    if not graphs:
        log.info("mixture-of-experts layers: decode steps run eagerly, not as CUDA graphs")
    return CudaModelRunner(model, num_blocks, block_size, dtype, device, seed=seed, max_num_seqs=max_num_seqs,
                           max_model_len=max_model_len, ops=kernels, cuda_graphs=graphs)


def kernels_unused_because(model, block_size: int, dtype: torch.dtype) -> str | None:
    """Why our CUDA kernels cannot serve this model (its shapes, a missing nvcc, a failed
    build), or None when they can; loads them (the first use on a machine compiles them)."""
    from llmserve import kernels

    why = kernels.supports(model.config.num_heads, model.num_kv_heads, model.head_dim, block_size, dtype)
    if why is None and model.config.attn_softcap:
        why = "attention soft-capping (Gemma 2) is not in our kernels"
    if why is None:
        why = kernels.missing_toolchain()
    if why is None:
        try:
            kernels.load()
        except kernels.KernelsUnavailable as e:
            why = str(e)
    return why


def activation_reserve_bytes(hidden_size: int, intermediate_size: int, vocab_size: int,
                             max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """GPU memory kept free for one step's activations, the graphs' pool and cuBLAS: the
    largest live tensors are the fused gate|up output [T, 2I] with its SiLU product and the
    fp32 logits [R, V] (plus their copy for sampling)."""
    per_token = (3 * intermediate_size + 8 * hidden_size) * 4
    return 512 * 2**20 + max_num_batched_tokens * per_token + 3 * max_num_seqs * vocab_size * 4


def kv_blocks_from_free_memory(device: torch.device, block_bytes: int, utilization: float,
                               reserve_bytes: int) -> int:
    """Blocks that fit in `utilization` of the GPU's memory after what is already in use (the
    weights, other processes) and `reserve_bytes` for activations. Call after loading the model."""
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return kv_blocks_for_budget(free, total, block_bytes, utilization, reserve_bytes)


def kv_blocks_for_budget(free: int, total: int, block_bytes: int, utilization: float,
                         reserve_bytes: int) -> int:
    """The arithmetic of `kv_blocks_from_free_memory`: of `utilization * total`, what is
    already used (total - free) and the activation reserve are taken first."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
    budget = total * utilization - (total - free) - reserve_bytes
    if budget < block_bytes * 2:
        raise RuntimeError(
            f"no GPU memory left for the KV cache: {free / 2**30:.1f} of {total / 2**30:.1f} GiB free, "
            f"utilization {utilization}, {reserve_bytes / 2**30:.1f} GiB kept for activations: "
            "raise --gpu-memory-utilization or free the GPU")
    return int(budget // block_bytes)
