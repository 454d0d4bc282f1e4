"""The model worker: `ModelRunner.execute(plan) -> SampleOutput` over a paged KV cache, with the
CPU torch attention path and the vectorized sampler."""

from llmserve.worker.runner import ModelRunner
from llmserve.worker.sampler import SampleOutput, Sampler

__all__ = ["ModelRunner", "SampleOutput", "Sampler"]
