"""A model folder the server cannot serve fails its load with a LoadError or SetupError (one
line in the log, no traceback) that names what is wrong, not with whatever the code under it
happened to raise."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

import llmserve
from llmserve.config import CacheConfig, Config, DeviceConfig, ModelConfig
from llmserve.engine.build import SetupError, _within_the_window, build_engine, native_positions
from llmserve.loaders import LoadError


@pytest.fixture
def folder(tiny_model, tmp_path) -> Path:
    copy = tmp_path / "model"
    shutil.copytree(tiny_model, copy)
    return copy


def _edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data))


def _build(folder: Path, **model):
    return build_engine(Config(model=ModelConfig(model=str(folder), **model), device=DeviceConfig(threads=1)))


def test_a_config_key_the_model_needs(folder):
    _edit_json(folder / "config.json", intermediate_size=None)
    with pytest.raises(LoadError, match="config has no 'intermediate_size'"):
        _build(folder)


def test_an_unsupported_feature(folder):
    _edit_json(folder / "config.json", rope_scaling={"rope_type": "dynamic", "factor": 4.0},
               rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0})
    with pytest.raises(LoadError, match="dynamic"):
        _build(folder)


def test_a_tensor_of_the_wrong_shape(folder):
    weights = load_file(str(folder / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.weight"
    weights[name] = weights[name][:100].contiguous()
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(LoadError, match=r": model\.layers\.0\.mlp\.up_proj\.weight is \[100, \d+\], "
                                        r"but the config makes it \[\d+, \d+\]$"):
        _build(folder)


def test_a_tokenizer_or_template_that_does_not_load(folder):
    (folder / "chat_template.jinja").write_text("{% for m in messages %}")
    with pytest.raises(LoadError, match="chat_template.jinja does not parse"):
        _build(folder)
    (folder / "chat_template.jinja").unlink()
    (folder / "tokenizer.json").write_text('{"model": {"type": "nonsense"}}')
    with pytest.raises(LoadError, match="tokenizer"):
        _build(folder)


def test_a_tokenizer_larger_than_the_embedding_table(folder):
    """Ids the model has no row for would fail every step that reads them: refused at once."""
    rows = json.loads((folder / "config.json").read_text())["vocab_size"]
    weights = load_file(str(folder / "model.safetensors"))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        weights[name] = weights[name][: rows - 4].contiguous()
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    _edit_json(folder / "config.json", vocab_size=rows - 4)
    with pytest.raises(LoadError, match=f"tokenizer has {rows} tokens but the model only {rows - 4}"):
        _build(folder)


def test_a_context_beyond_the_model_positions(folder):
    with pytest.raises(SetupError, match="--max-model-len 1024 exceeds the model's 512 positions"):
        _build(folder, max_model_len=1024)
    # (the public LoadError catches it too: every reason an engine cannot be built)
    with pytest.raises(llmserve.LoadError):
        _build(folder, max_model_len=1024)


def _gpt2(folder: Path, n_positions: int) -> None:
    """The tiny model's folder with a random GPT-2 in place of its Llama (same tokenizer)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    config = GPT2Config(vocab_size=vocab, n_embd=32, n_layer=1, n_head=2, n_positions=n_positions,
                        bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(folder)


def test_gpt2_is_served_up_to_its_learned_positions(folder):
    """GPT-2 learned an embedding for each of its n_positions and has none past them: it is
    served up to n_positions (its config's name, read through the registry's Llama keys), and a
    longer --max-model-len is refused with why, never served to crash on the first token past."""
    _gpt2(folder, n_positions=48)
    engine = _build(folder)
    assert engine.max_model_len == engine.router.max_model_len == 48
    assert _build(folder, max_model_len=32).router.max_model_len == 32
    with pytest.raises(SetupError, match="--max-model-len 49 exceeds the model's 48 positions: it has a learned "
                                         r"embedding for each position \(n_positions\) and none past them"):
        _build(folder, max_model_len=49)


def test_lora_adapters_the_server_cannot_serve_stop_it_with_what(folder, tmp_path):
    """--lora-modules: an adapter whose shapes are another model's, a kind PEFT makes that is not
    served (DoRA), and a name that is the base model's own, each stop the start with a
    SetupError naming the flag and what is wrong; a good one is served under its name."""
    from tiny import write_peft_adapter

    config = json.loads((folder / "config.json").read_text())
    good = tmp_path / "good"
    write_peft_adapter(good, config, ["q_proj", "v_proj"])
    engine = _build(folder, lora_modules=(f"sql={good}",))
    assert [m["id"] for m in json.loads(engine.router.models())["data"]] == ["model", "sql"]
    other = tmp_path / "other"
    write_peft_adapter(other, {**config, "hidden_size": 2 * config["hidden_size"]}, ["q_proj"])
    with pytest.raises(SetupError, match="--lora-modules: .*'other'.*hidden size"):
        _build(folder, lora_modules=(f"other={other}",))
    dora = tmp_path / "dora"
    write_peft_adapter(dora, config, ["q_proj"], config={"use_dora": True})
    with pytest.raises(SetupError, match="--lora-modules: .*DoRA"):
        _build(folder, lora_modules=(f"dora={dora}",))
    with pytest.raises(SetupError, match="--lora-modules names 'model', the base model's name"):
        _build(folder, lora_modules=(f"model={good}",))


