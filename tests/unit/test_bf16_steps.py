"""Steps of a GGUF model in bfloat16 (layers.Linear.bf16_weight): on a CPU with native bf16
the layer matmuls of the steps the quantized GEMV does not take (prompts, decode steps of
more than QUANT_MAX_TOKENS sequences) run on a bf16 copy of the weights, and so does the LM
head of those decode steps. Checked on a tiny quantized Llama, against the same model
without the copies: which steps take bf16 (never a few-sequence decode step, never a prompt
step's LM head), and that the logits stay close. That prompts
stay invariant to their split is test_row_invariance.py's."""

from __future__ import annotations

import torch

from _plans import run_schedule
from test_cpu_decoder import quantized_model

import llmserve.models.layers as layers
import llmserve.models.llama as llama
from llmserve.worker.threads import QUANT_MAX_TOKENS

torch.set_num_threads(1)

SEQS = QUANT_MAX_TOKENS + 4
PROMPTS = {s: [3 + (7 * s + i) % 90 for i in range(3 + s % 5)] for s in range(SEQS)}
# all prompts in one step; three decode steps of every sequence; then one of a few
SCHEDULE = [{s: len(p) for s, p in PROMPTS.items()}, *[{s: 1 for s in PROMPTS}] * 3,
            {s: 1 for s in range(3)}]


def _model(monkeypatch, bf16: bool, tile: int = 0):
    """`tile`: rows per bf16 call in prompt steps, as on a CPU with AMX (0: one call, as
    without), whatever this CPU has."""
    monkeypatch.setattr(llama, "native_bf16", lambda: bf16)
    monkeypatch.setattr(layers, "bf16_tile_rows", lambda: tile)
    return quantized_model("llama", seed=3)


def _bf16_rows(monkeypatch) -> list[int]:
    """From now on, the row count of every bf16 matmul, in call order."""
    rows: list[int] = []
    real = layers._bf16_mm

    def counted(x, w):
        assert x.dtype == torch.bfloat16
        rows.append(x.shape[0])
        return real(x, w)

    monkeypatch.setattr(layers, "_bf16_mm", counted)
    return rows


def test_prompt_and_big_decode_steps_run_in_bf16(monkeypatch):
    off = _model(monkeypatch, False)
    on = _model(monkeypatch, True)
    assert off.layers[0].attn.qkv.bf16_weight is None
    assert on.layers[0].mlp.gate_up.bf16_weight.dtype == torch.bfloat16
    ref, _ = run_schedule(off, PROMPTS, SCHEDULE, num_blocks=160, step_flags=True)
    bf16_calls = _bf16_rows(monkeypatch)
    prompt_tokens = sum(map(len, PROMPTS.values()))
    # rows of each step's bf16 matmuls: every layer linear (qkv, o, gate|up, down) of both
    # layers, and in the big decode steps the LM head too (a prompt step keeps it fp32);
    # none in the last step (3 sequences: the quantized GEMV)
    want = [[prompt_tokens] * 8, [SEQS] * 9, [SEQS] * 9, [SEQS] * 9, []]
    got = []
    for n in range(len(SCHEDULE)):       # one step more each time: count each step's calls
        bf16_calls.clear()
        got.append(run_schedule(on, PROMPTS, SCHEDULE[:n + 1], num_blocks=160, step_flags=True)[0][-1])
        assert bf16_calls == sum(want[:n + 1], []), (n, bf16_calls)
    # bf16 rounds each matmul's inputs and outputs to 8 significant bits (~0.4%); this random
    # model amplifies that to a few % of its logits (measured: max 2-6% of the largest, median
    # 1-2% of the median). A wrong weight or row would move them by ~100%.
    for step in range(len(SCHEDULE)):
        diff = (got[step] - ref[step]).abs()
        assert diff.max() > 0
        assert diff.max() < 0.1 * ref[step].abs().max(), step
        assert diff.median() < 0.05 * ref[step].abs().median(), step


