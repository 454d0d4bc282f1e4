"""Parity: our Llama / Qwen2 / Qwen3 / SmolLM3 / Gemma / Gemma 2 / Gemma 3 / Phi-3 / Granite /
OLMo 2 / OLMo 3 / StarCoder2 / StableLM / Phi-2 / Cohere / Cohere2 / GPT-NeoX / GPT-2 / MoE (Mixtral, Qwen2/3-MoE, OLMoE, GraniteMoE) models over the paged cache vs transformers on full sequences. Tiny random fp32 models built by
transformers itself; every weight (biases and norm weights included) is randomized so a dropped
or misplaced tensor shows up in the logits."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from _plans import Paged, greedy_steps
from tiny import PARITY_SHAPE, hf_logits, random_hf_model

from llmserve.models import build_model
from llmserve.worker import ModelRunner

transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)

TOL = 1e-4
BLOCK = 4
COMMON = PARITY_SHAPE

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False)),
    "llama_tied": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True)),
    "llama3_rope": ("LlamaConfig", "LlamaForCausalLM", dict(rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position_embeddings=16))),
    # a window shorter than the prompts: every layer attends over its last 6 keys
    "mistral_window": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=6)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=True)),
    # Qwen3's long-context YaRN (factor 4 over an original 8 positions: the ramp spans dims)
    "qwen3_yarn": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=True, rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=8))),
    # the first releases' legacy hidden_act "gelu" (the tanh approximation); 1 + w norms
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(
        head_dim=32, hidden_act="gelu", pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # a sliding layer (window 5) then a full one, sandwich norms, q . k scaled by 1/sqrt(24),
    # caps low enough to bite: the scaled scores reach ~1.5 and the logits ~1
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        head_dim=32, sliding_window=5, query_pre_attn_scalar=24, attn_logit_softcapping=0.8,
        final_logit_softcapping=0.6, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # sliding layers (window 5, their own RoPE base) and a full one; q . k scaled by 1/sqrt(24)
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=32, sliding_window=5, layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=24, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}})),
    # fused qkv_proj / gate_up_proj checkpoints; a window shorter than the prompts
    "phi3_window": ("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=6, pad_token_id=0, tie_word_embeddings=False)),
    # Phi-4-mini's shape: RoPE on half of each head, LongRoPE's short factors and its
    # attention factor (the sequences stay under the original length; see test_longrope_tables)
    "phi4_longrope": ("Phi3Config", "Phi3ForCausalLM", dict(
        pad_token_id=0, tie_word_embeddings=True, sliding_window=None, original_max_position_embeddings=64,
        rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.5,
                             short_factor=[1.0, 1.3, 2.0, 4.0], long_factor=[1.5, 3.0, 7.0, 20.0]))),
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(
        embedding_multiplier=3.0, attention_multiplier=0.2, residual_multiplier=0.4, logits_scaling=2.5,
        tie_word_embeddings=True)),
    # no norm before the attention or the MLP, their outputs normed; q and k normed across heads
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(tie_word_embeddings=False, pad_token_id=0)),
    # OLMo 2's layers, a sliding one (window 6) then a full one; YaRN on the full one alone
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", dict(
        tie_word_embeddings=False, pad_token_id=0, eos_token_id=2, sliding_window=6,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                            "original_max_position_embeddings": 8}})),
    # mixture-of-experts MLPs (here in transformers 5's stacked expert tensors;
    # test_moe_checkpoints_name_each_expert loads the per-expert names hub files hold)
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)),
    # a shared expert beside the routed ones; layer 1 dense (mlp_only_layers); top-2 not renormalized
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        mlp_only_layers=[1], tie_word_embeddings=False)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(
        num_experts=4, num_experts_per_tok=3, pad_token_id=0, eos_token_id=2, bos_token_id=1)),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", dict(
        num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=3.0, attention_multiplier=0.2,
        residual_multiplier=0.4, logits_scaling=2.5, tie_word_embeddings=True)),
    # LayerNorms with biases, an ungated GELU MLP with biases, a window shorter than the prompts
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", dict(
        sliding_window=6, hidden_act="gelu_pytorch_tanh", bos_token_id=0, eos_token_id=0)),
    # LayerNorms with biases, RoPE on a quarter of each head, q/k/v biases; then the parallel residual
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", dict(
        use_qkv_bias=True, pad_token_id=0, bos_token_id=0, eos_token_id=0,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25))),
    "stablelm_parallel": ("StableLmConfig", "StableLmForCausalLM", dict(
        use_parallel_residual=True, pad_token_id=0, bos_token_id=0, eos_token_id=0)),
    # Phi-2: LayerNorms, parallel residual, an ungated GELU MLP, biases everywhere (LM head too), partial RoPE
    "phi2": ("PhiConfig", "PhiForCausalLM", dict(
        hidden_act="gelu_new", pad_token_id=0, bos_token_id=0, eos_token_id=0,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5))),
    # LayerNorms without bias in float32, a parallel residual, RoPE over adjacent pairs, logits scaled
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(
        logit_scale=0.3, tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # Cohere's layers: a sliding one (window 6) with RoPE, then a full one with no position encoding
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", dict(
        logit_scale=0.25, sliding_window=6, layer_types=["sliding_attention", "full_attention"],
        pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # GPT-NeoX (Pythia): per-head fused q|k|v, RoPE on a quarter of each head, exact GELU, the
    # parallel residual with a norm for each branch; then sequential, biasless attention, half
    # the head rotated at another base, 20B's gelu_fast, the head tied
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(rotary_pct=0.25)),
    "gpt_neox_sequential": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(
        use_parallel_residual=False, attention_bias=False, rotary_pct=0.5, rotary_emb_base=500.0,
        hidden_act="gelu_fast", tie_word_embeddings=True)),
    # GPT-2: learned positions (256 here), Conv1D weights, fused c_attn, gelu_new, the head tied
    # (its config's n_* keys: COMMON's Llama names map onto them, its intermediate_size and
    # num_key_value_heads are stray keys GPT-2 reads as transformers does: not at all); then
    # unscaled scores and exact GELU
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_inner=96, bos_token_id=0, eos_token_id=0)),
    "gpt2_unscaled": ("GPT2Config", "GPT2LMHeadModel", dict(
        n_inner=96, scale_attn_weights=False, activation_function="gelu", bos_token_id=0, eos_token_id=0)),
    # layer 1 without RoPE (NoPE), as SmolLM3's every fourth
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(
        no_rope_layers=[1, 0], tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
}


def make_pair(family: str):
    config_name, arch, extra = FAMILIES[family]
    hf, hf_config = random_hf_model(config_name, arch, **COMMON, **extra)
    ours = build_model(hf_config, dict(hf.state_dict()), torch.float32, "cpu")
    return hf, ours


def our_logits(runner: ModelRunner, plan) -> torch.Tensor:
    """Logits for every token of the plan (not only the sampled rows)."""
    with torch.inference_mode():
        return runner.model.compute_logits(runner.run_model(plan))


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, COMMON["vocab_size"], (n,), generator=g).tolist()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_single_sequence(family):
    hf, ours = make_pair(family)
    runner = ModelRunner(ours, num_blocks=16, block_size=BLOCK, dtype=torch.float32, device="cpu")
    paged = Paged(16, BLOCK)
    toks = prompt(0, 11)
    paged.add(0, toks)
    got = our_logits(runner, paged.step({0: 11}))
    torch.testing.assert_close(got, hf_logits(hf, toks), atol=TOL, rtol=0)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_batch_prefill_then_decode(family):
    """3 sequences of different lengths share one cache; a 4th joins mid-decode so a step mixes
    decode rows with a prefill."""
    hf, ours = make_pair(family)
    runner = ModelRunner(ours, num_blocks=64, block_size=BLOCK, dtype=torch.float32, device="cpu")
    paged = Paged(64, BLOCK)
    seqs = {i: prompt(10 + i, n) for i, n in enumerate((5, 9, 14))}
    for sid, toks in seqs.items():
        paged.add(sid, toks)
    plan = paged.step({sid: len(t) for sid, t in seqs.items()})
    got = our_logits(runner, plan)
    for i, sid in enumerate(seqs):
        a, b = plan.query_start_loc[i], plan.query_start_loc[i + 1]
        torch.testing.assert_close(got[a:b], hf_logits(hf, seqs[sid]), atol=TOL, rtol=0)

    last = {sid: got[plan.query_start_loc[i + 1] - 1] for i, sid in enumerate(seqs)}
    for plan, schedule in greedy_steps(paged, seqs, last, 5, joins={2: (3, prompt(13, 7))}):
        got = our_logits(runner, plan)
        for i, sid in enumerate(schedule):
            row = plan.query_start_loc[i + 1] - 1
            expect = hf_logits(hf, seqs[sid])[-1]
            torch.testing.assert_close(got[row], expect, atol=TOL, rtol=0)
            last[sid] = got[row]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_chunked_prefill_equals_one_shot(family):
    hf, ours = make_pair(family)
    toks = prompt(3, 13)
    one = ModelRunner(ours, num_blocks=16, block_size=BLOCK, dtype=torch.float32, device="cpu")
    p1 = Paged(16, BLOCK)
    p1.add(0, toks)
    full = our_logits(one, p1.step({0: 13}))

    chunked = ModelRunner(ours, num_blocks=16, block_size=BLOCK, dtype=torch.float32, device="cpu")
    p2 = Paged(16, BLOCK)
    p2.add(0, toks)
    parts = [our_logits(chunked, p2.step({0: n})) for n in (5, 3, 5)]
    torch.testing.assert_close(torch.cat(parts), full, atol=TOL, rtol=0)
    torch.testing.assert_close(full, hf_logits(hf, toks), atol=TOL, rtol=0)


@pytest.mark.parametrize("family", ["llama", "mistral_window", "gemma2", "gemma3", "phi3_window", "olmo2", "olmo3",
                                    "qwen3_moe", "qwen2_moe", "starcoder2", "cohere", "cohere2", "stablelm", "phi2",
                                    "gpt_neox", "gpt_neox_sequential", "gpt2"])
def test_bf16_is_about_as_close_to_float32_as_transformers_bf16(family):
    """A bf16 model (a prompt past the window, then decode steps over the cache) against
    transformers in float32, next to transformers' own bf16 model: the two round in different
    places (our attention runs in float32, theirs in bf16 on CPU), so each is off the float32
    logits by bf16's noise (measured: ours 0.8-1.2x theirs on average, per family and seed),
    and a step computed in the wrong precision or order is off by far more. The exact check of
    a rounding convention is per op (test_gemma_norms_round_as_transformers)."""
    hf, _ = make_pair(family)
    weights = {k: v.clone() for k, v in hf.state_dict().items()}
    ours = build_model(hf.config.to_dict(), weights, torch.bfloat16, "cpu")
    toks = prompt(5, 14)
    ref32 = hf_logits(hf, toks)
    ref16 = hf_logits(hf.to(torch.bfloat16), toks)
    runner = ModelRunner(ours, num_blocks=16, block_size=BLOCK, dtype=torch.bfloat16, device="cpu")
    paged = Paged(16, BLOCK)
    paged.add(0, toks[:10])
    got = [our_logits(runner, paged.step({0: 10}))]
    for tok in toks[10:]:
        paged.append(0, tok)
        got.append(our_logits(runner, paged.step({0: 1})))
    ours_err, theirs_err = (torch.cat(got).float() - ref32).abs(), (ref16 - ref32).abs()
    assert ours_err.mean() <= 1.5 * theirs_err.mean(), (ours_err.mean(), theirs_err.mean())
    assert ours_err.max() <= 2 * theirs_err.max(), (ours_err.max(), theirs_err.max())


def test_gemma_norms_round_as_transformers():
    """Gemma scales by 1 + w in float32 and rounds the product once (Llama rounds the normed
    activations first, then multiplies in the model's dtype): bit for bit, in bf16. OLMo 2 the
    same with w."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    from llmserve.models.layers import RMSNorm

    g = torch.Generator().manual_seed(0)
    w = (0.3 * torch.randn(64, generator=g)).to(torch.bfloat16)
    x = (3 * torch.randn(9, 64, generator=g)).to(torch.bfloat16)
    theirs = Gemma3RMSNorm(64, eps=1e-6).to(torch.bfloat16)
    ours = RMSNorm(64, 1e-6)
    with torch.no_grad():
        theirs.weight.copy_(w)
        ours.weight = torch.nn.Parameter(w.float() + 1.0)   # as llama.fuse_hf_weights loads it
        assert torch.equal(ours(x), theirs(x))
        ours.weight = torch.nn.Parameter((w.float() + 1.0).to(torch.bfloat16))   # rounded 1 + w
        assert not torch.equal(ours(x), theirs(x))
    hf, _ = make_pair("gemma3")
    model = build_model(hf.config.to_dict(), dict(hf.state_dict()), torch.bfloat16, "cpu")
    norms = {n: p.dtype for n, p in model.named_parameters() if "norm" in n}
    assert len(norms) == 1 + 2 * 6 and set(norms.values()) == {torch.float32}

    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    theirs = Olmo2RMSNorm(64, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        theirs.weight.copy_(w + 1)
        ours.weight = torch.nn.Parameter(theirs.weight.float())
        assert torch.equal(ours(x), theirs(x))
    hf, _ = make_pair("olmo2")
    model = build_model(hf.config.to_dict(), dict(hf.state_dict()), torch.bfloat16, "cpu")
    norms = {n: p.dtype for n, p in model.named_parameters() if "norm" in n}
    assert len(norms) == 1 + 4 * 2 and set(norms.values()) == {torch.float32}


def test_cohere_layer_norms_round_as_transformers():
    """Cohere's LayerNorm (no bias) normalizes and scales in float32 and rounds once: bit for
    bit against transformers' in bf16. (torch's own bf16 layer_norm accumulates and scales in
    float32 too on CPU; the float32 path makes it so on any device.)"""
    from transformers.models.cohere.modeling_cohere import CohereLayerNorm

    from llmserve.models.layers import LayerNorm

    g = torch.Generator().manual_seed(0)
    w = (1 + 0.3 * torch.randn(64, generator=g)).to(torch.bfloat16)
    x = (3 * torch.randn(9, 64, generator=g) + 1).to(torch.bfloat16)
    theirs = CohereLayerNorm(64, eps=1e-5).to(torch.bfloat16)
    ours = LayerNorm(64, 1e-5, bias=False, fp32=True)
    with torch.no_grad():
        theirs.weight.copy_(w)
        ours.weight = torch.nn.Parameter(w.float())   # as llama.fuse_hf_weights loads it (fp32_norms)
        assert torch.equal(ours(x), theirs(x))
    hf, _ = make_pair("cohere")
    model = build_model(hf.config.to_dict(), dict(hf.state_dict()), torch.bfloat16, "cpu")
    norms = {n: p.dtype for n, p in model.named_parameters() if "norm" in n}
    assert len(norms) == 1 + 2 and set(norms.values()) == {torch.float32}


def test_greedy_generation_through_execute_matches_transformers():
    hf, ours = make_pair("qwen3")
    runner = ModelRunner(ours, num_blocks=32, block_size=BLOCK, dtype=torch.float32, device="cpu")
    paged = Paged(32, BLOCK)
    toks = prompt(4, 6)
    paged.add(0, toks)
    schedule = {0: 6}
    ours_out = []
    for _ in range(6):
        out = runner.execute(paged.step(schedule))
        ours_out.append(int(out.tokens[0]))
        paged.append(0, out.tokens[0])
        schedule = {0: 1}
    with torch.no_grad():
        ref = hf.generate(torch.tensor([toks]), max_new_tokens=6, do_sample=False,
                          attention_mask=torch.ones(1, 6, dtype=torch.long))
    assert ours_out == ref[0, 6:].tolist()


def test_missing_lm_head_ties_and_unknown_tensor_is_rejected():
    hf, _ = make_pair("llama")
    cfg = hf.config.to_dict()
    weights = dict(hf.state_dict())
    weights["model.layers.0.mlp.extra.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match="unexpected"):
        build_model(cfg, weights, torch.float32, "cpu")
    del weights["model.layers.0.mlp.extra.weight"]
    del weights["model.norm.weight"]
    with pytest.raises(ValueError, match="model.norm.weight"):
        build_model(cfg, weights, torch.float32, "cpu")
    with pytest.raises(ValueError, match="unsupported architecture"):
        build_model({**cfg, "architectures": ["BertForMaskedLM"]}, weights, torch.float32, "cpu")
    tied = dict(hf.state_dict())
    del tied["lm_head.weight"]
    model = build_model(cfg, tied, torch.float32, "cpu")
    assert model.lm_head is None
    assert np.isfinite(model.compute_logits(torch.ones(1, 64)).numpy()).all()


def test_qwen_sliding_window_is_rejected():
    """Mistral's window is attended through (the mistral_window family above); Qwen's
    `use_sliding_window` windows only some layers, which nothing here reads yet."""
    qwen, _ = make_pair("qwen2")
    with pytest.raises(ValueError, match="sliding"):
        build_model({**qwen.config.to_dict(), "use_sliding_window": True}, dict(qwen.state_dict()),
                    torch.float32, "cpu")


def test_gemma_1_and_2_read_hub_configs_as_transformers_does():
    """gemma-2b-it's config.json (hidden_act "gelu", meant as the tanh approximation) and
    gemma-2-2b-it's (no layer_types: every other layer slides, from the first): the same
    activation, windows, scale and caps as transformers' reading of them."""
    from llmserve.models.gemma import Gemma2ForCausalLM, GemmaForCausalLM

    g1 = dict(architectures=["GemmaForCausalLM"], model_type="gemma", hidden_size=2048, intermediate_size=16384,
              num_hidden_layers=18, num_attention_heads=8, num_key_value_heads=1, head_dim=256,
              hidden_act="gelu", max_position_embeddings=8192, rms_norm_eps=1e-6, rope_theta=10000.0,
              vocab_size=256000)
    theirs = transformers.GemmaConfig(**{k: v for k, v in g1.items() if k != "architectures"})
    ours = GemmaForCausalLM.parse_config(g1)
    assert ours.hidden_act == theirs.hidden_act == "gelu_pytorch_tanh"
    assert ours.tie_word_embeddings and not ours.layer_windows and ours.attn_scale is None
    assert ours.embed_scale == 2048 ** 0.5 and ours.norm_offset == 1.0

    g2 = dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", hidden_size=2304, intermediate_size=9216,
              num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
              hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256,
              sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
              max_position_embeddings=8192, rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=256000,
              cache_implementation="hybrid")
    theirs = transformers.Gemma2Config(**{k: v for k, v in g2.items() if k not in ("architectures", "hidden_act")})
    ours = Gemma2ForCausalLM.parse_config(g2)
    assert [w > 0 for w in ours.layer_windows] == [t == "sliding_attention" for t in theirs.layer_types]
    assert set(ours.layer_windows) == {0, 4096} and ours.layer_windows[0] == 4096
    assert (ours.attn_softcap, ours.final_softcap) == (50.0, 30.0)
    assert ours.attn_scale == 256 ** -0.5 and ours.sandwich_norms and not ours.qk_norm
    with pytest.raises(ValueError, match="hidden activation"):
        GemmaForCausalLM.parse_config(dict(g1, hidden_act="relu"))
    # Gemma 2's "gelu" is exact GELU to transformers (only Gemma 1's hidden_act meant the tanh)
    with pytest.raises(ValueError, match="hidden activation"):
        Gemma2ForCausalLM.parse_config(dict(g2, hidden_activation="gelu"))


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "granitemoe"])
def test_moe_checkpoints_name_each_expert(family, tmp_path):
    """Hub files hold each expert's projections by name (Mixtral's block_sparse_moe.experts.0.w1,
    Qwen's mlp.experts.0.gate_proj), or GraniteMoE's stacked (block_sparse_moe.input_linear), as
    transformers 5 still saves them."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    hf, _ = make_pair(family)
    hf.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        expert = {"mixtral": "block_sparse_moe.experts.3.w2", "qwen2_moe": "mlp.experts.3.down_proj",
                  "granitemoe": "block_sparse_moe.output_linear"}[family]
        assert any(expert in k for k in f.keys()), sorted(f.keys())[:8]
    ours = build_model(hf.config.to_dict(), weights, torch.float32, "cpu")
    runner = ModelRunner(ours, num_blocks=16, block_size=BLOCK, dtype=torch.float32, device="cpu")
    paged = Paged(16, BLOCK)
    toks = prompt(7, 12)
    paged.add(0, toks)
    torch.testing.assert_close(our_logits(runner, paged.step({0: 12})), hf_logits(hf, toks), atol=TOL, rtol=0)


def test_gpt_neox_and_gpt2_read_hub_configs_as_transformers_does():
    """pythia-70m's config.json (RoPE as rotary_pct and rotary_emb_base, no attention_bias) and
    gpt2's (n_* keys, no tie_word_embeddings): normalized to the Llama names the engine sizes
    with, and read as transformers reads them; what is not implemented is refused by name."""
    from llmserve.engine.build import kv_block_bytes, native_positions
    from llmserve.models import normalize_config
    from llmserve.models.gpt2 import GPT2LMHeadModel
    from llmserve.models.gpt_neox import GPTNeoXForCausalLM

    pythia = dict(architectures=["GPTNeoXForCausalLM"], model_type="gpt_neox", hidden_size=512,
                  intermediate_size=2048, num_attention_heads=8, num_hidden_layers=6, hidden_act="gelu",
                  layer_norm_eps=1e-5, max_position_embeddings=2048, rotary_emb_base=10000, rotary_pct=0.25,
                  tie_word_embeddings=False, use_parallel_residual=True, vocab_size=50304, bos_token_id=0,
                  eos_token_id=0)
    theirs = transformers.GPTNeoXConfig(**{k: v for k, v in pythia.items() if k != "architectures"})
    hf = normalize_config(pythia)
    ours = GPTNeoXForCausalLM.parse_config(hf)
    assert ours.rotary_dim == int(64 * theirs.rope_parameters["partial_rotary_factor"]) == 16
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"] == 10000
    assert ours.qkv_bias and ours.o_bias and theirs.attention_bias
    assert ours.parallel_residual and ours.parallel_mlp_norm and ours.hidden_act == theirs.hidden_act == "gelu"
    assert ours.num_kv_heads == 8 and not ours.tie_word_embeddings and native_positions(hf, None) == 2048
    with pytest.raises(ValueError, match="GPT-NeoX's hidden_act 'relu' is not supported"):
        GPTNeoXForCausalLM.parse_config(dict(hf, hidden_act="relu"))

    gpt2 = dict(architectures=["GPT2LMHeadModel"], model_type="gpt2", activation_function="gelu_new", n_ctx=1024,
                n_embd=768, n_head=12, n_layer=12, n_positions=1024, layer_norm_epsilon=1e-5, vocab_size=50257,
                bos_token_id=50256, eos_token_id=50256)
    theirs = transformers.GPT2Config(**{k: v for k, v in gpt2.items() if k != "architectures"})
    hf = normalize_config(gpt2)
    assert normalize_config(hf) == hf
    assert ([hf[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                             "intermediate_size", "max_position_embeddings")]
            == [theirs.hidden_size, theirs.num_hidden_layers, theirs.num_attention_heads, 12, 3072,
                theirs.max_position_embeddings] == [768, 12, 12, 12, 3072, 1024])
    assert kv_block_bytes(hf, 16, torch.float32) == 2 * 12 * 16 * 768 * 4 and native_positions(hf, None) == 1024
    ours = GPT2LMHeadModel.parse_config(hf)
    assert ours.tie_word_embeddings and theirs.tie_word_embeddings and ours.learned_positions
    assert ours.nope_layers == frozenset(range(12)) and ours.attn_scale is None
    assert ours.hidden_act == "gelu_pytorch_tanh" and ours.rms_norm_eps == 1e-5
    with pytest.raises(ValueError, match="scale_attn_by_inverse_layer_idx"):
        GPT2LMHeadModel.parse_config(dict(hf, scale_attn_by_inverse_layer_idx=True))
    with pytest.raises(ValueError, match="GPT-2's activation_function 'relu' is not supported"):
        GPT2LMHeadModel.parse_config(dict(hf, activation_function="relu"))


@pytest.mark.parametrize("family", ["gpt_neox", "gpt2"])
def test_gpt_neox_and_gpt2_hub_checkpoint_names(family, tmp_path):
    """As hub files name the tensors: GPT-NeoX's head `embed_out` (transformers 5 saves it so
    too), and older files' causal-mask buffers in each layer (`attention.bias`,
    `attention.masked_bias`); gpt2's without the `transformer.` prefix, with `attn.bias`."""
    from safetensors.torch import load_file

    hf, _ = make_pair(family)
    hf.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    mask = torch.tril(torch.ones(1, 1, 256, 256, dtype=torch.bool))
    if family == "gpt_neox":
        assert "embed_out.weight" in weights
        for i in range(COMMON["num_hidden_layers"]):
            weights[f"gpt_neox.layers.{i}.attention.bias"] = mask
            weights[f"gpt_neox.layers.{i}.attention.masked_bias"] = torch.tensor(-1e9)
    else:
        weights = {k.removeprefix("transformer."): v for k, v in weights.items()}
        weights.update({f"h.{i}.attn.bias": mask for i in range(COMMON["num_hidden_layers"])})
    ours = build_model(hf.config.to_dict(), weights, torch.float32, "cpu")
    runner = ModelRunner(ours, num_blocks=16, block_size=BLOCK, dtype=torch.float32, device="cpu")
    paged = Paged(16, BLOCK)
    toks = prompt(7, 12)
    paged.add(0, toks)
    torch.testing.assert_close(our_logits(runner, paged.step({0: 12})), hf_logits(hf, toks), atol=TOL, rtol=0)


