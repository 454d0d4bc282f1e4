"""Model families and their registry. Importing this package registers every family; use
`build_model(hf_config, weights, dtype, device)` to get a `CausalLM`."""

from llmserve.models import gemma, gemma3, granite, llama, phi3, qwen2, qwen3, smollm3  # noqa: F401  (register themselves)
from llmserve.models.registry import CausalLM, build_model, register, supported_architectures

__all__ = ["CausalLM", "build_model", "register", "supported_architectures"]
