"""The whole model on CUDA: bf16 greedy tokens agree with the CPU path (teacher-forced over a
schedule with chunked prefill, mixed steps and padded decode batches), CUDA-graph replay is
bit-identical to eager execution of the same padded batches, and sampling on the GPU (greedy,
and the whole sampler with bias and logprobs) gives what the CPU sampler gives on the same
logits."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
import torch

from _plans import Paged, Row
from _scenario import BLOCK, scenario_plans
from tiny import build_tiny_llama, random_llama_weights

from llmserve.kernels import reference
from llmserve.models import build_model
from llmserve.worker import ModelRunner
from llmserve.worker.cuda_graphs import CudaModelRunner
from llmserve.worker.sampler import Sampler, SamplingBatch

pytestmark = pytest.mark.gpu

# head_dim 64, 2 query heads per kv head: a shape the kernels serve
CONFIG = dict(architectures=["LlamaForCausalLM"], vocab_size=256, hidden_size=256, head_dim=64,
              intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=256,
              rope_theta=10000.0, tie_word_embeddings=False)
NUM_BLOCKS = 64


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def r(*shape, s=0.06):
        return (torch.randn(shape, generator=g) * s).to(torch.bfloat16).float()   # bf16-exact

    h, v = CONFIG["hidden_size"], CONFIG["vocab_size"]
    top = {"model.embed_tokens.weight": r(v, h, s=1.0), "model.norm.weight": 1 + r(h),
           "lm_head.weight": r(v, h, s=0.2)}
    return random_llama_weights(CONFIG, r, top)


def cuda_runner(graphs: bool, ops=None, prefill_attention: str = "sdpa", fused_ops: bool = False,
                piecewise: bool = False) -> CudaModelRunner:
    model = build_model(CONFIG, weights(), torch.bfloat16, torch.device("cuda"))
    runner = CudaModelRunner(model, NUM_BLOCKS, BLOCK, torch.bfloat16, "cuda", max_num_seqs=8,
                             max_model_len=256, cuda_graphs=graphs, eager_padded=True, ops=ops,
                             prefill_attention=prefill_attention,
                             fused_ops=fused_ops, piecewise=piecewise, max_num_batched_tokens=256)
    assert runner.fused_ops == fused_ops
    if piecewise and graphs:
        # as for the decode graphs: a failed capture would leave nothing to compare
        pieces = runner.pieces
        assert pieces is not None and sorted(pieces.graphs) == pieces.sizes == [16, 32, 64, 128, 256]
        assert all(len(p) == CONFIG["num_hidden_layers"] + 1 for p, _ in pieces.graphs.values())
    if graphs:
        # a failed capture only logs a warning and serves eagerly, which every comparison
        # below would pass: fail here instead
        assert runner.graphs.use_graphs and sorted(runner.graphs.graphs) == runner.graphs.sizes
    return runner


def step_logits(runner, plan) -> torch.Tensor:
    with torch.inference_mode():
        hidden = runner.run_model(plan)
        rows = torch.as_tensor(plan.logits_indices, device=hidden.device)
        return runner.model.compute_logits(hidden[rows]).float().cpu()


@pytest.mark.parametrize("fused_ops,piecewise", [(False, False), (True, False), (False, True), (True, True)])
def test_bf16_cuda_greedy_tokens_match_cpu_path(fused_ops, piecewise):
    cpu_model = build_model(CONFIG, weights(), torch.float32, torch.device("cpu"))
    cpu = ModelRunner(cpu_model, NUM_BLOCKS, BLOCK, torch.float32, "cpu")
    gpu = cuda_runner(graphs=True, fused_ops=fused_ops, piecewise=piecewise)
    compared = agreed = 0
    for plan in scenario_plans(CONFIG["vocab_size"], NUM_BLOCKS):
        want, got = step_logits(cpu, plan), step_logits(gpu, plan)
        top2 = want.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 0.15     # bf16 activations move logits by ~1e-2
        compared += int(clear.sum())
        agreed += int((want.argmax(-1) == got.argmax(-1))[clear].sum())
        assert (want - got).abs().max() < 0.05 * want.abs().max()
    assert compared >= 40, "the test model's logits are too flat to compare greedy tokens"
    assert agreed == compared


MOE_CONFIG = dict(CONFIG, architectures=["Qwen3MoeForCausalLM"], num_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=128, norm_topk_prob=True, mlp_only_layers=[1])


def moe_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """Qwen3-MoE weights: the Llama ones (layer 1 keeps its dense MLP), q/k norms, and 8
    experts with a router in layers 0 and 2; bf16-exact."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, s=0.06):
        return (torch.randn(shape, generator=g) * s).to(torch.bfloat16).float()

    w = weights(seed)
    h, i, d = MOE_CONFIG["hidden_size"], MOE_CONFIG["moe_intermediate_size"], MOE_CONFIG["head_dim"]
    for layer in (0, 2):
        p = f"model.layers.{layer}.mlp."
        for name in ("gate_proj", "up_proj", "down_proj"):
            del w[p + name + ".weight"]
        w[p + "gate.weight"] = r(8, h, s=0.5)
        for e in range(8):
            x = f"{p}experts.{e}."
            w.update({x + "gate_proj.weight": r(i, h), x + "up_proj.weight": r(i, h), x + "down_proj.weight": r(h, i)})
    for layer in range(3):
        a = f"model.layers.{layer}.self_attn."
        w.update({a + "q_norm.weight": 1 + r(d), a + "k_norm.weight": 1 + r(d)})
    return w


