"""The Rust decoder of few-token decode steps (models/cpu_decoder.py, rust/kernels/src/layer.rs)
against the torch layers, its reference: tiny quantized Llama, Qwen2 (qkv bias), Qwen3 (q/k
norms, o bias) and SmolLM3 (a layer without RoPE) models run the same steps both ways through ModelRunner, and the logits (the
Rust path applies the final norm too) and the KV cache must agree. Also: which steps take the path, and the binding's checks.

How close "agree" is: both paths feed the same int8-activation GEMV, but their norms round
differently in the last bit, and now and then that moves one activation across an int8
rounding boundary: that token's outputs then differ by up to a quantization step (~1-3% of
the logits' scale, measured), and the difference carries into its later steps through the KV
cache. Everything else agrees to ~1e-7. So the check is: most values within 1e-5 of the
scale (the median), none beyond 5% of it. A real mistake (a RoPE sign, a missing bias or
norm, a wrong head order) moves nearly every value by a large fraction of the scale; the
exact, per-op comparison is the Rust test beside layer.rs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GT
from gguf.quants import dequantize, quantize

from _plans import run_schedule
from tiny import random_llama_weights

from llmserve import _core
from llmserve.loaders import QuantTensor
from llmserve.models import build_model, cpu_decoder
from llmserve.models.cpu_decoder import CpuDecodePath

torch.set_num_threads(1)

BASE = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
            max_position_embeddings=256, rope_theta=10000.0, tie_word_embeddings=True)
FAMILIES = {
    "llama": dict(BASE, architectures=["LlamaForCausalLM"]),
    "qwen2": dict(BASE, architectures=["Qwen2ForCausalLM"]),
    "qwen3": dict(BASE, architectures=["Qwen3ForCausalLM"], attention_bias=True),
    "smollm3": dict(BASE, architectures=["SmolLM3ForCausalLM"], no_rope_layers=[0, 1]),
}
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def quantized_model(family: str, fmt: GT = GT.Q4_1, seed: int = 0, serving: bool = False,
                    blocks: bool = True):
    """A tiny model whose linears are GGUF blocks of `fmt`; its fp32 weights are those blocks
    dequantized, as the GGUF loader gives them. `serving`: built as the engine builds it.
    `blocks` False: the same fp32 weights without the blocks (its float twin)."""
    c = FAMILIES[family]
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(shape, generator=g) * 0.3

    h, d = c["hidden_size"], c["head_dim"]
    weights = random_llama_weights(c, r, {"model.embed_tokens.weight": r(c["vocab_size"], h),
                                          "model.norm.weight": 1 + r(h)})
    quant = {}
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        for lin in LINEARS:
            name = p + lin + ".weight"
            raw = np.ascontiguousarray(quantize(weights[name].numpy(), fmt))
            quant[name] = QuantTensor(raw, int(fmt), *weights[name].shape)
            weights[name] = torch.from_numpy(dequantize(raw, fmt).copy())
        if family in ("qwen2", "qwen3"):
            for proj, n in (("q", c["num_attention_heads"]), ("k", 2), ("v", 2)):
                weights[p + f"self_attn.{proj}_proj.bias"] = r(n * d)
        if family == "qwen3":
            weights[p + "self_attn.o_proj.bias"] = r(h)
            weights[p + "self_attn.q_norm.weight"] = 1 + r(d)
            weights[p + "self_attn.k_norm.weight"] = 1 + r(d)
    return build_model(c, weights, torch.float32, "cpu", quantized=quant if blocks else None, serving=serving)


@pytest.fixture
def path_calls(monkeypatch) -> list[int]:
    """Tokens of each step the Rust decoder served."""
    calls: list[int] = []
    real = CpuDecodePath.forward

    def counted(self, h, *args):
        calls.append(h.shape[0])
        return real(self, h, *args)

    monkeypatch.setattr(CpuDecodePath, "forward", counted)
    return calls


PROMPTS = {0: list(range(3, 24)), 1: [5, 7, 9], 2: list(range(40, 77))}
# prompts in chunks, then decode steps of 2 and 3 sequences; step 2 mixes decodes and a chunk
SCHEDULE = [{0: 21, 1: 3, 2: 10}, {0: 1, 1: 1, 2: 17}, {0: 1, 1: 1, 2: 10},
            {0: 1, 1: 1, 2: 1}, {0: 1, 1: 1, 2: 1}, {0: 1, 1: 1, 2: 1}]


def _run_steps(model, on: bool, monkeypatch, kv_dtype=None):
    """Logits of every step and the final K caches (as float32), with the Rust decoder on or
    off."""
    monkeypatch.setattr(cpu_decoder, "USE_CPU_DECODER", on)
    steps, runner = run_schedule(model, PROMPTS, SCHEDULE, kv_dtype=kv_dtype)
    return steps, [k.float() for k in runner.kv_cache.key]


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("fmt", [GT.Q4_1, GT.Q8_0])
def test_logits_and_cache_match_the_torch_layers(monkeypatch, path_calls, family, fmt):
    model = quantized_model(family, fmt)
    ref_logits, ref_cache = _run_steps(model, False, monkeypatch)
    assert path_calls == []
    got_logits, got_cache = _run_steps(model, True, monkeypatch)
    # steps 1-2 hold a prompt chunk (torch layers); steps 3-5 decode three sequences
    assert path_calls == [3, 3, 3]
    for n, (ref, got) in enumerate(zip(ref_logits, got_logits)):
        _agree(got, ref, f"logits of step {n}")
    for layer, (ref, got) in enumerate(zip(ref_cache, got_cache)):
        _agree(got, ref, f"K cache of layer {layer}")


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2])
def test_narrow_caches_match_the_torch_layers(monkeypatch, path_calls, kv_dtype):
    """--kv-cache-dtype: the Rust decoder writes each K/V value narrowed as the torch path's
    write_kv does (the same rounding and saturation), and reads the cache as it does."""
    model = quantized_model("qwen3")
    ref_logits, ref_cache = _run_steps(model, False, monkeypatch, kv_dtype)
    got_logits, got_cache = _run_steps(model, True, monkeypatch, kv_dtype)
    assert path_calls == [3, 3, 3]
    for n, (ref, got) in enumerate(zip(ref_logits, got_logits)):
        _agree(got, ref, f"logits of step {n}")
    for layer, (ref, got) in enumerate(zip(ref_cache, got_cache)):
        _agree(got, ref, f"K cache of layer {layer}")


def test_lora_steps_keep_the_torch_layers_and_add_their_deltas(monkeypatch, path_calls, tmp_path):
    """A quantized (GGUF) base serves LoRA adapters: a step with adapter rows runs the torch
    layers, whose quantized GEMV gets the delta added (the Rust layers hold no adapter), while
    base-model steps keep the Rust path. The adapter's effect matches the float twin's (the
    same weights without blocks) up to the int8 activations' error, far below the effect."""
    from tiny import write_peft_adapter

    from llmserve.models import lora

    c = FAMILIES["llama"]
    write_peft_adapter(tmp_path / "a", c, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                           "down_proj"], r=4, alpha=4.0)
    adapter = lora.load_adapter("a", str(tmp_path / "a"), c)
    monkeypatch.setattr(cpu_decoder, "USE_CPU_DECODER", True)
    runs = {}
    for blocks in (True, False):
        model = quantized_model("llama", GT.Q8_0, blocks=blocks)
        lora.attach(model, [adapter], torch.float32, "cpu")
        for adapted in (False, True):
            path_calls.clear()
            loras = {0: 1, 2: 1} if adapted else {}
            runs[blocks, adapted] = run_schedule(model, PROMPTS, SCHEDULE, loras=loras)[0]
            # (the float twin never takes the Rust path; the quantized base only without adapter rows)
            assert path_calls == ([3, 3, 3] if blocks and not adapted else []), (blocks, adapted)
    last = [torch.cat(runs[key][3:]) for key in ((True, True), (False, True), (False, False))]
    quantized, float_twin, float_base = last
    effect = (float_twin - float_base).abs().max().item()
    assert effect > 0.1 * float_base.abs().max().item()
    assert (quantized - float_twin).abs().max().item() < 0.05 * effect


