"""/v1/embeddings against transformers on the same weights.

A tiny random Llama folder is read by transformers (`AutoModel`: its `last_hidden_state` is
the final-normed hidden state, what sentence-transformers pools) and pooled and normalized
here by hand; the engine (`LLM.embed`: the server's Router, Core, scheduler and runner, in
process) must give the same vectors, for last-token and mean pooling, with each prompt in one
step or split into chunks, alone or batched, computed or partly read from the prefix cache,
and as a sentence-transformers folder's own files ask.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from llmserve import LLM
from llmserve._core import ApiError
from tiny import build_tiny_llama

TOL = 1e-4
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world!",
    "def add(a, b):\n    return a + b\n" * 3,
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("embed-llama"))


@pytest.fixture(scope="module")
def reference(folder):
    """embed(text or ids, pooling, normalize=True) as transformers computes it."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer
    from transformers import AutoModel

    model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))

    def embed(text, pooling: str, normalize: bool = True) -> np.ndarray:
        ids = tok.encode(text).ids if isinstance(text, str) else list(text)
        with torch.no_grad():
            h = model(torch.tensor([ids])).last_hidden_state[0]
        v = h[-1] if pooling == "last" else h.mean(0)
        return (torch.nn.functional.normalize(v, dim=0) if normalize else v).numpy()

    return embed


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_pooled_hidden_states_match_transformers(folder, reference, pooling):
    llm = LLM(str(folder), pooling=pooling, num_kv_blocks=64)
    got = np.asarray(llm.embed(TEXTS))
    want = np.stack([reference(t, pooling) for t in TEXTS])
    assert got.shape == (3, 64) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, atol=TOL)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    # each input alone gives what it gave in the batch
    np.testing.assert_allclose(llm.embed(TEXTS[1:2]), got[1:2], atol=1e-6)
    raw = llm.embed(TEXTS[:1], {"normalize": False})
    np.testing.assert_allclose(raw[0], reference(TEXTS[0], pooling, normalize=False), atol=TOL, rtol=TOL)
    ids = [5, 17, 42, 99, 7]
    np.testing.assert_allclose(llm.embed([ids])[0], reference(ids, pooling), atol=TOL)
    # no input is the route's 400, not an empty array of another shape
    with pytest.raises(ApiError, match="empty"):
        llm.embed([])


def test_prompts_split_into_chunks_pool_every_token_once(folder, reference):
    # 8 tokens a step: the 40-odd-token prompt runs in several steps, beside the others
    llm = LLM(str(folder), pooling="mean", num_kv_blocks=64, max_num_batched_tokens=8)
    np.testing.assert_allclose(llm.embed(TEXTS), np.stack([reference(t, "mean") for t in TEXTS]), atol=TOL)
    llm = LLM(str(folder), pooling="last", num_kv_blocks=64, max_num_batched_tokens=8)
    np.testing.assert_allclose(llm.embed(TEXTS), np.stack([reference(t, "last") for t in TEXTS]), atol=TOL)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_a_prompt_the_prefix_cache_holds_embeds_the_same(folder, reference, pooling):
    llm = LLM(str(folder), pooling=pooling, num_kv_blocks=200, block_size=4)
    ids = list(range(5, 41))
    # a completion leaves the prompt's blocks in the prefix cache
    first = llm.generate([ids], {"max_tokens": 1, "temperature": 0})[0]
    assert first.usage["prompt_tokens"] == 36
    again = llm.generate([ids], {"max_tokens": 1, "temperature": 0})[0]
    assert again.usage["prompt_tokens_details"]["cached_tokens"] == 32
    # last-token pooling reads the cache (only the last token is computed); mean pooling
    # computes every position itself
    np.testing.assert_allclose(llm.embed([ids])[0], reference(ids, pooling), atol=TOL)
    np.testing.assert_allclose(llm.embed([ids])[0], llm.embed([ids])[0], atol=0)


def _sentence_transformers(src, dst, modules, pooling_config=None, **config):
    shutil.copytree(src, dst)
    (dst / "modules.json").write_text(json.dumps(modules))
    if pooling_config is not None:
        (dst / "1_Pooling").mkdir()
        (dst / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config))
    if config:
        c = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**c, **config}))
    return dst


TRANSFORMER = {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}
POOLING = {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
NORMALIZE = {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
DENSE = {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}


def test_a_sentence_transformers_folder_pools_and_normalizes_as_its_files_say(folder, reference, tmp_path):
    mean = {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False}
    st = _sentence_transformers(folder, tmp_path / "st", [TRANSFORMER, POOLING], mean,
                                matryoshka_dimensions=[16, 32])
    llm = LLM(str(st), num_kv_blocks=64)
    # mean pooling, and no Normalize module: the raw mean
    np.testing.assert_allclose(llm.embed(TEXTS[:1])[0], reference(TEXTS[0], "mean", normalize=False),
                               atol=TOL, rtol=TOL)
    # Matryoshka: the first k components, then normalized when asked
    short = llm.embed(TEXTS[:1], {"dimensions": 32, "normalize": True})[0]
    full = reference(TEXTS[0], "mean", normalize=False)[:32]
    np.testing.assert_allclose(short, full / np.linalg.norm(full), atol=TOL)
    with pytest.raises(ApiError) as err:
        llm.embed(TEXTS[:1], {"dimensions": 20})
    assert err.value.param == "dimensions"

    normed = _sentence_transformers(folder, tmp_path / "normed", [TRANSFORMER, POOLING, NORMALIZE],
                                    {**mean, "pooling_mode_mean_tokens": False, "pooling_mode_lasttoken": True})
    np.testing.assert_allclose(LLM(str(normed), num_kv_blocks=64).embed(TEXTS[:1])[0],
                               reference(TEXTS[0], "last"), atol=TOL)


def test_a_folder_whose_embeddings_cannot_be_made_refuses_the_route(folder, tmp_path):
    dense = _sentence_transformers(folder, tmp_path / "dense", [TRANSFORMER, POOLING, DENSE],
                                   {"pooling_mode_mean_tokens": True})
    llm = LLM(str(dense), num_kv_blocks=64)
    with pytest.raises(ApiError) as err:
        llm.embed(TEXTS[:1])
    assert err.value.status == 400 and "does not serve embeddings" in str(err.value)
    # it still generates
    assert llm.generate(["Hello"], {"max_tokens": 2})[0].usage["completion_tokens"] >= 1
    # --pooling overrules the files (the Dense layer is then not applied)
    assert np.asarray(LLM(str(dense), num_kv_blocks=64, pooling="mean").embed(TEXTS[:1])).shape == (1, 64)
