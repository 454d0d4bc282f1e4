"""Pure-Python Plans for worker tests: the same column names as the Rust Plan
(ARCHITECTURE.md, Seam 2), built by a simple reference block allocator.

`Row` holds one sampling row's parameters; `Paged` tracks sequences, hands out blocks from a
free list (block 0 is the null block) and emits a `Plan` per step from {seq_id: new tokens}.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Row:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int = -1
    gen_index: int = 0
    num_logprobs: int = -1
    logit_bias: dict[int, float] = field(default_factory=dict)
    bans: list[int] = field(default_factory=list)        # min_tokens: eos/stop ids -> -inf
    prompt: list[int] = field(default_factory=list)      # history, used only when penalized
    output: list[int] = field(default_factory=list)

    @property
    def penalized(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1.0)


@dataclass
class Plan:
    input_ids: np.ndarray
    positions: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    block_tables: np.ndarray
    slot_mapping: np.ndarray
    copy_src: np.ndarray
    copy_dst: np.ndarray
    logits_indices: np.ndarray
    temperature: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    presence_penalty: np.ndarray
    frequency_penalty: np.ndarray
    repetition_penalty: np.ndarray
    top_k: np.ndarray
    seeds: np.ndarray
    gen_index: np.ndarray
    num_logprobs: np.ndarray
    bias_offsets: np.ndarray
    bias_token_ids: np.ndarray
    bias_values: np.ndarray
    hist_offsets: np.ndarray
    hist_tokens: np.ndarray
    hist_prompt_lens: np.ndarray
    row_req_ids: np.ndarray
    row_seq_index: np.ndarray
    # [S] each sequence's LoRA adapter (0: none)
    lora_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint32))
    # [S] how many of each sequence's tokens are its prompt's (None: all it computes)
    prompt_lens: np.ndarray | None = None


def sampling_columns(rows: list[Row]) -> dict[str, np.ndarray]:
    def col(name, dtype):
        return np.array([getattr(r, name) for r in rows], dtype=dtype)

    bias_ids, bias_vals, bias_off = [], [], [0]
    hist, hist_off, prompt_lens = [], [0], []
    for r in rows:
        entries = list(r.logit_bias.items()) + [(t, float("-inf")) for t in r.bans]
        bias_ids += [t for t, _ in entries]
        bias_vals += [v for _, v in entries]
        bias_off.append(len(bias_ids))
        if r.penalized:
            hist += r.prompt + r.output
        hist_off.append(len(hist))
        prompt_lens.append(len(r.prompt) if r.penalized else 0)
    return dict(
        temperature=col("temperature", np.float32), top_p=col("top_p", np.float32),
        min_p=col("min_p", np.float32), presence_penalty=col("presence_penalty", np.float32),
        frequency_penalty=col("frequency_penalty", np.float32),
        repetition_penalty=col("repetition_penalty", np.float32), top_k=col("top_k", np.int32),
        seeds=col("seed", np.int64), gen_index=col("gen_index", np.int64),
        num_logprobs=col("num_logprobs", np.int32),
        bias_offsets=np.array(bias_off, np.int32), bias_token_ids=np.array(bias_ids, np.int64),
        bias_values=np.array(bias_vals, np.float32), hist_offsets=np.array(hist_off, np.int32),
        hist_tokens=np.array(hist, np.int64), hist_prompt_lens=np.array(prompt_lens, np.int32),
        row_req_ids=np.arange(len(rows), dtype=np.uint64),
        row_seq_index=np.zeros(len(rows), np.uint32),
    )


def sampling_plan(rows: list[Row]) -> Plan:
    """A Plan carrying only sampling columns (no tokens): for sampler tests."""
    e64, e32 = np.zeros(0, np.int64), np.zeros(0, np.int32)
    return Plan(input_ids=e64, positions=e64, query_start_loc=np.zeros(1, np.int32), seq_lens=e32,
                block_tables=np.zeros((0, 0), np.int32), slot_mapping=e64, copy_src=e64,
                copy_dst=e64, logits_indices=np.arange(len(rows), dtype=np.int64),
                **sampling_columns(rows))


@dataclass
class _Seq:
    tokens: list[int]
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)
    prompt_len: int = 0
    lora: int = 0   # the LoRA adapter its tokens run through (0: none)


class Paged:
    """Reference allocator: sequences own blocks from a free list; no prefix sharing."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.free = list(range(1, num_blocks))   # block 0 is the null block
        self.seqs: dict[int, _Seq] = {}
        self.pending_copies: list[tuple[int, int]] = []

    def add(self, seq_id: int, prompt: list[int], lora: int = 0) -> None:
        self.seqs[seq_id] = _Seq(list(prompt), prompt_len=len(prompt), lora=lora)

    def append(self, seq_id: int, token: int) -> None:
        self.seqs[seq_id].tokens.append(int(token))

    def preempt(self, seq_id: int) -> None:
        """Frees the sequence's blocks, as preemption does: it recomputes all its tokens, those
        past its prompt included."""
        s = self.seqs[seq_id]
        self.free = s.blocks + self.free
        s.blocks, s.num_computed = [], 0

    def fork(self, src_id: int, new_id: int) -> None:
        """New sequence with the same tokens; its KV arrives by block copies in the next plan."""
        src = self.seqs[src_id]
        dst = _Seq(list(src.tokens), src.num_computed, [self.free.pop(0) for _ in src.blocks],
                   src.prompt_len)
        self.pending_copies += list(zip(src.blocks, dst.blocks))
        self.seqs[new_id] = dst

    def step(self, schedule: dict[int, int], rows: dict[int, Row] | None = None) -> Plan:
        """schedule: seq_id -> how many of its uncomputed tokens to run this step. A sequence
        samples (gets a row) when the step reaches the end of its tokens."""
        rows = rows or {}
        ids, pos, slots, qsl, lens, tables, logit_rows, row_specs, loras, plens = [], [], [], [0], [], [], [], [], [], []
        for sid, n in schedule.items():
            s = self.seqs[sid]
            start, end = s.num_computed, s.num_computed + n
            assert 0 < n and end <= len(s.tokens)
            while len(s.blocks) * self.block_size < end:
                s.blocks.append(self.free.pop(0))
            for p in range(start, end):
                ids.append(s.tokens[p])
                pos.append(p)
                slots.append(s.blocks[p // self.block_size] * self.block_size + p % self.block_size)
            qsl.append(len(ids))
            lens.append(end)
            loras.append(s.lora)
            plens.append(s.prompt_len)
            tables.append(list(s.blocks))
            s.num_computed = end
            if end == len(s.tokens):
                logit_rows.append(len(ids) - 1)
                # as the scheduler fills it: output tokens the sequence had before this step
                row_specs.append(rows.get(sid, Row(gen_index=len(s.tokens) - s.prompt_len)))
        width = max((len(t) for t in tables), default=0)
        bt = np.zeros((len(tables), width), np.int32)
        for i, t in enumerate(tables):
            bt[i, :len(t)] = t
        copies = self.pending_copies
        self.pending_copies = []
        return Plan(
            input_ids=np.array(ids, np.int64), positions=np.array(pos, np.int64),
            query_start_loc=np.array(qsl, np.int32), seq_lens=np.array(lens, np.int32),
            lora_ids=np.array(loras, np.uint32), prompt_lens=np.array(plens, np.int32),
            block_tables=bt, slot_mapping=np.array(slots, np.int64),
            copy_src=np.array([c[0] for c in copies], np.int64),
            copy_dst=np.array([c[1] for c in copies], np.int64),
            logits_indices=np.array(logit_rows, np.int64), **sampling_columns(row_specs))


def decode_plan(batch: int, ctx: int, block_size: int, vocab: int, seed: int = 0,
                lora_ids: list[int] | None = None) -> Plan:
    """A decode step of `batch` sequences, each computing its token at position `ctx` (`ctx`
    cached before it, in blocks of its own), greedy, random token ids; `lora_ids`: each
    sequence's LoRA adapter (none: 0)."""
    nblk = (ctx + block_size) // block_size
    tables = np.arange(1, 1 + batch * nblk, dtype=np.int32).reshape(batch, nblk)
    slots = tables[:, ctx // block_size].astype(np.int64) * block_size + ctx % block_size
    ids = np.random.default_rng(seed).integers(0, vocab, batch).astype(np.int64)
    return Plan(input_ids=ids, positions=np.full(batch, ctx, np.int64),
                query_start_loc=np.arange(batch + 1, dtype=np.int32), seq_lens=np.full(batch, ctx + 1, np.int32),
                block_tables=tables, slot_mapping=slots, copy_src=np.zeros(0, np.int64),
                copy_dst=np.zeros(0, np.int64), logits_indices=np.arange(batch, dtype=np.int64),
                lora_ids=np.array(lora_ids or [0] * batch, np.uint32),
                # (each sequence computes a token it sampled: a decode step, as the runner tells them)
                **sampling_columns([Row(gen_index=1)] * batch))


def greedy_steps(paged: Paged, seqs: dict[int, list[int]], last: dict, steps: int,
                 joins: dict[int, tuple[int, list[int]]] | None = None):
    """Decode steps: before each, every sequence that computed all its tokens appends its greedy
    token (the argmax of `last[sid]`, its last logits, which the caller updates from each
    step), and a sequence of `joins` (step -> (seq_id, prompt)) is added at its step, so that
    step mixes its prefill with the others' decode rows. Yields (plan, schedule)."""
    for step in range(steps):
        if step in (joins or {}):
            sid, toks = joins[step]
            seqs[sid] = toks
            paged.add(sid, toks)
        schedule = {}
        for sid in seqs:
            if paged.seqs[sid].num_computed == len(seqs[sid]) and sid in last:
                tok = int(last[sid].argmax())
                seqs[sid].append(tok)
                paged.append(sid, tok)
            schedule[sid] = len(seqs[sid]) - paged.seqs[sid].num_computed
        yield paged.step(schedule), schedule


def run_schedule(model, prompts: dict[int, list[int]], schedule: list[dict[int, int]],
                 num_blocks: int = 40, block_size: int = 4, step_flags: bool = False,
                 loras: dict[int, int] | None = None, kv_dtype=None):
    """Runs `schedule` (seq_id -> tokens per step) on `model` through a fresh ModelRunner, blocks
    handed out in a shuffled order. Before each later step, a sequence scheduled for 1 token
    that has computed all its tokens gets a new one (11 + step + seq_id). Returns every step's
    logits and the runner. `step_flags`: each step runs under the flags ModelRunner.execute
    gives it (worker/threads.py: cpu_step); without, linears decide by their row count alone.
    `loras`: seq_id -> the LoRA adapter its tokens run through (models/lora.py). `kv_dtype`:
    what the KV cache holds (None: float32)."""
    import contextlib
    import random

    import torch

    from llmserve.worker import ModelRunner
    from llmserve.worker.threads import QUANT_MAX_TOKENS, cpu_step, holds_prompt_tokens

    runner = ModelRunner(model, num_blocks, block_size, kv_dtype or torch.float32, "cpu", seed=0)
    paged = Paged(num_blocks, block_size)
    random.Random(1).shuffle(paged.free)          # blocks out of order
    for sid, p in prompts.items():
        paged.add(sid, p, (loras or {}).get(sid, 0))
    steps = []
    with torch.inference_mode():
        for n, sched in enumerate(schedule):
            if n:
                for sid, count in sched.items():
                    s = paged.seqs[sid]
                    if count == 1 and s.num_computed == len(s.tokens):
                        paged.append(sid, 11 + n + sid)
            plan = paged.step(sched)
            prompt = holds_prompt_tokens(plan)
            flags = (cpu_step(prompt, not prompt and len(plan.input_ids) <= QUANT_MAX_TOKENS)
                     if step_flags else contextlib.nullcontext())
            with flags:
                steps.append(model.compute_logits(runner.run_model(plan)))
    return steps, runner
