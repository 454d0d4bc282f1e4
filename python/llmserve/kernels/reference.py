"""Plain-torch versions of the csrc ops with the same signatures and semantics: the oracle the
CUDA kernels are tested against (tests/gpu), and a stand-in `ops` provider that lets the CUDA
attention dispatch run on a CPU in tests. Slow on purpose (a loop over sequences, fp32)."""

from __future__ import annotations

import torch


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key/value [T, KVH, D] -> caches [N, bs, KVH, D] at slot_mapping [T]; -1 skips."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    kvh, d = key_cache.shape[2], key_cache.shape[3]
    key_cache.view(-1, kvh, d).index_copy_(0, slots, key[keep].to(key_cache.dtype))
    value_cache.view(-1, kvh, d).index_copy_(0, slots, value[keep].to(value_cache.dtype))


def paged_attention_decode(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
                           value_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float,
                           num_splits: int | None = None, pipeline: bool | None = None) -> torch.Tensor:
    """out, query [S, H, D]; caches [N, bs, KVH, D]; block_tables [S, W]; seq_lens [S]
    (0 -> zeros). num_splits and pipeline are accepted and ignored (they change no result)."""
    num_seqs, heads, d = query.shape
    bs, kvh = key_cache.shape[1], key_cache.shape[2]
    group = heads // kvh
    lens = seq_lens.tolist()
    for s in range(num_seqs):
        n = int(lens[s])
        if n == 0:
            out[s].zero_()
            continue
        blocks = block_tables[s, :-(-n // bs)].long()
        k = key_cache[blocks].reshape(-1, kvh, d)[:n].float()          # [n, kvh, d]
        v = value_cache[blocks].reshape(-1, kvh, d)[:n].float()
        q = query[s].float().view(kvh, group, d)                        # [kvh, G, d]
        scores = torch.einsum("hgd,nhd->hgn", q, k) * scale
        probs = torch.softmax(scores, dim=-1)
        out[s] = torch.einsum("hgn,nhd->hgd", probs, v).reshape(heads, d).to(out.dtype)
    return out


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context: int) -> int:
    return 0


def fused_unserved(hidden_size: int, intermediate_sizes, head_dim: int, dtype: torch.dtype) -> str | None:
    """The fused layer ops below serve every shape and dtype."""
    return None


def _normed(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32, rounded as models/layers.py's RMSNorm rounds: to x's dtype before a
    weight of that dtype multiplies, once after a float32 weight has."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight.dtype == torch.float32:
        return (normed * weight).to(x.dtype)
    return normed.to(x.dtype) * weight


def rms_norm(out: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """out [T, H] <- RMSNorm(input [T, H]) * weight [H]."""
    out.copy_(_normed(input, weight, eps))


def fused_add_rms_norm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """residual [T, H] += input (rounded to its dtype); then input <- RMSNorm(residual) * weight."""
    residual.add_(input)
    input.copy_(_normed(residual, weight, eps))


def silu_and_mul(out: torch.Tensor, input: torch.Tensor) -> None:
    """out [T, I] <- silu(gate) * up for input [T, 2I] = [gate | up], each op rounded to the dtype."""
    gate, up = input.chunk(2, dim=-1)
    out.copy_(torch.nn.functional.silu(gate) * up)


def rotary_embedding(x: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """x [T, W]: rotate-half RoPE in place on its first `heads` heads, cos/sin [T, head_dim / 2]
    of x's dtype: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), each op rounded to the dtype."""
    half = cos.shape[-1]
    rows = x[:, :heads * 2 * half].unflatten(1, (heads, 2 * half))
    x1, x2 = rows[..., :half], rows[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    rows.copy_(rotated)


def varlen_attn(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_q: torch.Tensor,
                cu_seq_k: torch.Tensor, max_q: int, max_k: int, *, scale: float | None = None,
                window_size: tuple[int, int] = (-1, -1)) -> torch.Tensor:
    """torch.nn.attention.varlen.varlen_attn's semantics, one sequence at a time: query
    [Tq, H, D] and key/value [Tk, H, D] packed by the cumulative lengths cu_seq_q / cu_seq_k
    [N + 1]; window_size (-1, 0) is causal with the mask aligned to the bottom right (query i
    of a sequence with Lq queries and Lk keys sees keys up to Lk - Lq + i), (-1, -1) full."""
    if window_size not in ((-1, 0), (-1, -1)):
        raise ValueError(f"window_size {window_size}: only (-1, 0) and (-1, -1) are served")
    out = torch.empty_like(query)
    bounds_q, bounds_k = cu_seq_q.tolist(), cu_seq_k.tolist()
    for s in range(len(bounds_q) - 1):
        q0, q1, k0, k1 = bounds_q[s], bounds_q[s + 1], bounds_k[s], bounds_k[s + 1]
        q = query[q0:q1].float().transpose(0, 1)                        # [H, Lq, D]
        k = key[k0:k1].float().transpose(0, 1)
        v = value[k0:k1].float().transpose(0, 1)
        scores = q @ k.transpose(1, 2) * (q.shape[-1] ** -0.5 if scale is None else scale)
        if window_size == (-1, 0):
            lq, lk = q1 - q0, k1 - k0
            seen = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
            scores = scores.masked_fill(~seen, float("-inf"))
        out[q0:q1] = (torch.softmax(scores, dim=-1) @ v).transpose(0, 1).to(out.dtype)
    return out
