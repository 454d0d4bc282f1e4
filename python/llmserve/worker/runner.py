"""ModelRunner: runs one scheduled step (a Plan) through the model and samples.

`execute(plan)` is the whole per-step contract with the engine: block copies for forked
sequences, the forward over the flat tokens (writing their K/V into the paged cache), logits
for the sampled rows only, and sampling. The plan is any object exposing ARCHITECTURE.md's
Plan columns as numpy arrays; they become tensors without per-token Python.
"""

from __future__ import annotations

import ctypes
import sys

import numpy as np
import torch

from llmserve.worker.attention import AttentionMetadata, GatherWorkspace
from llmserve.worker.kv_cache import KVCache
from llmserve.worker.sampler import Sampler, SampleOutput, SamplingBatch, as_tensor


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3   # glibc mallopt parameters


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


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str, *, seed: int | None = None):
        """model: a CausalLM (see llmserve.models). seed: the shared generator of unseeded rows."""
        self.model = model
        self.block_size = block_size
        self.device = torch.device(device)
        if self.device.type == "cpu":
            retain_freed_memory()
        self.kv_cache = KVCache(model.num_layers, num_blocks, block_size, model.num_kv_heads,
                                model.head_dim, dtype, self.device)
        self.sampler = Sampler(seed)
        self.workspace = GatherWorkspace()

    def execute(self, plan) -> SampleOutput:
        with torch.inference_mode():
            copy_src = as_tensor(plan.copy_src, torch.int64)
            if copy_src.numel():
                self.kv_cache.copy_blocks(copy_src.to(self.device),
                                          as_tensor(plan.copy_dst, torch.int64).to(self.device))
            num_tokens = len(plan.input_ids)
            num_rows = len(plan.logits_indices)
            if num_tokens == 0:
                return SampleOutput.empty()
            hidden = self.run_model(plan)
            # NOTE: a chunk that does not reach the end of its prompt samples nothing, but its
            # forward above still had to run to fill the KV cache.
            if num_rows == 0:
                return SampleOutput.empty()
            rows = as_tensor(plan.logits_indices, torch.int64).to(self.device)
            logits = self.model.compute_logits(hidden[rows]).cpu()
            return self.sampler.sample(logits, SamplingBatch.from_plan(plan))

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
                                       slot_mapping, self.block_size, dev, self.workspace)
        return self.model.forward(input_ids, positions, attn, self.kv_cache)
