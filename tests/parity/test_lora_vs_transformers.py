"""Parity: PEFT LoRA adapters served by models/lora.py (over the paged cache, several adapters and
the base model mixed in one step) vs transformers' logits of the same base with each LoRA merged
into its weights by hand (W + scaling * B @ A). Tiny random fp32 models; adapter folders written
as PEFT saves them (tiny.write_peft_adapter). Then the adapters lora.py refuses."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from _plans import Paged, greedy_steps
from tiny import PARITY_SHAPE, hf_logits, random_hf_model, write_peft_adapter

from llmserve.models import build_model, lora
from llmserve.worker import ModelRunner

transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)

TOL = 1e-4
BLOCK = 4
COMMON = PARITY_SHAPE
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False)),   # q/k/v biases
    # q|k|v and gate|up fused in the checkpoint, and so in PEFT's modules
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(pad_token_id=0, tie_word_embeddings=False)),
    # RoPE over adjacent pairs: q and k rows reordered at load (llama.rope_rows), B's with them
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(
        logit_scale=0.3, tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
}
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PHI3 = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]


def base(family: str):
    """transformers' model with every weight randomized, and its config dict."""
    config_name, arch, extra = FAMILIES[family]
    return random_hf_model(config_name, arch, **COMMON, **extra)


def merged(hf, pairs: dict, scaling: float):
    """A copy of `hf` with each LoRA merged: W += scaling * B @ A."""
    out = copy.deepcopy(hf)
    with torch.no_grad():
        for module, (a, b) in pairs.items():
            out.get_submodule(module).weight += scaling * (b @ a)
    return out


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, COMMON["vocab_size"], (n,), generator=g).tolist()


def served(hf, cfg: dict, adapters: list, blocks: int = 64) -> ModelRunner:
    ours = build_model(cfg, dict(hf.state_dict()), torch.float32, "cpu")
    lora.attach(ours, adapters, torch.float32, "cpu")
    return ModelRunner(ours, num_blocks=blocks, block_size=BLOCK, dtype=torch.float32, device="cpu")


def run(runner: ModelRunner, plan, seq_adapters: list[int]) -> torch.Tensor:
    """Every token's logits, each sequence through its adapter (the plan's `lora_ids`, which the
    runner reads when it calls set_step itself)."""
    plan.lora_ids = np.asarray(seq_adapters, np.uint32)
    lora.set_step(lora.token_adapters(plan.query_start_loc, seq_adapters), runner.model)
    try:
        with torch.inference_mode():
            return runner.model.compute_logits(runner.run_model(plan))
    finally:
        lora.set_step(None)


@pytest.mark.parametrize("family,targets,extra", [
    ("llama", ALL, {}),
    ("llama", ["q_proj", "v_proj"], {}),
    ("llama", ["k_proj", "gate_proj", "down_proj"], {"use_rslora": True}),
    ("qwen2", ALL, {}),
    ("phi3", PHI3, {}),
    ("phi3", ["qkv_proj"], {"use_rslora": True}),
    ("cohere", ALL, {}),
    ("cohere", ["q_proj", "k_proj"], {}),
], ids=["llama-all", "llama-qv", "llama-rslora", "qwen2-all", "phi3-fused", "phi3-qkv-rslora", "cohere-all",
        "cohere-qk"])
