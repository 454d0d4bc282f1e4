"""Paged attention on CUDA: our csrc ops for the KV-cache write and the decode tokens, torch
SDPA for prefill chunks.

`CudaAttentionMetadata` plays the role of attention.py's AttentionMetadata on a GPU; the
shared `paged_attention` entry point hands the work to its `attend` method. Per layer and step:

1. `write_kv_cache` scatters the step's K/V rows by slot mapping (-1 = padding row, skipped).
2. Decode group (one query token each): ONE `paged_attention_decode` call over all of them,
   reading the paged cache through int32 block tables: no gather, no repeated KV heads.
3. Prefill group (several query tokens): one SDPA per sequence, exactly like the CPU path: a
   fresh prompt is plain causal over its own K/V; a chunk continuing a cached prefix gathers
   its blocks and uses the lower-right causal alignment (query i at absolute position
   context_len + i sees keys 0..context_len + i). Prefill is compute-bound, where torch's
   flash / memory-efficient kernels are already good; no kernel of ours has been measured
   faster yet. With LLMSERVE_PREFILL_ATTENTION=varlen, one torch `varlen_attn` call (flash
   attention over packed sequences, torch >= 2.10) serves every prefill chunk of the step
   instead, K/V read back from the cache by slot: per-sequence calls cost host time per
   prompt and layer. Not measured on a GPU yet: off by default until benches/step_profile.py
   shows it faster there and the gpu tests hold.

Everything here is built from the Plan's host-side columns once per step, so a decode-only
step issues no host sync in attention. The op module is injectable (`ops`) so the dispatch
logic can be tested against a torch reference on machines without a GPU.
"""

from __future__ import annotations

import functools
import inspect
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from llmserve.worker.attention import decode_rows
from llmserve.worker.sampler import to_device


@dataclass(frozen=True)
class PrefillChunk:
    """One sequence with several query tokens: rows start:end of the flat step tokens."""

    start: int
    end: int
    context_len: int              # tokens cached before this step
    seq_len: int                  # context_len + (end - start)
    block_ids: torch.Tensor       # [ceil(seq_len / block_size)] int64 (device)


# How prefill chunks attend on CUDA: "sdpa" (one SDPA per chunk) or "varlen" (one varlen_attn
# call per layer for the whole step).
PREFILL_ENV = "LLMSERVE_PREFILL_ATTENTION"
PREFILL_MODES = ("sdpa", "varlen")


def prefill_attention() -> str:
    """The prefill attention LLMSERVE_PREFILL_ATTENTION asks for (default "sdpa")."""
    mode = os.environ.get(PREFILL_ENV, "").strip().lower() or "sdpa"
    if mode not in PREFILL_MODES:
        raise ValueError(f"{PREFILL_ENV}={mode!r}: expected one of {', '.join(PREFILL_MODES)}")
    return mode


@dataclass(frozen=True)
class VarlenPrefill:
    """Every prefill chunk of a step as one packed varlen_attn call (tensors on the device)."""

    rows: torch.Tensor        # [Tq] int64: the chunks' query rows among the step's tokens
    slots: torch.Tensor       # [Tk] int64: cache slots of each chunk's keys (cached prefix + chunk)
    cu_q: torch.Tensor        # [P + 1] int32: cumulative query counts
    cu_k: torch.Tensor        # [P + 1] int32: cumulative key counts
    max_q: int
    max_k: int


def default_ops() -> Any:
    """The compiled ops (built on first use); imported lazily so CPU machines never need them."""
    from llmserve import kernels

    kernels.load()
    return kernels


