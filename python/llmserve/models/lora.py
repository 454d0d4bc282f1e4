"""LoRA adapters in PEFT's format, served beside the base model: each sequence of a step runs
through its own adapter (or none), all in one batch.

Vocabulary: `load_adapter` reads a PEFT folder into an `Adapter`; `compose` makes its weights
for our linears and `install` puts them on the model under an index (0 is the base model),
`remove` takes them off; `attach` installs a list at start (adapter i of the list is index
i + 1). The runner calls `set_step` before each forward with each token's index
(`token_adapters` makes them from the plan), and `set_step(None)` after. Adapters loaded at
runtime (engine/adapters.py) take fresh indices; an unloaded one is removed once no request
holds it.

How a linear applies them (layers.Linear.forward, after `linear()` returns, so on every path
of it): for the rows of adapter a, y[rows] += (x[rows] @ A_a^T) @ B_a^T, the scaling
(lora_alpha / r, or / sqrt(r) with `use_rslora`) folded into B_a at load. The step's tokens are
grouped by adapter once per step (`set_step`), not once per linear; a step whose tokens all use
one adapter adds the delta to every row without indexing. Without adapters a linear pays one
attribute test (`Linear.lora is None`); a model with adapters attached pays one global read per
linear in a step without any.

Fused linears: our model holds q|k|v as one `attn.qkv` and gate|up as one `mlp.gate_up`
(llama.fuse_hf_weights). An adapter's q, k and v LoRAs become one A = [A_q; A_k; A_v]
[r_q + r_k + r_v, in] and a block-diagonal B [q + 2 kv, r_q + r_k + r_v] (B_q in the q rows
and A_q's columns, ...; zeros where a part is not targeted), so one pair of matmuls serves the
fused linear; B's rows then get the fused weight's row order (llama.rope_rows: Cohere's
interleaved RoPE). Phi-3's natively fused `qkv_proj` and `gate_up_proj` LoRAs are taken as they
are. Rows stay row-stable as the base linears are: the two matmuls go through `linear()`, so
row by row with --batch-invariant, padded in prompt steps and quantized decode steps on CPU
(layers._dense_linear).

Targets: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, and on Phi-3
(checkpoints fused natively) qkv_proj, o_proj, gate_up_proj, down_proj, in the decoder layers
(`model.layers.N.self_attn.*`, `model.layers.N.mlp.*`). Everything else is refused with a
`LoraError` naming the adapter: embed_tokens and lm_head, MoE experts, projections under
other names (GPT-2's c_attn, GPT-NeoX's query_key_value, Phi-2's dense/fc1/fc2), DoRA,
modules_to_save, LoRA biases, fan_in_fan_out, rank/alpha patterns, layers_to_transform, and
tensors of another shape than the base model's (an adapter made for another hidden size says
so).

A GGUF base whose linears hold quantized blocks is served too: the delta is added to what the
quantized GEMV returns, and a step with adapter rows does not take the Rust layer stack of
few-token decode steps (models/cpu_decoder.py), which never calls Linear.forward
(`step_active`); base-model steps still do, and so do the base rows of a decode step that mixes
them with adapter rows (the runner runs it in two parts: worker/runner.py, ModelRunner._parts).
In those steps the delta's matmuls are padded as a prompt step's are (worker/threads.py:
pads_small_gemms), so an adapter row's bits do not depend on how many share its step. Its Q/K
rows are in HF's order (the loader un-permutes llama.cpp's), as the adapters' are.

NOTE: the step's grouping is module state (`set_step`), read by every adapted linear while the
forward runs on the runner's thread. A CUDA graph holds no Python: one captured without
adapter rows replays none, so on CUDA steps with adapter rows run eagerly (DecodeGraphs
.padded_size) and the others replay graphs. Pass
`set_step` the CPU tensor `token_adapters` returns: it groups on the host (a device tensor is
copied back, a sync) and moves each group's row indices to the model's device once.

bf16 models compute the delta in bf16 (x A^T, then its product with B^T, then the add, each
rounded), as PEFT does unmerged: about as far from float32 as transformers' bf16 model with
the adapter merged (tests/parity/test_lora_vs_transformers.py).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from llmserve.models.layers import Linear, QKVLinear, linear


class LoraError(ValueError):
    """An adapter that cannot be served; the message names the adapter and what is unsupported."""


# HF module name in a decoder layer -> (our linear in the layer, its part of a fused linear, or
# None: the whole linear).
_SPLIT = {"self_attn.q_proj": ("attn.qkv", 0), "self_attn.k_proj": ("attn.qkv", 1),
          "self_attn.v_proj": ("attn.qkv", 2), "self_attn.o_proj": ("attn.o_proj", None),
          "mlp.gate_proj": ("mlp.gate_up", 0), "mlp.up_proj": ("mlp.gate_up", 1),
          "mlp.down_proj": ("mlp.down", None)}
_FUSED = {"self_attn.qkv_proj": ("attn.qkv", None), "self_attn.o_proj": ("attn.o_proj", None),
          "mlp.gate_up_proj": ("mlp.gate_up", None), "mlp.down_proj": ("mlp.down", None)}
# Families whose checkpoints (and so whose PEFT modules) hold q|k|v and gate|up fused.
_FUSED_NATIVE = {"Phi3ForCausalLM"}

# base_model.model.model.layers.3.self_attn.q_proj.lora_A[.default].weight
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.((?:self_attn|mlp)\.\w+)"
                  r"\.lora_([AB])(?:\.([\w-]+))?\.weight$")


@dataclass
class Adapter:
    """A loaded PEFT LoRA adapter: float32 CPU tensors by (layer, HF module name)."""
    name: str
    path: str
    rank: int
    scaling: float                      # lora_alpha / r (or / sqrt(r) with use_rslora)
    # (layer, "self_attn.q_proj") -> (A [r, in], B [out, r] already multiplied by `scaling`)
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False, default_factory=dict)


def _modules(hf_config: dict) -> dict[str, tuple[str, int | None]]:
    archs = hf_config.get("architectures") or []
    return _FUSED if archs and archs[0] in _FUSED_NATIVE else _SPLIT


def _shapes(hf_config: dict) -> dict[str, tuple[int, int]]:
    """Each supported HF module's [out, in] in this config (as DecoderConfig.from_hf reads it)."""
    h, heads = hf_config["hidden_size"], hf_config["num_attention_heads"]
    d = hf_config.get("head_dim") or h // heads
    q, kv = heads * d, (hf_config.get("num_key_value_heads") or heads) * d
    i = hf_config["intermediate_size"]
    return {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
            "self_attn.qkv_proj": (q + 2 * kv, h), "self_attn.o_proj": (h, q),
            "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.gate_up_proj": (2 * i, h), "mlp.down_proj": (h, i)}