def test_one_adapter_matches_merged_weights(family, targets, extra, tmp_path):
    hf, cfg = base(family)
    r, alpha = 4, 8.0
    pairs = write_peft_adapter(tmp_path / "a", cfg, targets, r=r, alpha=alpha, config=extra,
                               infix=".default" if family == "qwen2" else "")
    adapter = lora.load_adapter("a", str(tmp_path / "a"), cfg)
    scaling = alpha / math.sqrt(r) if extra.get("use_rslora") else alpha / r
    assert adapter.scaling == scaling and adapter.rank == r
    ref = merged(hf, pairs, scaling)
    runner = served(hf, cfg, [adapter])
    paged = Paged(64, BLOCK)
    toks = prompt(0, 11)
    paged.add(0, toks)
    got = run(runner, paged.step({0: 11}), [1])
    expect = hf_logits(ref, toks)
    torch.testing.assert_close(got, expect, atol=TOL, rtol=0)
    assert (expect - hf_logits(hf, toks)).abs().max() > 100 * TOL   # (the adapter changes the logits)
    # a decode step of one token (T = 1), then the base model on the same sequence's next token
    paged.append(0, 7)
    torch.testing.assert_close(run(runner, paged.step({0: 1}), [1])[0], hf_logits(ref, toks + [7])[-1],
                               atol=TOL, rtol=0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bf16_adapters_are_about_as_close_to_float32_as_transformers_bf16(seed, tmp_path):
    """A bf16 model with an adapter (a prompt, then decode steps over the cache) against the
    float32 base with the adapter merged, next to transformers' bf16 model with it merged: ours
    rounds the delta as PEFT's unmerged path does (x A^T, its product with B^T, the add, each
    in bf16), so it is off by bf16's noise, as a merged weight is (measured: ours 0.5-1.1x
    theirs on average over these seeds); a delta lost, doubled or applied to the
    wrong rows is off by far more (the adapter moves the logits by about 40x our error)."""
    hf, cfg = base("llama")
    pairs = write_peft_adapter(tmp_path / "a", cfg, ALL, r=8, alpha=16.0, seed=seed)
    ref = merged(hf, pairs, 2.0)
    ours = build_model(cfg, {k: v.clone() for k, v in hf.state_dict().items()}, torch.bfloat16, "cpu")
    lora.attach(ours, [lora.load_adapter("a", str(tmp_path / "a"), cfg)], torch.bfloat16, "cpu")
    runner = ModelRunner(ours, num_blocks=16, block_size=BLOCK, dtype=torch.bfloat16, device="cpu")
    toks = prompt(20 + seed, 14)
    ref32, ref16 = hf_logits(ref, toks), hf_logits(copy.deepcopy(ref).to(torch.bfloat16), toks)
    paged = Paged(16, BLOCK)
    paged.add(0, toks[:10])
    got = [run(runner, paged.step({0: 10}), [1])]
    for tok in toks[10:]:
        paged.append(0, tok)
        got.append(run(runner, paged.step({0: 1}), [1]))
    ours_err, theirs_err = (torch.cat(got).float() - ref32).abs(), (ref16 - ref32).abs()
    assert ours_err.mean() <= 2 * theirs_err.mean(), (ours_err.mean(), theirs_err.mean())
    assert ours_err.max() <= 3 * theirs_err.max(), (ours_err.max(), theirs_err.max())
    assert (ref32 - hf_logits(hf, toks)).abs().mean() > 20 * ours_err.mean()


def test_two_adapters_and_the_base_in_one_batch(tmp_path):
    """Three prompts through adapter 1, the base and adapter 2 in one step; then decode steps,
    a fourth sequence (adapter 2) joining mid-decode so a step mixes its prefill with the
    others' decode rows; every row equals its own merged reference."""
    hf, cfg = base("llama")
    p1 = write_peft_adapter(tmp_path / "one", cfg, ALL, r=4, alpha=8.0, seed=1)
    p2 = write_peft_adapter(tmp_path / "two", cfg, ["q_proj", "v_proj", "up_proj"], r=8, alpha=4.0, seed=2,
                            config={"use_rslora": True})
    adapters = [lora.load_adapter("one", str(tmp_path / "one"), cfg),
                lora.load_adapter("two", str(tmp_path / "two"), cfg)]
    refs = {0: hf, 1: merged(hf, p1, 2.0), 2: merged(hf, p2, 4.0 / math.sqrt(8))}
    runner = served(hf, cfg, adapters)
    paged = Paged(64, BLOCK)
    seqs = {i: prompt(10 + i, n) for i, n in enumerate((5, 9, 14))}
    which = {0: 1, 1: 0, 2: 2, 3: 2}
    for sid, toks in seqs.items():
        paged.add(sid, toks)
    plan = paged.step({sid: len(t) for sid, t in seqs.items()})
    got = run(runner, plan, [which[s] for s in seqs])
    last = {}
    for i, sid in enumerate(seqs):
        a, b = plan.query_start_loc[i], plan.query_start_loc[i + 1]
        torch.testing.assert_close(got[a:b], hf_logits(refs[which[sid]], seqs[sid]), atol=TOL, rtol=0)
        last[sid] = got[b - 1]
    for plan, schedule in greedy_steps(paged, seqs, last, 4, joins={1: (3, prompt(13, 7))}):
        got = run(runner, plan, [which[s] for s in schedule])
        for i, sid in enumerate(schedule):
            row = plan.query_start_loc[i + 1] - 1
            torch.testing.assert_close(got[row], hf_logits(refs[which[sid]], seqs[sid])[-1], atol=TOL, rtol=0)
            last[sid] = got[row]


def test_rows_are_batch_invariant_with_adapters(tmp_path):
    """--batch-invariant: a sequence's logits through its adapter are bit-identical alone and in
    a step mixed with other adapters and the base."""
    hf, cfg = base("llama")
    write_peft_adapter(tmp_path / "one", cfg, ALL, seed=1)
    write_peft_adapter(tmp_path / "two", cfg, ["q_proj", "down_proj"], seed=2)
    adapters = [lora.load_adapter(n, str(tmp_path / n), cfg) for n in ("one", "two")]
    seqs = {i: prompt(20 + i, n) for i, n in enumerate((6, 3, 9))}
    which = [1, 2, 0]

    def logits(sids: list[int]) -> torch.Tensor:
        runner = served(hf, cfg, adapters)
        runner.model.set_batch_invariant(True)
        paged = Paged(64, BLOCK)
        for sid in sids:
            paged.add(sid, seqs[sid])
        return run(runner, paged.step({sid: len(seqs[sid]) for sid in sids}), [which[s] for s in sids])

    together = logits([0, 1, 2]).split([len(seqs[s]) for s in (0, 1, 2)])
    for sid in seqs:
        assert torch.equal(together[sid], logits([sid])), sid


def test_delta_rows_are_batch_invariant():
    """With --batch-invariant a row's delta is bit-identical whether its adapter takes the whole
    step, some rows of it (gathered and scattered), or the row alone (at a size where BLAS's
    blocking changes a row's sums with the batch)."""
    g = torch.Generator().manual_seed(0)
    a, b = 0.05 * torch.randn(16, 576, generator=g), 0.05 * torch.randn(1536, 16, generator=g)
    weights = lora.LoraWeights({1: (a, b)})
    x, base = torch.randn(64, 576, generator=g), torch.randn(64, 1536, generator=g)
    rows = torch.arange(1, 64, 2)
    try:
        lora._step.groups = ((1, None),)
        whole = weights.add(x, base.clone(), True)
        alone = torch.cat([weights.add(x[i:i + 1], base[i:i + 1].clone(), True) for i in range(64)])
        lora._step.groups = ((1, rows),)
        some = weights.add(x, base.clone(), True)
    finally:
        lora._step.groups = None
    assert torch.equal(whole, alone)
    assert torch.equal(some[rows], whole[rows]) and torch.equal(some[rows - 1], base[rows - 1])


def test_token_adapters_and_step_groups():
    assert lora.token_adapters([0, 3, 4, 6], [0, 0, 0]) is None
    assert lora.token_adapters(np.array([0, 3, 4, 6], np.int32), np.array([1, 0, 2], np.uint32)).tolist() == [
        1, 1, 1, 0, 2, 2]
    model = torch.nn.Module()
    model.lora_adapters = {1: None, 2: None}
    try:
        lora.set_step(torch.tensor([2, 2, 0, 2]), model)
        assert [(i, rows.tolist()) for i, rows in lora._step.groups] == [(2, [0, 1, 3])]
        lora.set_step(torch.tensor([1, 1]), model)
        assert lora._step.groups == ((1, None),)   # (one adapter for the whole step: no indexing)
        lora.set_step(torch.tensor([0, 0]), model)
        assert lora._step.groups is None
        with pytest.raises(ValueError, match="only \\[1, 2\\] are installed"):
            lora.set_step(torch.tensor([3]), model)
    finally:
        lora.set_step(None)


@pytest.mark.parametrize("config,message", [
    ({"use_dora": True}, "DoRA"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"bias": "lora_only"}, "bias 'lora_only'"),
    ({"fan_in_fan_out": True}, "fan_in_fan_out"),
    ({"rank_pattern": {"q_proj": 8}}, "rank_pattern"),
    ({"layers_to_transform": [0]}, "layers_to_transform"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, "'embed_tokens' is not supported"),
    ({"target_modules": ["qkv_proj"]}, "'qkv_proj' is absent from this model"),
    ({"r": 8}, "not of rank r=8"),
])
def test_refused_configs(config, message, tmp_path):
    _, cfg = base("llama")
    write_peft_adapter(tmp_path, cfg, ["q_proj"], config=config)
    with pytest.raises(lora.LoraError, match=f"adapter 'x'.*{message}"):
        lora.load_adapter("x", str(tmp_path), cfg)


