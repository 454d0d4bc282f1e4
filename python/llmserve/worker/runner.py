"""ModelRunner: runs one scheduled step (a Plan) through the model and samples.

`launch(plan, prev)` (and `execute`, which waits for its result) is the whole per-step
contract with the engine: block copies for forked
sequences, the forward over the flat tokens (writing their K/V into the paged cache), logits
for the sampled rows only, and sampling; plus, for the Plan's prompt-logprob entries
(completions `echo` with `logprobs`), the raw logprob of each next prompt token and its top
alternatives, and for its pooling entries (`/v1/embeddings`) the final hidden states. The plan
is any object exposing ARCHITECTURE.md's Plan columns as numpy arrays; they become tensors
without per-token Python.
"""

from __future__ import annotations

import ctypes
import dataclasses
import sys

import numpy as np
import torch

from llmserve.worker.attention import AttentionMetadata, GatherWorkspace
from llmserve.worker.kv_cache import KVCache
from llmserve.worker.sampler import DeviceSample, Sampler, SampleOutput, as_tensor, to_device
from llmserve.worker.threads import (QUANT_MAX_TOKENS, cpu_step, holds_prompt_tokens, in_prompt_step, in_runner_step,
                                     set_engine_threads)


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3   # glibc mallopt parameters
# Prompt-logprob rows per log_softmax: bounds the [rows, V] fp32 temporaries (256 x 49152
# x 4 B = 48 MiB) however long the prompt chunk is.
PROMPT_LP_CHUNK = 256


def retain_freed_memory() -> bool:
    """Make glibc keep freed large blocks for reuse instead of returning them to the OS.

    NOTE: a step allocates many multi-MB temporaries ([R, V] sampling rows, gathered KV). By
    default glibc serves each from fresh mmap'd pages and returns them on free, so every step
    page-faults them in again: measured 2-10x slower for those ops (batch-64 sampling with
    temperature: +52 ms per step without this, +5 ms with it). Process-wide; a no-op off glibc.
    Returns whether it applied."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30)
                    and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
    except (OSError, AttributeError):
        return False


def with_prompt_logprobs(out: SampleOutput, prompt_lp, pooled: np.ndarray | None = None) -> SampleOutput:
    """`out` carrying a step's prompt logprobs (as `ModelRunner.prompt_logprobs` returns them)
    and pooled hidden states (`ModelRunner.pooled`)."""
    if pooled is not None:
        out = dataclasses.replace(out, pooled=pooled)
    if prompt_lp is None:
        return out
    lp, ids, tops, ranks = prompt_lp
    return dataclasses.replace(out, prompt_logprobs=lp, prompt_top_ids=ids, prompt_top_logprobs=tops,
                               prompt_ranks=ranks)


@dataclasses.dataclass(frozen=True)
class Launched:
    """A step `ModelRunner.launch` started: `result()` waits for its samples and returns them
    on the host; `device_tokens()` are the sampled tokens where they were sampled, which the
    next step's placeholders read without waiting."""
    sample: DeviceSample
    prompt_lp: tuple | None = None
    pooled: np.ndarray | None = None

    def result(self) -> SampleOutput:
        return with_prompt_logprobs(self.sample.to_host(), self.prompt_lp, self.pooled)

    def device_tokens(self) -> torch.Tensor:
        if self.sample.tokens is not None:
            return self.sample.tokens
        return torch.from_numpy(self.sample.done.tokens)


def finished(out: SampleOutput) -> Launched:
    return Launched(DeviceSample(out))


class Resolved:
    """A plan read through, with its placeholder input ids filled in on the host
    (`input_ids`), or left for the device to fill from `prev_tokens`."""

    def __init__(self, plan, input_ids: np.ndarray, prev_tokens: torch.Tensor | None = None):
        self._plan = plan
        self.input_ids = input_ids
        self.prev_tokens = prev_tokens

    def __getattr__(self, name: str):
        return getattr(self._plan, name)


def has_placeholders(plan) -> bool:
    """Whether `plan` was made ahead (`Core.schedule_ahead`) with placeholder input ids
    (`-1 - r`: the token row r of the step before samples)."""
    ids = np.asarray(plan.input_ids)
    return len(ids) > 0 and ids.min() < 0


