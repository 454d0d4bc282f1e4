"""What a model built for serving holds (build_model(..., serving=True), as engine/build.py
builds it): it takes the checkpoint's tensors over, so a load never holds two copies of the
weights, and a GGUF model on a CPU with native bf16 drops the float32 copies of its layer
linears, which no runner step reads (the quantized GEMV and the bf16 copy compute them all).
Checked on tiny models: the same parameters and the same logits, bit for bit, as a model
built the plain way; the dropped tensors really freed."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch

from _plans import run_schedule
import test_cpu_decoder
from test_bf16_steps import PROMPTS, SCHEDULE
from test_cpu_decoder import BASE, quantized_model
from tiny import random_llama_weights

import llmserve.models.layers as layers
import llmserve.models.llama as llama
from llmserve.loaders.checkpoint import LazyWeights
from llmserve.models import build_model
from llmserve.models.layers import Linear
from llmserve.worker.threads import QUANT_MAX_TOKENS, cpu_step

torch.set_num_threads(1)

CONFIG = dict(BASE, architectures=["LlamaForCausalLM"], tie_word_embeddings=False)


def _bf16_checkpoint() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return (torch.randn(shape, generator=g) * 0.3).to(torch.bfloat16)

    h, v = CONFIG["hidden_size"], CONFIG["vocab_size"]
    return random_llama_weights(CONFIG, r, {"model.embed_tokens.weight": r(v, h),
                                            "model.norm.weight": 1 + r(h), "lm_head.weight": r(v, h)})


def test_a_serving_build_takes_the_tensors_over_and_fuses_in_the_target_dtype():
    plain = build_model(CONFIG, _bf16_checkpoint(), torch.float32, "cpu")
    weights = _bf16_checkpoint()
    q_proj = weakref.ref(weights["model.layers.0.self_attn.q_proj.weight"])
    served = build_model(CONFIG, weights, torch.float32, "cpu", serving=True)
    assert weights == {}
    gc.collect()
    assert q_proj() is None   # (fused into qkv, the part is gone)
    a, b = plain.state_dict(), served.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype == torch.float32, name
        assert torch.equal(a[name], b[name]), name
    # q|k|v fused in fp32 are the bf16 parts converted, row blocks in order
    ck = _bf16_checkpoint()
    sa = "model.layers.1.self_attn."
    want = torch.cat([ck[sa + p + "_proj.weight"].float() for p in "qkv"])
    assert torch.equal(served.layers[1].attn.qkv.weight, want)


def test_a_plain_build_leaves_the_checkpoint_alone():
    weights = _bf16_checkpoint()
    build_model(CONFIG, weights, torch.float32, "cpu")
    assert weights.keys() == _bf16_checkpoint().keys()


@pytest.mark.parametrize("name, shape", [("model.layers.1.self_attn.k_proj.weight", (48, 64)),
                                         ("model.layers.0.mlp.up_proj.weight", (96, 63)),
                                         ("model.layers.1.self_attn.o_proj.weight", (64, 32))])
def test_a_tensor_of_the_wrong_shape_is_named_as_the_checkpoint_names_it(name, shape):
    """A part of a fused weight is checked alone: q|k|v rows that add up to the fused
    weight's still name the part that is wrong."""
    weights = _bf16_checkpoint()
    weights[name] = torch.zeros(shape, dtype=torch.bfloat16)
    if name.endswith("k_proj.weight"):   # (the fused rows add up: q 64 + k 48 + v 16 = 128)
        weights[name.replace("k_proj", "v_proj")] = torch.zeros(16, 64, dtype=torch.bfloat16)
    want = {"k_proj": [32, 64], "up_proj": [96, 64], "o_proj": [64, 64]}
    with pytest.raises(ValueError) as e:
        build_model(CONFIG, weights, torch.float32, "cpu", serving=True)
    part = next(k for k in want if k in name)
    assert str(e.value) == f"{name} is {list(shape)}, but the config makes it {want[part]}"


def _layer_linears(model) -> list[Linear]:
    return [m for m in model.layers.modules() if isinstance(m, Linear)]


