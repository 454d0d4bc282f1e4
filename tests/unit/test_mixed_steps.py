"""A step that holds prompt tokens and generated ones (a request arriving while others
generate) computes the generated ones exactly as a decode step without the prompt would
(worker/runner.py: ModelRunner._execute_split): a sequence's greedy or seeded output does
not depend on what else the server is doing, up to QUANT_MAX_TOKENS sequences decoding.

Checked through ModelRunner.execute on a tiny quantized Llama: two sequences generate alone,
then again while a third prompt is computed in the same steps; their tokens and logprobs must
be bit-identical."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _plans import Paged, Row
from test_cpu_decoder import quantized_model

import llmserve.models.llama as llama
from llmserve.worker import ModelRunner
from llmserve.worker.runner import decode_sequences

torch.set_num_threads(1)

PROMPTS = {0: [3 + i % 50 for i in range(9)], 1: [7, 8, 9, 10, 11], 2: list(range(20, 33))}
ALONE = [{0: 9, 1: 5}, *[{0: 1, 1: 1}] * 4]
# seq 2's prompt arrives in two chunks beside the decode steps, then it decodes too
MIXED = [{0: 9, 1: 5}, {0: 1, 1: 1, 2: 6}, {0: 1, 1: 1, 2: 7}, {0: 1, 1: 1, 2: 1}, {0: 1, 1: 1, 2: 1}]


def _generate(model, schedule, loras: dict[int, int] | None = None,
              prompts: dict[int, list[int]] = PROMPTS) -> dict[int, list[tuple[int, float]]]:
    """Every sampled (token, logprob) of each sequence; sampled tokens are fed back. `loras`:
    seq_id -> its LoRA adapter's index."""
    runner = ModelRunner(model, 64, 4, torch.float32, "cpu", seed=0)
    paged = Paged(64, 4)
    for sid in schedule[0]:
        paged.add(sid, prompts[sid], (loras or {}).get(sid, 0))
    out: dict[int, list[tuple[int, float]]] = {}
    with torch.inference_mode():
        for sched in schedule:
            for sid in sched:
                if sid not in paged.seqs:
                    paged.add(sid, prompts[sid], (loras or {}).get(sid, 0))
            rows = {sid: Row(gen_index=len(s.tokens) - s.prompt_len, num_logprobs=0)
                    for sid, s in paged.seqs.items()}
            plan = paged.step(sched, rows)
            sampled = runner.execute(plan)
            ending = [sid for sid, n in sched.items()
                      if paged.seqs[sid].num_computed == len(paged.seqs[sid].tokens)]
            for sid, tok, lp in zip(ending, sampled.tokens, sampled.logprobs):
                out.setdefault(sid, []).append((int(tok), float(lp)))
                paged.append(sid, int(tok))
    return out


@pytest.mark.parametrize("bf16", [False, True])
def test_generated_tokens_do_not_depend_on_a_prompt_in_the_same_step(monkeypatch, bf16):
    monkeypatch.setattr(llama, "native_bf16", lambda: bf16)
    model = quantized_model("llama", seed=5)
    alone = _generate(model, ALONE)
    mixed = _generate(model, MIXED)
    for sid in (0, 1):
        assert mixed[sid] == alone[sid], f"sequence {sid}"
    assert len(mixed[2]) == 3


def test_decode_sequences_are_those_computing_a_generated_token():
    paged = Paged(64, 4)
    for sid, p in PROMPTS.items():
        paged.add(sid, p)
    paged.step({0: 9, 1: 5})
    paged.append(0, 40)
    paged.append(1, 41)
    # seq 0 decodes, seq 2 starts its prompt with one token: only seq 0 is a decode sequence
    plan = paged.step({2: 1, 0: 1}, {0: Row(gen_index=1)})
    assert list(decode_sequences(plan)) == [1]
    assert decode_sequences(plan).dtype == np.int64


