"""Gemma GGUF files (llama.cpp's `gemma`, `gemma2` and `gemma3` architectures), written here as
llama.cpp's converter writes them: names from the gguf package's own tensor map, norms stored
as 1 + w, rows unpermuted, a sentencepiece vocabulary with no space prefix whose whitespace runs
are spelled with real spaces, and no sliding-window pattern, local RoPE base or attention scale
in the metadata (llama.cpp hard-codes them); Gemma 2's soft caps as keys. Checked against
transformers: its model built from our config and weights gives the original model's logits,
its own GGUF loader reads the same tensors, and its GGUF tokenizer conversion tokenizes as ours
does (Gemma 2 and 3: transformers reads no `gemma` file)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tiny import write_gguf_shape

from llmserve import _core
from llmserve.loaders import LoadError, load_checkpoint

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

CONTROL, USER_DEFINED, BYTE, UNKNOWN, NORMAL = 3, 4, 6, 2, 1
SPECIALS = [("<pad>", CONTROL), ("<eos>", CONTROL), ("<bos>", CONTROL), ("<unk>", UNKNOWN), ("<mask>", USER_DEFINED),
            ("<start_of_turn>", CONTROL), ("<end_of_turn>", CONTROL)]
PIECES = ["▁", "h", "e", "l", "o", "w", "r", "d", "a", "b", "u", "s", "i", "n", "\n",
          "he", "ll", "llo", "hello", "▁hello", "wo", "wor", "world", "▁world", "\n\n", "▁a", "ab", "us", "er", "user",
          "m", "od", "mod", "el", "model"]
SPACES = ["  ", "   "]   # (Gemma's whitespace runs, user-defined, spelled with real spaces)
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m.role }}\n{{ m.content }}<end_of_turn>\n"
            "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
TEXTS = ["hello world", " hello", "hello  world\n\nab", "a   b", "  hello", "héllo wörld", "user\nhello",
         "<start_of_turn>user\nhello<end_of_turn>", "", "ab  ", "\n"]


def vocabulary() -> tuple[list[str], list[int], list[float]]:
    tokens = [t for t, _ in SPECIALS] + [f"<0x{b:02X}>" for b in range(256)] + PIECES + SPACES
    types = [k for _, k in SPECIALS] + [BYTE] * 256 + [NORMAL] * len(PIECES) + [USER_DEFINED] * len(SPACES)
    # Scores that run against the file's order: a merge ranked by them would go wrong, as it
    # would on Gemma's own files (transformers' gguf_tokenizer_mapping.gemma_tokenizer).
    scores = [float(i) for i in range(len(tokens))]
    return tokens, types, scores


COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-6,
              pad_token_id=0, eos_token_id=1, bos_token_id=2)
# arch -> (transformers config, model class, gguf arch, config fields, RoPE base): the fields
# llama.cpp hard-codes as these (q . k scaled by head_dim^-0.5, Gemma 3's local RoPE base)
ARCHS = {
    "gemma": ("GemmaConfig", "GemmaForCausalLM", "GEMMA", dict(hidden_act="gelu_pytorch_tanh"), 10000.0),
    # caps low enough to bite on this tiny model
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", "GEMMA2", dict(
        query_pre_attn_scalar=32, sliding_window=5, attn_logit_softcapping=0.8, final_logit_softcapping=0.6), 10000.0),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", "GEMMA3", dict(
        query_pre_attn_scalar=32, sliding_window=5,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}), 1e6),
}


def hf_class(arch: str, config: dict | None = None):
    """transformers' config for `arch` (from our config's fields when given) and its model class."""
    config_name, model_name, *_ = ARCHS[arch]
    cls = getattr(transformers, config_name)
    if config is not None:
        return cls(**{k: v for k, v in config.items() if k != "model_type"}), getattr(transformers, model_name)
    return cls, getattr(transformers, model_name)


def tiny_gemma(arch: str, vocab_size: int):
    torch.manual_seed(0)
    config_cls, model_cls = hf_class(arch)
    model = model_cls(config_cls(vocab_size=vocab_size, **COMMON, **ARCHS[arch][3])).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(0.2 * noise if "norm" in name else 0.1 * noise)
    return model


def write_gemma_gguf(path: Path, arch: str, model, tokens, types, scores, quant: str = "F32") -> None:
    """As llama.cpp's convert_hf_to_gguf writes a Gemma text model (its GemmaModel, Gemma2Model,
    Gemma3Model), the matrices in `quant` (F32 or Q8_0), the norms in F32."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    write_gguf_shape(w, cfg, ARCHS[arch][4])
    if arch != "gemma":
        w.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(False)
    w.add_chat_template(TEMPLATE)
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, ARCHS[arch][2]), cfg.num_hidden_layers)
    for hf, tensor in model.state_dict().items():
        if hf == "lm_head.weight":
            continue   # (tied)
        data = tensor.float().numpy()
        if hf.endswith("norm.weight"):
            data = data + 1   # (llama.cpp stores Gemma's norm scale, 1 + w)
        name = names.get_name(hf.removesuffix(".weight")) + ".weight"
        if data.ndim == 2 and quant == "Q8_0":
            w.add_tensor(name, gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, np.ascontiguousarray(data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module", params=list(ARCHS))
def gemma_file(request, tmp_path_factory):
    arch = request.param
    tokens, types, scores = vocabulary()
    model = tiny_gemma(arch, len(tokens))
    path = tmp_path_factory.mktemp(arch) / f"{arch}.gguf"
    write_gemma_gguf(path, arch, model, tokens, types, scores)
    return path, model, arch


def test_the_model_is_the_checkpoint_it_was_written_from(gemma_file):
    path, model, arch = gemma_file
    ckpt = load_checkpoint(str(path))
    assert ckpt.hf_config["architectures"] == [ARCHS[arch][1]]
    expected = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert set(ckpt.weights) == set(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(ckpt.weights[name], tensor, atol=1e-7, rtol=0, msg=name)
    # transformers' model built from our config and weights is the model (its sliding layers,
    # local RoPE base, attention scale and soft caps included)
    config, model_cls = hf_class(arch, ckpt.hf_config)
    for key in ("layer_types", "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"):
        assert getattr(config, key, None) == getattr(model.config, key, None), key
    rebuilt = model_cls(config).eval()
    rebuilt.load_state_dict(dict(ckpt.weights), strict=False)
    rebuilt.tie_weights()
    ids = torch.tensor([[2, 280, 290, 270, 263, 281, 282, 271, 293, 275, 268, 290, 289, 5]])
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(ids).logits, model(ids).logits, atol=1e-5, rtol=0)
    # <end_of_turn> ends a reply, as llama.cpp and Gemma's generation_config stop on it
    assert ckpt.eos_token_ids == [1, 6]


def test_transformers_reads_the_same_tensors(gemma_file):
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path, model, arch = gemma_file
    if arch == "gemma":
        pytest.skip("transformers reads no `gemma` GGUF file")
    ours = load_checkpoint(str(path)).weights
    # (the model is only asked for its parameter names)
    theirs = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    assert set(theirs) - {"lm_head.weight"} == set(ours)
    for name, tensor in theirs.items():
        if name in ours:
            torch.testing.assert_close(ours[name], torch.as_tensor(tensor).float(), atol=0, rtol=0, msg=name)


def test_the_tokenizer_is_transformers_gemma_conversion(gemma_file):
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_gguf_tokenizer

    path, _, arch = gemma_file
    if arch == "gemma":
        pytest.skip("transformers reads no `gemma` GGUF file")
    arch, tokenizer_dict, _ = get_gguf_tokenizer(str(path))
    theirs, _ = convert_gguf_tokenizer(arch, tokenizer_dict)
    ckpt = load_checkpoint(str(path))
    config = {"served_model_names": ["g"], "max_model_len": 256, "eos_token_ids": [1],
              "special_tokens": {"bos_token": "<bos>", "eos_token": "<eos>"}}
    sources = {"cli": None, "folder_jinja": None, "tokenizer_config": None, "gguf": TEMPLATE}
    router = _core.Router(None, json.dumps(ckpt.gguf_vocab), json.dumps(sources), json.dumps(config))

    def ours(text: str, specials: bool) -> list[int]:
        body = json.dumps({"model": "g", "prompt": text, "add_special_tokens": specials}).encode()
        return json.loads(router.handle("tokenize", body)[0])["tokens"]

    for text in TEXTS:
        assert ours(text, False) == theirs.encode(text, add_special_tokens=False).ids, text
        got = theirs.decode(ours(text, False), skip_special_tokens=False)
        assert got == text, text
    assert ours("hello", True) == [2] + ours("hello", False)   # (add_bos_token)
    # what makes Gemma's different: no space prepended, merges in the file's order, the
    # whitespace runs as the pieces they stand for
    tokens = ckpt.gguf_vocab["tokens"]
    assert [tokens[i] for i in ours("a   b", False)] == ["a", "   ", "b"]
    assert [tokens[i] for i in ours(" hello", False)] == ["▁hello"]



def test_served_greedy_tokens_are_transformers(gemma_file):
    """Through the engine, as `llmserve run model.gguf` serves it: the file's chat template
    (BOS from the template, none added twice), greedy tokens past the sliding window."""
    from llmserve.engine.offline import LLM

    path, model, _ = gemma_file
    llm = LLM(str(path), threads=1, max_model_len=64, num_kv_blocks=32, block_size=4)
    got = llm.chat([{"role": "user", "content": "hello world"}],
                   {"max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_token_ids": True})
    ids = got.body["prompt_token_ids"]
    tokens = vocabulary()[0]
    assert "".join(tokens[i] for i in ids) == "<bos><start_of_turn>user\nhello▁world<end_of_turn>\n<start_of_turn>model\n"
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    assert got.body["choices"][0]["token_ids"] == ref[0, len(ids):].tolist()


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_a_q8_0_file_serves_its_weights(tmp_path, arch):
    """Q8_0 matrices, as llama.cpp's own small Gemma files ship: the few-token steps read the
    blocks (the quantized GEMV), the others their values; greedy tokens are transformers' on
    those values."""
    from llmserve.engine.offline import LLM

    tokens, types, scores = vocabulary()
    path = tmp_path / f"{arch}-q8_0.gguf"
    write_gemma_gguf(path, arch, tiny_gemma(arch, len(tokens)), tokens, types, scores, quant="Q8_0")
    ckpt = load_checkpoint(str(path))
    assert ckpt.quantized and all(q.ggml_type == gguf.GGMLQuantizationType.Q8_0 for q in ckpt.quantized.values())
    config, model_cls = hf_class(arch, ckpt.hf_config)
    model = model_cls(config).eval()
    model.load_state_dict(dict(ckpt.weights), strict=False)
    model.tie_weights()
    llm = LLM(str(path), threads=1, max_model_len=64, num_kv_blocks=32, block_size=4)
    got = llm.chat([{"role": "user", "content": "hello world"}],
                   {"max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_token_ids": True})
    ids = got.body["prompt_token_ids"]
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    assert got.body["choices"][0]["token_ids"] == ref[0, len(ids):].tolist()


@pytest.mark.parametrize("arch, layers_27b", [("gemma2", 46), ("gemma3", 62)])
def test_what_llama_cpp_hard_codes_where_no_key_says(arch, layers_27b):
    """The keys a Gemma 2 or 3 file may lack read as llama.cpp reads them: q . k scaled by
    head_dim^-0.5, but by (hidden / heads)^-0.5 in the 27B model (which llama.cpp tells by its
    layer count), unless the file has attention.scale; Gemma 2's caps 50 and 30."""
    from llmserve.loaders.gguf_file import _gemma2_config, _gemma3_config, _Meta

    read = {"gemma2": _gemma2_config, "gemma3": _gemma3_config}[arch]
    meta = {f"{arch}.attention.sliding_window": 4096}
    config = dict(hidden_size=4608, num_attention_heads=32, head_dim=128, num_hidden_layers=layers_27b)
    assert read(_Meta(meta), config)["query_pre_attn_scalar"] == 144
    assert read(_Meta(meta), dict(config, num_hidden_layers=26))["query_pre_attn_scalar"] == 128
    assert read(_Meta({**meta, f"{arch}.attention.scale": 0.125}), config)["query_pre_attn_scalar"] == 64
    if arch == "gemma2":
        got = read(_Meta(meta), config)
        assert (got["attn_logit_softcapping"], got["final_logit_softcapping"]) == (50.0, 30.0)
        assert got["layer_types"][:3] == ["sliding_attention", "full_attention", "sliding_attention"]
    with pytest.raises(LoadError, match="sliding_window"):
        read(_Meta({}), config)