def test_moe_bf16_cuda_greedy_tokens_match_cpu_path():
    """A mixture-of-experts model on CUDA (our kernels, its decode steps eager: the routing
    reads on the host which experts run) computes what the float32 CPU path does, within bf16's
    noise. Where a token's router scores two
    experts almost alike, bf16 can pick the other one and move that row's logits further
    (measured with the CPU path in bf16: 1 row of 92 off by 0.10 of the largest logit, the
    median 0.008), so a few rows may be off by more."""
    from llmserve.worker.cuda_graphs import make_cuda_runner

    cpu = ModelRunner(build_model(MOE_CONFIG, moe_weights(), torch.float32, torch.device("cpu")), NUM_BLOCKS,
                      BLOCK, torch.float32, "cpu")
    model = build_model(MOE_CONFIG, moe_weights(), torch.bfloat16, torch.device("cuda"))
    gpu = make_cuda_runner(model, NUM_BLOCKS, BLOCK, torch.bfloat16, torch.device("cuda"), max_num_seqs=8,
                           max_model_len=256)
    assert isinstance(gpu, CudaModelRunner) and not gpu.graphs.use_graphs
    compared = agreed = 0
    errors = []
    for plan in scenario_plans(CONFIG["vocab_size"], NUM_BLOCKS):
        want, got = step_logits(cpu, plan), step_logits(gpu, plan)
        top2 = want.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 0.15
        compared += int(clear.sum())
        agreed += int((want.argmax(-1) == got.argmax(-1))[clear].sum())
        errors += ((want - got).abs().amax(dim=-1) / want.abs().max()).tolist()
    assert compared >= 40, "the test model's logits are too flat to compare greedy tokens"
    assert agreed >= 0.97 * compared
    errors = torch.tensor(errors)
    assert errors.median() < 0.02 and (errors > 0.05).float().mean() <= 0.05, errors


@pytest.mark.parametrize("fused_ops", [False, True])
def test_cuda_graph_replay_equals_eager(fused_ops):
    replayed, eager = cuda_runner(graphs=True, fused_ops=fused_ops), cuda_runner(graphs=False, fused_ops=fused_ops)
    used_graph = 0
    for plan in scenario_plans(CONFIG["vocab_size"], NUM_BLOCKS):
        used_graph += replayed.graphs.padded_size(plan) is not None
        with torch.inference_mode():
            a, b = replayed.run_model(plan), eager.run_model(plan)
        assert torch.equal(a, b)
    assert used_graph >= 15


@pytest.mark.parametrize("fused_ops", [False, True])
def test_piecewise_graph_replay_equals_its_eager_path(fused_ops):
    """Steps with prompt tokens replayed as piecewise graphs (LLMSERVE_PIECEWISE_GRAPHS=1), the
    attention run between the pieces, give the bits of the same padded static-buffer forward
    run eagerly; the next steps read the K/V those attentions wrote."""
    replayed = cuda_runner(graphs=True, fused_ops=fused_ops, piecewise=True)
    eager = cuda_runner(graphs=False, fused_ops=fused_ops, piecewise=True)
    pieces = 0
    for plan in scenario_plans(CONFIG["vocab_size"], NUM_BLOCKS):
        pieces += replayed.graphs.padded_size(plan) is None and replayed.pieces.size_for(plan) is not None
        with torch.inference_mode():
            a, b = replayed.run_model(plan), eager.run_model(plan)
        assert torch.equal(a, b)
    assert pieces == 3
    for x, y in zip(replayed.kv_cache.key + replayed.kv_cache.value, eager.kv_cache.key + eager.kv_cache.value):
        assert torch.equal(x, y)