def test_refused_tensors_and_shapes(tmp_path):
    from safetensors.torch import load_file, save_file

    _, cfg = base("llama")
    # an adapter for a model of another hidden size
    write_peft_adapter(tmp_path / "wide", {**cfg, "hidden_size": 128}, ["q_proj"])
    with pytest.raises(lora.LoraError, match="'wide' was made for a model of hidden size 128.*hidden size is 64"):
        lora.load_adapter("wide", str(tmp_path / "wide"), cfg)
    # a target's output rows that are not the base's (another head count)
    write_peft_adapter(tmp_path / "heads", {**cfg, "num_key_value_heads": 4}, ["k_proj"])
    with pytest.raises(lora.LoraError, match=r"'heads'.*k_proj is \[64, 64\].*base model's is \[32, 64\]"):
        lora.load_adapter("heads", str(tmp_path / "heads"), cfg)
    # LoRA on the LM head or the embeddings, and lora_A without its lora_B
    write_peft_adapter(tmp_path / "head", cfg, ["q_proj"])
    tensors = load_file(tmp_path / "head" / "adapter_model.safetensors")
    save_file({**tensors, "base_model.model.lm_head.lora_A.weight": torch.ones(4, 64),
               "base_model.model.lm_head.lora_B.weight": torch.ones(128, 4)},
              tmp_path / "head" / "adapter_model.safetensors")
    with pytest.raises(lora.LoraError, match="'head'.*lm_head.*not supported"):
        lora.load_adapter("head", str(tmp_path / "head"), cfg)
    save_file({k: v for k, v in tensors.items() if "layers.1.self_attn.q_proj.lora_B" not in k},
              tmp_path / "head" / "adapter_model.safetensors")
    with pytest.raises(lora.LoraError, match="'head'.*layers.1.self_attn.q_proj has lora_A without its pair"):
        lora.load_adapter("head", str(tmp_path / "head"), cfg)
    # a pickled adapter
    (tmp_path / "head" / "adapter_model.safetensors").rename(tmp_path / "head" / "adapter_model.bin")
    with pytest.raises(lora.LoraError, match="'head'.*adapter_model.bin"):
        lora.load_adapter("head", str(tmp_path / "head"), cfg)


