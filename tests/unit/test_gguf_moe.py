"""Mixture-of-experts GGUF files (llama.cpp's `qwen2moe`, `qwen3moe`, and `llama` files with
experts: Mixtral), written here as llama.cpp's converter writes them: names from the gguf
package's own tensor map, each layer's experts stacked [E, I, H] as ffn_gate_exps /
ffn_up_exps / ffn_down_exps, Q/K rows permuted in llama files, Qwen2-MoE's shared expert gate
as a vector, the expert counts and sizes as metadata keys (and nothing for what llama.cpp
hard-codes: Qwen3-MoE's renormalized top-k weights).

Checked: our model loaded from the file computes the logits of our model loaded from the HF
tensors the file holds (F32: the model's own; Q8_0: the gguf package's dequantization of the
blocks); and for qwen2moe and qwen3moe, transformers' own GGUF loading (its config parser, name
map and expert stacking) gives a model with the same logits. transformers reads a `llama` file
as a dense Llama, so Mixtral files have no such reference."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from _plans import Paged
from tiny import write_gguf_shape, write_gguf_vocab

from llmserve.loaders import LoadError, load_checkpoint
from llmserve.models import build_model
from llmserve.worker import ModelRunner

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

COMMON = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=10000.0,
              bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
# family -> (transformers config, model class, GGUF arch, config fields). The Qwen experts'
# sizes are transformers' defaults: its GGUF config parser reads no expert size key, so its
# model from one of these files has the right shape only then.
FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", "llama", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", "qwen2moe", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=1408, shared_expert_intermediate_size=5632)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", "qwen3moe", dict(
        head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=768, norm_topk_prob=True)),
    # a dense layer (mlp_only_layers) after a sparse one, experts of a size of its own (a file
    # llama.cpp's converter would not write: its qwen2moe layers are all sparse)
    "qwen2_moe_dense": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", "qwen2moe", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
        mlp_only_layers=[1])),
}
SPECIALS = ["<unk>", "<s>", "</s>", "<|im_end|>"]
TOKENS = [1, 5, 9, 17, 33, 40, 2, 7, 61, 12, 12, 30]


def tiny_moe(family: str):
    config_name, model_name, _, extra = FAMILIES[family]
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(getattr(transformers, config_name)(**COMMON, **extra)).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.2 * noise if "norm" in name else 0.1 * noise)
    return model


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """convert_hf_to_gguf's Q/K row permutation of llama files (rotate-half -> adjacent pairs)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_moe_gguf(path: Path, family: str, model, quant: str = "F32") -> dict[str, torch.Tensor]:
    """The GGUF file llama.cpp's converter writes of `model`, its matrices and experts in `quant`
    (F32 or Q8_0), vectors in F32; returns the HF tensors the file holds (Q8_0: the gguf
    package's dequantization of the blocks), transformers 5's stacked experts included."""
    cfg, arch = model.config, FAMILIES[family][2]
    w = gguf.GGUFWriter(str(path), arch)
    write_gguf_shape(w, cfg, cfg.rope_parameters["rope_theta"])
    w.add_rope_dimension_count(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    w.add_vocab_size(cfg.vocab_size)
    w.add_expert_count(getattr(cfg, "num_experts", None) or cfg.num_local_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if arch != "llama":
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    write_gguf_vocab(w, SPECIALS, cfg.vocab_size, "qwen2")
    w.add_add_bos_token(False)

    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.upper()), cfg.num_hidden_layers)
    # (llama.cpp's qwen2moe has no dense MLP tensors: a dense layer gets the names llama files use)
    dense_names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    qtype = getattr(gguf.GGMLQuantizationType, quant)
    held = {}
    for hf, tensor in model.state_dict().items():
        data = tensor.float().numpy()
        parts = {hf: data}
        if hf.endswith(".experts.gate_up_proj"):   # (llama.cpp's converter takes each expert's gate, up apart)
            i = data.shape[1] // 2
            base = hf.removesuffix("gate_up_proj")
            parts = {base + "gate_proj": data[:, :i], base + "up_proj": data[:, i:]}
        values = []
        for name, part in parts.items():
            # (the converter names each stacked expert tensor `...experts.gate_proj.weight`)
            suffixed = name if name.endswith((".weight", ".bias")) else name + ".weight"
            gguf_name = (names.get_name(suffixed, try_suffixes=(".weight", ".bias"))
                         or dense_names.get_name(suffixed, try_suffixes=(".weight", ".bias")))
            assert gguf_name is not None, name
            stored = part
            if arch == "llama" and ".q_proj." in name:
                stored = llama_cpp_permute(part, cfg.num_attention_heads)
            elif arch == "llama" and ".k_proj." in name:
                stored = llama_cpp_permute(part, cfg.num_key_value_heads)
            if name.endswith("shared_expert_gate.weight"):
                stored = part.reshape(-1)   # (llama.cpp's is a vector)
            if stored.ndim >= 2 and qtype != gguf.GGMLQuantizationType.F32:
                blocks = gguf.quants.quantize(np.ascontiguousarray(stored), qtype)
                w.add_tensor(gguf_name, blocks, raw_dtype=qtype)
                # (blocks run along rows, so the permuted rows' values are the rows' values permuted)
                part = gguf.quants.dequantize(gguf.quants.quantize(np.ascontiguousarray(part), qtype), qtype)
            else:
                w.add_tensor(gguf_name, np.ascontiguousarray(stored))
            values.append(torch.from_numpy(np.array(part, dtype=np.float32)))
        held[hf] = values[0] if len(values) == 1 else torch.cat(values, dim=1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


def our_logits(model, tokens: list[int] = TOKENS) -> torch.Tensor:
    runner = ModelRunner(model, num_blocks=16, block_size=4, dtype=torch.float32, device="cpu")
    paged = Paged(16, 4)
    paged.add(0, tokens)
    with torch.inference_mode():
        return runner.model.compute_logits(runner.run_model(paged.step({0: len(tokens)})))


@pytest.fixture(scope="module")
def moe_file(request, tmp_path_factory):
    family, quant = request.param
    model = tiny_moe(family)
    path = tmp_path_factory.mktemp(family) / f"{family}.{quant}.gguf"
    held = write_moe_gguf(path, family, model, quant)
    return path, model, family, quant, held


CASES = [(f, q) for f in FAMILIES for q in ("F32", "Q8_0")]


@pytest.mark.parametrize("moe_file", CASES, indirect=True, ids=[f"{f}-{q}" for f, q in CASES])
def test_the_gguf_model_is_the_hf_model_of_its_tensors(moe_file):
    path, model, family, quant, held = moe_file
    ckpt = load_checkpoint(str(path))
    c = ckpt.hf_config
    assert c["architectures"] == [FAMILIES[family][1]]
    assert c["num_experts_per_tok"] == 2
    if family != "mixtral":
        assert (c["num_experts"], c["moe_intermediate_size"]) == (4, model.config.moe_intermediate_size)
        assert c["norm_topk_prob"] is (family == "qwen3_moe")   # (what llama.cpp hard-codes)
        assert c["mlp_only_layers"] == list(getattr(model.config, "mlp_only_layers", []))
    else:
        assert (c["num_local_experts"], c["intermediate_size"]) == (4, 96)
    if family.startswith("qwen2_moe"):
        assert c["shared_expert_intermediate_size"] == model.config.shared_expert_intermediate_size

    # the checkpoint holds the file's values under the HF names (experts stacked gate|up)
    assert set(ckpt.weights) == set(held)
    for name, want in held.items():
        assert torch.equal(ckpt.weights[name], want), name
        index = np.random.default_rng(0).integers(0, want.numel(), 50)   # (rows read alone)
        assert torch.equal(ckpt.weights.sample(name, index), want.reshape(-1)[torch.from_numpy(index)]), name

    ours = our_logits(build_model(c, ckpt.weights, torch.float32, "cpu"))
    # our model from the HF config and the tensors the file holds
    hf = our_logits(build_model(model.config.to_dict() | {"architectures": [FAMILIES[family][1]]}, held,
                                torch.float32, "cpu"))
    torch.testing.assert_close(ours, hf, atol=1e-5, rtol=0)
    if quant == "F32":   # (and transformers' model, whose tensors these are)
        with torch.no_grad():
            theirs = model(torch.tensor([TOKENS])).logits[0]
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


TRANSFORMERS_CASES = [(f, q) for f in ("qwen2_moe", "qwen3_moe") for q in ("F32", "Q8_0")]


@pytest.mark.parametrize("moe_file", TRANSFORMERS_CASES, indirect=True,
                         ids=[f"{f}-{q}" for f, q in TRANSFORMERS_CASES])
def test_transformers_reads_the_file_as_we_do(moe_file):
    """transformers' own reading of the file (what from_pretrained(gguf_file=...) does, without
    accelerate): its config, its tensors (gate and up experts stacked its way, the shared gate
    reshaped) and its model's logits."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path, model, family, _, held = moe_file
    config = transformers.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    ckpt = load_checkpoint(str(path))
    for key in ("num_experts", "num_experts_per_tok", "norm_topk_prob", "moe_intermediate_size"):
        assert getattr(config, key) == ckpt.hf_config[key], key
    ref = type(model)(config).eval()
    theirs = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=ref)["tensors"]
    assert set(theirs) == set(held)
    for name, tensor in theirs.items():
        torch.testing.assert_close(ckpt.weights[name], torch.as_tensor(tensor).float(), atol=0, rtol=0, msg=name)
    ref.load_state_dict({k: torch.as_tensor(v) for k, v in theirs.items()}, strict=True)
    with torch.no_grad():
        want = ref(torch.tensor([TOKENS])).logits[0]
    ours = our_logits(build_model(ckpt.hf_config, ckpt.weights, torch.float32, "cpu"))
    torch.testing.assert_close(ours, want, atol=1e-4, rtol=0)


def test_a_q8_0_moe_file_serves_its_weights(tmp_path):
    """Through the engine (its weight samples, the quantized decode of the attention, the experts
    dequantized): greedy tokens are transformers' on the file's values."""
    from llmserve.engine.offline import LLM

    model = tiny_moe("qwen2_moe")
    path = tmp_path / "qwen2moe.Q8_0.gguf"
    held = write_moe_gguf(path, "qwen2_moe", model, "Q8_0")
    model.load_state_dict(held)
    llm = LLM(str(path), threads=1, max_model_len=64, num_kv_blocks=32, block_size=4)
    got = llm.generate([TOKENS], {"max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True})
    with torch.no_grad():
        ref = model.generate(torch.tensor([TOKENS]), max_new_tokens=8, do_sample=False,
                             attention_mask=torch.ones(1, len(TOKENS), dtype=torch.long))
    assert got[0].body["choices"][0]["token_ids"] == ref[0, len(TOKENS):].tolist()


@pytest.mark.parametrize("quant,served_as", [("Q8_0", "Q8_0"), ("Q4_0", "Q4_0"), ("Q4_1", "Q4_1"), ("Q5_0", "Q8_0")])
def test_served_experts_are_the_files_blocks(quant, served_as, tmp_path):
    """A served MoE GGUF model holds its experts as the file's blocks only (Q5_0 converted to
    Q8_0, as a linear's are), packed expert by expert, their float32 stacks released. In a
    prompt step each expert computes the float32 of its blocks: an MoE layer gives the float
    model's bits; decode steps of any size run the quantized GEMV (int8 activations), within its
    error, a row computing the same in a 3- or a 30-row step. The
    whole model, every linear on its blocks (outside a runner's steps), is within the GEMV's
    error of the float model of the same values, where a mistake in the blocks' layout (gate
    and up swapped) is off by about the logits' own size."""
    from llmserve.engine.build import build_engine
    from llmserve.engine.offline import make_config
    from llmserve.loaders.gguf_convert import type_name
    from llmserve.worker.threads import cpu_step

    model = tiny_moe("qwen3_moe")
    path = tmp_path / f"qwen3moe.{quant}.gguf"
    write_moe_gguf(path, "qwen3_moe", model, quant)
    served = build_engine(make_config(str(path), threads=1, max_model_len=64, num_kv_blocks=32, block_size=4))
    ours = served.runner.model
    for layer in ours.layers:
        mlp = layer.mlp
        assert mlp.gate_up.is_meta and mlp.down.is_meta
        assert [(len(q), type_name(q[0].ggml_type), q[0].rows, q[0].cols) for q in mlp.quant.values()] == [
            (4, served_as, 2 * 768, 64), (4, served_as, 64, 768)]
    # (the float model of the values served: the converted blocks' for Q5_0)
    ckpt = load_checkpoint(str(path), quantized_decode=True)
    ref_model = build_model(ckpt.hf_config, ckpt.weights, torch.float32, "cpu")
    runners = [ModelRunner(m, num_blocks=16, block_size=4, dtype=torch.float32, device="cpu")
               for m in (ours, ref_model)]
    pages = [Paged(16, 4), Paged(16, 4)]
    got, want = [], []
    for tokens in ([TOKENS], [[23]], [[44]]):   # (the prompt, then two decode steps)
        for runner, paged, out in zip(runners, pages, (got, want)):
            if len(tokens[0]) > 1:
                paged.add(0, tokens[0])
            else:
                paged.append(0, tokens[0][0])
            with torch.inference_mode():   # (outside a runner step: every linear of <= 24 rows reads blocks)
                out.append(runner.model.compute_logits(runner.run_model(paged.step({0: len(tokens[0])}))))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=0.15, rtol=0)
    # each MoE layer alone: a prompt step's experts compute the float model's bits, a decode
    # step's run the GEMV (not a float copy)
    x = torch.randn(12, 64, generator=torch.Generator().manual_seed(3))
    for ours_layer, ref_layer in zip(ours.layers, ref_model.layers):
        with torch.inference_mode():
            with cpu_step(True, False):
                assert torch.equal(ours_layer.mlp(x), ref_layer.mlp(x))
            with cpu_step(False, True):
                mine, theirs = ours_layer.mlp(x[:3]), ref_layer.mlp(x[:3])
            # (a decode step past the GEMV's few tokens: the released experts still run it, and
            # a row computes as it would in a small step)
            with cpu_step(False, False):
                big = ours_layer.mlp(torch.cat([x[:3]] * 10))
        torch.testing.assert_close(mine, theirs, atol=0.05, rtol=0)
        assert not torch.equal(mine, theirs)
        assert torch.equal(big[:3], mine)