def _check_config(name: str, cfg: dict) -> None:
    def refuse(what: str) -> None:
        raise LoraError(f"LoRA adapter {name!r}: {what} is not supported")

    if cfg.get("peft_type", "LORA") != "LORA":
        refuse(f"peft_type {cfg['peft_type']!r} (only LORA)")
    if cfg.get("use_dora"):
        refuse("DoRA (use_dora)")
    if cfg.get("modules_to_save"):
        refuse(f"modules_to_save {cfg['modules_to_save']}")
    if cfg.get("bias", "none") != "none":
        refuse(f"bias {cfg['bias']!r} (only 'none')")
    if cfg.get("lora_bias"):
        refuse("lora_bias")
    if cfg.get("fan_in_fan_out"):
        refuse("fan_in_fan_out")
    for key in ("rank_pattern", "alpha_pattern", "target_parameters"):
        if cfg.get(key):
            refuse(f"{key} {cfg[key]}")
    for key in ("layers_to_transform", "layer_replication"):
        if cfg.get(key) is not None:
            refuse(f"{key} {cfg[key]}")
    if not isinstance(cfg.get("r"), int) or cfg["r"] <= 0:
        raise LoraError(f"LoRA adapter {name!r}: adapter_config.json needs a positive integer r, not {cfg.get('r')!r}")


