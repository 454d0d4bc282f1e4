"""Model loading: Hugging Face folders, GGUF files, Hub ids and the default SmolLM2 model.

`load_checkpoint(model)` returns a `Checkpoint` (ARCHITECTURE.md, Seam 4): HF-named weights,
an HF config, the tokenizer source and chat template sources; every failure is a `LoadError`.
"""

from .checkpoint import Checkpoint, LoadError, QuantTensor
from .load import DEFAULT_MODEL_NAME, load_checkpoint

__all__ = ["Checkpoint", "LoadError", "QuantTensor", "load_checkpoint", "DEFAULT_MODEL_NAME"]
