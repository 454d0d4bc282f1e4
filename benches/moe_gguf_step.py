"""What serving a GGUF MoE model's experts as the file's blocks costs (and saves) against
dequantizing them to float32, the same file either way.

A random Qwen3-MoE of granite-3.1-1b-a400m's layer shape (hidden 1024, 16/8 heads, 32 experts of
512, 8 per token), with few layers so it builds quickly, written as llama.cpp writes a GGUF
(tests/unit/test_gguf_moe.py) in Q8_0 or Q4_0. Built twice through build_engine: the default
(experts held as blocks only: the quantized GEMV in every decode step, each expert's float32
made from its blocks in prompt steps) and --no-quantized-decode (every weight float32). The other
linears differ too (blocks in decode steps, bf16 copies in prompt steps on CPUs with native
bf16), as a dense model's do: the ratio is the whole step's. Decode steps at ~256 cached tokens and a
512-token prompt step run through ModelRunner.execute, the two alternating; medians compared,
with the bytes the experts take in each.

    python benches/moe_gguf_step.py [threads] [layers] [Q8_0|Q4_0]
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

# (as `llmserve run` sets it before torch loads: OpenMP workers sleep soon after each op)
os.environ.setdefault("GOMP_SPINCOUNT", "100000")

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, "tests")
sys.path.insert(0, "tests/unit")
from _plans import Paged, decode_plan  # noqa: E402

THREADS = int(sys.argv[1]) if len(sys.argv) > 1 else 2
LAYERS = int(sys.argv[2]) if len(sys.argv) > 2 else 4
QUANT = sys.argv[3] if len(sys.argv) > 3 else "Q8_0"
BLOCK, CTX = 16, 256


def write_file(path: Path) -> None:
    import transformers

    import test_gguf_moe as t

    t.COMMON.update(vocab_size=32000, hidden_size=1024, num_hidden_layers=LAYERS, num_attention_heads=16,
                    num_key_value_heads=8, max_position_embeddings=2048)
    t.FAMILIES["bench"] = ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", "qwen3moe", dict(
        head_dim=64, num_experts=32, num_experts_per_tok=8, moe_intermediate_size=512, norm_topk_prob=True))
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(**t.COMMON, **t.FAMILIES["bench"][3])
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    t.write_moe_gguf(path, "bench", model, QUANT)


def expert_bytes(model) -> int:
    total = 0
    for layer in model.layers:
        mlp = layer.mlp
        for p in (mlp.gate_up, mlp.down):
            total += 0 if p.is_meta else p.numel() * p.element_size()
        total += sum(q.data.nbytes for packs in mlp.quant.values() for q in packs)
    return total


def median_ms(runner, plans, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        for plan in plans:
            t0 = time.perf_counter()
            runner.execute(plan)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    from llmserve.engine.build import build_engine
    from llmserve.engine.offline import make_config

    torch.set_num_threads(THREADS)
    path = Path(tempfile.mkdtemp()) / f"moe.{QUANT}.gguf"
    write_file(path)
    runners = {}
    for label, on in (("blocks", True), ("float32", False)):
        engine = build_engine(make_config(str(path), threads=THREADS, quantized_decode=on, num_kv_blocks=1200,
                                          block_size=BLOCK, max_model_len=2048))
        runners[label] = engine.runner
    vocab = 32000
    prompt = Paged(1200, BLOCK)
    prompt.add(0, np.random.default_rng(0).integers(0, vocab, 512).tolist())
    steps = {"decode, batch 1": [decode_plan(1, CTX, BLOCK, vocab, seed=s) for s in range(3)],
             "decode, batch 16": [decode_plan(16, CTX, BLOCK, vocab, seed=s) for s in range(3)],
             "decode, batch 64": [decode_plan(64, CTX, BLOCK, vocab, seed=s) for s in range(3)],
             "prompt, 512 tokens": [prompt.step({0: 512})]}
    print(f"{LAYERS} layers, {THREADS} threads, {QUANT}; experts take "
          f"{expert_bytes(runners['blocks'].model) / 2**20:.0f} MiB as blocks, "
          f"{expert_bytes(runners['float32'].model) / 2**20:.0f} MiB in float32")
    print("| step | float32 experts | blocks | blocks / float32 |")
    print("| --- | --- | --- | --- |")
    for name, plans in steps.items():
        results = {label: [] for label in runners}
        for _ in range(5):   # (alternated, so drift hits both)
            for label, runner in runners.items():
                results[label].append(median_ms(runner, plans, 1 if "prompt" in name else 3))
        f, b = statistics.median(results["float32"]), statistics.median(results["blocks"])
        print(f"| {name} | {f:.1f} ms | {b:.1f} ms | {b / f:.2f}x |")


if __name__ == "__main__":
    main()
