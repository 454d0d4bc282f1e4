"""Model families and their registry. Importing this package registers every family; use
`build_model(hf_config, weights, dtype, device)` to get a `CausalLM`."""

# (each family module registers itself when imported)
from llmserve.models import (cohere, gemma, gemma3, gpt2, gpt_neox, granite, llama, moe,  # noqa: F401
                             olmo2, phi, phi3, qwen2, qwen3, smollm3, stablelm, starcoder2)
from llmserve.models.registry import CausalLM, build_model, normalize_config, register, supported_architectures

__all__ = ["CausalLM", "build_model", "normalize_config", "register", "supported_architectures"]
