"""The CUDA runner's Python side on a CPU, with the torch reference ops standing in for the
compiled kernels: metadata for mixed prefill/decode steps, chunked prefill over a cached
prefix (lower-right causal), decode batches padded to captured sizes (slot -1, seq_len 0),
the partition and capture-size choices. Runs everywhere; the kernels themselves are tested in
test_kernels.py on a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _scenario import BLOCK, scenario_plans
from tiny import random_llama_weights

from llmserve import kernels
from llmserve.kernels import reference
from llmserve.models import build_model
from llmserve.worker import ModelRunner
from llmserve.worker.cuda_graphs import CudaModelRunner, default_capture_sizes, default_piece_sizes
from llmserve.worker.sampler import to_device

CONFIG = dict(architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=32,
              intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=128,
              rope_theta=10000.0, tie_word_embeddings=True)


def tiny_weights(seed: int = 0, config: dict = CONFIG) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(shape, generator=g) * 0.2

    h = config["hidden_size"]
    top = {"model.embed_tokens.weight": r(config["vocab_size"], h), "model.norm.weight": 1 + r(h)}
    return random_llama_weights(config, r, top)


def runners(prefill_attention: str | None = None):
    model = build_model(CONFIG, tiny_weights(), torch.float32, torch.device("cpu"))
    cpu = ModelRunner(model, 64, BLOCK, torch.float32, "cpu", seed=0)
    cuda_path = CudaModelRunner(model, 64, BLOCK, torch.float32, "cpu", seed=0, max_num_seqs=8,
                                max_model_len=128, cuda_graphs=False, eager_padded=True, ops=reference,
                                prefill_attention=prefill_attention)
    return cpu, cuda_path


@pytest.mark.parametrize("prefill_attention", ["sdpa", "varlen"])
def test_cuda_path_matches_cpu_path_step_by_step(prefill_attention):
    """Both prefill attentions (one SDPA per chunk; every chunk in one packed varlen call, here
    through the reference varlen_attn, whose semantics torch's has) give the CPU path's
    hidden states and K/V: fresh prompts, a chunk over a cached prefix, mixed steps."""
    cpu, cuda_path = runners(prefill_attention)
    padded = 0
    for plan in scenario_plans(CONFIG["vocab_size"]):
        padded += cuda_path.graphs.padded_size(plan) is not None
        with torch.inference_mode():
            want = cpu.run_model(plan)
            got = cuda_path.run_model(plan)
        rows = plan.logits_indices
        assert got.shape == want.shape
        torch.testing.assert_close(got[rows], want[rows], atol=1e-4, rtol=1e-4)
        # the K/V each path wrote are the same
        for a, b in zip(cpu.kv_cache.key + cpu.kv_cache.value, cuda_path.kv_cache.key + cuda_path.kv_cache.value):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert padded >= 15          # the decode-only steps went through the padded static buffers


def test_decode_steps_no_graph_replays_run_at_their_own_size():
    """Without graphs (--enforce-eager, MoE, a failed capture) a decode step is not padded to a
    capture size: its attention sees only its own rows, as the CPU path's does."""
    model = build_model(CONFIG, tiny_weights(), torch.float32, torch.device("cpu"))
    cpu = ModelRunner(model, 64, BLOCK, torch.float32, "cpu", seed=0)
    decode_rows = []

    class Recording:
        def __getattr__(self, name):
            return getattr(reference, name)

        def paged_attention_decode(self, out, query, *args):
            decode_rows.append(query.shape[0])
            return reference.paged_attention_decode(out, query, *args)

    eager = CudaModelRunner(model, 64, BLOCK, torch.float32, "cpu", seed=0, max_num_seqs=8,
                            max_model_len=128, cuda_graphs=False, ops=Recording())
    unpadded = 0
    for plan in scenario_plans(CONFIG["vocab_size"]):
        decode_rows.clear()
        with torch.inference_mode():
            want, got = cpu.run_model(plan), eager.run_model(plan)
        assert got.shape == want.shape
        torch.testing.assert_close(got[plan.logits_indices], want[plan.logits_indices], atol=1e-4, rtol=1e-4)
        n = len(plan.seq_lens)
        if len(plan.input_ids) == n:
            assert decode_rows == [n] * CONFIG["num_hidden_layers"]
            unpadded += n not in eager.graphs.sizes      # (a graph step would have padded it)
    assert eager.graphs.sizes == [1, 2, 4, 8] and unpadded >= 3


FUSED = ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding")
FUSED_CONFIGS = {
    "llama": CONFIG,   # every residual add inside the norm after it
    # float32 norm weights (1 + w, scaled before the cast), GeGLU (its product stays torch's)
    "gemma": {**CONFIG, "architectures": ["GemmaForCausalLM"], "hidden_act": "gelu_pytorch_tanh"},
    # a residual multiplier: norms, SwiGLU and RoPE fused, the adds not
    "granite": {**CONFIG, "architectures": ["GraniteForCausalLM"], "residual_multiplier": 0.5,
                "embedding_multiplier": 2.0, "attention_multiplier": 0.3, "logits_scaling": 2.0},
}


class CountingOps:
    """kernels.reference, counting calls of the fused layer ops."""

    def __init__(self):
        self.calls = dict.fromkeys(FUSED, 0)

    def __getattr__(self, name):
        op = getattr(reference, name)
        if name not in FUSED:
            return op

        def counted(*args):
            self.calls[name] += 1
            return op(*args)
        return counted


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", FUSED_CONFIGS)
def test_the_fused_layer_ops_give_the_layers_results(arch, dtype):
    """With the fused ops (the reference ones here; tests/gpu/test_kernels.py checks the CUDA
    ones against them), every step's hidden states and K/V are those of the torch layers: the
    residual adds moved into the norms, RoPE in place, the SwiGLU product in one op."""
    config = FUSED_CONFIGS[arch]

    def runner(ops):
        model = build_model(config, tiny_weights(config=config), dtype, torch.device("cpu"))
        return CudaModelRunner(model, 64, BLOCK, dtype, "cpu", seed=0, max_num_seqs=8, max_model_len=128,
                               cuda_graphs=False, eager_padded=True, ops=ops, fused_ops=ops.calls is not None)

    counting = CountingOps()
    plain_ops = CountingOps()
    plain_ops.calls = None
    plain, fused = runner(plain_ops), runner(counting)
    assert fused.fused_ops and not plain.fused_ops
    # (identical here; the tolerance allows the sum of squares another order on another torch)
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=8e-3, rtol=8e-3)
    for plan in scenario_plans(config["vocab_size"], decode_steps=6):
        with torch.inference_mode():
            want, got = plain.run_model(plan), fused.run_model(plan)
        rows = plan.logits_indices
        torch.testing.assert_close(got[rows], want[rows], **tol)
        for a, b in zip(plain.kv_cache.key + plain.kv_cache.value, fused.kv_cache.key + fused.kv_cache.value):
            torch.testing.assert_close(b, a, **tol)
    calls = counting.calls
    layers = config["num_hidden_layers"] * len(scenario_plans(config["vocab_size"], decode_steps=6))
    assert calls["rotary_embedding"] == layers
    assert calls["silu_and_mul"] == (0 if arch == "gemma" else layers)
    if arch == "granite":
        assert calls["fused_add_rms_norm"] == 0 and calls["rms_norm"] == 2 * layers + layers // 2   # + the final
    else:
        # per step: the first layer's input norm alone, every other norm (the final one too) with
        # the add before it
        steps = layers // config["num_hidden_layers"]
        assert calls["rms_norm"] == steps and calls["fused_add_rms_norm"] == 2 * layers