def load_adapter(name: str, path: str, hf_config: dict) -> Adapter:
    """Reads a PEFT LoRA folder (adapter_config.json + adapter_model.safetensors; a pickled
    adapter_model.bin is refused) for the base model of `hf_config` (its config.json dict)."""
    from safetensors import safe_open

    from llmserve.models.registry import normalize_config

    folder = Path(path)
    config_file, tensors_file = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not config_file.is_file():
        raise LoraError(f"LoRA adapter {name!r}: no adapter_config.json in {path}")
    if not tensors_file.is_file():
        if (folder / "adapter_model.bin").is_file():
            raise LoraError(f"LoRA adapter {name!r}: adapter_model.bin (a pickle) is not loaded; convert it to "
                            f"adapter_model.safetensors")
        raise LoraError(f"LoRA adapter {name!r}: no adapter_model.safetensors in {path}")
    try:
        cfg = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise LoraError(f"LoRA adapter {name!r}: {config_file} is not readable JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise LoraError(f"LoRA adapter {name!r}: {config_file} holds {type(cfg).__name__}, not a JSON object")
    _check_config(name, cfg)
    hf_config = normalize_config(hf_config)
    r, alpha = cfg["r"], cfg.get("lora_alpha", cfg["r"])
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise LoraError(f"LoRA adapter {name!r}: lora_alpha must be a number, not {alpha!r}")
    rslora = cfg.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise LoraError(f"LoRA adapter {name!r}: use_rslora must be true or false, not {rslora!r}")
    scaling = float(alpha) / math.sqrt(r) if rslora else float(alpha) / r
    modules, shapes = _modules(hf_config), _shapes(hf_config)
    supported = sorted({m.split(".")[1] for m in modules})
    targets = cfg.get("target_modules")
    if not (targets is None or isinstance(targets, str)
            or (isinstance(targets, list) and all(isinstance(t, str) for t in targets))):
        raise LoraError(f"LoRA adapter {name!r}: target_modules must be a string or a list of strings, "
                        f"not {targets!r}")
    if isinstance(targets, list):
        for t in targets:
            short = t.rsplit(".", 1)[-1]
            if short not in supported:
                where = ("absent from this model" if short in {m.split(".")[1] for m in _SPLIT | _FUSED}
                         else "not supported")
                raise LoraError(f"LoRA adapter {name!r}: target module {t!r} is {where} "
                                f"(this model's LoRA targets: {', '.join(supported)})")

    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    infixes = set()
    try:
        tensors = safe_open(str(tensors_file), "pt")
    except Exception as exc:   # (safetensors raises its own SafetensorError, an Exception)
        raise LoraError(f"LoRA adapter {name!r}: {tensors_file} is not a readable safetensors file "
                        f"({exc})") from None
    with tensors as f:
        for key in f.keys():
            m = _KEY.match(key)
            if m is None or m.group(2) not in modules:
                what = (" (an MoE expert's)" if ".experts." in key else
                        " (DoRA's magnitude)" if "lora_magnitude" in key else "")
                raise LoraError(f"LoRA adapter {name!r}: tensor {key!r}{what} is not supported "
                                f"(this model's LoRA targets: {', '.join(supported)} in its decoder layers)")
            layer, module, ab, infix = int(m.group(1)), m.group(2), m.group(3), m.group(4)
            infixes.add(infix)
            if layer >= hf_config["num_hidden_layers"]:
                raise LoraError(f"LoRA adapter {name!r}: {key} is for layer {layer}; the model has "
                                f"{hf_config['num_hidden_layers']}")
            t = f.get_tensor(key).float()
            if not torch.isfinite(t).all():
                raise LoraError(f"LoRA adapter {name!r}: {key} holds NaN or infinite values")
            parts.setdefault((layer, module), {})[ab] = t
    if len(infixes) > 1:
        raise LoraError(f"LoRA adapter {name!r}: its tensors hold several adapters ({sorted(map(str, infixes))})")
    if not parts:
        raise LoraError(f"LoRA adapter {name!r}: adapter_model.safetensors holds no LoRA tensors")

    weights = {}
    for (layer, module), ab in sorted(parts.items()):
        where = f"layers.{layer}.{module}"
        if set(ab) != {"A", "B"}:
            raise LoraError(f"LoRA adapter {name!r}: {where} has lora_{''.join(ab)} without its pair")
        a, b = ab["A"], ab["B"]
        out, inp = shapes[module]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != r or b.shape[1] != r:
            raise LoraError(f"LoRA adapter {name!r}: {where} lora_A {list(a.shape)} / lora_B {list(b.shape)} "
                            f"are not of rank r={r}")
        if inp == hf_config["hidden_size"] and a.shape[1] != inp:
            raise LoraError(f"LoRA adapter {name!r} was made for a model of hidden size {a.shape[1]} "
                            f"({where} lora_A is {list(a.shape)}); this model's hidden size is {inp}")
        if (b.shape[0], a.shape[1]) != (out, inp):
            raise LoraError(f"LoRA adapter {name!r}: {where} is [{b.shape[0]}, {a.shape[1]}] "
                            f"(lora_B rows x lora_A columns); the base model's is [{out}, {inp}]")
        weights[(layer, module)] = (a.contiguous(), (b * scaling).contiguous())
    return Adapter(name=name, path=str(path), rank=r, scaling=scaling, weights=weights)


class LoraWeights:
    """One linear's adapters: `pairs[i]` = (A [r, in], B [out, r]) of adapter index i, for
    the adapters that target this linear."""

    def __init__(self, pairs: dict[int, tuple[torch.Tensor, torch.Tensor]]):
        self.pairs = pairs

    def add(self, x: torch.Tensor, y: torch.Tensor, row_invariant: bool) -> torch.Tensor:
        """y [T, out] += each row's delta (x [T, in]); in place."""
        groups = _step.groups
        if groups is None:
            return y
        for index, rows in groups:
            pair = self.pairs.get(index)
            if pair is None:
                continue
            a, b = pair
            if rows is None:   # (every token of the step: no gather, no scatter)
                y += linear(linear(x, a, None, None, row_invariant), b, None, None, row_invariant)
            else:
                xs = x.index_select(0, rows)
                y.index_add_(0, rows, linear(linear(xs, a, None, None, row_invariant), b, None, None,
                                             row_invariant))
        return y


class _Step:
    """The current step's tokens grouped by adapter: ((index, rows [n] int64 on the model's
    device, or None: all of the step's tokens), ...) for each index > 0 present; None: no
    adapter in this step."""
    groups: tuple[tuple[int, torch.Tensor | None], ...] | None = None


_step = _Step()


def _compose(c, module: Linear, parts: dict[int | None, tuple[torch.Tensor, torch.Tensor]],
             sizes: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One adapter's (A, B) for our linear `module` from its HF parts: part None, the whole
    linear; else part k of a fused linear whose parts have `sizes` output rows (block-diagonal B)."""
    if None in parts:
        a, b = parts[None]
    else:
        present = sorted(parts)
        a = torch.cat([parts[k][0] for k in present])
        b = a.new_zeros(sum(sizes), a.shape[0])
        offsets = np.cumsum([0, *sizes])
        col = 0
        for k in present:
            pb = parts[k][1]
            b[offsets[k]:offsets[k + 1], col:col + pb.shape[1]] = pb
            col += pb.shape[1]
    if isinstance(module, QKVLinear):
        from llmserve.models.llama import rope_rows
        b = rope_rows(c, b)   # (the fused weight's row order)
    return a, b


def compose(model, adapter: Adapter, dtype: torch.dtype, device) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The adapter's (A, B) for each of our linears it targets ("layers.3.attn.qkv"), in
    `dtype` on `device`: what `install` puts on the model. Changes nothing; raises LoraError
    for a target that is not a plain linear here."""
    grouped: dict[str, dict[int | None, tuple[torch.Tensor, torch.Tensor]]] = {}
    theirs: dict[str, list[str]] = {}   # (the adapter's module names, for messages)
    for (layer, module), pair in adapter.weights.items():
        ours, part = _SPLIT.get(module) or _FUSED[module]
        grouped.setdefault(f"layers.{layer}.{ours}", {})[part] = pair
        theirs.setdefault(f"layers.{layer}.{ours}", []).append(f"layers.{layer}.{module}")
    c, out = model.config, {}
    for ours, parts in grouped.items():
        try:
            target = model.get_submodule(ours)
        except AttributeError:
            target = None
        if not isinstance(target, Linear):
            raise LoraError(f"LoRA adapter {adapter.name!r}: this model's {', '.join(sorted(theirs[ours]))} "
                            f"{'is' if len(theirs[ours]) == 1 else 'are'} not a plain linear here (an MoE "
                            f"layer's experts, or an MLP of other projections): not supported")
        if isinstance(target, QKVLinear):
            sizes = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim)
        elif ours.endswith(".gate_up"):   # (a GateUpMLP's: an MoE block's is no Linear)
            sizes = (target.out_features // 2,) * 2
        else:
            sizes = (target.out_features,)
        a, b = _compose(c, target, parts, sizes)
        if (b.shape[0], a.shape[1]) != (target.out_features, target.in_features):
            raise LoraError(f"LoRA adapter {adapter.name!r}: {ours} would be [{b.shape[0]}, {a.shape[1]}], "
                            f"the model's is [{target.out_features}, {target.in_features}]")
        out[ours] = (a.to(device=device, dtype=dtype).contiguous(), b.to(device=device, dtype=dtype).contiguous())
    return out


def install(model, index: int, adapter: Adapter, composed: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Puts an adapter's `compose`d weights on the model under `index` (> 0, not installed).
    Safe while the model runs steps that do not name `index`: each linear gains a key, and
    the index is served once it is in `model.lora_adapters` ({index: Adapter}), set last,
    which also tells a runner to call `set_step`."""
    adapters = dict(getattr(model, "lora_adapters", None) or {})
    if index <= 0 or index in adapters:
        raise ValueError(f"LoRA index {index} is taken or invalid")
    for ours, pair in composed.items():
        module = model.get_submodule(ours)
        if module.lora is None:
            module.lora = LoraWeights({})
        module.lora.pairs[index] = pair
    if composed:
        model.lora_device = next(iter(composed.values()))[0].device   # (where set_step puts row indices)
    adapters[index] = adapter
    model.lora_adapters = adapters


def remove(model, index: int) -> None:
    """Frees the weights of adapter `index`: call it when no step to come names it. (Each
    linear keeps its LoraWeights, emptied, so a step running meanwhile never reads None.)"""
    adapters = dict(getattr(model, "lora_adapters", None) or {})
    adapters.pop(index, None)
    model.lora_adapters = adapters
    for m in model.modules():
        if isinstance(m, Linear) and m.lora is not None:
            m.lora.pairs.pop(index, None)


def attach(model, adapters: list[Adapter], dtype: torch.dtype, device) -> None:
    """Installs the adapters on the model's linears; adapter i (0-based in the list) is index
    i + 1 in a step; index 0 = the base model. Replaces any adapters attached before."""
    composed = [compose(model, adapter, dtype, device) for adapter in adapters]   # (all checked first)
    for m in model.modules():
        if isinstance(m, Linear):
            m.lora = None
    model.lora_adapters = {}
    _step.groups = None
    for i, (adapter, weights) in enumerate(zip(adapters, composed), start=1):
        install(model, i, adapter, weights)


def set_step(token_adapters: torch.Tensor | None, model=None) -> None:
    """[T] int64 adapter index per token of the step about to run on `model` (0: base); None:
    no adapter in this step. Called by the runner before each forward (and with None after)."""
    if token_adapters is None:
        _step.groups = None
        return
    ids = token_adapters.to("cpu", torch.int64)
    present = torch.unique(ids).tolist()
    adapters = [i for i in present if i]
    installed = getattr(model, "lora_adapters", None) or {}
    if any(i not in installed for i in adapters) or (present and present[0] < 0):
        raise ValueError(f"adapter indices {present}: only {sorted(installed)} are installed")
    device = getattr(model, "lora_device", torch.device("cpu"))
    if not adapters:
        _step.groups = None
    elif len(present) == 1:
        _step.groups = ((adapters[0], None),)
    else:
        _step.groups = tuple((i, torch.nonzero(ids == i).squeeze(1).to(device)) for i in adapters)


def step_active() -> bool:
    """Whether the step about to run has tokens through an adapter (`set_step`)."""
    return _step.groups is not None


def token_adapters(query_start_loc: Sequence[int], seq_adapters: Sequence[int]) -> torch.Tensor | None:
    """Per-token indices from the plan's per-sequence adapter indices ([S+1] prefix sums, [S]
    indices); None when all are 0."""
    ids = np.asarray(seq_adapters, dtype=np.int64)
    if not ids.any():
        return None
    starts = np.asarray(query_start_loc, dtype=np.int64)
    if starts.shape != (ids.shape[0] + 1,):
        raise ValueError(f"query_start_loc has {starts.shape[0]} entries for {ids.shape[0]} sequences")
    return torch.from_numpy(np.repeat(ids, np.diff(starts)))