def _agree(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """See the module doc."""
    scale = ref.abs().max().item()
    diff = (got - ref).abs()
    assert diff.median().item() <= 1e-5 * scale, what
    assert diff.max().item() <= 5e-2 * scale, what


def test_models_without_every_block_keep_the_torch_layers():
    model = quantized_model("llama")
    assert CpuDecodePath.available(model)
    model.layers[1].mlp.down.quant = None
    assert not CpuDecodePath.available(model)
    c = FAMILIES["llama"]
    g = torch.Generator().manual_seed(1)
    weights = random_llama_weights(c, lambda *s: torch.randn(s, generator=g) * 0.3, {
        "model.embed_tokens.weight": torch.randn(c["vocab_size"], c["hidden_size"]),
        "model.norm.weight": torch.ones(c["hidden_size"])})
    assert not CpuDecodePath.available(build_model(c, weights, torch.float32, "cpu"))


@pytest.mark.parametrize("arch, extra, llama", [
    ("LlamaForCausalLM", {}, True),
    ("Qwen2ForCausalLM", {}, True),
    ("Qwen3ForCausalLM", {}, True),
    ("SmolLM3ForCausalLM", {"no_rope_layers": [1, 0]}, True),   # (the Rust layer's rope flag)
    ("MistralForCausalLM", {"sliding_window": 64}, False),
    ("Phi3ForCausalLM", {"partial_rotary_factor": 0.5}, False),
    ("GraniteForCausalLM", {"residual_multiplier": 0.5}, False),
    ("GemmaForCausalLM", {}, False),
    ("Gemma2ForCausalLM", {"sliding_window": None}, False),
    ("Gemma3ForCausalLM", {"sliding_window": 64}, False),
    ("Olmo2ForCausalLM", {}, False),
    ("Olmo3ForCausalLM", {"sliding_window": None}, False),
    ("Qwen3ForCausalLM", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                           "original_max_position_embeddings": 64}}, True),
    ("Gemma3ForCausalLM", {"sliding_window": None, "layer_types": ["full_attention"] * 2}, False),
])
def test_only_llama_layers_take_the_rust_decoder(arch, extra, llama):
    """DecoderConfig.llama_layers: what the Rust decoder computes is a Llama layer (with
    Qwen's bias and norms and SmolLM3's NoPE layers); any other switch keeps the torch layers."""
    from llmserve.models.registry import _REGISTRY, supported_architectures

    supported_architectures()
    config = _REGISTRY[arch].parse_config(dict(FAMILIES["llama"], architectures=[arch], **extra))
    assert config.llama_layers is llama


