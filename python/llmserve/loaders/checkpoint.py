"""The Checkpoint a loader hands to the rest of llmserve, and the one error loaders raise.

A Checkpoint is everything the server needs from a model on disk, already read: the HF
config (for GGUF files, an equivalent one built from the metadata), the weights under Hugging
Face parameter names, where the tokenizer comes from (a tokenizer.json path or the GGUF
vocabulary), the chat template sources (resolution happens in the Rust router), the special
tokens and generation_config.json. Nothing downstream opens model files again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class LoadError(Exception):
    """A model could not be loaded; the message says what is wrong and what to do about it."""


@dataclass(frozen=True)
class Checkpoint:
    name: str                          # default served model name
    hf_config: dict                    # config.json (GGUF: an equivalent HF config)
    weights: dict[str, torch.Tensor]   # HF parameter names; GGUF: dequantized float32, Q/K un-permuted
    tokenizer_json: str | None         # path of tokenizer.json (HF folders)
    gguf_vocab: dict | None            # GgufVocab (rust/router tokenizer.rs) as a dict (GGUF files)
    template_sources: dict             # TemplateSources (rust/router template.rs) as a dict
    bos_token: str | None
    eos_token: str | None
    eos_token_ids: list[int]
    generation_config: dict = field(default_factory=dict)

    def __repr__(self) -> str:
        # The default repr would print every tensor; this is what a log line wants.
        n_params = sum(t.numel() for t in self.weights.values())
        arch = (self.hf_config.get("architectures") or ["?"])[0]
        return (
            f"Checkpoint(name={self.name!r}, arch={arch}, tensors={len(self.weights)}, "
            f"params={n_params}, tokenizer={'gguf' if self.gguf_vocab else self.tokenizer_json!r})"
        )


def empty_template_sources() -> dict:
    """TemplateSources with every slot empty; loaders fill the slots their format has."""
    return {"cli": None, "folder_jinja": None, "tokenizer_config": None, "gguf": None}
