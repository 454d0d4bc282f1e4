"""ModelRunner: slot-mapping writes, block copies (forks), empty and non-sampling plans,
read-only (Rust-like) plan arrays, output shapes."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from _plans import Paged, Row
from tiny import random_llama_weights

from llmserve.models import build_model
from llmserve.models.layers import RotaryEmbedding
from llmserve.worker import ModelRunner
from llmserve.worker.kv_cache import KVCache

torch.set_num_threads(1)

BLOCK, NUM_BLOCKS = 4, 32
CONFIG = dict(architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=32,
              intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=128,
              rope_theta=10000.0, tie_word_embeddings=True)


def tiny_weights(c: dict = CONFIG, seed: int = 0, scale: float = 0.2) -> dict[str, torch.Tensor]:
    """Random HF-named Llama weights for config `c` (shared by the runner and kernel tests)."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(shape, generator=g) * scale

    h = c["hidden_size"]
    top = {"model.embed_tokens.weight": r(c["vocab_size"], h), "model.norm.weight": 1 + r(h)}
    return random_llama_weights(c, r, top)


def make_runner(seed: int | None = 0) -> ModelRunner:
    model = build_model(CONFIG, tiny_weights(), torch.float32, "cpu")
    return ModelRunner(model, NUM_BLOCKS, BLOCK, torch.float32, "cpu", seed=seed)


def test_empty_plan_returns_empty_arrays():
    runner = make_runner()
    plan = Paged(NUM_BLOCKS, BLOCK).step({})
    out = runner.execute(plan)
    assert out.tokens.shape == (0,) and out.tokens.dtype == np.int64
    assert out.logprobs.shape == (0,) and out.logprobs.dtype == np.float32
    assert out.top_ids.shape == (0, 0) and out.top_logprobs.shape == (0, 0)
    assert all(not k.any() for k in runner.kv_cache.key)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_cpu_kv_cache_is_zero_and_takes_memory_only_where_written():
    before = _resident_bytes()
    cache = KVCache(2, 4096, 16, 4, 128, torch.float32, "cpu")       # 512 MiB
    assert cache.nbytes() == 512 * 2**20
    assert _resident_bytes() - before < 64 * 2**20
    for t in (*cache.key, *cache.value):
        assert t.shape == (4096, 16, 4, 128) and t.is_contiguous() and not t[::97].any()
    cache.value[1][7].fill_(3.0)                # layers and K/V do not alias each other
    assert cache.value[1][7].eq(3.0).all() and not cache.value[1][6].any()
    assert not cache.key[1][7].any() and not cache.value[0][7].any()


def test_slot_mapping_writes_rotated_keys_and_values():
    runner = make_runner()
    paged = Paged(NUM_BLOCKS, BLOCK)
    paged.add(0, [5, 9, 1, 3, 3, 7])
    plan = paged.step({0: 6})
    runner.execute(plan)

    model, slots = runner.model, torch.from_numpy(plan.slot_mapping)
    nh, nkv, d = 4, 2, 8
    with torch.no_grad():
        x = model.layers[0].input_norm(model.embed_tokens(torch.from_numpy(plan.input_ids)))
        qkv = model.layers[0].attn.qkv(x)
        cos, sin = model.rope.cos_sin(torch.from_numpy(plan.positions), torch.float32)
        k = RotaryEmbedding.apply(qkv[:, nh * d:(nh + nkv) * d].view(-1, nkv, d), cos, sin)
        v = qkv[:, (nh + nkv) * d:].view(-1, nkv, d)
    k_flat = runner.kv_cache.key[0].view(-1, nkv, d)
    v_flat = runner.kv_cache.value[0].view(-1, nkv, d)
    torch.testing.assert_close(k_flat[slots], k)
    torch.testing.assert_close(v_flat[slots], v)
    for cache in (*runner.kv_cache.key, *runner.kv_cache.value):   # nothing else written
        written = cache.view(-1, nkv * d).abs().sum(-1) > 0
        assert written.nonzero().squeeze(1).tolist() == sorted(slots.tolist())


def test_rope_in_place_gives_the_torch_ops_bits():
    """RotaryEmbedding.apply_in_place (the Rust kernel on a fused qkv output) rotates the q
    and k heads exactly as `apply` does, and leaves the v columns alone; where it does not
    serve (autograd, a non-contiguous tensor) it says so and writes nothing."""
    g = torch.Generator().manual_seed(0)
    nh, nkv, d, t = 9, 3, 64, 37
    rope = RotaryEmbedding(d, 10000.0, None, 512, torch.device("cpu"))
    cos, sin = rope.cos_sin(torch.randint(0, 512, (t,), generator=g), torch.float32)
    qkv = torch.randn(t, (nh + 2 * nkv) * d, generator=g) * 3
    want = RotaryEmbedding.apply(qkv[:, :(nh + nkv) * d].reshape(t, nh + nkv, d), cos, sin)
    got = qkv.clone()
    assert RotaryEmbedding.apply_in_place(got, nh + nkv, cos, sin)
    assert torch.equal(got[:, :(nh + nkv) * d].view(t, nh + nkv, d), want)
    assert torch.equal(got[:, (nh + nkv) * d:], qkv[:, (nh + nkv) * d:])
    strided = qkv.clone().t().contiguous().t()
    assert not RotaryEmbedding.apply_in_place(strided, nh + nkv, cos, sin)
    assert not RotaryEmbedding.apply_in_place(qkv.clone().requires_grad_(), nh + nkv, cos, sin)
    assert torch.equal(strided, qkv)
    with pytest.raises(ValueError, match="do not fit a row"):
        RotaryEmbedding.apply_in_place(qkv.clone(), nh + 2 * nkv + 1, cos, sin)