def resolve_placeholders(plan, prev_tokens: np.ndarray | None):
    """`plan` with each placeholder input id `-1 - r` replaced by `prev_tokens[r]`, on the
    host. The plan itself when it has none."""
    if not has_placeholders(plan):
        return plan
    if prev_tokens is None:
        raise ValueError("this plan was made ahead: pass the step before it")
    ids = np.array(plan.input_ids, np.int64)
    holes = ids < 0
    ids[holes] = np.asarray(prev_tokens, np.int64)[-1 - ids[holes]]
    return Resolved(plan, ids)


def fill_placeholders_(ids: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor:
    """In place, on the ids' device and without a host sync: each placeholder `-1 - r`
    becomes `prev_tokens[r]`."""
    rows = (-1 - ids).clamp_(min=0)
    return ids.copy_(torch.where(ids < 0, prev_tokens.index_select(0, rows), ids))


def row_sequences(plan) -> np.ndarray:
    """The plan's sequence index of each sampled row."""
    qsl = np.asarray(plan.query_start_loc, np.int64)
    return np.searchsorted(qsl, np.asarray(plan.logits_indices, np.int64), side="right") - 1


def decode_sequences(plan) -> np.ndarray:
    """Indices of the plan's sequences that compute generated tokens (the one they sampled in
    an earlier step, and with speculation the drafts after it: each token sampled by a row of
    its own), as opposed to prompt tokens."""
    q_lens = np.diff(np.asarray(plan.query_start_loc, np.int64))
    seq = row_sequences(plan)
    rows = np.bincount(seq, minlength=len(q_lens))
    prompt_rows = np.bincount(seq, weights=np.asarray(plan.gen_index, np.int64) < 1, minlength=len(q_lens))
    # (a fork's n rows share its prompt's last token, at gen_index 0)
    return np.flatnonzero((rows == q_lens) & (prompt_rows == 0))


def piece_plan(plan, pieces: list[tuple[int, int, int]]):
    """The forward columns of `pieces`, each (a sequence of the plan, and a range [a, b) of the
    plan's tokens that are among its), each piece a sequence of its own whose context ends at
    its last token; and the indices of their tokens in the plan's token order."""
    tokens = (np.concatenate([np.arange(a, b) for _, a, b in pieces]) if pieces
              else np.zeros(0, np.int64))
    seqs = np.array([s for s, _, _ in pieces], np.int64)
    positions = np.asarray(plan.positions)
    tables = np.asarray(plan.block_tables).reshape(len(plan.seq_lens), -1)
    sub = _Forward(input_ids=np.asarray(plan.input_ids)[tokens],
                   positions=positions[tokens],
                   slot_mapping=np.asarray(plan.slot_mapping)[tokens],
                   query_start_loc=np.concatenate(([0], np.cumsum([b - a for _, a, b in pieces], dtype=np.int64))),
                   seq_lens=np.array([positions[b - 1] + 1 for _, _, b in pieces], np.int32),
                   block_tables=tables[seqs], lora_ids=np.asarray(plan.lora_ids)[seqs])
    return sub, tokens


@dataclasses.dataclass
class _Forward:
    """The Plan columns `ModelRunner.run_model` reads."""
    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    block_tables: np.ndarray
    lora_ids: np.ndarray


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str, *, seed: int | None = None):
        """model: a CausalLM (see llmserve.models). seed: the shared generator of unseeded rows."""
        self.model = model
        self.block_size = block_size
        self.device = torch.device(device)
        if self.device.type == "cpu":
            retain_freed_memory()
            set_engine_threads(torch.get_num_threads())
        # Few-token CPU steps run on the Rust kernels: torch goes single-threaded for them
        # (worker/threads.py says why).
        self.kernel_steps = self.device.type == "cpu" and getattr(model, "quantized", False)
        self.kv_cache = KVCache(model.num_layers, num_blocks, block_size, model.num_kv_heads,
                                model.head_dim, dtype, self.device)
        self.sampler = Sampler(seed)
        self.workspace = GatherWorkspace()

    def execute(self, plan, prev: Launched | None = None) -> SampleOutput:
        """Run one step and return its samples on the host. `prev`: the step before, whose
        tokens a plan made ahead refers to."""
        return self.launch(plan, prev).result()

    def launch(self, plan, prev: Launched | None = None) -> Launched:
        """Start one step; `result()` of the returned object waits for its samples. On an
        accelerator the forward and the sampling are queued, so the engine can plan the next
        step meanwhile (CudaModelRunner also queues them behind a `prev` step still running;
        this class waits for `prev`'s tokens first); on the CPU the step has run when this
        returns."""
        plan = self.with_inputs_from(plan, prev)
        with torch.inference_mode():
            copy_src = as_tensor(plan.copy_src, torch.int64)
            if copy_src.numel():
                copy_dst = as_tensor(plan.copy_dst, torch.int64)
                self.kv_cache.copy_blocks(to_device(copy_src, self.device), to_device(copy_dst, self.device))
            num_tokens = len(plan.input_ids)
            num_rows = len(plan.logits_indices)
            if num_tokens == 0:
                return finished(SampleOutput.empty())
            prompt = holds_prompt_tokens(plan)
            if self.kernel_steps and not getattr(self.model, "batch_invariant", False):
                parts = self._parts(plan, prompt)
                if parts:
                    return finished(self._execute_split(plan, parts))
            quantized = self.kernel_steps and not prompt and num_tokens <= QUANT_MAX_TOKENS
            with cpu_step(prompt, quantized):
                return self._execute(plan, num_rows)

    def with_inputs_from(self, plan, prev: Launched | None):
        """`plan` with its placeholders filled from `prev`'s tokens (here on the host)."""
        return resolve_placeholders(plan, None if prev is None else prev.result().tokens)

    def _parts(self, plan, prompt: bool) -> list[tuple[list[tuple[int, int, int]], bool, bool]] | None:
        """How a CPU step of a quantized model runs in parts, in order, each (its pieces, as
        `piece_plan` takes them; whether it is a prompt step; whether it is a quantized decode
        step), when it does; None: in one.

        - A step that holds prompt tokens and up to QUANT_MAX_TOKENS generated ones runs the
          generated tokens as the decode step they would be alone, the prompt tokens as the
          prompt step they would be alone.
        - A decode step of up to QUANT_MAX_TOKENS tokens that holds both base-model and LoRA
          adapter rows runs each kind as a step of its own: the base rows keep the Rust layers
          (models/cpu_decoder.py), which hold no adapter.
        - A sequence that recomputes its tokens (preempted, or a beam that gave up its blocks)
          computes those past its prompt (`prompt_lens`) after its prompt's, each as a decode
          row of its own on the Rust layers, QUANT_MAX_TOKENS at a time: as its decode steps
          computed them. The Rust layers write every row's K/V before any row attends, so a
          row reads its sequence's earlier rows.

        NOTE: so a generated token computes the same bits whatever else the step holds (a
        request arriving mid-generation no longer moves its neighbours' tokens onto the bf16
        path, nor an adapter's request base rows onto the torch layers, where a near-tie could
        flip), and whether or not the KV cache ran out meanwhile: with up to QUANT_MAX_TOKENS
        sequences decoding, greedy and seeded output does not depend on the rest of the batch.
        Each part reads its own copy of the weights; the prompt part dominates such steps."""
        lora = np.asarray(plan.lora_ids)
        if not prompt and (len(plan.input_ids) > QUANT_MAX_TOKENS or lora.all() or not lora.any()):
            return None   # (decode steps: the common case, decided first)
        rust = self._rust_decode()
        qsl = np.asarray(plan.query_start_loc, np.int64)
        seqs = np.arange(len(plan.seq_lens))
        whole = [(int(s), int(qsl[s]), int(qsl[s + 1])) for s in seqs]
        if not prompt:
            if not rust:
                return None
            return [([whole[s] for s in seqs if not lora[s]], False, True),
                    ([whole[s] for s in seqs if lora[s]], False, True)]
        decode = decode_sequences(plan)
        decode_tokens = int(np.diff(qsl)[decode].sum())
        prompt_pieces, regen = [], []
        prompt_lens = getattr(plan, "prompt_lens", None)
        positions = np.asarray(plan.positions)
        for s in np.setdiff1d(seqs, decode):
            s, a, b = whole[s]
            cut = b
            if rust and prompt_lens is not None and not lora[s]:
                # (a chunk's positions increase: those past the prompt are its last)
                cut = a + int((positions[a:b] < prompt_lens[s]).sum())
            if cut > a:
                prompt_pieces.append((s, a, cut))
            regen += [(s, t, t + 1) for t in range(cut, b)]
        if not 0 < decode_tokens <= QUANT_MAX_TOKENS:
            # (many decode rows: one bf16 step with the prompts, as without parts)
            prompt_pieces = sorted(prompt_pieces + [whole[s] for s in decode])
            decode = decode[:0]
        if not regen and not len(decode):
            return None
        parts = [] if not prompt_pieces else [(prompt_pieces, True, False)]
        parts += [(regen[i:i + QUANT_MAX_TOKENS], False, True) for i in range(0, len(regen), QUANT_MAX_TOKENS)]
        adapted = lora[decode] != 0
        if adapted.any() and not adapted.all() and rust:
            parts += [([whole[s] for s in decode[~adapted]], False, True),
                      ([whole[s] for s in decode[adapted]], False, True)]
        elif len(decode):
            parts.append(([whole[s] for s in decode], False, True))
        return parts

    def _rust_decode(self) -> bool:
        """Whether the model's few-token decode steps can run on the Rust layers."""
        path = getattr(self.model, "cpu_decode_path", None)
        return path is not None and path() is not None

    def _execute_split(self, plan, parts: list[tuple[list[tuple[int, int, int]], bool, bool]]) -> SampleOutput:
        """A step run in `parts` (`_parts`), in order: each part's forward and logits as a step
        of its own."""
        rows = np.asarray(plan.logits_indices, np.int64)
        hidden, logits = None, None
        for pieces, prompt, quantized in parts:
            sub, tokens = piece_plan(plan, pieces)
            part_rows = np.flatnonzero(np.isin(rows, tokens))
            with cpu_step(prompt, quantized):
                h = self.run_model(sub)
                if hidden is None:
                    hidden = h.new_empty((len(plan.input_ids), h.shape[1]))
                hidden[torch.from_numpy(tokens)] = h
                if len(part_rows):
                    lg = self.model.compute_logits(hidden[torch.from_numpy(rows[part_rows])], sampling=True)
                    if logits is None:
                        logits = lg.new_empty((len(rows), lg.shape[1]))
                    logits[torch.from_numpy(part_rows)] = lg
        with cpu_step(True, False):
            prompt_lp = self.prompt_logprobs(hidden, plan)
            # (a recompute chunk that does not reach its sequence's end samples nothing)
            out = SampleOutput.empty() if logits is None else self.sampler.sample_plan(logits.cpu(), plan).to_host()
        return with_prompt_logprobs(out, prompt_lp, self.pooled(hidden, plan))

    def _execute(self, plan, num_rows: int) -> Launched:
        """Forward, prompt logprobs and sampling of a non-empty plan."""
        hidden = self.run_model(plan)
        prompt_lp = self.prompt_logprobs(hidden, plan)
        pooled = self.pooled(hidden, plan)
        # NOTE: a chunk that does not reach the end of its prompt samples nothing, but its
        # forward above still had to run to fill the KV cache.
        if num_rows == 0:
            return Launched(DeviceSample(SampleOutput.empty()), prompt_lp, pooled)
        indices = np.asarray(plan.logits_indices)
        if num_rows == hidden.shape[0] and (indices == np.arange(num_rows)).all():
            rows = hidden   # every token samples, in order (decode steps): no gather
        else:
            rows = hidden[to_device(as_tensor(indices, torch.int64), self.device)]
        # (on an accelerator the sampler runs there too: worker/sampler.py)
        logits = self.model.compute_logits(rows, sampling=True)
        return Launched(self.sampler.sample_plan(logits, plan), prompt_lp, pooled)

    def pooled(self, hidden: torch.Tensor, plan) -> np.ndarray | None:
        """The final hidden states [T, H] of the Plan's pooling entries, as float32 [Q, H] on
        the host (the Core sums them into each request's embedding). None when it lists none."""
        indices = getattr(plan, "pool_indices", None)
        if indices is None or len(indices) == 0:
            return None
        rows = hidden[to_device(as_tensor(indices, torch.int64), self.device)]
        return rows.float().cpu().numpy()

    def prompt_logprobs(self, hidden: torch.Tensor, plan):
        """The Plan's prompt-logprob entries from the final hidden states [T, H]:
        (logprob of each target f32 [P], top ids i64 [P, K], top logprobs f32 [P, K], rank of
        each target i64 [P]) from the raw log-softmax, K = the most alternatives any entry
        wants (ids -1 past an entry's own k); a rank is how many tokens are at least as likely
        as the target, itself included (vLLM's: ties count against it). None when the Plan
        lists none. Runs PROMPT_LP_CHUNK rows at a time."""
        indices = getattr(plan, "prompt_lp_indices", None)
        if indices is None or len(indices) == 0:
            return None
        num = np.asarray(plan.prompt_lp_num, np.int64)
        p, k = len(indices), max(int(num.max()), 0)
        rows = to_device(as_tensor(indices, torch.int64), self.device)
        targets = to_device(as_tensor(plan.prompt_lp_targets, torch.int64), self.device)
        chosen = np.empty(p, np.float32)
        ranks = np.empty(p, np.int64)
        top_ids = np.full((p, k), -1, np.int64)
        top_lp = np.zeros((p, k), np.float32)
        for start in range(0, p, PROMPT_LP_CHUNK):
            end = min(start + PROMPT_LP_CHUNK, p)
            logits = self.model.compute_logits(hidden[rows[start:end]]).float()
            lp = torch.log_softmax(logits, dim=-1)
            target_lp = lp.gather(1, targets[start:end].unsqueeze(1))
            chosen[start:end] = target_lp.squeeze(1).cpu().numpy()
            ranks[start:end] = (lp >= target_lp).sum(dim=1).cpu().numpy()
            if k:
                top = lp.topk(min(k, lp.shape[1]), dim=-1)   # sorted, largest first
                top_ids[start:end, :top.indices.shape[1]] = top.indices.cpu().numpy()
                top_lp[start:end, :top.values.shape[1]] = top.values.cpu().numpy()
        # An entry that wants fewer alternatives than K gets padding ids (Core drops them).
        top_ids[np.arange(k)[None, :] >= num[:, None]] = -1
        return chosen, top_ids, top_lp, ranks

    def run_model(self, plan) -> torch.Tensor:
        """The forward alone (K/V written to the cache): final hidden states [T, H].
        Call under torch.inference_mode(); `execute` does."""
        dev = self.device
        input_ids = as_tensor(plan.input_ids, torch.int64).to(dev)
        positions = as_tensor(plan.positions, torch.int64).to(dev)
        slot_mapping = as_tensor(plan.slot_mapping, torch.int64).to(dev)
        seq_lens = np.asarray(plan.seq_lens)
        block_tables = np.asarray(plan.block_tables).reshape(len(seq_lens), -1)
        attn = AttentionMetadata.build(np.asarray(plan.query_start_loc), seq_lens, block_tables,
                                       slot_mapping, self.block_size, dev, self.workspace,
                                       generated=in_runner_step() and not in_prompt_step())
        return self.forward(plan, input_ids, positions, attn)

    def forward(self, plan, input_ids: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        """The model's forward over the plan's tokens, each through its sequence's LoRA
        adapter when the model has adapters (models/lora.py)."""
        if not getattr(self.model, "lora_adapters", None):
            return self.model.forward(input_ids, positions, attn, self.kv_cache)
        from llmserve.models import lora

        tokens = lora.token_adapters(np.asarray(plan.query_start_loc), np.asarray(plan.lora_ids))
        lora.set_step(tokens, self.model)   # (a host tensor: set_step groups on the host)
        try:
            return self.model.forward(input_ids, positions, attn, self.kv_cache)
        finally:
            lora.set_step(None)
