"""The Llama family (Llama 2/3, SmolLM2, Mistral with its sliding window) and the decoder that
Qwen2, Qwen3, SmolLM3, Gemma, Phi-3, Granite, OLMo 2, StarCoder2, Cohere, StableLM, Phi,
GPT-NeoX, GPT-2 and the MoE families reuse with switches (DecoderConfig): QKV bias, q/k RMSNorm,
layers without RoPE, Gemma's norms, scales, activation, soft caps and local RoPE, OLMo 2's
output-only norms, StarCoder2's LayerNorms and ungated MLP, Cohere's parallel residual and
pairwise RoPE, GPT-NeoX's second norm in it, GPT-2's learned positions, experts (MoEConfig), ...

Weights arrive with HF names and are fused at load: q|k|v into one `qkv` matrix, gate|up into
one `gate_up` matrix. Modules are created on the meta device and the fused tensors assigned, so
loading never pays for a random init. GGUF checkpoints' quantized blocks, fused the same way
(whole rows concatenated), are attached to the linears for few-token float32 CPU steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, MutableMapping, Sequence

import torch
from torch import nn

from llmserve.loaders.checkpoint import LazyWeights, PackedQuant, QuantTensor, weight_shape
from llmserve.models import lora
from llmserve.models.cpu_decoder import CpuDecodePath
from llmserve.models.layers import (GateUpMLP, LayerNorm, Linear, MoEMLP, PagedAttention, PlainMLP, QKVLinear,
                                    RMSNorm,
                                    RotaryEmbedding, linear, pack_bf16, quant_linear,
                                    quant_serves)
from llmserve.models.registry import register
from llmserve.worker.attention import AttentionMetadata
from llmserve.worker.threads import in_big_decode_step, native_bf16

KVPair = tuple[torch.Tensor, torch.Tensor]   # one layer's (K cache, V cache)
# The cos and sin a model without RoPE (learned positions) passes its layers: none reads them.
_NO_ROPE = (torch.empty(0), torch.empty(0))


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts MLP's shape (layers.MoEMLP) and where a checkpoint keeps it."""
    num_experts: int
    top_k: int
    intermediate_size: int        # each expert's
    norm_topk_prob: bool          # the top k probabilities renormalized to sum to 1
    shared_intermediate_size: int = 0   # Qwen2-MoE's shared expert (0: none)
    # Layers with a dense MLP instead (Qwen's `mlp_only_layers`, `decoder_sparse_step`).
    dense_layers: frozenset[int] = frozenset()
    # HF names: the block in a layer (`mlp`, Mixtral's `block_sparse_moe`), and each expert's
    # gate, up and down projections (Mixtral's w1, w3, w2).
    prefix: str = "mlp"
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    # GraniteMoE's routing: a softmax over the top k scores (the same weights, rounded otherwise).
    softmax_topk: bool = False

    def sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers


@dataclass(frozen=True)
class DecoderConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_positions: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    # Layers whose q and k are not rotated (SmolLM3's NoPE layers); every other layer has RoPE.
    nope_layers: frozenset[int] = frozenset()
    # How many leading dims of each head RoPE rotates (`partial_rotary_factor`); None: all.
    rotary_dim: int | None = None
    # Each layer's sliding window (0: full attention); empty: every layer attends fully.
    layer_windows: tuple[int, ...] = ()
    # Gemma's switches:
    # - the checkpoint's norm weights hold w where the scale is 1 + w (1.0: added at load);
    norm_offset: float = 0.0
    # - "sandwich" norms: the attention's and the MLP's outputs are normed before each residual
    #   add (HF's post_attention_layernorm, post_feedforward_layernorm), the MLP's input by
    #   pre_feedforward_layernorm;
    sandwich_norms: bool = False
    # - the embeddings are multiplied by this (sqrt(hidden), rounded to the model's dtype);
    embed_scale: float = 1.0
    # - the MLP's gate activation: "silu" or "gelu_pytorch_tanh";
    hidden_act: str = "silu"
    # - q . k scale (None: head_dim^-0.5);
    attn_scale: float | None = None
    # - the RoPE (theta, scaling) of the layers in `local_layers` (the sliding-window ones);
    local_rope: tuple[float, dict | None] | None = None
    local_layers: frozenset[int] = frozenset()
    # Granite's multipliers: each layer's attention and MLP outputs are multiplied by
    # `residual_scale` before their residual adds, and the logits divided by `logits_scale`
    # (its embedding_multiplier and attention_multiplier are embed_scale and attn_scale).
    residual_scale: float = 1.0
    logits_scale: float = 1.0
    # Gemma 2's soft-capping (0: none): each scaled attention score s becomes
    # cap * tanh(s / cap) with `attn_softcap`, and each logit with `final_softcap`.
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    # OLMo 2's switches: no norm before the attention and the MLP (`pre_norms` False: only
    # their outputs are normed, `sandwich_norms`), and q and k each normed across all their
    # heads at once (`qk_norm_across_heads`: RMSNorm over [heads * head_dim], not per head).
    pre_norms: bool = True
    qk_norm_across_heads: bool = False
    # Norm weights stay float32 and scale in float32 before the one cast (OLMo 2's rounding, and
    # Gemma's with its 1 + w), where Llama casts the normed activations, then scales.
    fp32_norms: bool = False
    # Mixture-of-experts MLPs (None: every layer's MLP is dense, of `intermediate_size`).
    moe: MoEConfig | None = None
    # StarCoder2's switches: LayerNorms with a bias for the layers' and the final norm (eps
    # `rms_norm_eps`), and an ungated MLP with biases (layers.PlainMLP, `hidden_act`).
    layer_norm: bool = False
    plain_mlp: bool = False
    # Cohere's: LayerNorms without a bias (`layer_norm_bias` False; in float32 with
    # `fp32_norms`), the attention and the MLP both reading the layer's one normed input and
    # added to the residual together (`parallel_residual`), and RoPE rotating adjacent pairs
    # of a head's dims (`interleaved_rope`: q and k rows are reordered at load into the
    # rotate-half layout, which gives the same q . k).
    layer_norm_bias: bool = True
    parallel_residual: bool = False
    interleaved_rope: bool = False
    # Phi-1.5/2's: the LM head has a bias.
    lm_head_bias: bool = False
    # GPT-NeoX's: with `parallel_residual`, the MLP reads its own norm of the layer's input
    # (post_attention_layernorm) where Cohere's reads the attention's.
    parallel_mlp_norm: bool = False
    # GPT-2's: a learned embedding of each position [max_positions, H] added to the token's
    # (`embed_positions`) instead of RoPE: no position reaches max_positions (build.py caps
    # max_model_len there).
    learned_positions: bool = False

    @property
    def llama_layers(self) -> bool:
        """Layers the Rust decode path computes (models/cpu_decoder.py): none of Gemma's
        switches, no sliding window, no experts."""
        return (not self.norm_offset and not self.sandwich_norms and self.embed_scale == 1.0
                and self.hidden_act == "silu" and self.attn_scale is None and not any(self.layer_windows)
                and self.rotary_dim is None and self.residual_scale == 1.0 and not self.local_layers
                and not self.attn_softcap and self.moe is None and not self.layer_norm and not self.plain_mlp
                and not self.parallel_residual and not self.learned_positions)

    @property
    def mlp_norm(self) -> bool:
        """Whether a layer's MLP has its own input norm (post_attention_layernorm)."""
        return not self.parallel_residual or self.parallel_mlp_norm

    @staticmethod
    def from_hf(cfg: dict, partial_rotary_default: float = 1.0, **overrides) -> "DecoderConfig":
        """The config from an HF config.json dict; `partial_rotary_default`: the part of each
        head RoPE rotates when the config does not say (a family's transformers default)."""
        heads = cfg["num_attention_heads"]
        # transformers >= 5 writes rope settings as `rope_parameters`; older files use
        # `rope_theta` + `rope_scaling`.
        rope_params = cfg.get("rope_parameters") or {}
        theta = cfg.get("rope_theta") or rope_params.get("rope_theta") or 10000.0
        scaling = cfg.get("rope_scaling")
        if scaling is None and rope_params.get("rope_type", "default") != "default":
            scaling = rope_params
        if cfg.get("mlp_bias"):
            raise ValueError("mlp_bias is not supported")
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        partial = (cfg.get("partial_rotary_factor") or rope_params.get("partial_rotary_factor")
                   or partial_rotary_default)
        rotary_dim = int(head_dim * partial) if partial < 1.0 else None
        if rotary_dim is not None and (rotary_dim <= 0 or rotary_dim % 2):
            raise ValueError(f"partial_rotary_factor {partial} gives {rotary_dim} rotary dims of {head_dim}")
        fields = dict(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
            num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim, rotary_dim=rotary_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
            rope_scaling=scaling, max_positions=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", False)),
            o_bias=bool(cfg.get("attention_bias", False)),
        )
        fields.update(overrides)
        return DecoderConfig(**fields)


