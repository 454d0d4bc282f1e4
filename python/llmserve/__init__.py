"""llmserve: an OpenAI-compatible LLM inference server.

The public Python API: `LLM` (offline generation and chat), `AsyncEngine` (submit request
bytes, iterate response bytes) and `create_app` (an ASGI app to mount or serve). The Rust
core lives in the private `llmserve._core`.
"""

import os as _os

__version__ = "0.1.0"

# NOTE: before anything loads torch and MKL reads it: MKL's strict reproducible mode makes an
# fp32 GEMM's row the same bits however many rows the GEMM has, which prompt tokens computed
# around the prefix cache rely on (worker/threads.py: reproducible_blas). An explicit setting wins.
_os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

__all__ = ["LLM", "AsyncEngine", "create_app", "__version__"]


def __getattr__(name: str):
    # NOTE: imported lazily so `import llmserve` (and the CLI's --help) does not pay for torch.
    if name == "LLM":
        from llmserve.engine.offline import LLM

        return LLM
    if name == "AsyncEngine":
        from llmserve.engine.async_engine import AsyncEngine

        return AsyncEngine
    if name == "create_app":
        from llmserve.server.app import create_app

        return create_app
    raise AttributeError(name)