def test_kernel_path_matches_reference_ops_path():
    fast, slow = cuda_runner(graphs=True), cuda_runner(graphs=False, ops=reference)
    for plan in scenario_plans(CONFIG["vocab_size"], NUM_BLOCKS):
        torch.testing.assert_close(step_logits(fast, plan), step_logits(slow, plan), atol=0.1, rtol=0.05)


def test_fused_layer_ops_match_the_torch_layers():
    """LLMSERVE_FUSED_OPS=1: the csrc norms (with the residual adds), SwiGLU product and RoPE
    give the torch layers' logits; they round alike, so only a row's sum of squares in another
    order can move a bf16 value by one step."""
    fused, plain = cuda_runner(graphs=True, fused_ops=True), cuda_runner(graphs=True)
    worst, compared = 0.0, 0
    for plan in scenario_plans(CONFIG["vocab_size"], NUM_BLOCKS):
        got, want = step_logits(fused, plan), step_logits(plain, plan)
        worst = max(worst, float((got - want).abs().max() / want.abs().max()))
        top2 = want.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 0.05
        compared += int(clear.sum())
        assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])
    assert compared >= 40 and worst < 0.02, (compared, worst)


def test_varlen_prefill_matches_one_sdpa_per_chunk():
    """LLMSERVE_PREFILL_ATTENTION=varlen: torch's varlen_attn over every prefill chunk of a step
    (fresh prompts, a chunk over a cached prefix, mixed with decode rows) gives what one SDPA
    per chunk gives."""
    pytest.importorskip("torch.nn.attention.varlen")
    per_chunk, packed = cuda_runner(graphs=False), cuda_runner(graphs=False, prefill_attention="varlen")
    for plan in scenario_plans(CONFIG["vocab_size"], NUM_BLOCKS):
        torch.testing.assert_close(step_logits(packed, plan), step_logits(per_chunk, plan), atol=0.1, rtol=0.05)


def test_execute_samples_greedy_on_gpu():
    runner = cuda_runner(graphs=True)
    for plan in scenario_plans(CONFIG["vocab_size"], NUM_BLOCKS, decode_steps=4):
        out = runner.execute(plan)
        # running the step again rewrites the same K/V, so it sees the same context
        logits = step_logits(runner, plan)
        assert np.array_equal(out.tokens, logits.argmax(-1).numpy())


def test_execute_runs_the_sampler_on_gpu_logits():
    runner = cuda_runner(graphs=True)
    paged = Paged(NUM_BLOCKS, BLOCK)
    rng = np.random.default_rng(3)
    for sid, n in ((0, 21), (1, 9), (2, 33)):
        paged.add(sid, [int(t) for t in rng.integers(0, CONFIG["vocab_size"], n)])
    row = Row(num_logprobs=3, logit_bias={5: 2.0})
    schedule = {0: 21, 1: 9, 2: 33}
    for _ in range(5):
        plan = paged.step(schedule, {sid: row for sid in schedule})
        out = runner.execute(plan)
        with torch.inference_mode():
            ref = Sampler(seed=0).sample(step_logits(runner, plan), SamplingBatch.from_plan(plan))
        np.testing.assert_array_equal(out.tokens, ref.tokens)
        np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-4)
        np.testing.assert_array_equal(out.top_ids, ref.top_ids)
        for sid, tok in zip(schedule, out.tokens):
            paged.append(sid, int(tok))
        schedule = {sid: 1 for sid in schedule}        # then decode steps (graphs)


def test_enforce_eager_captures_no_graph(monkeypatch):
    """--enforce-eager (make_cuda_runner's graphs=False): our kernels, no decode graphs and no
    piecewise ones, whatever LLMSERVE_PIECEWISE_GRAPHS says; the steps still compute."""
    from llmserve.worker.cuda_graphs import make_cuda_runner

    monkeypatch.setenv("LLMSERVE_PIECEWISE_GRAPHS", "1")
    model = build_model(CONFIG, weights(), torch.bfloat16, torch.device("cuda"))
    runner = make_cuda_runner(model, NUM_BLOCKS, BLOCK, torch.bfloat16, torch.device("cuda"), max_num_seqs=8,
                              max_model_len=256, max_num_batched_tokens=256, graphs=False)
    assert isinstance(runner, CudaModelRunner) and not runner.graphs.use_graphs and runner.pieces is None
    plain = cuda_runner(graphs=False)
    for plan in scenario_plans(CONFIG["vocab_size"], NUM_BLOCKS, decode_steps=3):
        assert torch.equal(step_logits(runner, plan), step_logits(plain, plan))


@pytest.fixture(scope="module")
def kernel_shaped_model(tmp_path_factory):
    """The tiny test model with head_dim 64 (2 query heads over 1 kv head), a shape the
    kernels serve: the engine on CUDA then runs CudaModelRunner with graphs."""
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama-d64"), hidden_size=128,
                            intermediate_size=256, num_attention_heads=2, num_key_value_heads=1)