def require_silu(cfg: dict, family: str) -> None:
    """Refuses a config whose `hidden_act` is not SiLU (the gated MLP of `family`)."""
    act = cfg.get("hidden_act") or "silu"
    if act != "silu":
        raise ValueError(f"{family}'s hidden_act {act!r} is not supported (silu)")


def layer_types(cfg: dict, pattern: int) -> list[str]:
    """Each layer's attention, as transformers' configs with sliding-window layers (Gemma 2 and 3,
    OLMo 3) read it: `layer_types`, else a full-attention layer every `pattern`th
    (`sliding_window_pattern` if the config has one), sliding-window ones between."""
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:
        pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or pattern
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    if len(types) != n or set(types) - {"sliding_attention", "full_attention"}:
        raise ValueError(f"layer_types must give each of the {n} layers sliding_attention or full_attention")
    return list(types)


def layer_windows(cfg: dict, types: list[str]) -> tuple[int, ...]:
    """DecoderConfig.layer_windows: `sliding_window` in the layers `types` marks sliding."""
    window = int(cfg.get("sliding_window") or 0)
    return tuple(window if t == "sliding_attention" else 0 for t in types) if window else ()


def layer_type_rope(cfg: dict, layer_type: str, theta: float, scaling: dict | None) -> tuple[float, dict | None]:
    """(theta, scaling) of the layers of one type: transformers >= 5 writes them per type
    (`rope_parameters: {"full_attention": {...}, "sliding_attention": {...}}`); a config without
    that gets `theta` and `scaling`, the caller's reading of its flat keys."""
    params = cfg.get("rope_parameters") or {}
    nested = isinstance(params.get("full_attention"), dict) or isinstance(params.get("sliding_attention"), dict)
    own = params.get(layer_type) if nested else None
    if own is None:
        return float(theta), scaling
    kind = own.get("rope_type", own.get("type", "default"))
    return float(own.get("rope_theta", theta)), (None if kind == "default" else own)


def model_norm(c: DecoderConfig) -> RMSNorm | LayerNorm:
    """A layer's input norm, its MLP's, or the final one: RMSNorm, or StarCoder2's LayerNorm."""
    if c.layer_norm:
        return LayerNorm(c.hidden_size, c.rms_norm_eps, bias=c.layer_norm_bias, fp32=c.fp32_norms)
    return RMSNorm(c.hidden_size, c.rms_norm_eps)


