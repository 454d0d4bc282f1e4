"""Serving options that build_engine hands to the router, checked through the requests they
bound: --max-logprobs, --enable-force-include-usage, --return-tokens-as-token-ids."""

from __future__ import annotations

import json

import pytest
from _engine_thread import serve

from llmserve._core import BadRequestError
from llmserve.config import Config, DeviceConfig, ModelConfig, ServerConfig
from llmserve.engine.build import build_engine


def _router(tiny_model, **model):
    cfg = Config(model=ModelConfig(model=str(tiny_model), **model), device=DeviceConfig(threads=1))
    return build_engine(cfg).router


def _chat(k: int) -> bytes:
    return json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                       "logprobs": True, "top_logprobs": k}).encode()


def _completion(k: int) -> bytes:
    return json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 1, "logprobs": k}).encode()


@pytest.mark.parametrize("bound", [3, -1])
def test_max_logprobs_bounds_what_a_request_may_ask(tiny_model, bound):
    router = _router(tiny_model, served_model_name=("tiny",), max_logprobs=bound)
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    most = bound if bound >= 0 else vocab                     # (-1: the vocabulary, as vLLM's)
    for body in (_chat, _completion):
        router.prepare("chat" if body is _chat else "completion", body(most))
        with pytest.raises(BadRequestError, match=f"between 0 and {most}"):
            router.prepare("chat" if body is _chat else "completion", body(most + 1))


def test_max_logprobs_defaults_to_openais_20(tiny_model):
    router = _router(tiny_model, served_model_name=("tiny",))
    router.prepare("chat", _chat(20))
    with pytest.raises(BadRequestError, match="between 0 and 20"):
        router.prepare("chat", _chat(21))


@pytest.mark.parametrize("on", [False, True])
def test_vllms_usage_and_token_id_flags_reach_the_router(tiny_model, on):
    """A stream run through the engine ends with its usage chunk, and names its logprobs'
    tokens by id, with the flags on (and not without)."""
    cfg = Config(model=ModelConfig(model=str(tiny_model)), device=DeviceConfig(threads=1),
                 server=ServerConfig(enable_force_include_usage=on, return_tokens_as_token_ids=on))
    engine = build_engine(cfg)
    out, _ = serve(engine, [{"prompt": "hi", "max_tokens": 2, "logprobs": 1, "stream": True}])
    chunks = [json.loads(f[6:]) for f in out[0].decode().split("\n\n") if f.startswith("data: {")]
    assert (chunks[-1].get("usage") is not None) == on
    assert (chunks[-1]["choices"] == []) == on
    tokens = [t for c in chunks if c["choices"] for t in c["choices"][0]["logprobs"]["tokens"]]
    assert tokens and all(t.startswith("token_id:") == on for t in tokens), tokens


@pytest.mark.parametrize("generation_config", ["auto", "none"])
def test_override_generation_config_sets_the_sampling_defaults(tiny_model, generation_config):
    """vLLM's --override-generation-config: its keys over the model's generation_config.json
    (or alone with `none`); a request's own value still wins."""
    router = _router(tiny_model, served_model_name=("tiny",), generation_config=generation_config,
                     override_generation_config='{"max_new_tokens": 7, "temperature": 0.3}')
    body = {"model": "tiny", "prompt": "hi"}
    assert router.prepare("completion", json.dumps(body).encode()).max_tokens == 7
    assert router.prepare("completion", json.dumps({**body, "max_tokens": 3}).encode()).max_tokens == 3
    plain = _router(tiny_model, served_model_name=("tiny",), generation_config=generation_config)
    assert plain.prepare("completion", json.dumps(body).encode()).max_tokens != 7


def test_generation_config_folder_replaces_the_models_file(tiny_model, tmp_path):
    """vLLM's --generation-config FOLDER: that folder's generation_config.json gives the sampling
    defaults in place of the model's (--override-generation-config still over it); a folder
    without one, or a file that is not a JSON object, stops the start with the flag named."""
    (tmp_path / "generation_config.json").write_text('{"max_new_tokens": 5, "temperature": 0.4}')
    body = json.dumps({"model": "tiny", "prompt": "hi"}).encode()
    router = _router(tiny_model, served_model_name=("tiny",), generation_config=str(tmp_path))
    assert router.prepare("completion", body).max_tokens == 5
    over = _router(tiny_model, served_model_name=("tiny",), generation_config=str(tmp_path),
                   override_generation_config='{"max_new_tokens": 9}')
    assert over.prepare("completion", body).max_tokens == 9
    (tmp_path / "generation_config.json").write_text("[5]")
    with pytest.raises(ValueError, match="generation_config.json' must hold a JSON object"):
        ModelConfig(generation_config=str(tmp_path))
    (tmp_path / "generation_config.json").unlink()
    with pytest.raises(ValueError, match="--generation-config: the folder .* has no generation_config.json"):
        ModelConfig(generation_config=str(tmp_path))


