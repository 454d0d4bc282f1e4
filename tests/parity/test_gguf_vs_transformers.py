"""Parity: our GGUF loader (names, [out, in] layout, Q/K un-permutation, tied head) against
transformers' own, independent GGUF loading of the default SmolLM2 file (its GGUF config
parser, name map and reverse permutation).

Our weights go into transformers' LlamaForCausalLM built from our hf_config; if any tensor
were misplaced or the Q/K rows left in llama.cpp's order, the logits would differ grossly
(BENCH.md: the model then silently answers nothing). Runs in the normal suite (~30 s).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gguf")

from llmserve.loaders import load_checkpoint  # noqa: E402
from llmserve.loaders.load import default_model_path  # noqa: E402

PROMPTS = [
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "The three primary colors are",
]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def models():
    from transformers import AutoConfig, AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    torch.set_num_threads(1)
    torch.manual_seed(0)
    path = default_model_path()
    ckpt = load_checkpoint(None)

    ours = LlamaForCausalLM(LlamaConfig(**ckpt.hf_config)).to(torch.float32).eval()
    missing, unexpected = ours.load_state_dict(ckpt.weights, strict=False)
    # Tied embeddings: lm_head.weight is the embedding, which load_state_dict leaves alone.
    assert unexpected == []
    assert set(missing) <= {"lm_head.weight"}
    ours.tie_weights()
    assert torch.equal(ours.lm_head.weight, ckpt.weights["model.embed_tokens.weight"])

    # NOTE: from_pretrained(gguf_file=...) needs accelerate, which llmserve does not depend on;
    # these are the same transformers pieces it uses: the GGUF config parser, then its own
    # name mapping and reverse Q/K permutation (load_gguf_checkpoint).
    ref_config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    ref = LlamaForCausalLM(ref_config).to(torch.float32).eval()
    ref_weights = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=ref)["tensors"]
    missing, unexpected = ref.load_state_dict(ref_weights, strict=False)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}
    ref.tie_weights()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
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
