"""Paged attention on CPU in plain torch: the reference path (and test oracle for the CUDA ops).

Per layer and step: the new K/V rows are written into the paged cache at `slot_mapping`, then
every sequence attends over its whole context (cached prefix + new tokens), read back through
its block table. Two groups, decided once per step in `AttentionMetadata.build`:

- decode group: sequences with exactly one query token. Their blocks are gathered into one
  [S, W * block_size] key window and run as ONE SDPA call with a key-padding mask, so a batch
  of 64 decodes costs one call per layer, not 64. In a step of generated tokens alone
  (`generated`: with speculation a sequence computes its sampled token and the drafts after
  it) every token is a decode row of its own, over its sequence's blocks up to its position.
- prefill group: sequences with several query tokens (a prompt, or a chunk of one). One SDPA
  per sequence; a chunk that continues a cached prefix uses the lower-right causal alignment
  (query i at absolute position p sees keys 0..p).

On CPU, float32 rows skip the gather: the Rust kernel `llmserve._core.paged_decode_attention`
(rust/kernels) reads K/V in place through the block tables, one work item per (row, kv head),
online softmax in f32 (BENCH.md: the gather + padded SDPA read KV at ~5 GB/s). It reads a
float32, bfloat16 or fp8 cache (--kv-cache-dtype), widening each block to f32 as it goes.
Decode rows use it always; in a step with prompt rows, every token is its own row of it (each
with its sequence's block table and its own position + 1 as length), because its result for a
token depends only on that token and its context, while SDPA's shifts in the last bits with the
query count: a prompt must compute the same whether or not the prefix cache held its start
(worker/threads.py). The torch path stays the reference and the fallback (other dtypes or
devices, an extension without the kernel); `USE_CPU_DECODE_KERNEL = False` forces it.

Batch-invariant mode (--batch-invariant) uses the same per-token rows, and refuses to run
without the kernel.

A sliding window (`window` > 0: Mistral's, Gemma 3's local layers) limits each query to the
last `window` keys up to its own position: the kernel starts its rows there, the torch paths
mask the keys before it. The cache still holds every token (nothing is evicted).

A soft cap (`softcap` > 0: Gemma 2's) turns each scaled score s into softcap * tanh(s / softcap)
before the softmax: in the kernel, and in `_sdpa`, which writes the attention out for it (SDPA
has no cap) without repeating KV heads.

KV heads are never repeated: SDPA's `enable_gqa` handles grouped-query attention (BENCH.md:
repeat_interleave makes batch-64 decode ~5x slower). Softmax runs in float32 whatever the
model dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch
import torch.nn.functional as F

from llmserve.worker.kv_cache import kernel_kv_dtype, kernel_view, narrowed, write_kv
from llmserve.worker.threads import kernel_threads

try:
    from llmserve._core import paged_decode_attention as _cpu_decode
except ImportError:     # an extension built before the kernel existed: torch path only
    _cpu_decode = None

# Tests flip this to compare the kernel with the torch reference in one process.
USE_CPU_DECODE_KERNEL = True
# Threads of the kernel; None: the engine's (worker/threads.py).
# NOTE: torch's OpenMP workers spin for a while after each parallel op (libgomp's default wait
# policy), so a second kernel thread shares its core with a spinning worker: at batch 64 x 256
# tokens, 2 torch threads (benches/cpu_decode_attention.py), attention alone is ~1.9x faster
# than the torch path with 2 kernel threads (~1.15x with 1), but whole steps gain only ~3-7%
# either way; with OMP_WAIT_POLICY=passive, 2 kernel threads made the step ~18% faster.
CPU_DECODE_THREADS: int | None = None


@dataclass(frozen=True)
class PrefillSeq:
    """One sequence with several query tokens: rows start:end of the flat step tokens."""

    start: int
    end: int
    context_len: int            # tokens already cached before this step
    seq_len: int                # context_len + (end - start)
    block_ids: torch.Tensor     # [ceil(seq_len / block_size)] int64
    mask: torch.Tensor | None   # [end - start, seq_len] bool (True = attend); None: plain causal


class GatherWorkspace:
    """Reusable buffers for the block gathers, grown on demand and shared by every layer.

    NOTE: gathering into a fresh multi-MB tensor per layer page-faults on every call (the
    allocator returns big blocks to the OS); reusing one buffer made a batch-64 decode gather
    ~8x faster on CPU."""

    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}

    def take(self, name: str, rows: int, like: torch.Tensor) -> torch.Tensor:
        """A [rows, block_numel] buffer matching the cache `like` [N, bs, kvh, d]."""
        cols = like[0].numel()
        buf = self._bufs.get(name)
        if (buf is None or buf.numel() < rows * cols or buf.dtype != like.dtype
                or buf.device != like.device):
            buf = torch.empty(rows * cols, dtype=like.dtype, device=like.device)
            self._bufs[name] = buf
        return buf[:rows * cols].view(rows, cols)


@dataclass(frozen=True)
class AttentionMetadata:
    """Everything attention needs for one step, derived once from the Plan's columns."""

    slot_mapping: torch.Tensor              # [T] int64: where each token's K/V is written
    block_size: int
    num_decode: int                         # Sd
    decode_token_idx: torch.Tensor | None   # [Sd] rows of the decode tokens; None: all T, in order
    prefills: tuple[PrefillSeq, ...]
    device: torch.device
    workspace: GatherWorkspace | None = None    # None: gathers allocate fresh tensors
    decode_tables_np: np.ndarray | None = None  # [Sd, Wd] int32, the CPU kernel's block tables
    decode_lens_np: np.ndarray | None = None    # [Sd] int32
    query_start_loc_np: np.ndarray | None = None    # [S+1] int64, for the per-token tables
    seq_lens_np: np.ndarray | None = None           # [S] int64
    block_tables_np: np.ndarray | None = None       # [S, W] int64
    # (prefill index or None for the decode rows, window) -> mask: window_mask
    window_masks: dict[tuple[int | None, int], torch.Tensor] = field(default_factory=dict, repr=False,
                                                                    compare=False)

    # NOTE: the torch path's decode tables and key mask are made when it first reads them:
    # the Rust kernels read the numpy columns, and in a batch-1 decode step these few torch
    # ops cost ~0.2 ms (the weights just streamed through the caches; see Sampler.sample_plan).
    @cached_property
    def decode_block_tables(self) -> torch.Tensor:
        """[Sd, Wd] int64, Wd = blocks of the longest decode sequence."""
        return torch.from_numpy(self.decode_tables_np.astype(np.int64)).to(self.device)

    @cached_property
    def decode_key_mask(self) -> torch.Tensor:
        """[Sd, 1, 1, Wd * block_size] bool: key j < seq_len."""
        width = self.decode_tables_np.shape[1]
        key_pos = torch.arange(width * self.block_size, device=self.device)
        lens = torch.from_numpy(self.decode_lens_np.astype(np.int64)).to(self.device)
        return (key_pos[None, :] < lens[:, None])[:, None, None, :]

    def window_mask(self, prefill: int | None, window: int) -> torch.Tensor:
        """The mask of a sliding-window layer: for the decode rows (`prefill` None)
        decode_key_mask limited to each sequence's last `window` keys ([Sd, 1, 1, Wd * bs]),
        for prefill sequence `prefill` the causal mask limited the same way ([Tq, seq_len]): key
        j is seen by the query at position p when p - window < j <= p. Made once per step."""
        mask = self.window_masks.get((prefill, window))
        if mask is None:
            if prefill is None:
                key_pos = torch.arange(self.decode_tables_np.shape[1] * self.block_size, device=self.device)
                q_pos = torch.from_numpy(self.decode_lens_np.astype(np.int64)).to(self.device)[:, None] - 1
            else:
                p = self.prefills[prefill]
                key_pos = torch.arange(p.seq_len, device=self.device)
                q_pos = torch.arange(p.end - p.start, device=self.device)[:, None] + p.context_len
            mask = (key_pos[None, :] <= q_pos) & (key_pos[None, :] > q_pos - window)
            if prefill is None:
                mask = mask[:, None, None, :]
            self.window_masks[(prefill, window)] = mask
        return mask

    @cached_property
    def per_token_tables(self) -> tuple[np.ndarray, np.ndarray]:
        """Every query token as a kernel row (steps with prompt rows, batch-invariant mode) ->
        (block tables [T, W] int32, its sequence's block table; seq lens [T] int32, its
        position + 1)."""
        return _token_rows(self.query_start_loc_np, self.seq_lens_np, self.block_tables_np, self.block_size)

    @classmethod
    def build(cls, query_start_loc: np.ndarray, seq_lens: np.ndarray, block_tables: np.ndarray,
              slot_mapping: torch.Tensor, block_size: int, device: torch.device,
              workspace: GatherWorkspace | None = None, generated: bool = False) -> "AttentionMetadata":
        """From the Plan columns: query_start_loc [S+1], seq_lens [S], block_tables [S, W].
        `generated`: the step holds no prompt tokens (every token a decode row; module doc)."""
        # NOTE: copies (small): the Rust Plan's arrays are read-only, which torch.from_numpy rejects
        qsl = np.array(query_start_loc, dtype=np.int64)
        lens = np.array(seq_lens, dtype=np.int64)
        tables = np.array(block_tables, dtype=np.int64).reshape(len(lens), -1)
        q_lens = np.diff(qsl)
        if generated and len(q_lens) and q_lens.max() > 1:
            # each token as the sequence it would be in its own decode step: its own position + 1
            # keys of its sequence's blocks (their K/V is written for every token first)
            tables, lens = _token_rows(qsl, lens, tables, block_size)
            qsl = np.arange(len(lens) + 1, dtype=np.int64)
            q_lens = np.ones(len(lens), np.int64)
        dec, all_decode, width = decode_rows(qsl, lens, block_size)
        dec_lens = lens[dec]
        dec_idx = None if all_decode else torch.from_numpy(qsl[dec]).to(device)

        prefills = []
        for s in np.flatnonzero(q_lens > 1):
            start, end, seq_len = int(qsl[s]), int(qsl[s + 1]), int(lens[s])
            ctx = seq_len - (end - start)
            nblk = -(-seq_len // block_size)
            mask = None
            if ctx > 0:
                # lower-right causal: query i sits at absolute position ctx + i
                q_pos = torch.arange(end - start, device=device) + ctx
                mask = torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None]
            ids = torch.from_numpy(np.ascontiguousarray(tables[s, :nblk])).to(device)
            prefills.append(PrefillSeq(start, end, ctx, seq_len, ids, mask))

        return cls(slot_mapping=slot_mapping, block_size=block_size, num_decode=len(dec),
                   decode_token_idx=dec_idx, prefills=tuple(prefills), device=device,
                   workspace=workspace,
                   decode_tables_np=np.ascontiguousarray(tables[dec, :width], dtype=np.int32),
                   decode_lens_np=dec_lens.astype(np.int32), query_start_loc_np=qsl,
                   seq_lens_np=lens, block_tables_np=tables)


