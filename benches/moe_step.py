"""What a mixture-of-experts MLP costs (layers.MoEMLP) beside a dense MLP doing the same
arithmetic per token.

Two random fp32 models of granite-3.1-1b-a400m's layer shape (hidden 1024, 16/8 heads), with
fewer layers so they build quickly: one with its 32 experts of 512, 8 per token; a dense twin
whose MLP is 8 x 512 = 4096 wide, so each token does the same MLP multiply-adds in both. Decode
steps at ~256 cached tokens and a 512-token prompt step run through ModelRunner.execute, the two
models alternating, and the medians are compared. An MoE step also reads more weights (every
expert some token picked) and runs one GEMM per picked expert instead of one for all tokens.

    python benches/moe_step.py [threads] [layers]
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, "tests")
from _plans import Paged, decode_plan  # noqa: E402

from llmserve.models import build_model  # noqa: E402
from llmserve.worker import ModelRunner  # noqa: E402

THREADS = int(sys.argv[1]) if len(sys.argv) > 1 else 2
LAYERS = int(sys.argv[2]) if len(sys.argv) > 2 else 6
H, HEADS, KV, D, V = 1024, 16, 8, 64, 49155
EXPERTS, TOP_K, EXPERT_I = 32, 8, 512
BS, CTX = 16, 256
torch.set_num_threads(THREADS)


def build(moe: bool):
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(shape, generator=g) * 0.02

    cfg = dict(vocab_size=V, hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
               num_key_value_heads=KV, rms_norm_eps=1e-6, max_position_embeddings=4096, tie_word_embeddings=True)
    w = {"model.embed_tokens.weight": r(V, H), "model.norm.weight": torch.ones(H)}
    for layer in range(LAYERS):
        p, a = f"model.layers.{layer}.", f"model.layers.{layer}.self_attn."
        w.update({a + "q_proj.weight": r(HEADS * D, H), a + "k_proj.weight": r(KV * D, H),
                  a + "v_proj.weight": r(KV * D, H), a + "o_proj.weight": r(H, HEADS * D),
                  p + "input_layernorm.weight": torch.ones(H), p + "post_attention_layernorm.weight": torch.ones(H)})
        if moe:
            b = p + "block_sparse_moe."
            w.update({b + "router.layer.weight": r(EXPERTS, H), b + "input_linear.weight": r(EXPERTS, 2 * EXPERT_I, H),
                      b + "output_linear.weight": r(EXPERTS, H, EXPERT_I)})
        else:
            w.update({p + "mlp.gate_proj.weight": r(TOP_K * EXPERT_I, H), p + "mlp.up_proj.weight": r(TOP_K * EXPERT_I, H),
                      p + "mlp.down_proj.weight": r(H, TOP_K * EXPERT_I)})
    if moe:
        cfg.update(architectures=["GraniteMoeForCausalLM"], intermediate_size=EXPERT_I, num_local_experts=EXPERTS,
                   num_experts_per_tok=TOP_K)
    else:
        cfg.update(architectures=["GraniteForCausalLM"], intermediate_size=TOP_K * EXPERT_I)
    return build_model(cfg, w, torch.float32, "cpu")


def timed(runner: ModelRunner, plan) -> float:
    t0 = time.perf_counter()
    runner.execute(plan)
    return time.perf_counter() - t0


models = {"moe": build(True), "dense": build(False)}
print(f"{LAYERS} layers, {THREADS} threads; MoE {EXPERTS} experts x {EXPERT_I}, top {TOP_K}; dense {TOP_K * EXPERT_I}")
for batch in (1, 16, 64):
    runners = {}
    for name, model in models.items():
        runners[name] = ModelRunner(model, batch * ((CTX + BS) // BS) + 1, BS, torch.float32, "cpu", seed=0)
        for t in (*runners[name].kv_cache.key, *runners[name].kv_cache.value):
            t.normal_()
    times: dict[str, list[float]] = {name: [] for name in models}
    for rep in range(8):
        plan = decode_plan(batch, CTX, BS, V, rep)
        for name, runner in runners.items():
            t = timed(runner, plan)
            if rep:   # (the first is a warm-up)
                times[name].append(t)
    moe, dense = (statistics.median(times[n]) for n in ("moe", "dense"))
    print(f"decode batch {batch:3d}: MoE {moe * 1e3:7.1f} ms, dense {dense * 1e3:7.1f} ms, MoE/dense {moe / dense:.2f}x",
          flush=True)
    del runners
prompt = np.random.default_rng(0).integers(0, V, 512).tolist()
times = {name: [] for name in models}
for rep in range(4):
    for name, model in models.items():
        paged = Paged(40, BS)
        paged.add(0, prompt)
        t = timed(ModelRunner(model, 40, BS, torch.float32, "cpu", seed=0), paged.step({0: 512}))
        if rep:
            times[name].append(t)
moe, dense = (statistics.median(times[n]) for n in ("moe", "dense"))
print(f"prompt 512 tokens: MoE {moe * 1e3:7.1f} ms, dense {dense * 1e3:7.1f} ms, MoE/dense {moe / dense:.2f}x")