def test_with_native_bf16_a_serving_gguf_model_drops_its_fp32_layer_weights(monkeypatch):
    monkeypatch.setattr(llama, "native_bf16", lambda: True)
    real_bf16 = layers._bf16_linear
    plain = quantized_model("llama", seed=3)
    kept = []
    real_quantize = llama.quantize_linear

    def quantize(name, module, q, weight, bf16, release):
        kept.append(weakref.ref(weight))
        return real_quantize(name, module, q, weight, bf16, release)

    monkeypatch.setattr(llama, "quantize_linear", quantize)
    served = quantized_model("llama", seed=3, serving=True)
    linears = _layer_linears(served)
    assert linears and all(m.weight.is_meta and m.quant is not None and m.bf16_weight is not None
                           for m in linears)
    assert tuple(linears[0].weight.shape) == tuple(_layer_linears(plain)[0].weight.shape)
    gc.collect()
    assert len(kept) == len(linears) and all(ref() is None for ref in kept)   # really freed
    # the LM head and the embeddings keep fp32 (prompt logprobs, the embedding lookup)
    assert served.embed_tokens.weight.dtype == torch.float32 and not served.embed_tokens.weight.is_meta
    # every runner step computes the same bits: none read the fp32 weights
    ref, _ = run_schedule(plain, PROMPTS, SCHEDULE, num_blocks=160, step_flags=True)
    got, _ = run_schedule(served, PROMPTS, SCHEDULE, num_blocks=160, step_flags=True)
    for step, (a, b) in enumerate(zip(ref, got)):
        assert torch.equal(a, b), step
    # a linear called outside a runner step computes on the bf16 copy (30 rows: more than
    # the quantized GEMV takes), and refuses what it cannot compute
    calls = []
    monkeypatch.setattr(layers, "_bf16_linear", lambda *a: calls.append(1) or real_bf16(*a))
    x = torch.randn(QUANT_MAX_TOKENS + 6, linears[0].in_features, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        y, want = linears[0](x), _layer_linears(plain)[0](x)
    assert calls == [1] and y.shape == want.shape and (y - want).abs().max() < 0.05 * want.abs().max()
    with pytest.raises(ValueError, match="float32 weight was released"):
        linears[0](x.double())


def test_without_native_bf16_a_serving_gguf_model_keeps_fp32(monkeypatch):
    monkeypatch.setattr(llama, "native_bf16", lambda: False)
    served = quantized_model("llama", seed=3, serving=True)
    assert all(not m.weight.is_meta and m.bf16_weight is None for m in _layer_linears(served))


class _Recorded:
    """A LazyTensor over a float32 tensor. Each make records how many of the copies made so
    far of `watched` tensors are still alive, then keeps a weak reference to its own."""

    def __init__(self, name: str, t: torch.Tensor, watched: set, made: list, alive: list) -> None:
        self.name, self.t, self.shape = name, t, tuple(t.shape)
        self.watched, self.made, self.alive = watched, made, alive

    def make(self) -> torch.Tensor:
        self.alive.append(sum(1 for n, ref in self.made if n in self.watched and ref() is not None))
        copy = self.t.clone()
        self.made.append((self.name, weakref.ref(copy)))
        return copy

    def rows(self, index):
        return self.t[torch.from_numpy(index)]


def _dense(t: torch.Tensor) -> torch.Tensor:
    return t.to_dense() if t.is_mkldnn else t


def test_a_serving_build_from_lazy_weights_holds_one_fp32_layer_linear_at_a_time(monkeypatch):
    """A GGUF checkpoint's weights are made when read (LazyWeights): with native bf16 each layer
    linear gets its blocks and bf16 copy, and drops its fp32, as it is made, so the build never
    holds the model's layer linears in fp32 at once. The same model as from a dict."""
    monkeypatch.setattr(llama, "native_bf16", lambda: True)
    made, alive = [], []
    real_build = test_cpu_decoder.build_model

    def build(c, weights, dtype, device, quantized, serving):
        watched = set(quantized)   # (the layer linears' parts)
        lazy = LazyWeights({n: _Recorded(n, t, watched, made, alive) for n, t in weights.items()})
        return real_build(c, lazy, dtype, device, quantized=quantized, serving=serving)

    eager = quantized_model("llama", seed=5, serving=True)
    monkeypatch.setattr(test_cpu_decoder, "build_model", build)
    lazy = quantized_model("llama", seed=5, serving=True)
    assert len(alive) == len(made) > 8 and max(alive) <= 1, alive
    for a, b in zip(_layer_linears(eager), _layer_linears(lazy), strict=True):
        assert b.weight.is_meta and torch.equal(_dense(a.bf16_weight), _dense(b.bf16_weight))
        assert np.array_equal(a.quant.data, b.quant.data)
    for name, t in eager.state_dict().items():
        if not t.is_meta:
            assert torch.equal(t, lazy.state_dict()[name]), name
    assert torch.equal(eager.lm_bf16, lazy.lm_bf16)


def _gguf_model(monkeypatch, bf16: bool, gguf: bool = True):
    """A GGUF model none of whose linears has blocks (all K-quants, say): float32 weights."""
    monkeypatch.setattr(llama, "native_bf16", lambda: bf16)
    weights = {name: t.float() for name, t in _bf16_checkpoint().items()}
    return build_model(CONFIG, weights, torch.float32, "cpu", quantized={}, serving=True, gguf=gguf)


def test_a_gguf_model_without_blocks_computes_its_linears_in_bf16(monkeypatch):
    """On a CPU with native bf16, a GGUF model's linears that no kernel of ours reads (K-quants,
    Q5_x, F16, ...) get a bfloat16 copy, drop their float32, and every runner step, decode
    steps included, computes them in bf16 (~3.4x less time than the fp32 GEMV per token on
    SmolLM2's layers here); rows that sample read the LM head's bf16 copy, prompt logprobs
    keep float32. Without native bf16, or for a checkpoint that is not GGUF, nothing changes."""
    plain = build_model(CONFIG, {n: t.float() for n, t in _bf16_checkpoint().items()}, torch.float32, "cpu")
    model = _gguf_model(monkeypatch, True)
    linears = _layer_linears(model)
    assert all(m.quant is None and m.bf16_weight is not None and m.weight.is_meta for m in linears)
    assert model.bf16_sampling_head and model.lm_bf16 is not None and not model.quantized
    assert model.bf16_only_linears and not quantized_model("llama", seed=3, serving=True).bf16_only_linears
    calls = []
    real_mm = layers._bf16_mm
    monkeypatch.setattr(layers, "_bf16_mm", lambda x, w: calls.append(x.shape[0]) or real_mm(x, w))
    ref, _ = run_schedule(plain, PROMPTS, SCHEDULE, num_blocks=160, step_flags=True)
    got, _ = run_schedule(model, PROMPTS, SCHEDULE, num_blocks=160, step_flags=True)
    assert len(calls) >= len(SCHEDULE) * len(linears)   # (every step, decode steps too)
    for step, (a, b) in enumerate(zip(ref, got)):
        assert (a - b).abs().max() < 0.05 * a.abs().max(), step
    hidden = torch.randn(3, CONFIG["hidden_size"], generator=torch.Generator().manual_seed(2))
    with torch.inference_mode(), cpu_step(False, True):
        sampled, prompt_lp = model.compute_logits(hidden, sampling=True), model.compute_logits(hidden)
        exact = plain.compute_logits(hidden)
    assert torch.equal(prompt_lp, exact) and not torch.equal(sampled, exact)
    assert (sampled - exact).abs().max() < 0.05 * exact.abs().max()
    for off in (_gguf_model(monkeypatch, False), _gguf_model(monkeypatch, True, gguf=False)):
        assert all(m.bf16_weight is None and not m.weight.is_meta for m in _layer_linears(off))
        assert off.lm_bf16 is None and not off.bf16_sampling_head and not off.bf16_only_linears