def decode_rows(qsl: np.ndarray, lens: np.ndarray, block_size: int) -> tuple[np.ndarray, bool, int]:
    """A step's decode sequences (one query token each; the others are prompt chunks, or
    scheduled with no token), from query_start_loc [S+1] and seq_lens [S]: (their indices,
    whether they are the whole step, the block-table width their longest context needs). The
    CPU and CUDA attention metadata split a step alike."""
    dec = np.flatnonzero(np.diff(qsl) == 1)
    num_tokens = int(qsl[-1]) if len(qsl) else 0
    all_decode = len(dec) == len(lens) and num_tokens == len(dec)
    width = int(-(-lens[dec].max() // block_size)) if len(dec) else 0
    return dec, all_decode, width


def _token_rows(qsl: np.ndarray, lens: np.ndarray, tables: np.ndarray,
                block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Every query token as a row of its own: (block tables [T, W] int32, its sequence's; seq
    lens [T] int32, its position + 1), from query_start_loc [S+1], seq_lens [S] and block
    tables [S, W]."""
    q_lens = np.diff(qsl)
    seq_of = np.repeat(np.arange(len(lens)), q_lens)
    # token j of sequence s (rows qsl[s]..qsl[s+1]) sits at lens[s] - (qsl[s+1] - j)
    token_lens = lens[seq_of] - (qsl[1:][seq_of] - np.arange(int(qsl[-1])) - 1)
    width = int(-(-token_lens.max() // block_size)) if len(token_lens) else 0
    return (np.ascontiguousarray(tables[seq_of, :width], dtype=np.int32),
            np.ascontiguousarray(token_lens, dtype=np.int32))


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, workspace: GatherWorkspace | None,
            name: str) -> torch.Tensor:
    """cache [N, bs, kvh, d], block_ids [..., W] -> [..., W * bs, kvh, d] (a copy)."""
    # NOTE: index_select on whole flattened blocks is ~7x faster on CPU than `cache[block_ids]`
    # (advanced indexing).
    ids = block_ids.reshape(-1)
    flat = cache.view(cache.shape[0], -1)
    if workspace is None:
        g = flat.index_select(0, ids)
    else:
        g = torch.index_select(flat, 0, ids, out=workspace.take(name, ids.numel(), cache))
    return g.view(*block_ids.shape[:-1], -1, cache.shape[2], cache.shape[3])


def _kernel_serves(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   meta: AttentionMetadata) -> bool:
    return (USE_CPU_DECODE_KERNEL and _cpu_decode is not None and meta.decode_lens_np is not None
            and q.device.type == "cpu" and q.dtype == torch.float32
            and k_cache.dtype == v_cache.dtype and kernel_kv_dtype(k_cache) is not None
            and k_cache.is_contiguous() and v_cache.is_contiguous())


def _decode_kernel(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   tables: np.ndarray, lens: np.ndarray, scale: float, window: int,
                   softcap: float) -> torch.Tensor:
    """q [R, heads, d] fp32 -> [R, heads, d], K/V read in place (numpy views, no copy; a
    bfloat16 or fp8 cache is widened to f32 a block at a time); row r attends over the first
    lens[r] tokens of block table tables[r] (the last `window` of them)."""
    q = q.contiguous()
    out = torch.empty_like(q)
    _cpu_decode(out.numpy(), q.numpy(), kernel_view(k_cache), kernel_view(v_cache), tables, lens, scale,
                CPU_DECODE_THREADS or kernel_threads(), window, softcap, kernel_kv_dtype(k_cache))
    return out


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
          softcap: float) -> torch.Tensor:
    """q [B, heads, Tq, d], k/v [B, kv_heads, L, d], mask (True: attend) broadcast to
    [B, heads, Tq, L] or None for causal (Tq == L) -> [B, heads, Tq, d]. SDPA; or, with a soft
    cap, the same written out, each KV head's query heads stacked as rows of one matmul."""
    if not softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                              scale=scale, enable_gqa=True)
    b, h, tq, d = q.shape
    kvh, length = k.shape[1], k.shape[2]
    s = (q.reshape(b, kvh, h // kvh * tq, d) @ k.transpose(-1, -2)).view(b, h, tq, length)
    s = s.mul_(scale / softcap).tanh_().mul_(softcap)
    if mask is None:
        mask = torch.ones(tq, length, dtype=torch.bool, device=q.device).tril_()
    s = s.masked_fill_(~mask, float("-inf")).softmax(-1)
    return (s.view(b, kvh, h // kvh * tq, length) @ v).view(b, h, tq, d)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, *,
                    batch_invariant: bool = False, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """q [T, heads, d], k/v [T, kv_heads, d], caches [N, block_size, kv_heads, d]
    -> [T, heads, d]. `batch_invariant`: every token through the CPU kernel (module doc).
    `window` > 0: each query sees only the last `window` keys up to its position. `softcap`
    > 0: scores soft-capped (module doc)."""
    if not isinstance(meta, AttentionMetadata):
        if softcap:
            # (kernels_unused_because sends a soft-capped model to the torch path instead)
            raise RuntimeError("our CUDA attention kernels have no soft cap")
        # the CUDA path (worker/cuda_attention.py) brings its own metadata and csrc ops.
        # NOTE: they have no window: the engine serves a model they take up to its window,
        # where full attention is the same (engine/build.py).
        return meta.attend(q, k, v, k_cache, v_cache, scale)
    write_kv(k_cache, v_cache, meta.slot_mapping, k, v)
    kernel = _kernel_serves(q, k_cache, v_cache, meta)    # (float32 models: before q is widened below)
    if batch_invariant or meta.prefills:
        # Every token as its own kernel row, so a token's result does not depend on the rest of
        # the step: a prompt computes the same however it was split into steps (a prefix-cache
        # hit computes only the tail; worker/threads.py). SDPA's results shift in the last bits
        # with the query count.
        if kernel:
            return _decode_kernel(q, k_cache, v_cache, *meta.per_token_tables, scale, window, softcap)
        if batch_invariant:
            raise RuntimeError("batch-invariant attention needs the CPU decode kernel "
                               "(float32 on CPU)")
    out_dtype = q.dtype
    # NOTE: softmax in float32 whatever the model dtype (a no-op for fp32 models).
    q, k, v = q.float(), k.float(), v.float()
    if meta.num_decode:
        idx = meta.decode_token_idx
        if kernel:
            od = _decode_kernel(q if idx is None else q[idx], k_cache, v_cache,
                                meta.decode_tables_np, meta.decode_lens_np, scale, window, softcap)
        else:
            qd = (q if idx is None else q[idx]).unsqueeze(2)                # [Sd, heads, 1, d]
            tables, ws = meta.decode_block_tables, meta.workspace
            kd = _gather(k_cache, tables, ws, "k").float().transpose(1, 2)  # [Sd, kvh, L, d]
            vd = _gather(v_cache, tables, ws, "v").float().transpose(1, 2)
            mask = meta.window_mask(None, window) if window else meta.decode_key_mask
            od = _sdpa(qd, kd, vd, mask, scale, softcap).squeeze(2)
        if idx is None:          # every token of the step is a decode token, in order
            return od.to(out_dtype)
    out = q.new_empty(q.shape)
    if meta.num_decode:
        out[meta.decode_token_idx] = od
    for i, p in enumerate(meta.prefills):
        qp = q[p.start:p.end].transpose(0, 1).unsqueeze(0)                  # [1, heads, Tq, d]
        if p.context_len == 0:
            # whole context is in this step: use the fresh K/V, no gather (rounded as the cache
            # keeps them, so that a token computes the same as when its prefix is cached)
            kp, vp = k[p.start:p.end], v[p.start:p.end]
            if k_cache.dtype != out_dtype:   # (a cache of the model's own dtype keeps them exactly)
                kp, vp = narrowed(kp, k_cache.dtype).float(), narrowed(vp, v_cache.dtype).float()
        else:
            kp = _gather(k_cache, p.block_ids, meta.workspace, "k")[:p.seq_len].float()
            vp = _gather(v_cache, p.block_ids, meta.workspace, "v")[:p.seq_len].float()
        kp, vp = kp.transpose(0, 1).unsqueeze(0), vp.transpose(0, 1).unsqueeze(0)  # [1, kvh, L, d]
        mask = meta.window_mask(i, window) if window else p.mask
        op = _sdpa(qp, kp, vp, mask, scale, softcap)
        out[p.start:p.end] = op.squeeze(0).transpose(0, 1)
    return out.to(out_dtype)