def test_batch_invariant_mode_keeps_the_torch_layers(monkeypatch, path_calls):
    model = quantized_model("llama")
    model.set_batch_invariant(True)
    _run_steps(model, True, monkeypatch)
    assert path_calls == []


def test_binding_refuses_bad_arguments_and_writes_nothing():
    model = quantized_model("llama")
    path = model.cpu_decode_path()
    c = model.config
    t, bs, blocks = 2, 4, 6
    h = np.random.default_rng(0).standard_normal((t, c.hidden_size)).astype(np.float32)
    cos = np.ones((t, c.head_dim // 2), np.float32)
    sin = np.zeros((t, c.head_dim // 2), np.float32)
    caches = [np.zeros((blocks, bs, c.num_kv_heads, c.head_dim), np.float32) for _ in range(4)]
    ks, vs = caches[:2], caches[2:]
    good = dict(slots=np.array([4, 9], np.int64), tables=np.array([[1, 0], [2, 0]], np.int32),
                lens=np.array([1, 2], np.int32))
    bad = [
        (dict(slots=np.array([4, 99], np.int64)), "slot 99"),
        (dict(tables=np.array([[1, 0], [7, 0]], np.int32)), "block id 7"),
        (dict(lens=np.array([1, 9], np.int32)), "seq_lens"),
    ]
    for change, needle in bad:
        args = {**good, **change}
        before = h.copy()
        with pytest.raises(ValueError, match=needle):
            path.decoder.forward(h, cos, sin, args["slots"], args["tables"], args["lens"], ks, vs, 1)
        np.testing.assert_array_equal(h, before)
        assert not any(c.any() for c in caches)
    with pytest.raises(ValueError, match="2 layers"):
        path.decoder.forward(h, cos, sin, good["slots"], good["tables"], good["lens"], ks[:1], vs, 1)
    frozen = h.copy()
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="h must be writeable"):
        path.decoder.forward(frozen, cos, sin, good["slots"], good["tables"], good["lens"], ks, vs, 1)
    path.decoder.forward(h, cos, sin, good["slots"], good["tables"], good["lens"], ks, vs, 1)
    assert np.isfinite(h).all() and ks[0].any()


def test_binding_refuses_raw_blocks_in_place_of_packed_ones():
    # With rows a multiple of 8, raw GGUF blocks have exactly the packed byte count: only the
    # shape tells them apart, and reading them as packed would give wrong numbers silently.
    rng = np.random.default_rng(0)
    hidden, heads, head_dim, inter = 64, 2, 32, 64

    def blocks(rows, cols):
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        return QuantTensor(np.ascontiguousarray(quantize(w, GT.Q8_0)), int(GT.Q8_0), rows, cols)

    linears = {"qkv": blocks(3 * heads * head_dim, hidden), "o_proj": blocks(hidden, heads * head_dim),
               "gate_up": blocks(2 * inter, hidden), "down": blocks(hidden, inter)}
    shape = dict(hidden=hidden, num_heads=heads, num_kv_heads=heads, head_dim=head_dim,
                 intermediate=inter, eps=1e-5, scale=head_dim ** -0.5)

    def layer(raw_name=None):
        quant = {n: q if n == raw_name else q.pack() for n, q in linears.items()}
        return {"input_norm": np.ones(hidden, np.float32), "post_norm": np.ones(hidden, np.float32),
                **{n: (q.data, q.ggml_type, q.rows, q.cols) for n, q in quant.items()}}

    assert _core.CpuDecoder(shape, [layer()]).num_layers == 1
    assert _core.CpuDecoder(shape, [layer()], np.ones(hidden, np.float32)).num_layers == 1
    with pytest.raises(ValueError, match="final_norm has 63 values, expected hidden 64"):
        _core.CpuDecoder(shape, [layer()], np.ones(hidden - 1, np.float32))
    for name in linears:
        assert linears[name].data.size == linears[name].pack().data.size
        with pytest.raises(ValueError, match=f"{name}: w_packed .* must be"):
            _core.CpuDecoder(shape, [layer(name)])
