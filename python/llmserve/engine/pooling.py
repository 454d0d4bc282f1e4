"""vLLM's `PoolingParams` and pooling outputs, for code written against vLLM's `LLM.embed` and
`LLM.score`.

`LLM.embed(prompts, pooling_params=PoolingParams(dimensions=32))` answers as vLLM's does: a
list of `EmbeddingRequestOutput`, one per prompt in order, whose `outputs.embedding` is the
vector (`np.asarray(outputs)` gives them all as float32 [N, D]). A `PoolingParams` stands for
the /v1/embeddings fields that hold the same values, so what it asks is validated as a
request to the server is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class PoolingParams:
    """vLLM's `PoolingParams` for an embedding model: `dimensions` (a Matryoshka model's
    leading dimensions), `normalize` (L2-normalize; vLLM's newer name for it is
    `use_activation`: either may be set), `truncate_prompt_tokens` (keep the prompt's last k
    tokens; -1: as many as the context holds). None leaves each to the route's default. Each
    is the request field of its name (docs/FIELDS.md); the classification switches
    (`softmax`, `activation`) are reported as fields without effect: no classifier is
    served."""

    truncate_prompt_tokens: int | None = None
    dimensions: int | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    softmax: bool | None = None
    activation: bool | None = None

    def request_fields(self) -> dict[str, Any]:
        """The request fields of the same names, those that are set (the route checks them:
        `normalize` and `use_activation` disagreeing is its 400)."""
        return {name: value for name, value in vars(self).items() if value is not None}


@dataclass(frozen=True)
class EmbeddingOutput:
    """One prompt's vector, as vLLM's `EmbeddingOutput`."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(frozen=True)
class EmbeddingRequestOutput:
    """One prompt's answer, as vLLM's `EmbeddingRequestOutput`: `outputs.embedding`, the
    `prompt_token_ids` that were pooled (after any truncation), `request_id`. As an array
    (`np.asarray`) it is the vector, float32."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        return np.asarray(self.outputs.embedding, dtype or np.float32)


@dataclass(frozen=True)
class ScoringOutput:
    """One pair's score, as vLLM's `ScoringOutput`."""

    score: float


@dataclass(frozen=True)
class ScoringRequestOutput:
    """One pair's answer, as vLLM's `ScoringRequestOutput`: `outputs.score`, and the
    `prompt_token_ids` of both texts (the first's, then the second's), as vLLM joins them for
    an embedding model's score."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True