def test_a_lone_row_is_padded_to_two(monkeypatch):
    """oneDNN's bf16 GEMV (M = 1) sums differently from its GEMM: a one-token prompt step
    pads, so its row is the same bits as in a bigger step."""
    on = _model(monkeypatch, True)
    rows = _bf16_rows(monkeypatch)
    run_schedule(on, {0: [5, 6, 7, 8, 9]}, [{0: 4}, {0: 1}], step_flags=True)
    assert rows == [4] * 8 + [2] * 8


def test_with_amx_prompt_steps_run_bf16_matmuls_in_tiles(monkeypatch):
    """On a CPU with AMX a prompt step's bf16 matmuls run in calls of a fixed number of rows
    (the last padded), so each row's bits do not depend on the step (worker/threads.py); the
    big decode steps keep one call. The logits equal those of one call up to bf16 rounding."""
    ref, _ = run_schedule(_model(monkeypatch, True, tile=0), PROMPTS, SCHEDULE[:2], num_blocks=160,
                          step_flags=True)
    on = _model(monkeypatch, True, tile=32)
    rows = _bf16_rows(monkeypatch)
    got, _ = run_schedule(on, PROMPTS, SCHEDULE[:2], num_blocks=160, step_flags=True)
    prompt_tokens = sum(map(len, PROMPTS.values()))
    tiles = [32] * -(-prompt_tokens // 32)
    assert rows == tiles * 8 + [SEQS] * 9
    for step in range(2):
        diff = (got[step] - ref[step]).abs()
        assert diff.max() < 0.1 * ref[step].abs().max(), step


def test_without_native_bf16_nothing_is_copied(monkeypatch):
    model = _model(monkeypatch, False)
    assert all(m.bf16_weight is None for m in model.modules() if hasattr(m, "bf16_weight"))
    assert model.lm_bf16 is None


def test_prepacked_bf16_weights_give_f_linear_bits(monkeypatch):
    """layers.pack_bf16 hands oneDNN its blocked layout once (F.linear reorders a plain weight
    on every call); the products must be F.linear's bits at any row count, and weights of a
    shape it cannot vouch for (checked once a shape) stay plain."""
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(200, 96, generator=g) * 0.1).to(torch.bfloat16)
    packed = layers.pack_bf16(w)
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        assert packed is w
        return
    if packed.layout == torch._mkldnn:
        assert packed.shape == w.shape
        for rows in (1, 2, 5, 64, 130):
            x = torch.randn(rows, 96, generator=g).to(torch.bfloat16)
            assert torch.equal(layers._bf16_mm(x, packed), torch.nn.functional.linear(x, w)), rows
    else:
        # (where oneDNN cannot pack bf16 on this CPU, such as an AVX2 one, or its packed
        # product is not F.linear's bits, the weight stays plain)
        assert packed is w and layers._packed_same_bits.get((200, 96)) in (None, False)
    assert layers.pack_bf16(w.float()).layout == torch.strided
    if packed is w:
        return
    # a packed product that differs from F.linear's keeps weights of that shape plain
    monkeypatch.setattr(layers, "_packed_same_bits", {})
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda x, *a: torch.zeros(x.shape[0], 200))
    assert layers.pack_bf16(w) is w and layers.pack_bf16(w.clone()).layout == torch.strided
    assert layers._packed_same_bits == {(200, 96): False}


def test_the_reused_pad_buffer_works_in_and_out_of_inference_mode(monkeypatch):
    """_bf16_linear pads a tile in a reused per-thread buffer: made inside the runner's
    inference mode, it must still take a later call outside it (and keep rows past the input
    zero, whatever a longer call wrote there)."""
    from llmserve.worker.threads import cpu_step

    monkeypatch.setattr(layers, "bf16_tile_rows", lambda: 8)
    monkeypatch.setattr(layers, "_pad_buffers", layers._PadBuffers())
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 40, generator=g).to(torch.bfloat16)
    x = torch.randn(7, 40, generator=g)
    with cpu_step(prompt_tokens=True, quantized=False):
        with torch.inference_mode():
            long = layers._bf16_linear(x, w, None)
        short = layers._bf16_linear(x[:3], w, None)
    assert torch.equal(short, long[:3])
    assert not layers._pad_buffers.bufs[40][3:].any()