def test_qwen_moe_dense_layers_are_transformers():
    """`mlp_only_layers` and `decoder_sparse_step` pick the dense layers as transformers does."""
    from llmserve.models.layers import MoEMLP
    from llmserve.models.moe import Qwen3MoeForCausalLM

    extra = dict(FAMILIES["qwen3_moe"][2], num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])
    config = transformers.Qwen3MoeConfig(**{**COMMON, **extra})
    hf = transformers.Qwen3MoeForCausalLM(config)
    theirs = [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in hf.model.layers]
    with torch.device("meta"):
        ours = Qwen3MoeForCausalLM(Qwen3MoeForCausalLM.parse_config(config.to_dict()))
    assert [isinstance(layer.mlp, MoEMLP) for layer in ours.layers] == theirs == [False, True, False, False,
                                                                                   False, True]


def test_moe_rows_are_batch_invariant():
    """--batch-invariant: a token's MoE output (its experts' and the shared expert's, gated) is
    bit-identical whatever else is in the step. (At this size a sigmoid over the step's column
    of shared-expert gates rounds rows differently by T: layers._rowwise_sigmoid.)"""
    from llmserve.models.layers import MoEMLP

    g = torch.Generator().manual_seed(3)
    mlp = MoEMLP(576, 1536, num_experts=6, top_k=3, norm_topk_prob=True, shared_intermediate=256)
    for p in mlp.parameters():
        p.data = 0.05 * torch.randn(p.shape, generator=g)
    for m in mlp.modules():
        if isinstance(m, MoEMLP) or hasattr(m, "quant"):
            m.batch_invariant = True
    x = torch.randn(64, 576, generator=g)
    with torch.inference_mode():
        whole = mlp(x)
        alone = torch.cat([mlp(x[i:i + 1]) for i in range(x.shape[0])])
    assert torch.equal(whole, alone)