@pytest.mark.parametrize("fused", [False, True])
def test_piecewise_steps_give_the_plain_forwards_results(fused):
    """Steps with prompt tokens through the piecewise graphs' static buffers (eagerly here: the
    GPU tests replay the captured pieces), padded to the next captured token count, give the
    plain forward's hidden states and K/V: each attention runs on the n real rows between the
    pieces, the padding rows write nothing and are dropped."""
    def runner(piecewise):
        model = build_model(CONFIG, tiny_weights(), torch.float32, torch.device("cpu"))
        return CudaModelRunner(model, 64, BLOCK, torch.float32, "cpu", seed=0, max_num_seqs=8, max_model_len=128,
                               cuda_graphs=False, eager_padded=True, ops=reference, fused_ops=fused, piecewise=piecewise,
                               piece_sizes=[8, 16, 48, 64])
    plain, pieces = runner(False), runner(True)
    assert plain.pieces is None and pieces.pieces.sizes == [8, 16, 48, 64]
    padded = []
    for plan in scenario_plans(CONFIG["vocab_size"]):
        if pieces.graphs.padded_size(plan) is None:
            padded.append((len(plan.input_ids), pieces.pieces.size_for(plan)))
        with torch.inference_mode():
            want, got = plain.run_model(plan), pieces.run_model(plan)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        for a, b in zip(plain.kv_cache.key + plain.kv_cache.value, pieces.kv_cache.key + pieces.kv_cache.value):
            torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-6)
    # the scenario's mixed steps: 62 tokens padded to 64, 48 exactly, 27 padded to 48
    assert padded == [(62, 64), (48, 48), (27, 48)]