class DecoderAttention(nn.Module):
    fused: Any = None   # the fused layer ops (layers.RMSNorm.fused): RoPE in place in one kernel

    def __init__(self, c: DecoderConfig, rope: bool = True, window: int = 0):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.rope = rope
        self.rotary_dim = c.rotary_dim   # (None: the whole head)
        self.qkv = QKVLinear(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.qkv_bias)
        self.o_proj = Linear(c.num_heads * c.head_dim, c.hidden_size, bias=c.o_bias)
        self.qk_across = c.qk_norm_across_heads
        q_dim, k_dim = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim) if self.qk_across else (c.head_dim,) * 2
        self.q_norm = RMSNorm(q_dim, c.rms_norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(k_dim, c.rms_norm_eps) if c.qk_norm else None
        self.attn = PagedAttention(c.num_heads, c.num_kv_heads, c.head_dim, scale=c.attn_scale, window=window,
                                   softcap=c.attn_softcap)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn: AttentionMetadata, kv_cache: KVPair) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        nh, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv(x)
        whole = self.rotary_dim is None
        # (rotated in place where it can be: no per-head norm first, the whole head rotated)
        in_place = self.q_norm is None and (
            not self.rope or (whole and RotaryEmbedding.apply_in_place(qkv, nh + nkv, cos, sin, self.fused)))
        if in_place:
            q, k, v = qkv.split((nh * d, nkv * d, nkv * d), dim=-1)
            q, k = q.view(-1, nh, d), k.view(-1, nkv, d)
        else:
            qk, v = qkv.split(((nh + nkv) * d, nkv * d), dim=-1)
            if self.qk_across:                          # OLMo 2: RMSNorm across the heads
                qk = torch.cat((self.q_norm(qk[:, :nh * d]), self.k_norm(qk[:, nh * d:])), dim=-1)
            qk = qk.view(-1, nh + nkv, d)               # q heads then k heads: RoPE both in one go
            if self.q_norm is not None and not self.qk_across:   # Qwen3: per-head RMSNorm before RoPE
                qk = torch.cat((self.q_norm(qk[:, :nh]), self.k_norm(qk[:, nh:])), dim=1)
            if self.rope and whole:
                qk = RotaryEmbedding.apply(qk, cos, sin)
            elif self.rope:                             # Phi-4-mini: the leading dims only
                r = self.rotary_dim
                qk = torch.cat((RotaryEmbedding.apply(qk[..., :r], cos, sin), qk[..., r:]), dim=-1)
            q, k = qk.split((nh, nkv), dim=1)
        o = self.attn(q, k, v.view(-1, nkv, d), attn, kv_cache)
        return self.o_proj(o)