@pytest.mark.parametrize("env", [{}, {"LLMSERVE_FUSED_OPS": "1", "LLMSERVE_PIECEWISE_GRAPHS": "1"}])
def test_planning_ahead_on_cuda_gives_the_same_tokens(kernel_shaped_model, env, monkeypatch):
    """--async-scheduling on CUDA: a request alone runs the same batches with or without
    planning ahead, so its greedy and seeded tokens are identical; a mixed batch finishes
    and frees every block. Also with the fused layer ops and the piecewise graphs."""
    from _engine_thread import BODIES, serve

    from llmserve.engine.build import build_engine
    from llmserve.engine.offline import make_config

    for name, value in env.items():
        monkeypatch.setenv(name, value)

    def build(ahead: bool):
        return build_engine(make_config(str(kernel_shaped_model), device="cuda", num_kv_blocks=120,
                                        max_num_seqs=8, async_scheduling="on" if ahead else "off"))
    sync, ahead = build(False), build(True)
    assert ahead.plan_ahead and not sync.plan_ahead
    for engine in (sync, ahead):     # the kernels and graphs, not the torch fallback
        assert isinstance(engine.runner, CudaModelRunner) and engine.runner.graphs.use_graphs
        assert engine.runner.fused_ops == bool(env) and (engine.runner.pieces is not None) == bool(env)
    alone = [b for b in BODIES if "n" not in b]
    for body in alone:
        want, _ = serve(sync, [body])
        got, spy = serve(ahead, [body])
        assert got == want, body
        # penalties and grammars need each token before the next step can be planned
        follows = not ({"presence_penalty", "response_format"} & body.keys())
        assert (spy.ahead > 0) == (follows and body["max_tokens"] > 2), body
    out, spy = serve(ahead, BODIES)
    assert len(out) == len(BODIES) and spy.ahead > 0
    assert ahead.core.stats()["used_blocks"] == 0


def test_launch_queues_a_decode_step_without_waiting_for_the_gpu():
    """What --async-scheduling overlaps: launch() of a decode step (graphs, greedy, seeded,
    logprob and filtered rows: top_p's radix select included) only queues work, so the engine plans the next step while the GPU runs.
    CUDA's sync debug mode raises on any host sync inside launch(); result() is the wait."""
    runner = cuda_runner(graphs=True)
    paged = Paged(NUM_BLOCKS, BLOCK)
    rng = np.random.default_rng(5)
    for sid, n in ((0, 17), (1, 8), (2, 30), (3, 5)):
        paged.add(sid, [int(t) for t in rng.integers(0, CONFIG["vocab_size"], n)])
    rows = {0: Row(), 1: Row(temperature=0.8, seed=11), 2: Row(num_logprobs=2),
            3: Row(temperature=5.0, top_p=0.99, top_k=200, min_p=0.001, logit_bias={7: 3.0})}
    out = runner.execute(paged.step({0: 17, 1: 8, 2: 30, 3: 5}, rows))
    for sid, tok in zip(rows, out.tokens):
        paged.append(sid, int(tok))
    plan = paged.step({sid: 1 for sid in rows}, rows)
    assert runner.graphs.padded_size(plan) is not None
    # the step after, made ahead: its tokens are the first step's rows 0..2 (placeholders)
    for sid in rows:
        paged.append(sid, 0)
    ahead = dataclasses.replace(paged.step({sid: 1 for sid in rows}, rows), input_ids=np.array([-1, -2, -3, -4]))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        launched = runner.launch(plan)
        queued = runner.launch(ahead, launched)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    first, second = launched.result(), queued.result()
    assert first.tokens.shape == second.tokens.shape == (4,)

    # The sync debug mode sees torch's own waits only; a copy from pageable host memory can
    # wait inside the driver. So: queue ~1 s of GPU work first; both launches must return
    # long before it ends.
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10**8)
    end.record()
    end.synchronize()
    cycles = int(10**8 * 1000 / start.elapsed_time(end))           # ~1 s of spinning
    torch.cuda._sleep(cycles)
    t = time.perf_counter()
    launched = runner.launch(plan)
    queued = runner.launch(ahead, launched)
    took = time.perf_counter() - t
    busy = not torch.cuda.current_stream().query()
    assert busy and took < 0.3, f"launch() waited for the GPU: {took:.3f} s"
    # the same steps again (they rewrite the same K/V): rows 0-2 are greedy or seeded
    assert np.array_equal(launched.result().tokens[:3], first.tokens[:3])
    assert np.array_equal(queued.result().tokens[:3], second.tokens[:3])