def test_piecewise_sizes_and_the_steps_they_take():
    assert default_piece_sizes(8192) == [16, 32, 64, 128, 256, 512, 1024, 1536, 2048, 2560, 3072, 3584, 4096,
                                         5120, 6144, 7168, 8192]
    assert default_piece_sizes(2048) == [16, 32, 64, 128, 256, 512, 1024, 1536, 2048]
    assert default_piece_sizes(100) == [16, 32, 64, 100]
    from _plans import Paged, Row

    model = build_model(CONFIG, tiny_weights(), torch.float32, torch.device("cpu"))
    runner = CudaModelRunner(model, 64, BLOCK, torch.float32, "cpu", seed=0, max_num_seqs=8, max_model_len=128,
                             cuda_graphs=False, eager_padded=True, ops=reference, piecewise=True, piece_sizes=[16, 32])
    def plan(schedule):
        paged = Paged(64, BLOCK)
        paged.add(0, list(range(40)))
        paged.add(1, list(range(40)), 1)                   # a LoRA adapter's rows
        return paged.step(schedule)

    assert runner.pieces.size_for(plan({0: 20})) == 32
    assert runner.pieces.size_for(plan({0: 16})) == 16
    assert runner.pieces.size_for(plan({0: 20, 1: 5})) is None      # a graph replays no adapter
    assert runner.pieces.size_for(plan({0: 33})) is None            # more tokens than captured


def test_the_fused_layer_ops_are_asked_for_by_environment(monkeypatch):
    from llmserve.worker import cuda_graphs

    monkeypatch.delenv(cuda_graphs.FUSED_OPS_ENV, raising=False)
    assert not cuda_graphs.fused_ops_requested()
    monkeypatch.setenv(cuda_graphs.FUSED_OPS_ENV, "1")
    assert cuda_graphs.fused_ops_requested()
    monkeypatch.setenv(cuda_graphs.FUSED_OPS_ENV, "yes")
    with pytest.raises(ValueError, match="expected 0 or 1"):
        cuda_graphs.fused_ops_requested()
    monkeypatch.delenv(cuda_graphs.PIECEWISE_ENV, raising=False)
    assert not cuda_graphs.piecewise_requested()
    monkeypatch.setenv(cuda_graphs.PIECEWISE_ENV, "1")
    assert cuda_graphs.piecewise_requested()