class DecoderLayer(nn.Module):
    def __init__(self, c: DecoderConfig, index: int):
        super().__init__()
        window = c.layer_windows[index] if c.layer_windows else 0
        self.input_norm = model_norm(c) if c.pre_norms else None
        self.attn = DecoderAttention(c, rope=index not in c.nope_layers, window=window)
        # the MLP's input norm
        self.post_norm = model_norm(c) if c.pre_norms and c.mlp_norm else None
        self.parallel = c.parallel_residual
        m = c.moe
        self.mlp = (MoEMLP(c.hidden_size, m.intermediate_size, m.num_experts, m.top_k, m.norm_topk_prob,
                           m.shared_intermediate_size, m.softmax_topk)
                    if m is not None and m.sparse(index)
                    else PlainMLP(c.hidden_size, c.intermediate_size, c.hidden_act) if c.plain_mlp
                    else GateUpMLP(c.hidden_size, c.intermediate_size, c.hidden_act))
        sandwich = c.sandwich_norms
        self.attn_out_norm = RMSNorm(c.hidden_size, c.rms_norm_eps) if sandwich else None
        self.mlp_out_norm = RMSNorm(c.hidden_size, c.rms_norm_eps) if sandwich else None
        # rotated with the model's local RoPE (Gemma's sliding-window layers)
        self.local_rope = c.local_rope is not None and index in c.local_layers
        self.residual_scale = c.residual_scale

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn: AttentionMetadata, kv_cache: KVPair) -> torch.Tensor:
        x = h if self.input_norm is None else self.input_norm(h)
        if self.parallel:
            a = self.attn(x, cos, sin, attn, kv_cache)
            if self.post_norm is not None:   # GPT-NeoX: the MLP's own norm of h; (MLP + attention) + h
                return self.mlp(self.post_norm(h)) + a + h
            # (Cohere: both read x; (h + attention) + MLP, as transformers adds them)
            return self._add(self._add(h, a, None), self.mlp(x), None)
        h = self._add(h, self.attn(x, cos, sin, attn, kv_cache), self.attn_out_norm)
        return self._add(h, self.mlp(h if self.post_norm is None else self.post_norm(h)), self.mlp_out_norm)

    @property
    def fusable(self) -> bool:
        """The layer takes `forward_fused`: RMSNorms before attention and MLP, and plain
        residual adds after them (no parallel residual, sandwich norms or residual scale)."""
        return (isinstance(self.input_norm, RMSNorm) and isinstance(self.post_norm, RMSNorm)
                and not self.parallel and self.attn_out_norm is None and self.mlp_out_norm is None
                and self.residual_scale == 1.0)

    def forward_fused(self, h: torch.Tensor, pending: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                      attn: AttentionMetadata, kv_cache: KVPair, ops: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` with each residual add done by the norm after it (ops.fused_add_rms_norm,
        in place): the layer's input is h + pending (pending None: h alone), and it returns
        (h, pending) of the next layer's input the same way, its MLP output not yet added.
        The adds and norms round where `forward`'s do; only a row's sum of squares, taken in
        another order by a kernel, can move a result. Mutates h (the embeddings' output or the
        previous layer's) in place."""
        if pending is None:
            x = self.input_norm(h)
        else:
            x = pending
            ops.fused_add_rms_norm(x, h, self.input_norm.weight, self.input_norm.eps)   # h += x; x = norm(h)
        a = self.attn(x, cos, sin, attn, kv_cache)
        ops.fused_add_rms_norm(a, h, self.post_norm.weight, self.post_norm.eps)
        return h, self.mlp(a)

    def _add(self, h: torch.Tensor, out: torch.Tensor, out_norm: RMSNorm | None) -> torch.Tensor:
        """The residual add of a sublayer's output (normed first with sandwich norms, scaled
        by Granite's residual multiplier)."""
        out = out if out_norm is None else out_norm(out)
        return h + (out if self.residual_scale == 1.0 else out * self.residual_scale)


@register("LlamaForCausalLM", "MistralForCausalLM")
class LlamaForCausalLM(nn.Module):
    """Decoder-only transformer: embed -> layers -> norm; `compute_logits` applies the LM head."""

    @classmethod
    def parse_config(cls, hf_config: dict) -> DecoderConfig:
        # Mistral's sliding window, in every layer: the CPU and torch paths attend through it;
        # our CUDA kernels serve the model up to the window, where attention is full (build.py).
        window = hf_config.get("sliding_window") if hf_config.get("use_sliding_window", True) else None
        windows = (int(window),) * hf_config["num_hidden_layers"] if window else ()
        return DecoderConfig.from_hf(hf_config, layer_windows=windows)

    @property
    def sliding_window(self) -> int:
        """The smallest window of a sliding-window layer; 0: every layer attends fully."""
        return min((w for w in self.config.layer_windows if w), default=0)

    def __init__(self, c: DecoderConfig):
        super().__init__()
        self.config = c
        self.num_layers, self.num_kv_heads, self.head_dim = c.num_layers, c.num_kv_heads, c.head_dim
        self.vocab_size = c.vocab_size
        # NOTE: from_hf assigns the weights; an uninitialized tensor skips the embedding's
        # random init, whose normal_ on the meta device first imports torch's decompositions
        # (~1.2 s of every start).
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size,
                                         _weight=torch.empty(c.vocab_size, c.hidden_size))
        self.embed_positions = (nn.Embedding(c.max_positions, c.hidden_size,
                                             _weight=torch.empty(c.max_positions, c.hidden_size))
                                if c.learned_positions else None)
        self.layers = nn.ModuleList(DecoderLayer(c, i) for i in range(c.num_layers))
        self.norm = model_norm(c)
        self.lm_head = (None if c.tie_word_embeddings
                        else nn.Linear(c.hidden_size, c.vocab_size, bias=c.lm_head_bias))
        self.rope: RotaryEmbedding | None = None   # set by from_hf (needs the real device; none: GPT-2)
        self.local_rope: RotaryEmbedding | None = None   # c.local_rope's, set by from_hf
        self.lm_quant: PackedQuant | None = None   # the LM head's GGUF blocks, if any
        # Its bfloat16 copy for decode steps the quantized GEMV does not take (compute_logits).
        self.lm_bf16: torch.Tensor | None = None
        self.quantized = False                     # some linear has GGUF blocks
        # Rows that sample read `lm_bf16` in every step (a GGUF head without blocks: from_hf).
        self.bf16_sampling_head = False
        self.batch_invariant = False
        # The Rust path of few-token decode steps (cpu_decoder.py); built on first use,
        # False when the model cannot take it.
        self._cpu_path: CpuDecodePath | bool | None = None
        # The fused layer ops (set_fused_ops), and whether every layer adds its residuals
        # through them.
        self._fused_ops: Any = None
        self._fused_residual = False

    def set_fused_ops(self, ops: Any) -> None:
        """Run the layers with the fused ops of `ops` (llmserve.kernels on a GPU, whose
        `fused_unserved` the caller checked; kernels.reference in tests), or without (None):
        every RMSNorm, SwiGLU product and whole-head RoPE in one kernel each, and when every
        layer is `fusable` and the final norm an RMSNorm, each residual add inside the norm
        after it. They round where the torch layers round, so only a row's sum of squares
        taken in another order can tell them apart; in far fewer kernels, which bound a small
        decode step on a GPU."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, GateUpMLP, DecoderAttention)):
                module.fused = ops
        self._fused_ops = ops
        self._fused_residual = (ops is not None and isinstance(self.norm, RMSNorm) and len(self.layers) > 0
                                and all(layer.fusable for layer in self.layers))

    def set_batch_invariant(self, on: bool) -> None:
        """--batch-invariant: every linear (LM head included) row by row and every token's
        attention alone (layers.linear, attention.paged_attention), so a row's result does
        not depend on the rest of the step. CPU float32 only (build.py checks)."""
        self.batch_invariant = on
        for module in self.modules():
            if isinstance(module, (Linear, PagedAttention, MoEMLP)):
                module.batch_invariant = on

    @classmethod
    def from_hf(cls, hf_config: dict, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                device: torch.device, quantized: dict[str, QuantTensor] | None = None,
                serving: bool = False, gguf: bool = False) -> "LlamaForCausalLM":
        """The model with HF-named `weights` (and a GGUF checkpoint's `quantized` blocks) loaded.

        `serving`: the model is for a ModelRunner, built from tensors nothing else needs. Each
        is then popped from `weights` and `quantized` once converted (the dicts end empty), so
        the checkpoint's copy of a weight is freed as the model's is made; and a layer linear
        that gets GGUF blocks and a bfloat16 copy keeps no float32 weight, which no runner step
        reads (`quantize_linear`). Each linear gets its blocks as its weight is made, so with
        lazily made weights (a GGUF checkpoint's) such a build holds one linear's float32 at a
        time, never the whole model's.

        `gguf`: the weights are a GGUF file's (already rounded to its types). On a CPU with
        native bf16, a float32 model's layer linears without blocks (F16, BF16, IQ types, ...,
        which convert to no type our kernels read) then get a bfloat16 copy too, which every runner step
        computes them with (a serving build drops their float32), and sampled rows read the LM
        head's bfloat16 copy when it has no blocks (prompt logprobs read the head in float32)."""
        c = cls.parse_config(hf_config)
        if not c.tie_word_embeddings and "lm_head.weight" not in weights:
            # NOTE: checkpoints that ship no LM head (GGUF without `output.weight`) tie it.
            c = DecoderConfig(**{**c.__dict__, "tie_word_embeddings": True})
        with torch.device("meta"):
            model = cls(c)
        cpu_fp32 = dtype == torch.float32 and device.type == "cpu"
        blocks = quantized if quantized and cpu_fp32 else None
        bf16 = native_bf16()
        lossy = gguf and cpu_fp32 and bf16   # (linears without blocks get bf16 copies too)
        parts = quantized_parts(c)

        def attach(name: str, weight: torch.Tensor) -> torch.Tensor:
            q = fused_blocks(blocks, parts[name], take=serving) if blocks is not None else None
            owner, _, which = name.rpartition(".")
            experts = model.get_submodule(owner)
            if isinstance(experts, MoEMLP):
                return quantize_experts(name, experts, which, q, weight, serving) if q is not None else weight
            if q is None and not lossy:
                return weight
            return quantize_linear(name, model.get_submodule(name), q, weight, bf16, serving)

        state = fuse_hf_weights(c, weights, dtype, device, take=serving,
                                on_linear=None if blocks is None and not lossy else attach)
        model.load_state_dict(state, strict=True, assign=True)
        del state
        if not c.learned_positions:
            model.rope = RotaryEmbedding(c.rotary_dim or c.head_dim, c.rope_theta, c.rope_scaling, c.max_positions,
                                         device)
        if c.local_rope is not None:
            model.local_rope = RotaryEmbedding(c.head_dim, *c.local_rope, c.max_positions, device)
        if blocks is not None or lossy:   # (served, its dict is empty by now)
            head = fused_blocks(blocks, parts["lm_head"], take=serving) if blocks is not None else None
            model.bf16_sampling_head = lossy and head is None
            model.attach_head(head, bf16)
        model.requires_grad_(False)
        return model.eval()

    @property
    def learned_positions(self) -> bool:
        """Positions are learned embeddings (GPT-2): none past the config's (build.py)."""
        return self.config.learned_positions

    @property
    def bf16_only_linears(self) -> bool:
        """Whether some linear computes on a bf16 copy with no GGUF blocks beside it (from_hf
        `gguf`): what such a model outputs differs from its float32 one in every step."""
        return self.bf16_sampling_head or any(
            isinstance(m, Linear) and m.quant is None and m.bf16_weight is not None for m in self.layers.modules())

    def attach_head(self, q: QuantTensor | None, bf16: bool) -> None:
        """The LM head's blocks (None: it has none) and, once the model has blocks anywhere and
        with `bf16`, its bfloat16 copy; call after the layer linears got theirs."""
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if q is not None:
            if (q.rows, q.cols) != tuple(head.shape):
                raise ValueError(f"quantized lm_head is [{q.rows}, {q.cols}], its weight {list(head.shape)}")
            self.lm_quant = q.pack()
        self.quantized = self.lm_quant is not None or any(
            getattr(m, "quant", None) is not None for m in self.layers.modules())
        self.lm_bf16 = (head.detach().to(torch.bfloat16) if bf16 and (self.quantized or self.bf16_sampling_head)
                        else None)
        self._cpu_path = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                kv_caches: Sequence[KVPair]) -> torch.Tensor:
        """input_ids, positions [T] int64 -> final-normed hidden [T, H]."""
        path = self.cpu_decode_path() if self._fused_ops is None else None
        # (its Rust layers hold no LoRA adapter: a step with adapter rows runs the torch layers)
        if path and path.serves(input_ids.shape[0], attn, self.batch_invariant) and not lora.step_active():
            return path.forward(input_ids, positions, attn, kv_caches)
        h = self.embed_tokens(input_ids)
        c = self.config
        if c.embed_scale != 1.0:
            h = h * torch.tensor(c.embed_scale, dtype=h.dtype)
        if self.embed_positions is not None:
            h = h + self.embed_positions(positions)
        rope = self.rope.cos_sin(positions, h.dtype) if self.rope is not None else _NO_ROPE
        local = self.local_rope.cos_sin(positions, h.dtype) if self.local_rope is not None else rope
        if self._fused_residual:
            ops, pending = self._fused_ops, None
            for layer, kv_cache in zip(self.layers, kv_caches):
                h, pending = layer.forward_fused(h, pending, *(local if layer.local_rope else rope), attn, kv_cache,
                                                 ops)
            ops.fused_add_rms_norm(pending, h, self.norm.weight, self.norm.eps)
            return pending
        for layer, kv_cache in zip(self.layers, kv_caches):
            h = layer(h, *(local if layer.local_rope else rope), attn, kv_cache)
        return self.norm(h)

    def cpu_decode_path(self) -> CpuDecodePath | None:
        """The Rust path of few-token decode steps, when this model can take it."""
        if self._cpu_path is None:
            self._cpu_path = CpuDecodePath.available(self) and CpuDecodePath(self)
        return self._cpu_path or None

    def compute_logits(self, hidden: torch.Tensor, sampling: bool = False) -> torch.Tensor:
        """hidden [R, H] -> float32 logits [R, V]. `sampling`: the rows sample tokens (they are
        not prompt logprobs)."""
        logits = self._head(hidden, sampling)
        scale, cap = self.config.logits_scale, self.config.final_softcap
        if scale != 1.0:
            logits.div_(scale)
        if cap:
            logits = logits.div_(cap).tanh_().mul_(cap)
        return logits

    def _head(self, hidden: torch.Tensor, sampling: bool) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        # NOTE: rows that sample read the Q8_0 blocks with int8 activations in every step but
        # decode steps of more than QUANT_MAX_TOKENS sequences (bf16 there), however many rows
        # sample: so a prompt's first token is computed as the tokens after it are, and each
        # row alone, so neither the prefix cache nor the requests sharing its step can move
        # it. (The fp32 GEMV of a 49152-token head took ~17 ms of a short prompt's ~95 ms.)
        # Prompt logprobs keep fp32: they do not round.
        q = self.lm_quant
        bias = None if self.lm_head is None else self.lm_head.bias
        if sampling and quant_serves(hidden, q) and not in_big_decode_step():
            return quant_linear(hidden, bias, q)
        bf16 = self.lm_bf16 if in_big_decode_step() or (sampling and self.bf16_sampling_head) else None
        return linear(hidden, weight, bias, q, self.batch_invariant, bf16).float()


def hf_shapes(c: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """The shape `c` gives each HF-named tensor a checkpoint must hold (the optional ones
    too: a checkpoint holds those its config switches on)."""
    h, i, v, d = c.hidden_size, c.intermediate_size, c.vocab_size, c.head_dim
    q, kv = c.num_heads * d, c.num_kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,),
                                          "model.norm.bias": (h,), "lm_head.weight": (v, h), "lm_head.bias": (v,),
                                          "model.embed_positions.weight": (c.max_positions, h)}
    for layer in range(c.num_layers):
        p, a = f"model.layers.{layer}.", f"model.layers.{layer}.self_attn."
        shapes.update({a + "q_proj.weight": (q, h), a + "k_proj.weight": (kv, h), a + "v_proj.weight": (kv, h),
                       a + "qkv_proj.weight": (q + 2 * kv, h), a + "qkv_proj.bias": (q + 2 * kv,),
                       p + "mlp.gate_up_proj.weight": (2 * i, h),
                       a + "q_proj.bias": (q,), a + "k_proj.bias": (kv,), a + "v_proj.bias": (kv,),
                       a + "o_proj.weight": (h, q), a + "o_proj.bias": (h,),
                       a + "q_norm.weight": (q,) if c.qk_norm_across_heads else (d,),
                       a + "k_norm.weight": (kv,) if c.qk_norm_across_heads else (d,),
                       p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                       p + "mlp.down_proj.weight": (h, i),
                       p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "pre_feedforward_layernorm.weight": (h,), p + "post_feedforward_layernorm.weight": (h,),
                       p + "input_layernorm.bias": (h,), p + "post_attention_layernorm.bias": (h,),
                       p + "mlp.c_fc.weight": (i, h), p + "mlp.c_fc.bias": (i,), p + "mlp.c_proj.weight": (h, i),
                       p + "mlp.c_proj.bias": (h,)})
        if c.moe is not None and c.moe.sparse(layer):
            for prefix in {c.moe.prefix, "mlp"}:   # (transformers >= 5 names every block `mlp`)
                shapes.update(moe_shapes(c.moe, h, p + prefix + "."))
    return shapes


# A MoE block's router, and its experts' gate|up [E, 2I, H] and down [E, H, I] where a
# checkpoint stacks them (transformers >= 5's names; GraniteMoE's), by their names in the block.
MOE_ROUTERS = ("gate.weight", "router.weight", "router.layer.weight")
MOE_STACKED = (("experts.gate_up_proj", "experts.down_proj"), ("input_linear.weight", "output_linear.weight"))


def moe_shapes(m: MoEConfig, h: int, block: str) -> dict[str, tuple[int, ...]]:
    """The HF-named tensors of one MoE block (`block`: `model.layers.0.mlp.`): the router, each
    expert's projections (or all of them stacked) and a shared expert with its gate."""
    e, i, s = m.num_experts, m.intermediate_size, m.shared_intermediate_size
    g, u, d = m.expert_names
    shapes: dict[str, tuple[int, ...]] = {block + r: (e, h) for r in MOE_ROUTERS}
    for gate_up, down in MOE_STACKED:
        shapes.update({block + gate_up: (e, 2 * i, h), block + down: (e, h, i)})
    for x in range(e):
        x_ = f"{block}experts.{x}."
        shapes.update({x_ + g + ".weight": (i, h), x_ + u + ".weight": (i, h), x_ + d + ".weight": (h, i)})
    if s:
        shapes.update({block + "shared_expert.gate_proj.weight": (s, h), block + "shared_expert.up_proj.weight": (s, h),
                       block + "shared_expert.down_proj.weight": (h, s), block + "shared_expert_gate.weight": (1, h)})
    return shapes


def fuse_hf_weights(c: DecoderConfig, weights: Mapping[str, torch.Tensor], dtype: torch.dtype,
                    device: torch.device | str = "cpu", take: bool = False,
                    on_linear: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
                    ) -> dict[str, torch.Tensor]:
    """HF parameter names -> this module's names, with q|k|v and gate|up concatenated, each
    tensor converted to `dtype` on `device` (fused ones written straight into their place, so
    no fused copy in the checkpoint's dtype is made). `take`: tensors are popped from
    `weights` (a dict or LazyWeights) as they are used. `on_linear(name, weight)`: called
    with each layer linear's weight (`layers.0.attn.qkv`, ...) as it is made, before the next
    one; what it returns goes in its place. Raises, naming the checkpoint's tensor, on one
    that is missing, unexpected or of another shape than the config gives it, so a wrong
    mapping never loads silently."""
    left = weights if take else weights.copy() if isinstance(weights, LazyWeights) else dict(weights)
    shapes = hf_shapes(c)

    def checked(name: str) -> tuple[int, ...]:
        if name not in left:
            raise ValueError(f"checkpoint is missing {name!r}")
        shape = weight_shape(left, name)
        if shape != shapes[name]:
            raise ValueError(f"{name} is {list(shape)}, but the config makes it {list(shapes[name])}")
        return shape

    def one(name: str) -> torch.Tensor:
        checked(name)
        return left.pop(name).to(device=device, dtype=dtype).contiguous()

    def norm(name: str) -> torch.Tensor:
        # Gemma's 1 + w (and OLMo 2's w) stays float32: its norms scale in float32, then round
        # (layers.RMSNorm)
        if not (c.norm_offset or c.fp32_norms):
            return one(name)
        checked(name)
        return (left.pop(name).float() + c.norm_offset).to(device=device).contiguous()

    def cat(*names: str) -> torch.Tensor:
        parts = [checked(n) for n in names]
        out = torch.empty((sum(p[0] for p in parts), *parts[0][1:]), dtype=dtype, device=device)
        row = 0
        for n in names:
            part = left.pop(n)
            out[row:row + part.shape[0]].copy_(part)
            row += part.shape[0]
            del part
        return out

    def linear(ours: str, t: torch.Tensor) -> torch.Tensor:
        return t if on_linear is None else on_linear(ours, t)

    out = {"embed_tokens.weight": one("model.embed_tokens.weight"),
           "norm.weight": norm("model.norm.weight")}
    if c.learned_positions:
        out["embed_positions.weight"] = one("model.embed_positions.weight")
    if c.layer_norm and c.layer_norm_bias:
        out["norm.bias"] = one("model.norm.bias")
    for i in range(c.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        sa = hf + "self_attn."
        # (Phi-3 checkpoints hold q|k|v and gate|up fused already, as this module does)
        fused = sa + "qkv_proj.weight" in left
        qkv = one(sa + "qkv_proj.weight") if fused else cat(sa + "q_proj.weight", sa + "k_proj.weight",
                                                            sa + "v_proj.weight")
        out[ours + "attn.qkv.weight"] = linear(ours + "attn.qkv", rope_rows(c, qkv))
        if c.qkv_bias:
            bias = one(sa + "qkv_proj.bias") if fused else cat(sa + "q_proj.bias", sa + "k_proj.bias",
                                                               sa + "v_proj.bias")
            out[ours + "attn.qkv.bias"] = rope_rows(c, bias)
        out[ours + "attn.o_proj.weight"] = linear(ours + "attn.o_proj", one(sa + "o_proj.weight"))
        if c.o_bias:
            out[ours + "attn.o_proj.bias"] = one(sa + "o_proj.bias")
        if c.qk_norm:
            out[ours + "attn.q_norm.weight"] = norm(sa + "q_norm.weight")
            out[ours + "attn.k_norm.weight"] = norm(sa + "k_norm.weight")
        if c.plain_mlp:
            # (no GGUF file gives this MLP blocks: `quantized_parts` names none)
            for ours_name, theirs in (("fc", "c_fc"), ("proj", "c_proj")):
                out[f"{ours}mlp.{ours_name}.weight"] = one(f"{hf}mlp.{theirs}.weight")
                out[f"{ours}mlp.{ours_name}.bias"] = one(f"{hf}mlp.{theirs}.bias")
        elif c.moe is not None and c.moe.sparse(i):
            # (transformers >= 5 saves Mixtral's `block_sparse_moe` as `mlp`)
            block = next((hf + p + "." for p in (c.moe.prefix, "mlp") for r in MOE_ROUTERS
                          if hf + p + "." + r in left), hf + c.moe.prefix + ".")
            out.update(moe_weights(c.moe, block, ours + "mlp.", one, cat, left, linear))
        else:
            fused = hf + "mlp.gate_up_proj.weight" in left
            out[ours + "mlp.gate_up.weight"] = linear(ours + "mlp.gate_up", one(hf + "mlp.gate_up_proj.weight")
                                                      if fused else cat(hf + "mlp.gate_proj.weight",
                                                                        hf + "mlp.up_proj.weight"))
            out[ours + "mlp.down.weight"] = linear(ours + "mlp.down", one(hf + "mlp.down_proj.weight"))
        if c.pre_norms:
            out[ours + "input_norm.weight"] = norm(hf + "input_layernorm.weight")
        if c.layer_norm and c.layer_norm_bias:
            out[ours + "input_norm.bias"] = one(hf + "input_layernorm.bias")
            if c.mlp_norm:
                out[ours + "post_norm.bias"] = one(hf + "post_attention_layernorm.bias")
        if c.sandwich_norms:
            out[ours + "attn_out_norm.weight"] = norm(hf + "post_attention_layernorm.weight")
            if c.pre_norms:
                out[ours + "post_norm.weight"] = norm(hf + "pre_feedforward_layernorm.weight")
            out[ours + "mlp_out_norm.weight"] = norm(hf + "post_feedforward_layernorm.weight")
        elif c.mlp_norm:
            out[ours + "post_norm.weight"] = norm(hf + "post_attention_layernorm.weight")
    if c.tie_word_embeddings:
        left.pop("lm_head.weight", None)   # some tied checkpoints still ship a copy
    else:
        out["lm_head.weight"] = one("lm_head.weight")
        if c.lm_head_bias:
            out["lm_head.bias"] = one("lm_head.bias")
    unexpected = [k for k in left if not k.endswith("rotary_emb.inv_freq")]
    if unexpected:
        raise ValueError(f"unexpected tensors in checkpoint: {sorted(unexpected)[:8]}")
    return out


def renamed_weights(weights: MutableMapping[str, torch.Tensor], serving: bool, rename: Callable[[str], str],
                    convert: Callable[[str, torch.Tensor], torch.Tensor] = lambda name, t: t,
                    drop: tuple[str, ...] = ()) -> MutableMapping[str, torch.Tensor]:
    """A family's checkpoint names as the shared decoder reads them: each name `rename` changes
    renamed, its tensor through `convert(old_name, tensor)`, and names ending in `drop` (saved
    buffers) left out. In place when `serving` (that build empties the dict it was given as it
    loads, so no second dict holds the tensors), else in a copy (the caller's stays as it was)."""
    out = weights if serving else dict(weights)
    for name in list(out):
        if name.endswith(drop):
            del out[name]
        elif (new := rename(name)) != name:
            out[new] = convert(name, out.pop(name))
    return out


def rope_rows(c: DecoderConfig, qkv: torch.Tensor) -> torch.Tensor:
    """A fused q|k|v weight (or bias) with each q and k head's rows in the rotate-half layout
    where the checkpoint's RoPE rotates adjacent pairs (`interleaved_rope`): pair (2i, 2i+1)
    moves to (i, i + d/2), the dims rotate-half pairs with frequency i. q and k move alike, so
    q . k is unchanged; v stays."""
    if not c.interleaved_rope:
        return qkv
    d, heads = c.head_dim, c.num_heads + c.num_kv_heads
    order = torch.cat((torch.arange(0, d, 2), torch.arange(1, d, 2))).to(qkv.device)
    qk = qkv[:heads * d].reshape(heads, d, *qkv.shape[1:]).index_select(1, order)
    return torch.cat((qk.reshape(heads * d, *qkv.shape[1:]), qkv[heads * d:]))


def moe_weights(m: MoEConfig, block: str, ours: str, one: Callable, cat: Callable,
                left: Mapping[str, torch.Tensor],
                linear: Callable[[str, torch.Tensor], torch.Tensor] = lambda name, t: t) -> dict[str, torch.Tensor]:
    """One MoE block's tensors for layers.MoEMLP (`fuse_hf_weights`' helpers do the popping and
    checking): the router, the experts' gate|up and down stacked (each expert's written into
    its place), a shared expert's fused like a dense MLP. Stacked experts (a GGUF file's) go
    through `linear` as a layer linear's weight does (their blocks attached, `quantized_parts`)."""
    router = next((r for r in MOE_ROUTERS if block + r in left), MOE_ROUTERS[0])
    out = {ours + "router.weight": one(block + router)}
    stacked = next((pair for pair in MOE_STACKED if block + pair[0] in left), None)
    if stacked is not None:
        out[ours + "gate_up"] = linear(ours + "gate_up", one(block + stacked[0]))
        out[ours + "down"] = linear(ours + "down", one(block + stacked[1]))
    else:
        g, u, d = m.expert_names
        gate_up = down = None
        for x in range(m.num_experts):
            x_ = f"{block}experts.{x}."
            pair = cat(x_ + g + ".weight", x_ + u + ".weight")
            if gate_up is None:
                gate_up = pair.new_empty((m.num_experts, *pair.shape))
            gate_up[x] = pair
            del pair
            w = one(x_ + d + ".weight")
            if down is None:
                down = w.new_empty((m.num_experts, *w.shape))
            down[x] = w
            del w
        out[ours + "gate_up"], out[ours + "down"] = gate_up, down
    if m.shared_intermediate_size:
        s = block + "shared_expert."
        out[ours + "shared.gate_up.weight"] = cat(s + "gate_proj.weight", s + "up_proj.weight")
        out[ours + "shared.down.weight"] = one(s + "down_proj.weight")
        out[ours + "shared_gate.weight"] = one(block + "shared_expert_gate.weight")
    return out


def quantized_parts(c: DecoderConfig) -> dict[str, tuple[str, ...]]:
    """Each linear that can take GGUF blocks (`lm_head`, `layers.0.attn.qkv`, ...) -> the
    HF-named weights fused into it, in order."""
    parts = {"lm_head": ("model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight",)}
    for i in range(c.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        sa = hf + "self_attn."
        parts[ours + "attn.qkv"] = (sa + "q_proj.weight", sa + "k_proj.weight", sa + "v_proj.weight")
        parts[ours + "attn.o_proj"] = (sa + "o_proj.weight",)
        if (c.moe is None or not c.moe.sparse(i)) and not c.plain_mlp:
            parts[ours + "mlp.gate_up"] = (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight")
            parts[ours + "mlp.down"] = (hf + "mlp.down_proj.weight",)
        elif c.moe is not None:   # (a GGUF file's stacked experts: every expert's rows, one matrix)
            parts[ours + "mlp.gate_up"] = (hf + "mlp.experts.gate_up_proj",)
            parts[ours + "mlp.down"] = (hf + "mlp.experts.down_proj",)
    return parts


def fused_blocks(quantized: dict[str, QuantTensor], names: Sequence[str], take: bool = False) -> QuantTensor | None:
    """The blocks of HF-named `names` fused (rows concatenated); None when one of them is not
    quantized or their formats differ: the linear then always runs the fp32 matmul. `take`:
    the parts are popped from `quantized`."""
    parts = [quantized.pop(n, None) if take else quantized.get(n) for n in names]
    if any(p is None for p in parts):
        return None
    return parts[0] if len(parts) == 1 else QuantTensor.concat(parts)


def quantize_experts(name: str, mlp: MoEMLP, which: str, q: QuantTensor, weight: torch.Tensor,
                     release: bool) -> torch.Tensor:
    """Give an MoE layer's stacked experts (`which`: "gate_up" [E, 2I, H] or "down" [E, H, I],
    float32 `weight`) their GGUF blocks `q` (every expert's rows, one matrix), packed expert by
    expert (MoEMLP.quant); returns the weight it keeps: `weight`, or with `release` a meta tensor
    of its shape (the experts then compute from their blocks alone, layers.linear)."""
    e, rows, cols = weight.shape
    if (q.rows, q.cols) != (e * rows, cols):
        raise ValueError(f"quantized {name} is [{q.rows}, {q.cols}], its experts {list(weight.shape)}")
    mlp.quant[which] = [QuantTensor(q.data[x * rows:(x + 1) * rows], q.ggml_type, rows, cols).pack()
                        for x in range(e)]
    return torch.empty(weight.shape, device="meta") if release else weight


def quantize_linear(name: str, module: Linear, q: QuantTensor | None, weight: torch.Tensor, bf16: bool,
                    release: bool) -> torch.Tensor:
    """Give the layer linear `module` (`name`), whose float32 weight is `weight`, its GGUF blocks `q`
    (None: a GGUF type no kernel of ours reads) and, with `bf16`, a bfloat16 copy of the weight
    (layers.Linear.bf16_weight); returns the weight it keeps: `weight`, or with `bf16` and
    `release` a meta tensor of its shape (no runner step reads it; `layers.linear` then
    computes on the bf16 copy outside runner steps too)."""
    if q is not None and (q.rows, q.cols) != tuple(weight.shape):
        raise ValueError(f"quantized {name} is [{q.rows}, {q.cols}], its weight {list(weight.shape)}")
    module.quant = q.pack() if q is not None else None
    # (detached: a copy made with grad would keep the fp32 weight alive in its graph)
    module.bf16_weight = pack_bf16(weight.detach().to(torch.bfloat16)) if bf16 else None
    return torch.empty(weight.shape, device="meta") if bf16 and release else weight