def _lora_model(tmp_path):
    """The tiny quantized Llama with a LoRA adapter (index 1) on every projection."""
    from test_cpu_decoder import FAMILIES
    from tiny import write_peft_adapter

    from llmserve.models import lora

    c = FAMILIES["llama"]
    write_peft_adapter(tmp_path / "a", c, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                           "down_proj"], r=4, alpha=4.0)
    model = quantized_model("llama", seed=5)
    lora.attach(model, [lora.load_adapter("a", str(tmp_path / "a"), c)], torch.float32, "cpu")
    return model


def test_generated_tokens_do_not_depend_on_adapters_in_the_same_step(tmp_path):
    """With LoRA adapters: a base sequence decoding beside adapter sequences computes what it
    computes alone (its rows keep the Rust layers: the step runs in parts), and an adapter
    sequence what it computes alone, however many rows of its adapter share its steps (the
    delta's matmuls compute each row alone). Also when a prompt arrives in the same steps."""
    model = _lora_model(tmp_path)
    adapters = {1: 1, 3: 1}
    prompts = {**PROMPTS, 3: [9, 4, 13, 21, 2, 30]}

    def run(schedule):
        return _generate(model, schedule, adapters, prompts)

    alone = {}
    for sid in (0, 1, 3):
        alone.update(run([{sid: len(prompts[sid])}, *[{sid: 1}] * 4]))
    together = run([{0: 9, 1: 5, 3: 6}, *[{0: 1, 1: 1, 3: 1}] * 4])
    arriving = run([{0: 9, 1: 5, 3: 6}, {0: 1, 1: 1, 3: 1, 2: 6}, {0: 1, 1: 1, 3: 1, 2: 7},
                    *[{0: 1, 1: 1, 3: 1, 2: 1}] * 2])
    for sid in (0, 1, 3):
        assert together[sid] == alone[sid], f"sequence {sid} beside the others"
        assert arriving[sid] == alone[sid], f"sequence {sid} beside the others and a prompt"
    assert alone[1] != _generate(model, [{1: 5}, *[{1: 1}] * 4])[1]   # (the adapter changes them)


@pytest.mark.parametrize("chunks", [[18], [6, 12], [9, 9], [12, 6], [3, 3, 3, 9]])
def test_a_preempted_sequence_recomputes_its_generated_tokens_as_decode_steps_did(chunks):
    """A sequence that gives up its blocks (preempted, or a beam) recomputes all its tokens:
    those past its prompt run as decode rows on the Rust layers (ModelRunner._parts), so what
    it samples next is what it would have sampled had it kept its blocks, to the bit; also
    when the recompute comes in chunks that cut the prompt or the generated tokens, and beside
    another sequence decoding (audit A: beams and greedy output moved under KV pressure)."""
    model = quantized_model("llama", seed=5)
    schedule = [{0: 9, 1: 5}, *[{0: 1, 1: 1}] * 8]
    kept = _generate(model, schedule + [{0: 1, 1: 1}] * 8)

    runner = ModelRunner(model, 64, 4, torch.float32, "cpu", seed=0)
    paged = Paged(64, 4)
    for sid in (0, 1):
        paged.add(sid, PROMPTS[sid])
    out: dict[int, list[tuple[int, float]]] = {0: [], 1: []}

    def run(sched):
        rows = {sid: Row(gen_index=len(s.tokens) - s.prompt_len, num_logprobs=0) for sid, s in paged.seqs.items()}
        sampled = runner.execute(paged.step(sched, rows))
        ending = [sid for sid in sched if paged.seqs[sid].num_computed == len(paged.seqs[sid].tokens)]
        for sid, tok, lp in zip(ending, sampled.tokens, sampled.logprobs):
            out[sid].append((int(tok), float(lp)))
            paged.append(sid, int(tok))

    with torch.inference_mode():
        for sched in schedule:
            run(sched)
        # sequence 0 (9 prompt + 9 generated tokens, the last not computed yet) loses its blocks
        paged.preempt(0)
        for n in chunks:
            run({0: n, 1: 1})
        for _ in range(3):
            run({0: 1, 1: 1})
    assert sum(chunks) == 18
    assert out[0] == kept[0][:13] and len(out[0]) == 13
    assert out[1] == kept[1][:len(out[1])] and len(out[1]) == 12 + len(chunks)
