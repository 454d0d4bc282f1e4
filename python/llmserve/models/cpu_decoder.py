"""Few-token decode steps on CPU in one Rust call for all the decoder layers.

At batch 1 a decoder layer is ~35 small torch ops around its four GEMVs, and each op costs a
few microseconds of dispatch: for SmolLM2-135M that is several milliseconds of a ~16 ms token.
`llmserve._core.CpuDecoder` (rust/kernels/src/layer.rs) runs the whole layer stack of such a
step instead: norms, RoPE, the KV write, paged attention, SiLU and residuals in Rust, the
linears through the same quantized GEMV the torch path calls, then the model's final norm.
The embedding rows and the RoPE table rows are gathered with numpy: right after a step's
weights streamed through the caches, each torch op costs ~0.1-0.3 ms (its code and data are
evicted), a numpy gather a few microseconds.

It serves a step when all of these hold, else the torch layers run (they stay the reference
that tests compare this path with):
- a float32 model on CPU whose every layer holds GGUF blocks for all four linears, and
  is a Llama layer (DecoderConfig.llama_layers: no sliding window, no Gemma switch);
- every token of the step is the only new token of its sequence (a pure decode step), there
  are at most QUANT_MAX_TOKENS of them, and the runner marked the step as one that reads GGUF
  blocks (worker/threads.py: generated tokens only, never prompt tokens);
- not --batch-invariant (that mode promises the torch path's chunked numerics at any size).
"""

from __future__ import annotations

import numpy as np
import torch

from llmserve import _core
from llmserve.worker.attention import AttentionMetadata
from llmserve.worker.kv_cache import kernel_kv_dtype, kernel_view
from llmserve.worker.threads import kernel_threads, quantized_step_allowed

# Tests flip this to compare the two paths in one process.
USE_CPU_DECODER = True


def _vector(t: torch.Tensor | None) -> np.ndarray | None:
    return None if t is None else t.detach().contiguous().numpy()


def _quant(linear) -> tuple:
    q = linear.quant
    return (q.data, q.ggml_type, q.rows, q.cols)


class CpuDecodePath:
    """The Rust decoder of one model, and the numpy views of the KV cache it was last given."""

    def __init__(self, model) -> None:
        c = model.config
        layers = []
        for layer in model.layers:
            a = layer.attn
            layers.append({
                "input_norm": _vector(layer.input_norm.weight),
                "post_norm": _vector(layer.post_norm.weight),
                "qkv": _quant(a.qkv), "qkv_bias": _vector(a.qkv.bias),
                "q_norm": _vector(a.q_norm.weight) if a.q_norm is not None else None,
                "k_norm": _vector(a.k_norm.weight) if a.k_norm is not None else None,
                "rope": a.rope,
                "o_proj": _quant(a.o_proj), "o_bias": _vector(a.o_proj.bias),
                "gate_up": _quant(layer.mlp.gate_up), "down": _quant(layer.mlp.down),
            })
        shape = {"hidden": c.hidden_size, "num_heads": c.num_heads, "num_kv_heads": c.num_kv_heads,
                 "head_dim": c.head_dim, "intermediate": c.intermediate_size,
                 "eps": c.rms_norm_eps, "scale": model.layers[0].attn.attn.scale}
        self.decoder = _core.CpuDecoder(shape, layers, _vector(model.norm.weight))
        self._embed = model.embed_tokens.weight.detach().numpy()   # [V, H], no copy
        self._rope = model.rope
        self._caches = None   # (the kv_caches object, [K views], [V views], the kernels' kv_dtype)

    @staticmethod
    def available(model) -> bool:
        """Whether the model can take this path at all (see the module doc)."""
        if not hasattr(_core, "CpuDecoder") or not getattr(model, "quantized", False):
            return False
        if not model.config.llama_layers:   # (its layers are Llama's: no window, no Gemma switch)
            return False
        embed = model.embed_tokens.weight
        if embed.dtype != torch.float32 or embed.device.type != "cpu" or not embed.is_contiguous():
            return False
        return all(lin.quant is not None
                   for layer in model.layers
                   for lin in (layer.attn.qkv, layer.attn.o_proj, layer.mlp.gate_up, layer.mlp.down))

    @staticmethod
    def serves(num_tokens: int, attn, batch_invariant: bool) -> bool:
        """Whether this step is one the path serves (given the model can take it)."""
        return (USE_CPU_DECODER and not batch_invariant and isinstance(attn, AttentionMetadata)
                and 0 < num_tokens and quantized_step_allowed(num_tokens)
                and attn.num_decode == num_tokens and attn.decode_token_idx is None
                and attn.decode_tables_np is not None)

    def _views(self, kv_caches) -> tuple[list[np.ndarray], list[np.ndarray], str | None]:
        # NOTE: the runner's KV cache lives as long as the runner; its numpy views are made
        # once, not 2 x layers times per step.
        if self._caches is None or self._caches[0] is not kv_caches:
            pairs = [kv_caches[i] for i in range(len(kv_caches))]
            self._caches = (kv_caches, [kernel_view(k) for k, _ in pairs], [kernel_view(v) for _, v in pairs],
                            kernel_kv_dtype(pairs[0][0]))
        return self._caches[1], self._caches[2], self._caches[3]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                kv_caches) -> torch.Tensor:
        """input_ids, positions [T] int64 -> the final-normed hidden states [T, H]; K/V written."""
        h = self._embed[input_ids.numpy()]              # a new [T, H] array
        cos, sin = self._rope.cos_sin_host(positions.numpy())
        ks, vs, kv_dtype = self._views(kv_caches)
        self.decoder.forward(h, cos, sin, attn.slot_mapping.numpy(), attn.decode_tables_np,
                             attn.decode_lens_np, ks, vs, kernel_threads(), kv_dtype)
        return torch.from_numpy(h)
