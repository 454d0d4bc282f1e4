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
with the same CUDA attention path, or with LLMSERVE_PIECEWISE_GRAPHS=1 as `PiecewiseGraphs`:
one graph per stretch of layer work between two attentions, the attention run eagerly between
them.

Per step the host copies the step's columns in, replays, and reads back the sampled tokens:
sampling runs on the GPU's logits (ModelRunner._execute with worker/sampler.py), so only the
tokens and any logprobs come back (a greedy-only step: one device-to-host sync); top_p rows
whose top candidates hold too little mass add one sync for the radix select.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Sequence

import numpy as np
import torch

from llmserve.config import default_capture_sizes, env_switch
from llmserve.worker import cuda_attention
from llmserve.worker.cuda_attention import CudaAttentionMetadata
from llmserve.worker.runner import Launched, ModelRunner, Resolved, fill_placeholders_, has_placeholders
from llmserve.worker.sampler import as_tensor, pinned_for, to_device

log = logging.getLogger("llmserve.worker")


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
        # (the split count follows the batch size alone: the kernel sizes each sequence's
        # partitions from its length on the device, so the graph serves every context)
        choose = getattr(self.ops, "choose_num_splits", None)
        splits = int(choose(b, self.model.num_kv_heads, self.width * self.block_size)) if choose else 0
        return CudaAttentionMetadata(
            slot_mapping=self.slot_mapping[:b], num_decode=b, decode_token_idx=None,
            block_tables=self.block_tables[:b], seq_lens=self.seq_lens[:b], num_splits=splits,
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


# Steps with prompt tokens as piecewise CUDA graphs (`PiecewiseGraphs`): "1" on, "0" off (the
# default until a GPU run has checked them: tests/gpu/test_cuda_model.py, gpu_check's serving).
PIECEWISE_ENV = "LLMSERVE_PIECEWISE_GRAPHS"


def piecewise_requested() -> bool:
    """What LLMSERVE_PIECEWISE_GRAPHS asks for (default off)."""
    return env_switch(PIECEWISE_ENV)


def default_piece_sizes(max_tokens: int) -> list[int]:
    """Token counts the piecewise graphs are captured for: powers of two from 16 to 512, then
    every 512 to 4096 and every 1024 beyond, up to `max_tokens` (the step token budget). A
    step is padded to the next one: a quarter of it at most from 1024 tokens on."""
    sizes = [t for t in (16, 32, 64, 128, 256, 512) if t < max_tokens]
    sizes += [t for t in range(1024, 4097, 512) if t < max_tokens]
    sizes += [t for t in range(5120, max_tokens, 1024)]
    return sorted(set(sizes + [max_tokens]))


class _Cuts:
    """The attention metadata of a piecewise step: each layer's attention is a cut between two
    pieces. Its q/k/v rows go to the static buffers, `cut(k_cache, v_cache, scale)` runs (in a
    capture: end this piece's graph and begin the next; eagerly: the step's attention), and the
    static output rows come back for the next piece to read."""

    def __init__(self, owner: "PiecewiseGraphs", t: int, cut):
        self.owner, self.t, self.cut = owner, t, cut
        self.cuts: list[tuple[torch.Tensor, torch.Tensor, float]] = []   # (k_cache, v_cache, scale)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        owner, t = self.owner, self.t
        owner.q[:t].copy_(q)
        owner.k[:t].copy_(k)
        owner.v[:t].copy_(v)
        self.cuts.append((k_cache, v_cache, scale))
        self.cut(k_cache, v_cache, scale)
        return owner.o[:t]


class PiecewiseGraphs:
    """Steps with prompt tokens as CUDA graphs of the work between the layers' attentions
    (vLLM's piecewise graphs, without torch.compile).

    A decode graph can hold a whole step because the decode kernel's launch depends only on
    the batch size; prefill attention does not (one SDPA per prompt chunk, each of its own
    length). Everything else in a layer depends only on the step's token count. So for each
    captured count t the model forward is recorded as num_layers + 1 graphs, cut at each
    attention: the capture's attention metadata (`_Cuts`) ends the graph being captured and
    begins the next. A step of n <= t tokens replays piece 0 (embeddings to the first layer's
    q/k/v), then for each layer runs its attention eagerly from the static q/k/v rows [:n]
    into the static output rows and replays the next piece (o_proj, the MLP, the next layer's
    norm and q/k/v; the last one ends with the final norm, copied to a static buffer). Rows
    n..t pad the step: ids and positions 0, never read by attention (the slot mapping and the
    metadata cover the n real rows), their hidden states dropped.

    Host work per step: num_layers + 1 replays and the attention's own launches, where an eager
    forward launches every kernel of every layer (the first H200 run: a batch-1 SmolLM2-135M
    step took 16.6 ms eagerly, 2.2 ms as one graph).

    Every size's pieces share one memory pool; replaying them in the order they were captured,
    one step at a time, is what makes that safe (torch.cuda.graph's rule for shared pools).
    With use_graphs=False the same static-buffer path runs eagerly (the CPU tests' check)."""

    def __init__(self, model, kv_cache, sizes: Sequence[int], device: torch.device, dtype: torch.dtype,
                 use_graphs: bool = True):
        self.model, self.kv_cache, self.device, self.use_graphs = model, kv_cache, device, use_graphs
        self.sizes = sorted(set(int(t) for t in sizes))
        self.max_size = t = self.sizes[-1]
        nh, nkv, d = model.config.num_heads, model.num_kv_heads, model.head_dim
        self.input_ids = torch.zeros(t, dtype=torch.int64, device=device)
        self.positions = torch.zeros(t, dtype=torch.int64, device=device)
        self.q = torch.zeros(t, nh, d, dtype=dtype, device=device)
        self.k = torch.zeros(t, nkv, d, dtype=dtype, device=device)
        self.v = torch.zeros(t, nkv, d, dtype=dtype, device=device)
        self.o = torch.zeros(t, nh, d, dtype=dtype, device=device)
        self.hidden = torch.zeros(t, model.config.hidden_size, dtype=dtype, device=device)
        # per size: the pieces, and the caches and scale of each cut between them
        self.graphs: dict[int, tuple[list, list[tuple[torch.Tensor, torch.Tensor, float]]]] = {}

    def size_for(self, plan) -> int | None:
        """The captured token count this plan runs at, or None (too many tokens, or LoRA rows:
        a graph replays no adapter)."""
        n = len(plan.input_ids)
        if n == 0 or n > self.max_size or np.asarray(plan.lora_ids).any():
            return None
        return next(t for t in self.sizes if t >= n)

    def _forward(self, t: int, cut) -> _Cuts:
        """The forward over the first t static rows, its final hidden states copied to the
        static buffer; `cut` runs at each attention."""
        cuts = _Cuts(self, t, cut)
        hidden = self.model.forward(self.input_ids[:t], self.positions[:t], cuts, self.kv_cache)
        self.hidden[:t].copy_(hidden)
        return cuts

    def capture(self) -> None:
        """Warm every size up (cuBLAS sets up each shape's kernels), then record its pieces,
        largest size first, all in one pool. No attention runs: nothing is written to the cache."""
        if not self.use_graphs:
            return
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.inference_mode(), torch.cuda.stream(stream):
            for t in self.sizes:
                self._forward(t, lambda *cut: None)
            torch.cuda.synchronize(self.device)
            for t in reversed(self.sizes):
                self.graphs[t] = self._capture(t, pool)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        log.info("captured %d piecewise CUDA graphs (%d token counts, up to %d) in %.1f s",
                 sum(len(g) for g, _ in self.graphs.values()), len(self.sizes), self.max_size,
                 time.perf_counter() - start)

    def _capture(self, t: int, pool) -> tuple[list, list]:
        pieces = [torch.cuda.CUDAGraph()]

        def cut(*_):
            pieces[-1].capture_end()
            pieces.append(torch.cuda.CUDAGraph())
            pieces[-1].capture_begin(pool=pool)

        pieces[0].capture_begin(pool=pool)
        try:
            cuts = self._forward(t, cut)
        finally:
            pieces[-1].capture_end()
        return pieces, cuts.cuts

    def run(self, plan, t: int, meta: CudaAttentionMetadata) -> torch.Tensor:
        """The plan's n tokens padded to t: final hidden states [n, H] (a view of the static
        buffer). `meta`: the step's attention metadata over its n real rows."""
        n = len(plan.input_ids)
        dev = self.device
        self.input_ids[:t].copy_(_padded(plan.input_ids, t, 0, np.int64, dev), non_blocking=True)
        if getattr(plan, "prev_tokens", None) is not None:
            fill_placeholders_(self.input_ids[:n], plan.prev_tokens)
        self.positions[:t].copy_(_padded(plan.positions, t, 0, np.int64, dev), non_blocking=True)

        def attention(k_cache, v_cache, scale):
            meta.attend(self.q[:n], self.k[:n], self.v[:n], k_cache, v_cache, scale, out=self.o[:n])

        if not self.use_graphs:
            self._forward(t, attention)
            return self.hidden[:n]
        pieces, cuts = self.graphs[t]
        pieces[0].replay()
        for piece, cut in zip(pieces[1:], cuts):
            attention(*cut)
            piece.replay()
        return self.hidden[:n]


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
    return env_switch(FUSED_OPS_ENV)


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
                 prefill_attention: str | None = None, fused_ops: bool | None = None,
                 piecewise: bool | None = None, max_num_batched_tokens: int = 8192,
                 piece_sizes: Sequence[int] | None = None, eager_padded: bool = False):
        """ops: the op provider (default: the compiled llmserve.kernels; tests pass
        llmserve.kernels.reference). cuda_graphs: capture decode graphs (needs a CUDA device).
        prefill_attention: "sdpa" or "varlen" (cuda_attention.py; default: LLMSERVE_PREFILL_ATTENTION).
        fused_ops: run the model's layers with the fused ops of `ops` where they serve it
        (default: LLMSERVE_FUSED_OPS); this sets them on `model`.
        piecewise: run steps with prompt tokens as piecewise graphs (`PiecewiseGraphs`; default:
        LLMSERVE_PIECEWISE_GRAPHS), of `piece_sizes` tokens (default: `default_piece_sizes` of
        max_num_batched_tokens); captured when cuda_graphs is on, else run on their static
        buffers eagerly (the CPU tests).
        eager_padded: without decode graphs, still run decode-only steps padded on the graphs'
        static buffers, the path a graph records (tests compare replays and the CPU path with it);
        otherwise a step no graph replays (--enforce-eager, MoE, a failed capture, LoRA rows)
        runs at its own size."""
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
        self.eager_padded = eager_padded
        try:
            self.graphs.capture()
        except RuntimeError as e:
            # NOTE: serving eagerly is slower but correct (the gpu tests check that capture works)
            # (with its traceback: a failure inside a capture surfaces as capture_end's error,
            # the first one only in the chain)
            log.warning("CUDA graph capture failed, decode runs eagerly: %s", e, exc_info=True)
            self.graphs.graphs.clear()
            self.graphs.use_graphs = False
        self.pieces: PiecewiseGraphs | None = None
        if piecewise_requested() if piecewise is None else piecewise:
            sizes = list(piece_sizes) if piece_sizes else default_piece_sizes(max_num_batched_tokens)
            self.pieces = PiecewiseGraphs(model, self.kv_cache, sizes, self.device, dtype, use_graphs=cuda_graphs)
            try:
                self.pieces.capture()
            except RuntimeError as e:
                # (their eager static-buffer path would only be slower than the plain forward)
                log.warning("piecewise CUDA graph capture failed, prompt steps run eagerly: %s", e, exc_info=True)
                self.pieces = None

    def with_inputs_from(self, plan, prev: Launched | None):
        """Placeholders are filled on the GPU from `prev`'s sampled tokens (run_model), so a
        plan made ahead is queued behind its step without waiting for it."""
        if not has_placeholders(plan):
            return plan
        if prev is None:
            raise ValueError("this plan was made ahead: pass the step before it")
        return Resolved(plan, np.asarray(plan.input_ids), to_device(prev.device_tokens(), self.device))

    def run_model(self, plan) -> torch.Tensor:
        # (padding a step only pays when a graph replays it)
        b = self.graphs.padded_size(plan) if self.graphs.use_graphs or self.eager_padded else None
        if b is not None:
            return self.graphs.run(plan, b)
        dev = self.device
        slot_mapping = to_device(as_tensor(plan.slot_mapping, torch.int64), dev)
        seq_lens = np.asarray(plan.seq_lens)
        meta = CudaAttentionMetadata.build(
            np.asarray(plan.query_start_loc), seq_lens,
            np.asarray(plan.block_tables).reshape(len(seq_lens), -1), slot_mapping,
            self.block_size, dev, self.model.num_kv_heads, ops=self.ops, varlen=self.varlen_prefill)
        t = self.pieces.size_for(plan) if self.pieces is not None else None
        if t is not None:
            return self.pieces.run(plan, t, meta)
        input_ids = to_device(as_tensor(plan.input_ids, torch.int64), dev)
        if getattr(plan, "prev_tokens", None) is not None:
            fill_placeholders_(input_ids, plan.prev_tokens)
        positions = to_device(as_tensor(plan.positions, torch.int64), dev)
        return self.forward(plan, input_ids, positions, meta)


