"""csrc ops against their torch reference (llmserve.kernels.reference): decode attention over
dtype x head size x GQA ratio x split-K count, with context lengths that are not multiples
of the block size, mixed lengths in one batch, padding rows, block tables far wider than the
contexts, strided inputs and CUDA-graph capture; the KV-cache write by slot mapping; the fused layer ops (RMSNorm alone and with the
residual add, SwiGLU's product, RoPE in place); and the checks that reject unserved shapes."""

from __future__ import annotations

import pytest
import torch

from llmserve import kernels
from llmserve.kernels import reference

pytestmark = pytest.mark.gpu

BS = 16
TOL = {torch.float16: dict(atol=2e-3, rtol=2e-3), torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}


@pytest.fixture(scope="module", autouse=True)
def _built():
    kernels.load()


def paged_case(lens: list[int], kv_heads: int, group: int, head_dim: int, dtype, extra_cols: int = 2,
               seed: int = 0):
    """Random caches and shuffled block tables for sequences of `lens` tokens."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    need = [-(-n // BS) for n in lens]
    num_blocks = sum(need) + 8
    width = max(need) + extra_cols
    k_cache = torch.randn(num_blocks, BS, kv_heads, head_dim, generator=g, device="cuda").to(dtype)
    v_cache = torch.randn(num_blocks, BS, kv_heads, head_dim, generator=g, device="cuda").to(dtype)
    perm = (torch.randperm(num_blocks - 1, generator=g, device="cuda") + 1).tolist()   # never block 0
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    for i, n in enumerate(need):
        tables[i, :n] = torch.tensor(perm[:n])
        perm = perm[n:]
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=g, device="cuda").to(dtype)
    return q, k_cache, v_cache, tables.cuda(), torch.tensor(lens, dtype=torch.int32, device="cuda")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("splits", [None, 0, 1, 3, 16])
@pytest.mark.parametrize("pipeline", [False, True])
def test_decode_matches_reference(dtype, head_dim, group, splits, pipeline):
    lens = [1, 15, 17, 100, 333, 1000, 0, 64]     # 0: a padding row (zeros out)
    q, kc, vc, tables, seq_lens = paged_case(lens, kv_heads=2, group=group, head_dim=head_dim, dtype=dtype)
    scale = head_dim ** -0.5
    out = torch.full_like(q, float("nan"))
    kernels.paged_attention_decode(out, q, kc, vc, tables, seq_lens, scale, splits, pipeline)
    want = reference.paged_attention_decode(torch.empty_like(q), q, kc, vc, tables, seq_lens, scale)
    torch.testing.assert_close(out.float(), want.float(), **TOL[dtype])
    assert torch.all(out[6] == 0)


@pytest.mark.parametrize("group", [3, 7])
@pytest.mark.parametrize("pipeline", [False, True])
def test_decode_group_sizes_between_buckets(group, pipeline):
    # SmolLM2-135M has 3 query heads per kv head, Qwen2.5-0.5B 7: rounded up inside the kernel
    q, kc, vc, tables, seq_lens = paged_case([5, 300, 129], kv_heads=3, group=group, head_dim=64,
                                             dtype=torch.bfloat16)
    out = kernels.paged_attention_decode(torch.empty_like(q), q, kc, vc, tables, seq_lens, 0.125, pipeline=pipeline)
    want = reference.paged_attention_decode(torch.empty_like(q), q, kc, vc, tables, seq_lens, 0.125)
    torch.testing.assert_close(out.float(), want.float(), **TOL[torch.bfloat16])


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("pipeline", [False, True])
def test_decode_with_more_partitions_than_merge_threads(head_dim, pipeline):
    """200 splits over ~9k tokens (64-token partitions, 141 of them): more partitions than the
    merge kernel has threads (one per head dim), so each thread finds the max of several, and
    sequences of every length cut their own context into their own partitions."""
    q, kc, vc, tables, seq_lens = paged_case([9000, 4100, 64, 1], kv_heads=2, group=4, head_dim=head_dim,
                                             dtype=torch.bfloat16)
    scale = head_dim ** -0.5
    out = kernels.paged_attention_decode(torch.empty_like(q), q, kc, vc, tables, seq_lens, scale, 200, pipeline)
    want = reference.paged_attention_decode(torch.empty_like(q), q, kc, vc, tables, seq_lens, scale)
    torch.testing.assert_close(out.float(), want.float(), **TOL[torch.bfloat16])
    # and with no split: one CTA walks each whole context, chunk after chunk
    out = kernels.paged_attention_decode(torch.empty_like(q), q, kc, vc, tables, seq_lens, scale, 0, pipeline)
    torch.testing.assert_close(out.float(), want.float(), **TOL[torch.bfloat16])


@pytest.mark.parametrize("splits", [None, 2, 5, 88])
def test_decode_with_tables_far_wider_than_the_contexts(splits):
    """A CUDA-graph step passes tables as wide as --max-model-len: each sequence's partitions
    follow its own length (uneven shares, partitions left empty), not the table's width."""
    lens = [1, 70, 1000, 129, 0, 4097]
    q, kc, vc, tables, seq_lens = paged_case(lens, kv_heads=3, group=3, head_dim=64, dtype=torch.bfloat16,
                                             extra_cols=2048)
    out = kernels.paged_attention_decode(torch.full_like(q, float("nan")), q, kc, vc, tables, seq_lens,
                                         0.125, splits)
    want = reference.paged_attention_decode(torch.empty_like(q), q, kc, vc, tables, seq_lens, 0.125)
    torch.testing.assert_close(out.float(), want.float(), **TOL[torch.bfloat16])
    assert torch.all(out[4] == 0)