def test_olmo3_reads_a_hub_config_as_transformers_does():
    """Olmo-3's config.json (flat keys: rope_theta, a YaRN rope_scaling, no layer_types): the
    same layers slide, YaRN rotates the full-attention layers alone, as transformers reads it;
    the positions served are the original context times the factor."""
    from llmserve.engine.build import native_positions
    from llmserve.models.olmo2 import Olmo3ForCausalLM

    yarn = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192, "attention_factor": 1.2079,
            "beta_fast": 32, "beta_slow": 1}
    hub = dict(architectures=["Olmo3ForCausalLM"], model_type="olmo3", hidden_size=4096, intermediate_size=11008,
               num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=65536,
               rms_norm_eps=1e-6, rope_theta=500000, rope_scaling=yarn, sliding_window=4096, vocab_size=100278)
    theirs = transformers.Olmo3Config(**{k: v for k, v in hub.items() if k != "architectures"})
    ours = Olmo3ForCausalLM.parse_config(hub)
    assert [w > 0 for w in ours.layer_windows] == [t == "sliding_attention" for t in theirs.layer_types]
    assert ours.rope_scaling["rope_type"] == theirs.rope_parameters["full_attention"]["rope_type"] == "yarn"
    assert ours.local_rope == (500000.0, None) and theirs.rope_parameters["sliding_attention"]["rope_type"] == "default"
    assert ours.rope_theta == 500000.0 and sorted(ours.local_layers) == [i for i in range(32) if (i + 1) % 4]
    assert native_positions(hub, None) == 65536


