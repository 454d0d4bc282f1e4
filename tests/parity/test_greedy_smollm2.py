"""Our greedy continuations of SmolLM2 (from its GGUF) equal transformers' on the same file.

Both sides get the same prompt token ids (the reference tokenizer's), so this checks the
model path alone: loading, dequantization, RoPE, attention over the paged cache, sampling.
It runs our fp32 path (`quantized_decode=False`): the default decode path reads the GGUF
blocks with int8-rounded activations, as llama.cpp does, and parts from fp32 greedy output
at near-ties; tests/unit/test_quant_kernels.py bounds how far.
"""

from __future__ import annotations

import pytest
import torch

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
N = 32


@pytest.fixture(scope="module")
def reference(hf_gguf_reference):
    model, tok = hf_gguf_reference
    out = []
    with torch.inference_mode():
        for p in PROMPTS:
            ids = tok(p, return_tensors="pt").input_ids
            # min_new_tokens bans eos, as our min_tokens does, so both run N steps.
            gen = model.generate(ids, max_new_tokens=N, min_new_tokens=N, do_sample=False,
                                 pad_token_id=tok.eos_token_id)
            cont = gen[0, ids.shape[1]:].tolist()
            out.append((ids[0].tolist(), tok.decode(cont, skip_special_tokens=True)))
    return out


def test_greedy_continuations_equal_transformers(reference):
    from llmserve import LLM

    llm = LLM(None, max_model_len=512, num_kv_blocks=64, quantized_decode=False)
    results = llm.generate([ids for ids, _ in reference],
                           {"max_tokens": N, "min_tokens": N, "temperature": 0})
    for (ids, ref_text), r in zip(reference, results):
        assert r.usage["completion_tokens"] == N
        assert r.text == ref_text