@pytest.mark.parametrize("damage, says", [
    (lambda d: (d / "adapter_config.json").write_text("{not json"), "adapter_config.json is not readable JSON"),
    (lambda d: (d / "adapter_config.json").write_text("[1, 2]"), "holds list, not a JSON object"),
    (lambda d: _edit_json(d / "adapter_config.json", lora_alpha="eight"), "lora_alpha must be a number"),
    (lambda d: _edit_json(d / "adapter_config.json", use_rslora="false"), "use_rslora must be true or false"),
    (lambda d: _edit_json(d / "adapter_config.json", target_modules=["q_proj", 7]),
     "target_modules must be a string or a list of strings"),
    (lambda d: (d / "adapter_model.safetensors").write_bytes(b"\x00\x01garbage"),
     "adapter_model.safetensors is not a readable safetensors file"),
    (lambda d: save_file({k: v * float("nan") for k, v in load_file(d / "adapter_model.safetensors").items()},
                         d / "adapter_model.safetensors"), "holds NaN or infinite values"),
])
def test_a_damaged_adapter_is_one_line_naming_it(folder, tmp_path, damage, says):
    from tiny import write_peft_adapter

    write_peft_adapter(tmp_path / "x", json.loads((folder / "config.json").read_text()), ["q_proj", "v_proj"])
    damage(tmp_path / "x")
    with pytest.raises(SetupError, match=f"--lora-modules: LoRA adapter 'x': .*{says}"):
        _build(folder, lora_modules=(f"x={tmp_path / 'x'}",))


@pytest.mark.parametrize("cache, flag", [(CacheConfig(num_kv_blocks=4), "--num-kv-blocks to at least 17"),
                                         (CacheConfig(kv_cache_memory="64KiB"), "--kv-cache-memory")])
def test_a_cache_too_small_for_one_request_names_the_flag_that_sized_it(folder, cache, flag):
    config = Config(model=ModelConfig(model=str(folder), max_model_len=256), cache=cache,
                    device=DeviceConfig(threads=1))
    with pytest.raises(SetupError, match=f"less than one request of --max-model-len 256: raise {flag} "):
        build_engine(config)


@pytest.mark.parametrize("cache, flag", [(CacheConfig(kv_cache_memory="65536TiB"), "--kv-cache-memory"),
                                         (CacheConfig(num_kv_blocks=2**31 - 1), "--num-kv-blocks")])
def test_a_cpu_cache_beyond_the_machine_s_memory_is_refused(folder, cache, flag):
    """Its pages are mapped as they are first written: it would start, then be killed once
    requests filled it (or fail in mmap with a traceback, past what the system maps)."""
    config = Config(model=ModelConfig(model=str(folder)), cache=cache, device=DeviceConfig(threads=1))
    with pytest.raises(SetupError, match=f"more than this machine's .* GiB of memory: lower {flag}$"):
        build_engine(config)


def test_a_sliding_window_is_served_at_full_length_on_cpu(folder):
    """Mistral's sliding window is implemented on CPU: the model is served at its full length,
    every layer attending through the window."""
    _edit_json(folder / "config.json", architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=64)
    engine = _build(folder)
    assert engine.router.max_model_len == 512
    assert engine.model_name == "model"   # the folder's name: the first served name
    assert engine.runner.model.sliding_window == 64


def test_our_cuda_kernels_serve_a_windowed_model_up_to_its_window():
    """build_engine calls this only where our CUDA kernels serve the model (no window in them
    yet); the torch path, which serves models they do not (head_dim 256), attends through it."""
    assert _within_the_window(4096, 32768, None) == 4096
    assert _within_the_window(4096, 32768, 4096) == 4096
    with pytest.raises(SetupError, match="--max-model-len 4097 exceeds the model's sliding window of 4096 "
                                         "tokens, which our CUDA kernels do not implement yet"):
        _within_the_window(4096, 32768, 4097)


def test_gemma3_counts_its_linear_rope_scaling_in_its_positions():
    from llmserve.models.gemma3 import Gemma3ForCausalLM
    from llmserve.models.llama import LlamaForCausalLM

    hf = {"max_position_embeddings": 131072, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    assert native_positions(hf, Gemma3ForCausalLM) == 131072
    assert native_positions(hf, LlamaForCausalLM) == 8 * 131072
    assert native_positions({}, LlamaForCausalLM) == 2048


def test_linear_rope_scaling_stretches_the_positions(folder):
    """As vLLM: a linear RoPE scaling's factor multiplies max_position_embeddings."""
    _edit_json(folder / "config.json", rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert _build(folder).router.max_model_len == 1024
    with pytest.raises(SetupError, match="exceeds the model's 1024 positions"):
        _build(folder, max_model_len=1025)


def test_more_threads_than_cores_are_warned_of(folder, monkeypatch, caplog):
    """Torch's threads past the cores contend for them: every step slows (BENCH.md)."""
    import llmserve.engine.build as build

    monkeypatch.setattr(build.os, "sched_getaffinity", lambda pid: {0})
    monkeypatch.setattr(build.torch, "set_num_threads", lambda n: None)   # (this process keeps its 1)
    config = Config(model=ModelConfig(model=str(folder), max_model_len=256), cache=CacheConfig(num_kv_blocks=4),
                    device=DeviceConfig(threads=2))
    with caplog.at_level("WARNING", logger="llmserve.engine"), pytest.raises(SetupError):
        build_engine(config)
    assert "--threads 2 on 1 cores: torch's threads will contend for them" in caplog.text


def test_a_step_budget_below_a_block_is_said(folder, caplog):
    """--max-num-batched-tokens under --block-size is raised to a block, and the log says so
    (nothing is changed without a word)."""
    from llmserve.config import SchedulerConfig

    with caplog.at_level("INFO", logger="llmserve"):
        build_engine(Config(model=ModelConfig(model=str(folder)), device=DeviceConfig(threads=1),
                            scheduler=SchedulerConfig(max_num_batched_tokens=4)))
    assert "--max-num-batched-tokens 4 is below --block-size 16: a step computes up to 16 tokens" in caplog.text
