"""llmserve: an OpenAI-compatible LLM inference server.

The public Python API: `LLM` (offline generation and chat), `AsyncEngine` (submit request
bytes, iterate response bytes) and `create_app` (an ASGI app to mount or serve). The Rust
core lives in the private `llmserve._core`.
"""

__version__ = "0.1.0"

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
