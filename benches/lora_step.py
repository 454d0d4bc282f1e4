"""What serving LoRA adapters costs a step (models/lora.py), beside the same model without them.

Two random fp32 models of SmolLM2-135M's layer shape (hidden 576, 9/3 heads, MLP 1536), with
fewer layers so they build quickly, the same weights in both; one has two rank-16 adapters
attached on all seven projections. Decode steps at ~256 cached tokens (batch 1, 16, 64) and a
512-token prompt step run through ModelRunner.execute, alternating:
- `plain`: the model without adapters;
- `base`: the model with adapters, every row on the base model (what adapters cost a server's
  base-model traffic);
- `one`: every row through adapter 1 (one delta per linear, no gather);
- `mixed` (decode only): a third of the rows on each of the base, adapter 1 and adapter 2
  (gather, two small GEMMs and a scatter per adapter and linear).
Medians of 7 runs, each step kind's time over `plain`'s.

    python benches/lora_step.py [threads] [layers]
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, "tests")
from _plans import Paged, decode_plan  # noqa: E402
from tiny import write_peft_adapter  # noqa: E402

from llmserve.models import build_model, lora  # noqa: E402
from llmserve.worker import ModelRunner  # noqa: E402

THREADS = int(sys.argv[1]) if len(sys.argv) > 1 else 2
LAYERS = int(sys.argv[2]) if len(sys.argv) > 2 else 10
H, HEADS, KV, D, I, V = 576, 9, 3, 64, 1536, 49152
BS, CTX, RANK = 16, 256, 16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
torch.set_num_threads(THREADS)

CONFIG = dict(architectures=["LlamaForCausalLM"], vocab_size=V, hidden_size=H, intermediate_size=I,
              num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV, rms_norm_eps=1e-5,
              max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=100000.0)


def build():
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(shape, generator=g) * 0.02

    w = {"model.embed_tokens.weight": r(V, H), "model.norm.weight": torch.ones(H)}
    for layer in range(LAYERS):
        p, a = f"model.layers.{layer}.", f"model.layers.{layer}.self_attn."
        w.update({a + "q_proj.weight": r(HEADS * D, H), a + "k_proj.weight": r(KV * D, H),
                  a + "v_proj.weight": r(KV * D, H), a + "o_proj.weight": r(H, HEADS * D),
                  p + "mlp.gate_proj.weight": r(I, H), p + "mlp.up_proj.weight": r(I, H),
                  p + "mlp.down_proj.weight": r(H, I),
                  p + "input_layernorm.weight": torch.ones(H), p + "post_attention_layernorm.weight": torch.ones(H)})
    return build_model(CONFIG, w, torch.float32, "cpu")


def timed(runner: ModelRunner, plan) -> float:
    t0 = time.perf_counter()
    runner.execute(plan)
    return time.perf_counter() - t0


plain, adapted = build(), build()
with tempfile.TemporaryDirectory() as tmp:
    loaded = []
    for i in (1, 2):
        write_peft_adapter(Path(tmp) / str(i), CONFIG, TARGETS, r=RANK, alpha=2.0 * RANK, seed=i)
        loaded.append(lora.load_adapter(f"a{i}", str(Path(tmp) / str(i)), json.loads(json.dumps(CONFIG))))
    lora.attach(adapted, loaded, torch.float32, "cpu")
KINDS = {"plain": (plain, lambda n: [0] * n), "base": (adapted, lambda n: [0] * n),
         "one": (adapted, lambda n: [1] * n), "mixed": (adapted, lambda n: [i % 3 for i in range(n)])}
print(f"{LAYERS} layers, {THREADS} threads; 2 adapters of rank {RANK} on {len(TARGETS)} projections")


def report(what: str, times: dict[str, list[float]]) -> None:
    med = {k: statistics.median(v) for k, v in times.items()}
    ratios = ", ".join(f"{k} {med[k] / med['plain']:.2f}x" for k in med if k != "plain")
    print(f"{what}: plain {med['plain'] * 1e3:7.1f} ms; {ratios}", flush=True)


for batch in (1, 16, 64):
    runners = {}
    for name, (model, _) in KINDS.items():
        runners[name] = ModelRunner(model, batch * ((CTX + BS) // BS) + 1, BS, torch.float32, "cpu", seed=0)
        for t in (*runners[name].kv_cache.key, *runners[name].kv_cache.value):
            t.normal_()
    times: dict[str, list[float]] = {name: [] for name in KINDS}
    for rep in range(8):
        for name, (_, ids) in KINDS.items():
            t = timed(runners[name], decode_plan(batch, CTX, BS, V, rep, ids(batch)))
            if rep:   # (the first is a warm-up)
                times[name].append(t)
    report(f"decode batch {batch:3d}", times)
    del runners
# (one prompt: through no adapter, or all of it through one)
prompt = np.random.default_rng(0).integers(0, V, 512).tolist()
times = {name: [] for name in ("plain", "base", "one")}
for rep in range(4):
    for name in times:
        model, ids = KINDS[name]
        paged = Paged(40, BS)
        paged.add(0, prompt)
        plan = paged.step({0: 512})
        plan.lora_ids = np.array(ids(1), np.uint32)
        t = timed(ModelRunner(model, 40, BS, torch.float32, "cpu", seed=0), plan)
        if rep:
            times[name].append(t)
report("prompt 512 tokens", times)