def test_hf_overrides_replace_config_keys_before_the_build(tiny_model):
    """vLLM's --hf-overrides: config.json keys replaced before the model is built (here its
    positions, which bound the context); the fingerprint tells the two setups apart; a value
    that is not a JSON object stops the start."""
    from llmserve.config import Config, DeviceConfig, ModelConfig
    from llmserve.engine.build import build_engine

    def engine(**model):
        return build_engine(Config(model=ModelConfig(model=str(tiny_model), served_model_name=("tiny",), **model),
                                   device=DeviceConfig(threads=1)))

    plain, shorter = engine(), engine(hf_overrides='{"max_position_embeddings": 128}')
    assert (plain.max_model_len, shorter.max_model_len) == (512, 128)
    def fingerprint(e):
        sse = serve(e, [{"prompt": "hi", "max_tokens": 1, "stream": True}])[0][0].decode()
        return json.loads(sse.split("\n\n")[0].removeprefix("data: "))["system_fingerprint"]

    fingerprints = [fingerprint(e) for e in (plain, shorter)]
    assert fingerprints[0] != fingerprints[1]
    with pytest.raises(ValueError, match="--hf-overrides must be a JSON object"):
        ModelConfig(hf_overrides="[1]")
    # a value of another kind than the config's, or a size of 0, stops the start with one line
    from llmserve.engine.build import SetupError
    for overrides, says in (('{"hidden_size": "abc"}', "hidden_size: the model's config holds 64; 'abc' is not"),
                            ('{"num_hidden_layers": 1.5}', "num_hidden_layers: the model's config holds"),
                            ('{"max_position_embeddings": 0}', "max_position_embeddings: a size or count, 0")):
        with pytest.raises(SetupError, match=says):
            engine(hf_overrides=overrides)


def test_kv_cache_dtype_holds_more_tokens_in_the_same_memory(tiny_model):
    """--kv-cache-dtype: the cache holds bfloat16 or fp8 values, so the same --kv-cache-memory
    makes 2x or 4x the blocks of the float32 model's own (counted here from config.json); the
    requests run, the fingerprint tells the setups apart (a narrow cache moves the numbers), and
    vLLM's `fp8` is E4M3."""
    import torch

    from llmserve.config import CacheConfig

    hf = json.loads((tiny_model / "config.json").read_text())
    kv_heads = hf.get("num_key_value_heads") or hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    per_block_fp32 = 2 * hf["num_hidden_layers"] * 16 * kv_heads * head_dim * 4

    def engine(kv_cache_dtype):
        return build_engine(Config(model=ModelConfig(model=str(tiny_model), served_model_name=("tiny",)),
                                   cache=CacheConfig(kv_cache_memory="4MiB", kv_cache_dtype=kv_cache_dtype),
                                   device=DeviceConfig(threads=1)))

    fingerprints = []
    for name, dtype, size in [("auto", torch.float32, 4), ("bfloat16", torch.bfloat16, 2),
                              ("fp8", torch.float8_e4m3fn, 1), ("fp8_e5m2", torch.float8_e5m2, 1)]:
        e = engine(name)
        assert e.num_blocks == 4 * 2**20 // (per_block_fp32 // 4 * size), name
        assert {t.dtype for t in (*e.runner.kv_cache.key, *e.runner.kv_cache.value)} == {dtype}
        sse = serve(e, [{"prompt": "hi", "max_tokens": 4, "stream": True, "ignore_eos": True,
                         "stream_options": {"include_usage": True}}])[0][0].decode()
        events = [json.loads(x.removeprefix("data: ")) for x in sse.split("\n\n") if x.startswith("data: {")]
        assert events[-1]["usage"]["completion_tokens"] == 4
        fingerprints.append(events[0]["system_fingerprint"])
    assert len(set(fingerprints)) == 4


def test_kv_cache_dtype_choices_are_the_types_the_cache_takes():
    """config.py (torch-free, for the CLI) names --kv-cache-dtype's choices; worker/kv_cache.py
    maps them to torch dtypes: the two lists must be the same."""
    from dataclasses import fields

    from llmserve.config import CacheConfig
    from llmserve.worker.kv_cache import KV_CACHE_DTYPES

    field = next(f for f in fields(CacheConfig) if f.name == "kv_cache_dtype")
    assert field.metadata["choices"] == ("auto", *KV_CACHE_DTYPES)


def test_the_seed_fixes_unseeded_sampling_and_leaves_torchs_global_rng_alone(tiny_model):
    """`--seed` seeds the engine's own generators: unseeded sampling repeats under one seed
    and not under another, and a program that embeds the engine keeps its random stream."""
    import torch

    def sampled(seed: int) -> str:
        cfg = Config(model=ModelConfig(model=str(tiny_model)), device=DeviceConfig(threads=1, seed=seed))
        torch.manual_seed(1234)
        before = torch.get_rng_state()
        engine = build_engine(cfg)
        assert torch.equal(torch.get_rng_state(), before), "the build moved torch's global RNG"
        out, _ = serve(engine, [{"prompt": "hi", "max_tokens": 24, "temperature": 1.5}])
        return out[0]["choices"][0]["text"]

    first = sampled(7)
    assert sampled(7) == first
    assert sampled(8) != first
