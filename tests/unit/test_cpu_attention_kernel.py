"""The Rust CPU decode kernel (`llmserve._core.paged_decode_attention`, rust/kernels) against
the torch path of worker/attention.py, its reference: one attention call on random paged
caches, and whole mixed (prefill + chunk + decode) steps through ModelRunner. Also the
binding's argument checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _plans import run_schedule
from test_runner import tiny_weights

from llmserve import _core
from llmserve.models import build_model
from llmserve.worker import attention
from llmserve.worker.attention import AttentionMetadata, paged_attention
from llmserve.worker.kv_cache import narrowed, write_kv

torch.set_num_threads(1)


@pytest.fixture
def kernel_calls(monkeypatch) -> list[int]:
    """Counts the kernel's calls, so a test knows the kernel path really ran."""
    calls: list[int] = []

    def counted(*args):
        calls.append(args[1].shape[0])
        return _core.paged_decode_attention(*args)

    monkeypatch.setattr(attention, "_cpu_decode", counted)
    return calls


def _random_step(rng: np.random.Generator, heads: int, kv_heads: int, d: int, bs: int,
                 q_lens: list[int], ctx_lens: list[int]):
    """A step over sequences with `ctx_lens` cached tokens and `q_lens` new ones, blocks handed
    out in a shuffled order; returns (metadata, q, k, v, k_cache, v_cache)."""
    seq_lens = [c + n for c, n in zip(ctx_lens, q_lens)]
    nblk = [-(-s // bs) for s in seq_lens]
    num_blocks = sum(nblk) + 2
    ids = rng.permutation(np.arange(1, num_blocks))
    width = max(nblk)
    tables = np.zeros((len(seq_lens), width), np.int32)
    slots, used = [], 0
    for i, (c, s) in enumerate(zip(ctx_lens, seq_lens)):
        tables[i, :nblk[i]] = ids[used:used + nblk[i]]
        used += nblk[i]
        slots += [int(tables[i, p // bs]) * bs + p % bs for p in range(c, s)]
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    meta = AttentionMetadata.build(qsl, np.array(seq_lens, np.int32), tables,
                                   torch.tensor(slots, dtype=torch.int64), bs,
                                   torch.device("cpu"))
    t = int(qsl[-1])
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    k_cache = torch.randn(num_blocks, bs, kv_heads, d, generator=gen)
    v_cache = torch.randn(num_blocks, bs, kv_heads, d, generator=gen)
    q = torch.randn(t, heads, d, generator=gen) * 2
    k = torch.randn(t, kv_heads, d, generator=gen)
    v = torch.randn(t, kv_heads, d, generator=gen)
    return meta, q, k, v, k_cache, v_cache


def _both_ways(monkeypatch, meta, q, k, v, k_cache, v_cache, scale, window=0, softcap=0.0):
    outs = []
    for on in (False, True):
        monkeypatch.setattr(attention, "USE_CPU_DECODE_KERNEL", on)
        kc, vc = k_cache.clone(), v_cache.clone()
        outs.append(paged_attention(q, k, v, kc, vc, meta, scale, window=window, softcap=softcap))
    return outs


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (16, 2)])
@pytest.mark.parametrize("d", [64, 128])
def test_kernel_matches_torch_on_decode_batches(monkeypatch, kernel_calls, heads, kv_heads, d):
    rng = np.random.default_rng(heads * 1000 + d)
    ctx = [0, 4, 15, 16, 31, 100, 257]          # 1 + ctx keys: lengths not multiples of 16
    meta, *tensors = _random_step(rng, heads, kv_heads, d, 16, [1] * len(ctx), ctx)
    ref, got = _both_ways(monkeypatch, meta, *tensors, d ** -0.5)
    assert kernel_calls == [len(ctx)]
    assert (got - ref).abs().max().item() < 1e-5


def test_kernel_matches_torch_on_mixed_steps(monkeypatch, kernel_calls):
    """Decode rows interleaved with a prompt and a chunk continuing a cached prefix: the kernel
    takes every token as its own row (17 rows), and agrees with torch's SDPA path."""
    rng = np.random.default_rng(7)
    q_lens, ctx = [1, 9, 1, 5, 1], [40, 0, 3, 20, 70]
    meta, *tensors = _random_step(rng, 6, 2, 32, 8, q_lens, ctx)
    assert meta.decode_token_idx is not None
    ref, got = _both_ways(monkeypatch, meta, *tensors, 0.2)
    assert kernel_calls == [sum(q_lens)]
    assert (got - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("window", [1, 5, 13, 200])
def test_a_sliding_window_both_ways(monkeypatch, kernel_calls, window):
    """Sliding-window attention (each query sees its last `window` keys): the torch path's masks
    and the kernel's window agree, on a decode-only step (the kernel's decode tables, torch's
    key mask) and on a mixed one (a whole prompt, a chunk after a cached prefix, decode rows);
    a window longer than every sequence is no window."""
    rng = np.random.default_rng(window)
    for q_lens, ctx in (([1, 1, 1], [0, 9, 40]), ([1, 9, 1, 5, 1], [40, 0, 3, 20, 70])):
        meta, *tensors = _random_step(rng, 6, 2, 32, 8, q_lens, ctx)
        ref, got = _both_ways(monkeypatch, meta, *tensors, 0.2, window=window)
        assert (got - ref).abs().max().item() < 1e-5
        full = _both_ways(monkeypatch, meta, *tensors, 0.2)[0]
        assert torch.equal(ref, full) == (window > max(c + n for c, n in zip(ctx, q_lens)))
    assert kernel_calls == [3, 3, 17, 17]   # (with the window, then without)


@pytest.mark.parametrize("softcap,window", [(0.7, 0), (3.0, 0), (0.7, 6)])
def test_soft_capped_scores_both_ways(monkeypatch, kernel_calls, softcap, window):
    """Gemma 2's soft cap (scores s -> softcap * tanh(s / softcap)): the torch path's written-out
    attention and the kernel agree, alone and with a window, on decode-only and mixed steps
    (whole prompts, whose torch mask is the causal one, and a chunk after a cached prefix); and
    the cap changes the result (the scores of q ~ 2 N(0, 1) at scale 0.2 reach past it)."""
    rng = np.random.default_rng(int(softcap * 10) + window)
    for q_lens, ctx in (([1, 1, 1], [0, 9, 40]), ([1, 9, 1, 5, 1], [40, 0, 3, 20, 70])):
        meta, *tensors = _random_step(rng, 6, 2, 32, 8, q_lens, ctx)
        ref, got = _both_ways(monkeypatch, meta, *tensors, 0.2, window=window, softcap=softcap)
        assert (got - ref).abs().max().item() < 1e-5
        uncapped = _both_ways(monkeypatch, meta, *tensors, 0.2, window=window)[0]
        assert (ref - uncapped).abs().max().item() > 1e-2
    assert kernel_calls == [3, 3, 17, 17]


@pytest.mark.parametrize("kernel", [False, True])
def test_soft_capped_attention_against_a_naive_reference(monkeypatch, kernel):
    """Soft-capped attention, on the torch path and through the kernel, against a naive
    per-head loop in float64: a whole prompt (causal, no mask) and a chunk over a cached prefix
    (lower-right)."""
    monkeypatch.setattr(attention, "USE_CPU_DECODE_KERNEL", kernel)
    rng = np.random.default_rng(3)
    meta, q, k, v, k_cache, v_cache = _random_step(rng, 6, 2, 16, 4, [7, 4], [0, 9])
    out = paged_attention(q, k, v, k_cache, v_cache, meta, 0.3, softcap=1.5)
    for p in meta.prefills:
        ids = p.block_ids
        keys = k_cache[ids].reshape(-1, 2, 16)[:p.seq_len].double()
        vals = v_cache[ids].reshape(-1, 2, 16)[:p.seq_len].double()
        for t in range(p.end - p.start):
            pos = p.context_len + t
            for h in range(6):
                s = keys[:pos + 1, h // 3] @ q[p.start + t, h].double() * 0.3
                w = torch.softmax(1.5 * torch.tanh(s / 1.5), 0)
                want = w @ vals[:pos + 1, h // 3]
                torch.testing.assert_close(out[p.start + t, h].double(), want, atol=1e-5, rtol=0)


def test_torch_path_when_switched_off_or_not_float32(monkeypatch, kernel_calls):
    rng = np.random.default_rng(3)
    meta, q, k, v, kc, vc = _random_step(rng, 4, 2, 16, 4, [1, 1], [5, 9])
    monkeypatch.setattr(attention, "USE_CPU_DECODE_KERNEL", False)
    paged_attention(q, k, v, kc, vc, meta, 0.25)
    monkeypatch.setattr(attention, "USE_CPU_DECODE_KERNEL", True)
    paged_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), kc.bfloat16(), vc.bfloat16(),
                    meta, 0.25)
    assert kernel_calls == []


CONFIG = dict(architectures=["LlamaForCausalLM"], vocab_size=96, hidden_size=96,
              intermediate_size=64, num_hidden_layers=2, num_attention_heads=6,
              num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=256,
              rope_theta=10000.0, tie_word_embeddings=True)


def test_runner_logits_match_with_and_without_kernel(monkeypatch, kernel_calls):
    """Several steps mixing prompts, chunks and decodes give the same logits both ways."""
    model = build_model(CONFIG, tiny_weights(CONFIG, scale=0.3), torch.float32, "cpu")
    prompts = {0: list(range(3, 24)), 1: [5, 7, 9], 2: list(range(40, 77))}
    schedule = [{0: 21, 1: 3, 2: 10}, {0: 1, 1: 1, 2: 17}, {0: 1, 1: 1, 2: 10},
                {0: 1, 1: 1, 2: 1}, {0: 1, 1: 1, 2: 1}]
    logits = []
    for on in (False, True):
        monkeypatch.setattr(attention, "USE_CPU_DECODE_KERNEL", on)
        logits.append(run_schedule(model, prompts, schedule)[0])
    # per layer (2 layers): every token of every step, prompt chunks included (34, 19, 12, 3, 3)
    assert kernel_calls == [34] * 2 + [19] * 2 + [12] * 2 + [3] * 4
    for ref, got in zip(*logits):
        assert (got - ref).abs().max().item() < 1e-4


def _args(s=2, heads=4, kvh=2, d=8, bs=4, nblocks=6, width=3):
    out = np.zeros((s, heads, d), np.float32)
    q = np.ones((s, heads, d), np.float32)
    kc = np.random.default_rng(0).standard_normal((nblocks, bs, kvh, d)).astype(np.float32)
    tables = np.array([[1, 2, 0], [3, 4, 5]][:s], np.int32)[:, :width]
    return [out, q, kc, kc.copy(), tables, np.array([5, 12][:s], np.int32), 0.5, 2]


@pytest.mark.parametrize("edit,needle", [
    (lambda a: a.__setitem__(0, np.zeros((2, 4, 4), np.float32)), "out"),
    (lambda a: a.__setitem__(3, a[3][:5]), "v_cache"),
    (lambda a: a.__setitem__(slice(2, 4), [np.zeros((6, 4, 2, 4), np.float32)] * 2), "head_dim"),
    (lambda a: a.__setitem__(4, a[4][:1]), "block_tables"),
    (lambda a: a.__setitem__(5, np.array([5], np.int32)), "seq_lens"),
    (lambda a: a.__setitem__(5, np.array([5, 13], np.int32)), "seq_lens[1]"),
    (lambda a: a[4].__setitem__((1, 2), 6), "block id"),
    (lambda a: a.__setitem__(1, np.ones((2, 8, 4), np.float32).transpose(0, 2, 1)), "contiguous"),
    (lambda a: a.__setitem__(slice(2, 4), [np.zeros((6, 4, 3, 8), np.float32)] * 2), "multiple"),
])
def test_binding_rejects_bad_arguments(edit, needle):
    args = _args()
    edit(args)
    args[0] = np.full(args[1].shape, 7.0, np.float32) if args[0].shape == args[1].shape else args[0]
    with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        _core.paged_decode_attention(*args)
    if args[0].shape == args[1].shape:
        assert (args[0] == 7.0).all()


def test_binding_refuses_a_read_only_out():
    args = _args()
    args[0].flags.writeable = False
    with pytest.raises(ValueError, match="out must be writeable"):
        _core.paged_decode_attention(*args)


def test_binding_rejects_other_dtypes():
    args = _args()
    args[2] = args[2].astype(np.float64)
    with pytest.raises(TypeError):
        _core.paged_decode_attention(*args)


NARROW = [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("dtype", NARROW)
@pytest.mark.parametrize("q_lens,ctx", [([1] * 7, [0, 4, 15, 16, 31, 100, 257]),
                                        ([1, 9, 1, 5, 1], [40, 0, 3, 20, 70])])
def test_narrow_caches_read_as_their_float32_values(monkeypatch, kernel_calls, dtype, q_lens, ctx):
    """A bfloat16 or fp8 cache (--kv-cache-dtype) through the kernel gives exactly what a float32
    cache holding the same values gives (the kernel widens exactly, then computes as for
    float32), on decode-only and mixed steps; and the torch path, which gathers and widens,
    agrees with it."""
    rng = np.random.default_rng(len(q_lens))
    meta, q, k, v, k_cache, v_cache = _random_step(rng, 9, 3, 64, 16, q_lens, ctx)
    k, v = narrowed(k, dtype).float(), narrowed(v, dtype).float()       # (written exactly)
    k_narrow, v_narrow = narrowed(k_cache, dtype), narrowed(v_cache, dtype)
    want = paged_attention(q, k, v, k_narrow.float(), v_narrow.float(), meta, 0.125)
    kc, vc = k_narrow.clone(), v_narrow.clone()
    got = paged_attention(q, k, v, kc, vc, meta, 0.125)
    assert kernel_calls == [sum(q_lens)] * 2
    assert torch.equal(got, want)
    # the step's K/V landed in the narrow cache, rounded as a cast rounds them
    slots = meta.slot_mapping
    assert torch.equal(kc.view(-1, 3, 64)[slots].float(), k)
    assert torch.equal(vc.view(-1, 3, 64)[slots].float(), v)
    ref, got = _both_ways(monkeypatch, meta, q, k, v, k_narrow, v_narrow, 0.125)
    assert (got - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("dtype,top", [(torch.float8_e4m3fn, 448.0), (torch.float8_e5m2, 57344.0),
                                       (torch.bfloat16, None)])
def test_writes_round_to_nearest_and_saturate_8_bit_floats(dtype, top):
    """write_kv rounds as torch's cast does, but an 8-bit float saturates at its largest finite
    value where the cast would give infinity (E5M2) or where a value lies past it."""
    cache = torch.zeros(2, 4, 1, 4, dtype=dtype)
    x = torch.tensor([[[1e6, -1e6, 1.0625, 3e-3]], [[0.1, -0.2, 7.5, 1e-9]]])
    write_kv(cache, cache.clone(), torch.tensor([5, 2]), x, x)
    got = cache.view(-1, 1, 4)[torch.tensor([5, 2])].float()
    want = x.to(dtype).float()
    if top is not None:
        want[0, 0, :2] = torch.tensor([top, -top])
    assert torch.equal(got, want)


def test_binding_checks_the_cache_dtype():
    args = _args()
    with pytest.raises(ValueError, match='kv_dtype "fp16" is none of'):
        _core.paged_decode_attention(*args, 0, 0.0, "fp16")
    with pytest.raises(TypeError, match="k_cache must be a 4-d numpy array of u8 for kv_dtype fp8_e5m2"):
        _core.paged_decode_attention(*args, 0, 0.0, "fp8_e5m2")
    with pytest.raises(TypeError, match="v_cache must be a 4-d numpy array of u16 for kv_dtype bfloat16"):
        bits = torch.from_numpy(args[2]).bfloat16().view(torch.uint16).numpy()
        _core.paged_decode_attention(*args[:2], bits, args[3], *args[4:], 0, 0.0, "bfloat16")
    widened = torch.from_numpy(args[2]).bfloat16().float().numpy()
    _core.paged_decode_attention(*args[:2], widened, widened.copy(), *args[4:])
    want = args[0].copy()
    _core.paged_decode_attention(*args[:2], bits, bits.copy(), *args[4:], 0, 0.0, "bfloat16")
    assert np.array_equal(args[0], want)


def test_runner_logits_with_a_narrow_cache(monkeypatch, kernel_calls):
    """Whole steps through ModelRunner with a narrow cache: the same logits both ways (kernel
    and torch path, as closely as the comment below says), and the fewer mantissa bits a type keeps, the further they are from the
    float32 cache's (bfloat16 7, E4M3 3, E5M2 2)."""
    model = build_model(CONFIG, tiny_weights(CONFIG, scale=0.3), torch.float32, "cpu")
    prompts = {0: list(range(3, 24)), 1: [5, 7, 9], 2: list(range(40, 77))}
    schedule = [{0: 21, 1: 3, 2: 10}, {0: 1, 1: 1, 2: 17}, {0: 1, 1: 1, 2: 10},
                {0: 1, 1: 1, 2: 1}, {0: 1, 1: 1, 2: 1}]
    full = run_schedule(model, prompts, schedule)[0]
    scale = max(x.abs().max().item() for x in full)
    distance = []
    for dtype in NARROW:
        monkeypatch.setattr(attention, "USE_CPU_DECODE_KERNEL", True)
        narrow = run_schedule(model, prompts, schedule, kv_dtype=dtype)[0]
        monkeypatch.setattr(attention, "USE_CPU_DECODE_KERNEL", False)
        torch_path = run_schedule(model, prompts, schedule, kv_dtype=dtype)[0]
        # (both paths agree to float32 rounding, but the next layer's K/V then differ in the last
        # bits, and now and then that moves a value across a rounding boundary of the narrow
        # type: a whole step of it, ~12% of the value in fp8. So: nearly all within float32
        # rounding, none far.)
        diffs = torch.cat([(got - ref).abs().flatten() for ref, got in zip(torch_path, narrow)])
        assert diffs.median().item() < 1e-5 * scale and diffs.max().item() < 0.02 * scale
        distance.append(max((a - b).abs().max().item() for a, b in zip(full, narrow)) / scale)
    assert 0 < distance[0] < distance[1] < distance[2]
    assert kernel_calls == [34, 34, 19, 19, 12, 12, 3, 3, 3, 3] * 3 + [34] * 2 + [19] * 2 + [12] * 2 + [3] * 4


@pytest.mark.parametrize("dtype", [torch.float32, *NARROW])
def test_forked_blocks_are_copied_in_every_cache_type(dtype):
    """KVCache.copy_blocks (a beam or an n > 1 choice forking its last block) copies whole
    blocks in every layer whatever the cache holds (8-bit floats as their bytes), and nothing
    else."""
    from llmserve.worker.kv_cache import KVCache

    cache = KVCache(num_layers=2, num_blocks=6, block_size=4, num_kv_heads=2, head_dim=8, dtype=dtype,
                    device="cpu")
    gen = torch.Generator().manual_seed(0)
    for t in (*cache.key, *cache.value):
        write_kv(t, t.clone(), torch.arange(24), torch.randn(24, 2, 8, generator=gen), torch.zeros(24, 2, 8))
    before = [t.float().clone() for t in (*cache.key, *cache.value)]
    cache.copy_blocks(torch.tensor([1, 4]), torch.tensor([3, 5]))
    for old, new in zip(before, (*cache.key, *cache.value)):
        want = old.clone()
        want[[3, 5]] = old[[1, 4]]
        assert new.dtype == dtype and torch.equal(new.float(), want)
