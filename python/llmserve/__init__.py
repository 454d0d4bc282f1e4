"""llmserve: an OpenAI-compatible LLM inference server.

The public Python API: `LLM` (offline generation and chat, answering `Result`s; its params
may be vLLM's `SamplingParams`; `beam_search` takes its `BeamSearchParams`, `embed` and
`score` its `PoolingParams`),
`AsyncEngine` (submit request bytes, iterate response bytes), `create_app` (an ASGI app to
mount or serve) and the `Config` both take; `ApiError` is the base of every request error
(one subclass per status: `BadRequestError`, also a `ValueError` as vLLM's offline errors,
`AuthenticationError`, `NotFoundError`,
`MethodNotAllowedError`, `PayloadTooLargeError`, `InternalServerError`,
`ServiceUnavailableError`), `LoadError` a model that cannot be loaded or served as configured. The Rust core lives in
the private `llmserve._core`.
"""

import importlib
import os as _os
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# NOTE: before anything loads torch and MKL reads it: MKL's strict reproducible mode makes an
# fp32 GEMM's row the same bits however many rows the GEMM has, which prompt tokens computed
# around the prefix cache rely on (worker/threads.py: reproducible_blas). An explicit setting wins.
_os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

# every request error, in the OpenAI shape: the base, then one class per status
_ERRORS = ("ApiError", "BadRequestError", "AuthenticationError", "NotFoundError", "MethodNotAllowedError",
           "PayloadTooLargeError", "InternalServerError", "ServiceUnavailableError")

__all__ = ["LLM", "Result", "SamplingParams", "BeamSearchParams", "PoolingParams", "AsyncEngine", "create_app",
           "Config", *_ERRORS, "LoadError", "__version__"]

if TYPE_CHECKING:
    from llmserve._core import (ApiError, AuthenticationError, BadRequestError, InternalServerError,
                                MethodNotAllowedError, NotFoundError, PayloadTooLargeError,
                                ServiceUnavailableError)
    from llmserve.config import Config
    from llmserve.engine.async_engine import AsyncEngine
    from llmserve.engine.offline import LLM, Result
    from llmserve.engine.pooling import PoolingParams
    from llmserve.engine.sampling_params import BeamSearchParams, SamplingParams
    from llmserve.loaders.checkpoint import LoadError
    from llmserve.server.app import create_app

# NOTE: imported lazily so `import llmserve` (and the CLI's --help) does not pay for torch.
_LAZY = {
    "LLM": "llmserve.engine.offline",
    "Result": "llmserve.engine.offline",
    "SamplingParams": "llmserve.engine.sampling_params",
    "BeamSearchParams": "llmserve.engine.sampling_params",
    "PoolingParams": "llmserve.engine.pooling",
    "AsyncEngine": "llmserve.engine.async_engine",
    "create_app": "llmserve.server.app",
    "Config": "llmserve.config",
    **{name: "llmserve._core" for name in _ERRORS},
    # a model that cannot be loaded (missing, unsupported)
    "LoadError": "llmserve.loaders.checkpoint",
}


def __dir__() -> list[str]:
    # (the lazy names too, for completion and `help(llmserve)`)
    return sorted({*globals(), *_LAZY})


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'llmserve' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