def test_refused_on_phi3_and_moe(tmp_path):
    _, phi3 = base("phi3")
    write_peft_adapter(tmp_path / "split", phi3, ["q_proj", "v_proj"])
    with pytest.raises(lora.LoraError, match="'split'.*'q_proj' is absent from this model.*qkv_proj"):
        lora.load_adapter("split", str(tmp_path / "split"), phi3)
    # experts of a MoE model
    _, cfg = base("llama")
    write_peft_adapter(tmp_path / "moe", cfg, ["q_proj"], config={"target_modules": "gate_proj"})
    from safetensors.torch import load_file, save_file
    tensors = load_file(tmp_path / "moe" / "adapter_model.safetensors")
    tensors["base_model.model.model.layers.0.mlp.experts.0.gate_proj.lora_A.weight"] = torch.ones(4, 64)
    tensors["base_model.model.model.layers.0.mlp.experts.0.gate_proj.lora_B.weight"] = torch.ones(32, 4)
    save_file(tensors, tmp_path / "moe" / "adapter_model.safetensors")
    with pytest.raises(lora.LoraError, match="'moe'.*experts.*an MoE expert's"):
        lora.load_adapter("moe", str(tmp_path / "moe"), cfg)
    # (a base whose linears hold GGUF blocks is served: tests/unit/test_cpu_decoder.py)

