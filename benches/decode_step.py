"""Decode-step timing for a SmolLM2-135M-shaped random model (fp32) through ModelRunner.execute."""
import sys, time, statistics, ctypes
if len(sys.argv) > 2 and sys.argv[2] == "mallopt":
    _libc = ctypes.CDLL("libc.so.6"); _libc.mallopt(-3, 1 << 30); _libc.mallopt(-1, 2**31 - 1); print("mallopt on")
import numpy as np, torch
sys.path.insert(0, "/work/main/tests"); sys.path.insert(0, "/work/main/python")
from _plans import Row, sampling_columns, Plan
from llmserve.models import build_model
from llmserve.worker import ModelRunner

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
cfg = dict(architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=576, intermediate_size=1536,
           num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, rms_norm_eps=1e-5,
           max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True)
g = torch.Generator().manual_seed(0)
H, I, d = 576, 1536, 64
def r(*s): return torch.randn(s, generator=g) * 0.02
w = {"model.embed_tokens.weight": r(49152, H), "model.norm.weight": torch.ones(H)}
for l in range(30):
    p = f"model.layers.{l}."
    w.update({p+"self_attn.q_proj.weight": r(9*d, H), p+"self_attn.k_proj.weight": r(3*d, H), p+"self_attn.v_proj.weight": r(3*d, H),
              p+"self_attn.o_proj.weight": r(H, 9*d), p+"mlp.gate_proj.weight": r(I, H), p+"mlp.up_proj.weight": r(I, H),
              p+"mlp.down_proj.weight": r(H, I), p+"input_layernorm.weight": torch.ones(H), p+"post_attention_layernorm.weight": torch.ones(H)})
model = build_model(cfg, w, torch.float32, "cpu"); del w
BS, CTX = 16, 256
def decode_plan(batch, row):
    nblk = (CTX + 1 + BS - 1) // BS
    tables = np.arange(1, 1 + batch * nblk, dtype=np.int32).reshape(batch, nblk)
    pos = np.full(batch, CTX, np.int64)
    slots = tables[:, CTX // BS].astype(np.int64) * BS + CTX % BS
    return Plan(input_ids=np.random.randint(0, 49152, batch).astype(np.int64), positions=pos,
                query_start_loc=np.arange(batch + 1, dtype=np.int32), seq_lens=np.full(batch, CTX + 1, np.int32),
                block_tables=tables, slot_mapping=slots, copy_src=np.zeros(0, np.int64), copy_dst=np.zeros(0, np.int64),
                logits_indices=np.arange(batch, dtype=np.int64), **sampling_columns([row] * batch))
for batch in (1, 64):
    nblk = (CTX + 1 + BS - 1) // BS
    runner = ModelRunner(model, batch * nblk + 1, BS, torch.float32, "cpu", seed=0)
    for t in (*runner.kv_cache.key, *runner.kv_cache.value):
        t.normal_()
    for label, row in (("greedy", Row()), ("temp=1", Row(temperature=1.0)), ("temp=1 top_p=0.9 (flat logits)", Row(temperature=1.0, top_p=0.9))):
        plan = decode_plan(batch, row)
        runner.execute(plan)
        times = []
        for _ in range(7):
            t0 = time.perf_counter(); runner.execute(plan); times.append(time.perf_counter() - t0)
        print(f"batch {batch:3d} {label:18s} median {statistics.median(times)*1e3:7.1f} ms/step  (min {min(times)*1e3:.1f})", flush=True)
    # reference in the same run: the step's GEMMs alone (30 layers x qkv, o, gate_up, down + LM head)
    x = torch.randn(batch, H); xi = torch.randn(batch, I)
    def gemms():
        with torch.inference_mode():
            for layer in model.layers:
                layer.attn.qkv(x); layer.attn.o_proj(x); layer.mlp.gate_up(x); layer.mlp.down(xi)
            model.compute_logits(x)
    gemms(); gt = []
    for _ in range(7):
        t0 = time.perf_counter(); gemms(); gt.append(time.perf_counter() - t0)
    print(f"batch {batch:3d} GEMMs only          median {statistics.median(gt)*1e3:7.1f} ms", flush=True)
    del runner
# prefill: one 1,024-token prompt, one sampled row
from _plans import Paged
runner = ModelRunner(model, 80, BS, torch.float32, "cpu", seed=0)
pt = []
for _ in range(3):
    paged = Paged(80, BS); paged.add(0, np.random.randint(0, 49152, 1024).tolist())
    plan = paged.step({0: 1024})
    t0 = time.perf_counter(); runner.execute(plan); pt.append(time.perf_counter() - t0)
print(f"prefill 1024 tokens median {statistics.median(pt)*1e3:.0f} ms = {1024/statistics.median(pt):.0f} tok/s")
