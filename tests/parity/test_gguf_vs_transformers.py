"""Parity: our GGUF loader (names, [out, in] layout, Q/K un-permutation, tied head) against
transformers' own, independent GGUF loading of the default SmolLM2 file (its GGUF config
parser, name map and reverse permutation).

Our weights go into transformers' LlamaForCausalLM built from our hf_config; if any tensor
were misplaced or the Q/K rows left in llama.cpp's order, the logits would differ grossly
(BENCH.md: the model then silently answers nothing). Runs in the normal suite.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gguf")

from llmserve.loaders import load_checkpoint  # noqa: E402

PROMPTS = [
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "The three primary colors are",
]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def models(hf_gguf_reference):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    ckpt = load_checkpoint(None)

    ours = LlamaForCausalLM(LlamaConfig(**ckpt.hf_config)).to(torch.float32).eval()
    missing, unexpected = ours.load_state_dict(ckpt.weights, strict=False)
    # Tied embeddings: lm_head.weight is the embedding, which load_state_dict leaves alone.
    assert unexpected == []
    assert set(missing) <= {"lm_head.weight"}
    ours.tie_weights()
    assert torch.equal(ours.lm_head.weight, ckpt.weights["model.embed_tokens.weight"])

    # NOTE: from_pretrained(gguf_file=...) needs accelerate, which llmserve does not depend on;
    # the reference (conftest.py) is built from the same transformers pieces it uses.
    ref, tok = hf_gguf_reference
    return ours, ref, tok


@pytest.mark.parametrize("prompt", PROMPTS)
def test_logits_match(models, prompt):
    ours, ref, tok = models
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        a = ours(ids).logits
        b = ref(ids).logits
    assert a.shape == b.shape
    assert (a - b).abs().max().item() < 1e-3


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_continuation_matches(models, prompt):
    ours, ref, tok = models
    ids = tok(prompt, return_tensors="pt").input_ids
    kwargs = dict(max_new_tokens=16, do_sample=False, pad_token_id=tok.eos_token_id)
    with torch.no_grad():
        a = ours.generate(ids, **kwargs)[0, ids.shape[1]:]
        b = ref.generate(ids, **kwargs)[0, ids.shape[1]:]
    assert a.tolist() == b.tolist()
    # A real answer, not an immediate end of turn: catches a model that "answers nothing".
    assert len(tok.decode(a, skip_special_tokens=True).strip()) > 0