def _rewrite(src: Path, dst: Path, rename=None, drop=(), keys=None) -> None:
    """`src` copied to `dst` with tensors renamed (`rename(name)`), some dropped, keys added."""
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch)
    for field in reader.fields.values():
        if field.name.startswith(("GGUF.", "general.architecture")):
            continue
        w.add_key_value(field.name, field.contents(), field.types[0],
                        field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None)
    for key, value in (keys or {}).items():
        w.add_uint32(key, value)
    for t in reader.tensors:
        if t.name in drop:
            continue
        w.add_tensor((rename or str)(t.name), np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_what_we_refuse_is_named(tmp_path):
    src = tmp_path / "mixtral.gguf"
    write_moe_gguf(src, "mixtral", tiny_moe("mixtral"))
    # llama.cpp's first Mixtral files held each expert apart
    old = tmp_path / "old.gguf"
    _rewrite(src, old, rename=lambda n: n.replace("ffn_gate_exps", "ffn_gate.0"))
    with pytest.raises(LoadError, match=r"'blk.0.ffn_gate.0.weight' is one expert's.*convert the model again"):
        load_checkpoint(str(old))
    half = tmp_path / "half.gguf"
    _rewrite(src, half, drop={"blk.1.ffn_up_exps.weight"})
    with pytest.raises(LoadError, match="GGUF layer 1 has ffn_gate_exps but no ffn_up_exps"):
        load_checkpoint(str(half))
    shared = tmp_path / "shared.gguf"
    _rewrite(src, shared, keys={"llama.expert_shared_feed_forward_length": 32})
    with pytest.raises(LoadError, match="shared experts"):
        load_checkpoint(str(shared))