def test_the_pipelined_decode_kernel_is_asked_for_by_environment(monkeypatch):
    for value, want in (("", False), ("0", False), ("1", True)):
        monkeypatch.setattr(kernels, "_pipeline", None)
        monkeypatch.setenv(kernels.PIPELINE_ENV, value)
        assert kernels.decode_pipeline() is want
    monkeypatch.setattr(kernels, "_pipeline", None)
    monkeypatch.setenv(kernels.PIPELINE_ENV, "on")
    with pytest.raises(ValueError, match="expected 0 or 1"):
        kernels.decode_pipeline()


def test_the_fused_layer_ops_name_the_sizes_they_do_not_serve():
    bf16 = torch.bfloat16
    assert kernels.fused_unserved(576, [1536], 64, bf16) is None
    assert "float32" in kernels.fused_unserved(576, [1536], 64, torch.float32)
    assert "hidden_size 580" in kernels.fused_unserved(580, [1536], 64, bf16)
    assert "intermediate_size 1540" in kernels.fused_unserved(576, [1536, 1540], 64, bf16)
    assert "head_dim 72" in kernels.fused_unserved(576, [1536], 72, bf16)


def test_an_moe_model_runs_the_cuda_path_eagerly():
    """A mixture-of-experts model goes to our kernels without graphs (make_cuda_runner): its
    padded decode steps, run eagerly with padding rows routed to experts too, give the CPU
    path's rows."""
    moe = dict(CONFIG, architectures=["Qwen3MoeForCausalLM"], num_experts=4, num_experts_per_tok=2,
               moe_intermediate_size=24, norm_topk_prob=True)
    g = torch.Generator().manual_seed(1)
    weights = tiny_weights()
    h, d = CONFIG["hidden_size"], CONFIG["hidden_size"] // CONFIG["num_attention_heads"]
    for layer in range(CONFIG["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        for name in ("gate_proj", "up_proj", "down_proj"):
            del weights[f"{p}mlp.{name}.weight"]
        weights[p + "mlp.gate.weight"] = torch.randn(4, h, generator=g)
        for e in range(4):
            x = f"{p}mlp.experts.{e}."
            weights.update({x + "gate_proj.weight": torch.randn(24, h, generator=g) * 0.2,
                            x + "up_proj.weight": torch.randn(24, h, generator=g) * 0.2,
                            x + "down_proj.weight": torch.randn(h, 24, generator=g) * 0.2})
        weights.update({p + "self_attn.q_norm.weight": torch.ones(d), p + "self_attn.k_norm.weight": torch.ones(d)})
    model = build_model(moe, weights, torch.float32, torch.device("cpu"))
    cpu = ModelRunner(model, 64, BLOCK, torch.float32, "cpu", seed=0)
    cuda_path = CudaModelRunner(model, 64, BLOCK, torch.float32, "cpu", seed=0, max_num_seqs=8,
                                max_model_len=128, cuda_graphs=False, eager_padded=True, ops=reference)
    padded = 0
    for plan in scenario_plans(CONFIG["vocab_size"]):
        padded += cuda_path.graphs.padded_size(plan) is not None
        with torch.inference_mode():
            want, got = cpu.run_model(plan), cuda_path.run_model(plan)
        torch.testing.assert_close(got[plan.logits_indices], want[plan.logits_indices], atol=1e-4, rtol=1e-4)
    assert padded >= 15


def test_steps_with_lora_rows_run_eagerly():
    """A captured graph replays no LoRA adapter (it holds no Python): decode steps with adapter
    rows skip the padded static buffers and give the CPU path's rows; decode steps of base
    rows alone still take them (make_cuda_runner keeps graphs for a model with adapters)."""
    from llmserve.models import lora

    model = build_model(CONFIG, tiny_weights(), torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(2)
    h, q = CONFIG["hidden_size"], CONFIG["hidden_size"]
    weights = {(layer, "self_attn.q_proj"): (torch.randn(4, h, generator=g), torch.randn(q, 4, generator=g))
               for layer in range(CONFIG["num_hidden_layers"])}
    lora.attach(model, [lora.Adapter("a", "/a", 4, 1.0, weights)], torch.float32, "cpu")
    cpu = ModelRunner(model, 64, BLOCK, torch.float32, "cpu", seed=0)
    cuda_path = CudaModelRunner(model, 64, BLOCK, torch.float32, "cpu", seed=0, max_num_seqs=8,
                                max_model_len=128, cuda_graphs=False, eager_padded=True, ops=reference)
    padded = adapted = 0
    for plan in scenario_plans(CONFIG["vocab_size"], loras={4: 1}):   # (sequence 4 joins at step 8)
        through = cuda_path.graphs.padded_size(plan) is not None
        assert not (through and plan.lora_ids.any())
        padded += through
        adapted += bool(plan.lora_ids.any()) and len(plan.input_ids) == len(plan.seq_lens)
        with torch.inference_mode():
            want, got = cpu.run_model(plan), cuda_path.run_model(plan)
        torch.testing.assert_close(got[plan.logits_indices], want[plan.logits_indices], atol=1e-4, rtol=1e-4)
    assert padded >= 7 and adapted >= 7


def test_padding_rows_write_nothing():
    _, cuda_path = runners()
    plans = scenario_plans(CONFIG["vocab_size"])
    with torch.inference_mode():
        for plan in plans[:3]:
            cuda_path.run_model(plan)
    used = set()
    for plan in plans[:3]:
        used |= set((np.asarray(plan.slot_mapping) // BLOCK).tolist())
    key = cuda_path.kv_cache.key[0]
    untouched = [b for b in range(key.shape[0]) if b not in used]
    assert untouched and all(not key[b].any() for b in untouched)


def test_execute_samples_like_the_cpu_runner():
    cpu, cuda_path = runners()
    for plan in scenario_plans(CONFIG["vocab_size"], decode_steps=6):
        a, b = cpu.execute(plan), cuda_path.execute(plan)
        assert np.array_equal(a.tokens, b.tokens)
        assert b.top_ids.shape == (len(plan.logits_indices), 0)


class _Pooling:
    """`plan` listing every one of its tokens as a pooling entry (an embeddings request's
    mean pooling lists each prompt position once)."""

    def __init__(self, plan):
        self._plan = plan
        self.pool_indices = np.arange(len(plan.input_ids), dtype=np.int64)

    def __getattr__(self, name):
        return getattr(self._plan, name)


def test_pooled_hidden_states_match_the_cpu_runner():
    cpu, cuda_path = runners()
    for plan in scenario_plans(CONFIG["vocab_size"], decode_steps=3):
        a, b = cpu.execute(_Pooling(plan)), cuda_path.execute(_Pooling(plan))
        assert a.pooled.shape == b.pooled.shape == (len(plan.input_ids), CONFIG["hidden_size"])
        assert a.pooled.dtype == b.pooled.dtype == np.float32
        np.testing.assert_allclose(b.pooled, a.pooled, atol=1e-4, rtol=1e-4)
        assert cpu.execute(plan).pooled is None   # a plan that lists none returns none


def test_capture_sizes_and_splits():
    assert default_capture_sizes(1) == [1]
    assert default_capture_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert default_capture_sizes(40)[-2:] == [32, 40]
    # 132 SMs: batch 1 splits its context; a big batch fills the GPU without splitting
    assert kernels.choose_num_splits(1, 8, 8192, num_sms=132) == 33        # 33 x 8 CTAs ~ 2 waves
    assert kernels.choose_num_splits(1, 3, 2048, num_sms=132) == 32        # 64-token partitions at most
    assert kernels.choose_num_splits(64, 3, 1024, num_sms=132) == 2
    assert kernels.choose_num_splits(256, 3, 2048, num_sms=132) == 0
    assert kernels.choose_num_splits(4, 2, 64, num_sms=132) == 0
    # the count follows the batch, not the table's width: a graph captured at --max-model-len
    # 131072 splits batch 1 as one at 8192 does (the kernel sizes partitions per sequence)
    assert kernels.choose_num_splits(1, 3, 131072, num_sms=132) == kernels.choose_num_splits(1, 3, 8192, num_sms=132)


def test_the_runner_sizes_rope_for_every_position_it_can_be_given():
    """CudaModelRunner builds the RoPE tables for max_model_len up front, so no forward reads
    the largest position back from the device (a host sync per step on a GPU)."""
    _, cuda_path = runners()
    rope = cuda_path.model.rope
    assert rope.cos.shape[0] >= 128 and not rope.checked
    positions = torch.tensor([0, 5, 127])
    cos, _ = rope.cos_sin(positions, torch.float32)
    assert torch.equal(cos[:, 0], rope.cos[positions])


def test_host_columns_reach_the_cpu_device_as_they_are():
    t = torch.arange(4)
    assert to_device(t, torch.device("cpu")) is t


def test_supports_names_the_unserved_dimension():
    assert kernels.supports(9, 3, 64, 16, torch.bfloat16) is None
    assert "head_dim" in kernels.supports(4, 2, 16, 16, torch.bfloat16)
    assert "block_size" in kernels.supports(4, 2, 64, 32, torch.bfloat16)
    assert "dtype" in kernels.supports(4, 2, 64, 16, torch.float32)
    assert "per kv head" in kernels.supports(32, 2, 64, 16, torch.float16)


def test_soft_capped_scores_keep_the_torch_path():
    """Gemma 2's soft cap is not in our kernels: a model with it is served by the torch path
    even at shapes the kernels take (checked before any toolchain or build)."""
    from types import SimpleNamespace

    from llmserve.models.gemma import Gemma2ForCausalLM
    from llmserve.worker.cuda_graphs import kernels_unused_because

    c = Gemma2ForCausalLM.parse_config(dict(CONFIG, architectures=["Gemma2ForCausalLM"], head_dim=64,
                                            attn_logit_softcapping=50.0))
    assert kernels.supports(c.num_heads, c.num_kv_heads, c.head_dim, 16, torch.bfloat16) is None
    model = SimpleNamespace(config=c, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim)
    assert "soft-capping" in kernels_unused_because(model, 16, torch.bfloat16)
    # and a cap never reaches the kernels' metadata unnoticed
    from llmserve.worker.attention import paged_attention

    cuda_meta = SimpleNamespace(attend=lambda *a: pytest.fail("attended without the cap"))
    x = torch.zeros(1, 4, 64)
    with pytest.raises(RuntimeError, match="no soft cap"):
        paged_attention(x, x, x, x, x, cuda_meta, 0.125, softcap=50.0)


def test_without_a_gpu_the_factory_falls_back_to_the_torch_path(caplog):
    from llmserve.worker.cuda_graphs import make_cuda_runner

    model = build_model(CONFIG, tiny_weights(), torch.float32, torch.device("cpu"))
    with caplog.at_level("WARNING", logger="llmserve.worker"):
        runner = make_cuda_runner(model, 16, BLOCK, torch.float32, torch.device("cpu"),
                                  max_num_seqs=4, max_model_len=64)
    assert type(runner) is ModelRunner
    assert "CUDA kernels not used" in caplog.text


def test_importing_the_package_builds_nothing():
    import subprocess
    import sys

    # the extension is built by torch.utils.cpp_extension, on first use only
    code = ("import sys, llmserve, llmserve.kernels, llmserve.worker.cuda_attention, "
            "llmserve.worker.cuda_graphs; "
            "assert 'torch.utils.cpp_extension' not in sys.modules; "
            "assert not llmserve.kernels._loaded")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_kv_cache_sizing_from_free_memory():
    from llmserve.worker.cuda_graphs import activation_reserve_bytes, kv_blocks_for_budget

    gib = 2**30
    # 140 GiB card, 1 GiB used (weights), 90%: 126 - 1 - 2 (reserve) = 123 GiB of blocks
    assert kv_blocks_for_budget(139 * gib, 140 * gib, gib // 4, 0.9, 2 * gib) == 123 * 4
    with pytest.raises(RuntimeError, match="no GPU memory left"):
        kv_blocks_for_budget(10 * gib, 140 * gib, gib // 4, 0.9, 2 * gib)   # another process holds it
    with pytest.raises(ValueError, match="gpu-memory-utilization"):
        kv_blocks_for_budget(139 * gib, 140 * gib, gib // 4, 1.5, 0)
    # SmolLM2-135M at 2048 batched tokens and 256 sequences keeps well under 1 GiB back
    assert 512 * 2**20 < activation_reserve_bytes(576, 1536, 49152, 2048, 256) < gib


@pytest.mark.parametrize("mixed,piecewise", [(False, False), (True, False), (True, True)])
def test_a_plan_made_ahead_fills_its_placeholders_on_the_device(mixed, piecewise):
    """--async-scheduling on the CUDA runner: a plan whose decode tokens are placeholders
    for the previous step's rows (-1 - r) computes what the same plan with the tokens
    computes: filled on the device from that step's samples (padded decode batch, an eager
    mixed step with a prompt in it, and the same through the piecewise graphs' buffers)."""
    import dataclasses

    from _plans import Paged, Row

    def cuda_runner():
        model = build_model(CONFIG, tiny_weights(), torch.float32, torch.device("cpu"))
        return CudaModelRunner(model, 64, BLOCK, torch.float32, "cpu", seed=0, max_num_seqs=8,
                               max_model_len=128, cuda_graphs=False, eager_padded=True, ops=reference, piecewise=piecewise,
                               piece_sizes=[16, 32])

    known, ahead = cuda_runner(), cuda_runner()
    paged = Paged(64, BLOCK)
    rng = np.random.default_rng(2)
    for sid, n in ((0, 9), (1, 21), (2, 5)):
        paged.add(sid, [int(t) for t in rng.integers(0, CONFIG["vocab_size"], n)])
    rows = {0: Row(), 1: Row(temperature=0.9, seed=4), 2: Row()}
    first = paged.step({0: 9, 1: 21, 2: 5}, rows)
    launched = ahead.launch(first)
    out = known.execute(first)
    for sid, tok in zip(rows, out.tokens):
        paged.append(sid, int(tok))
    schedule = {sid: 1 for sid in rows}
    if mixed:
        paged.add(3, [int(t) for t in rng.integers(0, CONFIG["vocab_size"], 11)])
        schedule[3] = 11
    plan = paged.step(schedule, {**rows, 3: Row()})
    assert (ahead.graphs.padded_size(plan) is None) == mixed
    assert (ahead.pieces is not None and ahead.pieces.size_for(plan) == 16) == piecewise
    ids = np.array(plan.input_ids)
    ids[:3] = [-1, -2, -3]                       # rows 0..2 of `first` sample these tokens
    made_ahead = dataclasses.replace(plan, input_ids=ids)
    want, got = known.execute(plan), ahead.execute(made_ahead, launched)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    for a, b in zip(known.kv_cache.key + known.kv_cache.value, ahead.kv_cache.key + ahead.kv_cache.value):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_a_prebuilt_kernels_library_is_loaded_instead_of_building(monkeypatch, tmp_path):
    """LLMSERVE_KERNELS_LIBRARY: a machine without nvcc loads a library built elsewhere. What
    it names is checked before the engine counts on it: a missing file is the reason the
    kernels are unavailable, and a file that is no library fails loading with a clear error."""
    from llmserve.kernels import build

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setenv(build.PREBUILT_ENV, str(tmp_path / "absent.so"))
    assert build.missing_toolchain() == f"{build.PREBUILT_ENV}={tmp_path / 'absent.so'} is not a file"
    with pytest.raises(build.KernelsUnavailable, match="is not a file"):
        build.build_and_load()

    not_a_library = tmp_path / "llmserve_kernels.so"
    not_a_library.write_bytes(b"not an ELF file")
    monkeypatch.setenv(build.PREBUILT_ENV, str(not_a_library))
    assert build.missing_toolchain() is None          # no nvcc or ninja needed
    with pytest.raises(build.KernelsUnavailable, match=f"loading {build.PREBUILT_ENV}=.* failed"):
        build.build_and_load()
    monkeypatch.delenv(build.PREBUILT_ENV)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert build.missing_toolchain() == "torch sees no CUDA device"


def test_the_prefill_attention_is_chosen_by_environment(monkeypatch):
    from llmserve.worker import cuda_attention

    monkeypatch.delenv(cuda_attention.PREFILL_ENV, raising=False)
    assert cuda_attention.prefill_attention() == "sdpa"
    monkeypatch.setenv(cuda_attention.PREFILL_ENV, "VarLen")
    assert cuda_attention.prefill_attention() == "varlen"
    assert runners()[1].varlen_prefill
    monkeypatch.setenv(cuda_attention.PREFILL_ENV, "flash")
    with pytest.raises(ValueError, match="LLMSERVE_PREFILL_ATTENTION='flash'"):
        runners()


def test_piecewise_capture_cuts_the_forward_at_each_attention(monkeypatch):
    """The capture's bookkeeping, on CPU with a stand-in for torch.cuda's graphs (the GPU tests
    replay real ones): each size is captured as num_layers + 1 pieces, every capture begun is
    ended, the cuts hold each layer's caches in order, and a step replays piece 0, then each
    layer's attention on its n real rows before the piece after it."""
    import contextlib

    log = []

    class FakeGraph:
        count = 0

        def __init__(self):
            FakeGraph.count += 1
            self.id = FakeGraph.count

        def capture_begin(self, pool=None):
            assert pool == "pool"
            log.append(("begin", self.id))

        def capture_end(self):
            log.append(("end", self.id))

        def replay(self):
            log.append(("replay", self.id))

    class Stream:
        def wait_stream(self, other):
            pass

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    model = build_model(CONFIG, tiny_weights(), torch.float32, torch.device("cpu"))
    runner = CudaModelRunner(model, 64, BLOCK, torch.float32, "cpu", seed=0, max_num_seqs=8, max_model_len=128,
                             cuda_graphs=False, eager_padded=True, ops=reference, piecewise=True, piece_sizes=[16, 64])
    pieces = runner.pieces
    pieces.use_graphs = True
    pieces.capture()
    layers = CONFIG["num_hidden_layers"]
    assert sorted(pieces.graphs) == [16, 64]
    begun = [g for what, g in log if what == "begin"]
    assert [g for what, g in log if what == "end"] == begun and len(begun) == 2 * (layers + 1)
    assert all(log[i] == ("begin", g) and log[i + 1] == ("end", g) for i, g in zip(range(0, len(log), 2), begun))
    for graphs, cuts in pieces.graphs.values():
        assert len(graphs) == layers + 1
        assert [c[0] for c in cuts] == runner.kv_cache.key and [c[1] for c in cuts] == runner.kv_cache.value

    attended = []

    class Meta:
        def attend(self, q, k, v, k_cache, v_cache, scale, out):
            attended.append((q.shape[0], k_cache))
            log.append(("attend", len(attended)))

    log.clear()
    plan = scenario_plans(CONFIG["vocab_size"])[0]            # 62 tokens: the 64 pieces
    pieces.run(plan, 64, Meta())
    ids = [g.id for g in pieces.graphs[64][0]]
    want = [("replay", ids[0])]
    for i in range(layers):
        want += [("attend", i + 1), ("replay", ids[i + 1])]
    assert log == want
    assert [n for n, _ in attended] == [62] * layers
    assert [kc for _, kc in attended] == runner.kv_cache.key