def test_block_copies_apply_to_every_layer_before_the_forward():
    runner = make_runner()
    cache = runner.kv_cache
    for layer in range(len(cache)):
        cache.key[layer][3].fill_(layer + 1.0)
        cache.value[layer][3].fill_(-(layer + 1.0))
    plan = Paged(NUM_BLOCKS, BLOCK).step({})
    plan.copy_src, plan.copy_dst = np.array([3], np.int64), np.array([5], np.int64)
    runner.execute(plan)
    for layer in range(len(cache)):
        assert torch.equal(cache.key[layer][5], cache.key[layer][3])
        assert torch.equal(cache.value[layer][5], cache.value[layer][3])
        assert not cache.key[layer][4].any()


def test_forked_sequence_continues_like_its_parent():
    runner = make_runner()
    paged = Paged(NUM_BLOCKS, BLOCK)
    paged.add(0, [1, 2, 3, 4, 5, 6, 7])
    first = runner.execute(paged.step({0: 7}))
    tok = int(first.tokens[0])
    paged.fork(0, 1)                     # copies arrive in the next plan
    paged.append(0, tok)
    paged.append(1, tok)
    plan = paged.step({0: 1, 1: 1})
    assert len(plan.copy_src) == 2
    out = runner.execute(plan)
    assert out.tokens[0] == out.tokens[1]
    with torch.inference_mode():        # and the forked blocks hold the parent's K/V
        k = runner.kv_cache.key[1]
        for src, dst in zip(paged.seqs[0].blocks[:1], paged.seqs[1].blocks[:1]):
            assert torch.equal(k[src], k[dst])


def test_chunk_that_does_not_sample_still_fills_the_cache():
    runner = make_runner()
    paged = Paged(NUM_BLOCKS, BLOCK)
    paged.add(0, [4, 4, 2, 8, 1])
    plan = paged.step({0: 3})
    assert len(plan.logits_indices) == 0
    out = runner.execute(plan)
    assert out.tokens.shape == (0,)
    slots = torch.from_numpy(plan.slot_mapping)
    assert runner.kv_cache.key[0].view(-1, 2, 8)[slots].abs().sum() > 0


def test_read_only_plan_columns_and_repeated_logit_rows():
    runner = make_runner()
    paged = Paged(NUM_BLOCKS, BLOCK)
    paged.add(0, [3, 1, 4, 1, 5])
    paged.add(1, [9, 2, 6])
    plan = paged.step({0: 5, 1: 3}, {0: Row(num_logprobs=3), 1: Row(num_logprobs=1)})
    # n > 1: two forks sample from the same prompt row
    plan.logits_indices = np.array([4, 4, 7], np.int64)
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "top_k", "seeds", "gen_index", "num_logprobs"):
        col = getattr(plan, name)
        setattr(plan, name, np.concatenate([col[:1], col]))
    plan.bias_offsets = np.array([0, 0, 0, 0], np.int32)
    plan.hist_offsets = np.array([0, 0, 0, 0], np.int32)
    plan.hist_prompt_lens = np.zeros(3, np.int32)
    for name, value in vars(plan).items():
        if isinstance(value, np.ndarray):
            value.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = runner.execute(plan)
    assert out.tokens.shape == (3,) and out.top_ids.shape == (3, 3)
    assert out.tokens[0] == out.tokens[1]
    assert (out.logprobs <= 0).all()
    np.testing.assert_allclose(out.top_logprobs[0, 0], out.logprobs[0], atol=1e-6)  # greedy = top-1


def test_bf16_model_tracks_fp32():
    """bf16 weights and cache: RMSNorm and softmax still accumulate in float32."""
    fp32 = make_runner()
    bf16 = ModelRunner(build_model(CONFIG, tiny_weights(), torch.bfloat16, "cpu"), NUM_BLOCKS,
                       BLOCK, torch.bfloat16, "cpu")
    logits = []
    for runner in (fp32, bf16):
        paged = Paged(NUM_BLOCKS, BLOCK)
        paged.add(0, [3, 1, 4, 1, 5, 9, 2, 6])
        paged.add(1, [2, 7])
        with torch.inference_mode():
            runner.run_model(paged.step({0: 5, 1: 2}))
            paged.append(1, 8)
            hidden = runner.run_model(paged.step({0: 3, 1: 1}))
            logits.append(runner.model.compute_logits(hidden))
    assert logits[1].dtype == torch.float32 and torch.isfinite(logits[1]).all()
    torch.testing.assert_close(logits[1], logits[0], atol=0.15, rtol=0.05)