def make_cuda_runner(model, num_blocks: int, block_size: int, dtype: torch.dtype,
                     device: torch.device, *, max_num_seqs: int, max_model_len: int,
                     max_num_batched_tokens: int = 8192, seed: int | None = None,
                     graphs: bool = True, capture_sizes: Sequence[int] | None = None) -> ModelRunner:
    """The runner for a CUDA device: CudaModelRunner when our kernels serve this model here,
    else (with a warning saying why) the torch reference path, which runs on CUDA too.
    `graphs` False (--enforce-eager): no CUDA graphs of any kind. `capture_sizes`: the decode
    batch sizes captured (None: `default_capture_sizes`)."""
    from llmserve import kernels

    why = kernels_unused_because(model, block_size, dtype)
    if why is not None:
        log.warning("CUDA kernels not used (%s): serving with the torch attention path, no CUDA graphs", why)
        return ModelRunner(model, num_blocks, block_size, dtype, device, seed=seed)
    # (an MoE layer reads on the host which experts a step runs: no graph can hold it. LoRA
    # adapters do too, which rows each takes: steps with adapter rows run eagerly, the others
    # replay graphs, DecodeGraphs.padded_size)
    if not graphs:
        log.info("--enforce-eager: every step runs eagerly, no CUDA graphs")
    elif model.config.moe is not None:
        graphs = False
        log.info("mixture-of-experts layers: decode steps run eagerly, not as CUDA graphs")
    return CudaModelRunner(model, num_blocks, block_size, dtype, device, seed=seed, max_num_seqs=max_num_seqs,
                           max_model_len=max_model_len, ops=kernels, cuda_graphs=graphs,
                           piecewise=None if graphs else False, max_num_batched_tokens=max_num_batched_tokens,
                           capture_sizes=capture_sizes)


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
                             max_num_batched_tokens: int, max_num_seqs: int, piecewise: bool = False) -> int:
    """GPU memory kept free for one step's activations, the graphs' pool and cuBLAS: the
    largest live tensors are the fused gate|up output [T, 2I] with its SiLU product and the
    fp32 logits [R, V] (plus their copy for sampling). `piecewise`: the piecewise graphs' pool
    holds a step's layer activations of its own, beside the eager attention's."""
    per_token = (3 * intermediate_size + 8 * hidden_size) * 4
    steps = 2 if piecewise else 1
    return 512 * 2**20 + steps * max_num_batched_tokens * per_token + 3 * max_num_seqs * vocab_size * 4


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