@dataclass(frozen=True)
class CudaAttentionMetadata:
    """Everything attention needs for one step on CUDA (tensors on the device)."""

    slot_mapping: torch.Tensor              # [T] int64; -1 = padding row (not written)
    num_decode: int                         # Sd
    decode_token_idx: torch.Tensor | None   # [Sd] int64 rows of the decode tokens; None: rows 0..T-1, all decode
    block_tables: torch.Tensor              # [Sd, W] int32 (decode sequences)
    seq_lens: torch.Tensor                  # [Sd] int32, 0 = padding row (output zeros)
    num_splits: int                         # split-K partitions per sequence for the decode kernel (0: none)
    prefills: tuple[PrefillChunk, ...]
    ops: Any                                # write_kv_cache / paged_attention_decode provider
    varlen: VarlenPrefill | None = None     # the prefill chunks as one call (then `prefills` is empty)

    @classmethod
    def build(cls, query_start_loc: np.ndarray, seq_lens: np.ndarray, block_tables: np.ndarray,
              slot_mapping: torch.Tensor, block_size: int, device: torch.device,
              num_kv_heads: int, ops: Any = None, varlen: bool = False) -> "CudaAttentionMetadata":
        """From the Plan columns: query_start_loc [S+1], seq_lens [S], block_tables [S, W].
        `varlen`: the prefill chunks go through one varlen_attn call (`VarlenPrefill`)."""
        ops = default_ops() if ops is None else ops
        qsl = np.asarray(query_start_loc, dtype=np.int64)
        lens = np.asarray(seq_lens, dtype=np.int64)
        tables = np.asarray(block_tables).reshape(len(lens), -1)
        q_lens = np.diff(qsl)
        dec, all_decode, width = decode_rows(qsl, lens, block_size)
        dec_lens = lens[dec]
        # NOTE: to_device copies from pinned memory without waiting, so the step's only host
        # sync stays the read-back of the sampled tokens.
        dec_tables = to_device(torch.from_numpy(np.ascontiguousarray(tables[dec, :width], dtype=np.int32)), device)
        dec_seq_lens = to_device(torch.from_numpy(dec_lens.astype(np.int32)), device)
        dec_idx = None if all_decode else to_device(torch.from_numpy(qsl[dec]), device)
        splits = _choose_splits(ops, len(dec), num_kv_heads, width * block_size)

        prefills, packed = [], None
        chunks = np.flatnonzero(q_lens > 1)
        if varlen and len(chunks):
            packed = _packed_prefill(qsl, lens, tables, chunks, block_size, device)
        else:
            for s in chunks:
                start, end, seq_len = int(qsl[s]), int(qsl[s + 1]), int(lens[s])
                nblk = -(-seq_len // block_size)
                ids = to_device(torch.from_numpy(np.ascontiguousarray(tables[s, :nblk], dtype=np.int64)), device)
                prefills.append(PrefillChunk(start, end, seq_len - (end - start), seq_len, ids))
        return cls(slot_mapping=slot_mapping, num_decode=len(dec), decode_token_idx=dec_idx,
                   block_tables=dec_tables, seq_lens=dec_seq_lens, num_splits=splits,
                   prefills=tuple(prefills), ops=ops, varlen=packed)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, heads, d], k/v [T, kv_heads, d], caches [N, block_size, kv_heads, d] -> [T, heads, d]
        (written into `out` when given: contiguous, shaped and typed like q)."""
        if k.dtype != k_cache.dtype:
            k, v = k.to(k_cache.dtype), v.to(k_cache.dtype)
        self.ops.write_kv_cache(k, v, k_cache, v_cache, self.slot_mapping)
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if self.num_decode:
            idx = self.decode_token_idx
            if idx is None:       # every row is a decode token (CUDA-graph batches always are)
                self.ops.paged_attention_decode(out, q, k_cache, v_cache, self.block_tables,
                                                self.seq_lens, scale, self.num_splits)
                return out
            od = torch.empty((idx.numel(), *q.shape[1:]), dtype=q.dtype, device=q.device)
            self.ops.paged_attention_decode(od, q[idx], k_cache, v_cache, self.block_tables,
                                            self.seq_lens, scale, self.num_splits)
            out[idx] = od
        for p in self.prefills:
            out[p.start:p.end] = _prefill(q[p.start:p.end], k[p.start:p.end], v[p.start:p.end],
                                          k_cache, v_cache, p, scale)
        if self.varlen is not None:
            out.index_copy_(0, self.varlen.rows, _varlen_prefill(self.ops, q, k_cache, v_cache, self.varlen, scale))
        return out


def _packed_prefill(qsl: np.ndarray, lens: np.ndarray, tables: np.ndarray, chunks: np.ndarray,
                    block_size: int, device: torch.device) -> VarlenPrefill:
    """The step's prefill chunks (sequences `chunks`) packed for varlen_attn: each chunk's
    query rows, and the cache slots of its keys (its cached prefix, then itself)."""
    rows, slots = [], []
    for s in chunks:
        rows.append(np.arange(qsl[s], qsl[s + 1], dtype=np.int64))
        t = np.arange(lens[s], dtype=np.int64)
        slots.append(tables[s, t // block_size].astype(np.int64) * block_size + t % block_size)
    q_counts, k_counts = np.diff(qsl)[chunks], lens[chunks]

    def dev(a: np.ndarray, dtype) -> torch.Tensor:
        return to_device(torch.from_numpy(np.ascontiguousarray(a, dtype=dtype)), device)

    return VarlenPrefill(rows=dev(np.concatenate(rows), np.int64), slots=dev(np.concatenate(slots), np.int64),
                         cu_q=dev(np.concatenate([[0], np.cumsum(q_counts)]), np.int32),
                         cu_k=dev(np.concatenate([[0], np.cumsum(k_counts)]), np.int32),
                         max_q=int(q_counts.max()), max_k=int(k_counts.max()))


@functools.lru_cache(maxsize=8)   # (per ops provider: read once, not per layer)
def _varlen_attention(ops: Any) -> tuple[Any, bool]:
    """The varlen_attn to call (the ops provider's, else torch's) and whether it takes
    `enable_gqa` (torch 2.11's does not: K/V heads are then repeated)."""
    fn = getattr(ops, "varlen_attn", None)
    if fn is None:
        from torch.nn.attention.varlen import varlen_attn as fn
    return fn, "enable_gqa" in inspect.signature(fn).parameters


def _varlen_prefill(ops: Any, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    p: VarlenPrefill, scale: float) -> torch.Tensor:
    """q [T, heads, d] -> the prefill rows' attention [Tq, heads, d], causal with the mask
    aligned to the bottom right (a chunk's query i sees its cached prefix and itself up to i)."""
    kvh, d = k_cache.shape[2], k_cache.shape[3]
    keys = k_cache.view(-1, kvh, d).index_select(0, p.slots)
    values = v_cache.view(-1, kvh, d).index_select(0, p.slots)
    fn, takes_gqa = _varlen_attention(ops)
    extra = {}
    if q.shape[1] != kvh:
        if takes_gqa:
            extra["enable_gqa"] = True
        else:
            keys = keys.repeat_interleave(q.shape[1] // kvh, dim=1)
            values = values.repeat_interleave(q.shape[1] // kvh, dim=1)
    o = fn(q.index_select(0, p.rows), keys, values, p.cu_q, p.cu_k, p.max_q, p.max_k, scale=scale,
           window_size=(-1, 0), **extra)
    return o.to(q.dtype)


def _choose_splits(ops: Any, num_seqs: int, num_kv_heads: int, max_context: int) -> int:
    choose = getattr(ops, "choose_num_splits", None)
    return 0 if choose is None or num_seqs == 0 else int(choose(num_seqs, num_kv_heads, max_context))


def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, p: PrefillChunk, scale: float) -> torch.Tensor:
    """q [Tq, heads, d], this chunk's k/v [Tq, kvh, d] -> [Tq, heads, d] (model dtype)."""
    heads, kvh = q.shape[1], k_cache.shape[2]
    if p.context_len > 0:
        # the cached prefix plus this chunk, read back through the block table
        k = k_cache.index_select(0, p.block_ids).view(-1, kvh, k_cache.shape[3])[:p.seq_len]
        v = v_cache.index_select(0, p.block_ids).view(-1, kvh, v_cache.shape[3])[:p.seq_len]
    qp = q.transpose(0, 1).unsqueeze(0)                       # [1, heads, Tq, d]
    kp = k.transpose(0, 1).unsqueeze(0)                       # [1, kvh, L, d]
    vp = v.transpose(0, 1).unsqueeze(0)
    if heads != kvh:
        # NOTE: flash / memory-efficient SDPA want equal head counts; on a GPU repeating K/V
        # for one prefill chunk costs far less than falling back to the math kernel.
        kp = kp.repeat_interleave(heads // kvh, dim=1)
        vp = vp.repeat_interleave(heads // kvh, dim=1)
    if p.context_len == 0:
        o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale)
    else:
        from torch.nn.attention.bias import causal_lower_right

        mask = causal_lower_right(qp.shape[2], kp.shape[2])
        o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale)
    return o.squeeze(0).transpose(0, 1)
