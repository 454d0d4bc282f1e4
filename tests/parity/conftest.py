"""transformers' own reading of the default SmolLM2 GGUF, loaded once for the parity tests.

Each of transformers' GGUF reads (config, tensors, tokenizer) parses the file's metadata anew,
5-12 s apiece here; the two modules that compare against it share one.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="package")
def hf_gguf_reference():
    """(model, tokenizer): transformers' LlamaForCausalLM in fp32 and its tokenizer, both built
    by transformers from the default GGUF with its own config parser, name map and reverse Q/K
    permutation (what from_pretrained(gguf_file=...) does)."""
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from llmserve.loaders.load import default_model_path

    path = default_model_path()
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    weights = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(weights, strict=False)
    # Tied embeddings: lm_head.weight is the embedding, which load_state_dict leaves alone.
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model, tok