def test_decode_large_batch_and_strided_query():
    gen = torch.Generator().manual_seed(1)
    lens = torch.randint(1, 1100, (64,), generator=gen).tolist()
    q, kc, vc, tables, seq_lens = paged_case(lens, kv_heads=3, group=3, head_dim=64, dtype=torch.bfloat16)
    # the model hands over q as a view of the fused q|k projection: rows are strided
    fused = torch.randn(64, 9 + 3, 64, device="cuda").to(torch.bfloat16)
    fused[:, :9] = q
    qv = fused[:, :9]
    assert not qv.is_contiguous()
    out = kernels.paged_attention_decode(torch.empty_like(q), qv, kc, vc, tables, seq_lens, 0.125)
    want = reference.paged_attention_decode(torch.empty_like(q), q, kc, vc, tables, seq_lens, 0.125)
    torch.testing.assert_close(out.float(), want.float(), **TOL[torch.bfloat16])


def test_decode_in_cuda_graph_follows_new_inputs():
    # (a table as wide as a server's: the graph's split count fits any context it holds)
    q, kc, vc, tables, seq_lens = paged_case([40, 700, 3, 0], kv_heads=2, group=4, head_dim=128,
                                             dtype=torch.bfloat16, extra_cols=500)
    out = torch.empty_like(q)
    splits = kernels.choose_num_splits(4, 2, tables.shape[1] * BS)
    assert splits > 1
    kernels.paged_attention_decode(out, q, kc, vc, tables, seq_lens, 0.1, splits)   # warm-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernels.paged_attention_decode(out, q, kc, vc, tables, seq_lens, 0.1, splits)
    q.copy_(torch.randn_like(q.float()).to(q.dtype))
    seq_lens.copy_(torch.tensor([41, 12, 650, 1], dtype=torch.int32))
    graph.replay()
    want = reference.paged_attention_decode(torch.empty_like(q), q, kc, vc, tables, seq_lens, 0.1)
    torch.testing.assert_close(out.float(), want.float(), **TOL[torch.bfloat16])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_write_kv_cache_matches_reference(dtype, head_dim):
    kvh, n_blocks, t = 3, 12, 37
    g = torch.Generator(device="cuda").manual_seed(2)
    fused = torch.randn(t, 4 + 2 * kvh, head_dim, generator=g, device="cuda").to(dtype)
    key, value = fused[:, 4:4 + kvh], fused[:, 4 + kvh:]           # strided views, as in the model
    slots = torch.randperm(n_blocks * BS, generator=g, device="cuda")[:t]
    slots[::5] = -1                                                 # padding rows: not written
    caches = [torch.zeros(n_blocks, BS, kvh, head_dim, dtype=dtype, device="cuda") for _ in range(4)]
    kernels.write_kv_cache(key, value, caches[0], caches[1], slots)
    reference.write_kv_cache(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def test_unserved_shapes_are_rejected_clearly():
    q, kc, vc, tables, lens = paged_case([20], kv_heads=1, group=1, head_dim=64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="dtype"):
        kernels.paged_attention_decode(q.float(), q.float(), kc.float(), vc.float(), tables, lens, 0.1)
    q96 = torch.zeros(1, 1, 96, dtype=torch.bfloat16, device="cuda")
    c96 = torch.zeros(4, BS, 1, 96, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(RuntimeError, match="head_dim 96"):
        kernels.paged_attention_decode(torch.empty_like(q96), q96, c96, c96, tables, lens, 0.1)
    c8 = torch.zeros(8, 8, 1, 64, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(RuntimeError, match="block_size 8"):
        kernels.paged_attention_decode(torch.empty_like(q), q, c8, c8, tables, lens, 0.1)
    q16 = torch.zeros(1, 16, 64, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(RuntimeError, match="query heads per kv head"):
        kernels.paged_attention_decode(torch.empty_like(q16), q16, kc, vc, tables, lens, 0.1)
    with pytest.raises(RuntimeError, match="pipeline must be 0 or 1"):
        torch.ops.llmserve.paged_attention_decode(torch.empty_like(q), q, kc, vc, tables, lens, 0.1, 0, 2)
    with pytest.raises(RuntimeError, match="num_splits"):
        kernels.paged_attention_decode(torch.empty_like(q), q, kc, vc, tables, lens, 0.1, -1)
    with pytest.raises(RuntimeError, match="int32"):
        kernels.paged_attention_decode(torch.empty_like(q), q, kc, vc, tables.long(), lens, 0.1)


# Two steps of the dtype: the fused ops round where the reference rounds, but a row's sum of
# squares (or silu's exp) may come out an fp32 ulp apart, which can flip a rounding, and the
# multiply after it round once more.
STEP = {torch.float16: dict(atol=2e-3, rtol=2e-3), torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("weight_dtype", ["same", torch.float32])
@pytest.mark.parametrize("hidden", [64, 576, 4096, 8200])
def test_rms_norm_ops_match_reference(dtype, weight_dtype, hidden):
    g = torch.Generator(device="cuda").manual_seed(hidden)
    wd = dtype if weight_dtype == "same" else weight_dtype
    weight = (1 + 0.1 * torch.randn(hidden, generator=g, device="cuda")).to(wd)
    wide = (3 * torch.randn(37, hidden + 16, generator=g, device="cuda")).to(dtype)
    x = wide[:, :hidden]                                        # strided rows
    out, want = torch.empty_like(x), torch.empty_like(x)
    kernels.rms_norm(out, x, weight, 1e-6)
    reference.rms_norm(want, x, weight, 1e-6)
    torch.testing.assert_close(out, want, **STEP[dtype])
    assert (out != want).float().mean() < 0.01                   # nearly all equal

    residual = (2 * torch.randn(37, hidden, generator=g, device="cuda")).to(dtype)
    a_in, a_res = x.clone(), residual.clone()
    b_in, b_res = x.clone(), residual.clone()
    kernels.fused_add_rms_norm(a_in, a_res, weight, 1e-6)
    reference.fused_add_rms_norm(b_in, b_res, weight, 1e-6)
    assert torch.equal(a_res, b_res)                             # the add rounds once, alike
    torch.testing.assert_close(a_in, b_in, **STEP[dtype])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("inter", [8, 1536, 14336])
def test_silu_and_mul_matches_reference(dtype, inter):
    g = torch.Generator(device="cuda").manual_seed(inter)
    x = (4 * torch.randn(19, 2 * inter, generator=g, device="cuda")).to(dtype)
    out, want = torch.empty(19, inter, dtype=dtype, device="cuda"), torch.empty(19, inter, dtype=dtype, device="cuda")
    kernels.silu_and_mul(out, x)
    reference.silu_and_mul(want, x)
    torch.testing.assert_close(out, want, **STEP[dtype])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_embedding_matches_reference(dtype, head_dim):
    """In place on the q and k heads of a fused qkv row, the v heads untouched; every product
    and sum rounds as torch's rounds, so the bits are the reference's."""
    g = torch.Generator(device="cuda").manual_seed(head_dim)
    heads, kv = 9, 3
    qkv = torch.randn(23, (heads + 2 * kv) * head_dim, generator=g, device="cuda").to(dtype)
    angles = torch.rand(23, head_dim // 2, generator=g, device="cuda") * 50
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    a, b = qkv.clone(), qkv.clone()
    kernels.rotary_embedding(a, heads + kv, cos, sin)
    reference.rotary_embedding(b, heads + kv, cos, sin)
    assert torch.equal(a, b)
    assert torch.equal(a[:, (heads + kv) * head_dim:], qkv[:, (heads + kv) * head_dim:])
    assert not torch.equal(a, qkv)


def test_fused_ops_reject_what_they_do_not_serve():
    x = torch.zeros(4, 64, dtype=torch.bfloat16, device="cuda")
    w = torch.ones(64, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(RuntimeError, match="dtype"):
        kernels.rms_norm(x.float(), x.float(), w.float(), 1e-6)
    odd = torch.zeros(4, 60, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(RuntimeError, match="not a multiple of 8"):
        kernels.rms_norm(torch.empty_like(odd), odd, w[:60], 1e-6)
    with pytest.raises(RuntimeError, match="weight must be"):
        kernels.rms_norm(torch.empty_like(x), x, w[:32], 1e-6)
    with pytest.raises(RuntimeError, match="16-byte aligned"):
        shifted = torch.zeros(4, 72, dtype=torch.bfloat16, device="cuda")[:, 4:68]
        kernels.rms_norm(torch.empty_like(x), shifted, w, 1e-6)
    with pytest.raises(RuntimeError, match=r"\[T, 2I\]"):
        kernels.silu_and_mul(torch.empty_like(x), x)
    with pytest.raises(RuntimeError, match="do not fit"):
        kernels.rotary_embedding(x, 2, x[:, :32], x[:, :32])
    # and the device still serves
    kernels.rms_norm(torch.empty_like(x), x, w, 1e-6)
    torch.cuda.synchronize()