def test_gemma3_reads_a_hub_config_as_transformers_does():
    """gemma-3-1b-it's config.json (the flat keys transformers 4 wrote: rope_theta,
    rope_local_base_freq, sliding_window_pattern): the same layers slide, with the same RoPE
    bases, as transformers' own reading of it."""
    from llmserve.models.gemma3 import Gemma3ForCausalLM

    hub = dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", hidden_size=1152,
               intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1,
               head_dim=256, max_position_embeddings=32768, query_pre_attn_scalar=256, rms_norm_eps=1e-6,
               rope_theta=1000000, rope_local_base_freq=10000, rope_scaling=None, sliding_window=512,
               sliding_window_pattern=6, vocab_size=262144, hidden_activation="gelu_pytorch_tanh",
               attn_logit_softcapping=None, final_logit_softcapping=None)
    theirs = transformers.Gemma3TextConfig(**{k: v for k, v in hub.items() if k != "architectures"})
    ours = Gemma3ForCausalLM.parse_config(hub)
    assert [w > 0 for w in ours.layer_windows] == [t == "sliding_attention" for t in theirs.layer_types]
    assert set(ours.layer_windows) == {0, theirs.sliding_window}
    assert (ours.rope_theta, ours.local_rope[0]) == (theirs.rope_parameters["full_attention"]["rope_theta"],
                                                      theirs.rope_parameters["sliding_attention"]["rope_theta"])
    assert ours.tie_word_embeddings and ours.attn_scale == 256 ** -0.5


