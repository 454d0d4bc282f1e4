"""Big decode steps of a GGUF model in bfloat16 (layers.Linear.bf16_weight): on a CPU with
native bf16 the layer matmuls of decode steps too big for the quantized GEMV run on a bf16
copy of the weights. Checked on a tiny quantized Llama, against the same model without the
copies: which steps take bf16 (only decode steps of more than QUANT_MAX_TOKENS sequences;
never a step with prompt tokens, never the LM head), and that its logits stay close."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from _plans import run_schedule
from test_cpu_decoder import quantized_model

import llmserve.models.llama as llama
from llmserve.worker.threads import QUANT_MAX_TOKENS

torch.set_num_threads(1)

SEQS = QUANT_MAX_TOKENS + 4
PROMPTS = {s: [3 + (7 * s + i) % 90 for i in range(5 + s)] for s in range(SEQS)}
# all prompts in one step; three decode steps of every sequence; then one of a few
SCHEDULE = [{s: len(p) for s, p in PROMPTS.items()}, *[{s: 1 for s in PROMPTS}] * 3,
            {s: 1 for s in range(3)}]


def _model(monkeypatch, bf16: bool):
    monkeypatch.setattr(llama, "native_bf16", lambda: bf16)
    return quantized_model("llama", seed=3)


def test_only_big_decode_steps_run_in_bf16(monkeypatch):
    off = _model(monkeypatch, False)
    on = _model(monkeypatch, True)
    assert off.layers[0].attn.qkv.bf16_weight is None
    assert on.layers[0].mlp.gate_up.bf16_weight.dtype == torch.bfloat16
    ref, _ = run_schedule(off, PROMPTS, SCHEDULE, num_blocks=80, step_flags=True)

    bf16_calls: list[int] = []           # rows of each bf16 matmul
    real = F.linear

    def counted(x, w, *args):
        if x.dtype == torch.bfloat16:
            bf16_calls.append(x.shape[0])
        return real(x, w, *args)

    monkeypatch.setattr(F, "linear", counted)
    got = []
    for n in range(len(SCHEDULE)):       # one step more each time: count each step's calls
        bf16_calls.clear()
        got.append(run_schedule(on, PROMPTS, SCHEDULE[:n + 1], num_blocks=80, step_flags=True)[0][-1])
        if n in (1, 2, 3):
            # every layer linear (qkv, o, gate|up, down) of both layers; the LM head stays fp32
            assert bf16_calls[-8:] == [SEQS] * 8 and len(bf16_calls) == 8 * n, (n, bf16_calls)
        else:
            assert len(bf16_calls) == 8 * min(n, 3), (n, bf16_calls)
    # the prompt step is untouched; the big decode steps' logits stay close
    assert torch.equal(got[0], ref[0])
    for step in (1, 2, 3):
        diff = (got[step] - ref[step]).abs()
        assert diff.max() > 0
        assert diff.max() < 0.05 * ref[step].abs().max() and diff.median() < 0.02 * ref[step].abs().median(), step


def test_without_native_bf16_nothing_is_copied(monkeypatch):
    model = _model(monkeypatch, False)
    assert all(m.bf16_weight is None for m in model.modules() if hasattr(m, "bf16_weight"))