@pytest.mark.parametrize("params", [
    dict(factor=4.0, original_max_position_embeddings=64),
    dict(factor=8.0, original_max_position_embeddings=32, beta_fast=16, beta_slow=2, truncate=False),
    dict(factor=40.0, original_max_position_embeddings=64, mscale=1.0, mscale_all_dim=0.707),   # DeepSeek's
    dict(factor=4.0, original_max_position_embeddings=64, attention_factor=1.5),
    dict(factor=None, original_max_position_embeddings=64),   # factor: max_position_embeddings / original
    dict(factor=2.0),   # the original context: max_position_embeddings, as transformers fills it
])
def test_yarn_tables(params):
    """YaRN's frequencies and attention factor, as transformers computes them (its
    _compute_yarn_parameters), with each optional key; and the positions served: the original
    context times the factor, as vLLM serves YaRN."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from llmserve.engine.build import native_positions
    from llmserve.models.layers import RotaryEmbedding

    config = transformers.Qwen3Config(**{**COMMON, "max_position_embeddings": 512}, head_dim=32,
                                      rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, **params))
    inv_freq, attention = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    ours = RotaryEmbedding(32, 10000.0, config.rope_parameters, 512, torch.device("cpu"))
    torch.testing.assert_close(ours.inv_freq.float(), inv_freq, rtol=1e-6, atol=0)
    assert ours.mscale == pytest.approx(attention, rel=1e-12) and attention != 1.0
    positions = torch.arange(512)
    cos = torch.outer(positions.double(), inv_freq.double()).cos() * attention
    torch.testing.assert_close(ours.cos, cos.float(), atol=2e-5, rtol=0)
    hf = {**config.to_dict(), "rope_scaling": dict(config.rope_parameters)}
    original = params.get("original_max_position_embeddings", 512)
    assert native_positions(hf, None) == int(original * (params["factor"] or 512 / original))


def test_longrope_tables():
    """LongRoPE rotates a position before original_max_position_embeddings with the short
    factors and one from it on with the long, both scaled by the attention factor: the tables
    transformers computes for a sequence within the original length and for one past it."""
    from llmserve.models.layers import RotaryEmbedding
    from llmserve.models.phi3 import longrope

    _, _, extra = FAMILIES["phi4_longrope"]
    config = transformers.Phi3Config(**COMMON, **{**extra, "original_max_position_embeddings": 16})
    hf_rope = transformers.models.phi3.modeling_phi3.Phi3RotaryEmbedding(config)
    x = torch.zeros(1, dtype=torch.float32)

    def hf_cos(n):   # cos over positions 0..n-1 of a sequence of n tokens: [n, rotary_dim / 2]
        cos, _ = hf_rope(x, torch.arange(n)[None])
        return cos[0, :, :cos.shape[-1] // 2]

    scaling = longrope(config.to_dict())
    assert scaling["attention_factor"] == pytest.approx(hf_rope.attention_scaling) != 1.0
    ours = RotaryEmbedding(8, 10000.0, scaling, 256, torch.device("cpu"))
    # (transformers computes the angles in float32, these tables in float64: 1e-6 apart)
    torch.testing.assert_close(ours.cos[:16], hf_cos(16), atol=1e-5, rtol=0)
    torch.testing.assert_close(ours.cos[16:40], hf_cos(40)[16:], atol=1e-5, rtol=0)
    assert not torch.allclose(hf_cos(40)[:16], hf_cos(16), atol=1e-3)   # (the factors differ)


def test_partial_rope_defaults_are_the_families_transformers_defaults():
    """A StableLM or Phi config that does not give `partial_rotary_factor` rotates the part of
    each head transformers' config classes default to (0.25 and 0.5)."""
    from llmserve.models.phi import PhiForCausalLM
    from llmserve.models.stablelm import StableLmForCausalLM

    hub = dict(COMMON, rope_theta=10000.0)
    for cls, name in ((StableLmForCausalLM, "StableLmConfig"), (PhiForCausalLM, "PhiConfig")):
        theirs = getattr(transformers, name)(**hub)
        ours = cls.parse_config(hub)
        assert ours.rotary_dim == int(ours.head_dim * theirs.rope_parameters["partial_rotary_factor"]), name
