"""Shared fixtures: tiny random models built by the tests, and real servers to talk to."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import llmserve  # noqa: F401  (first: sets MKL's reproducible mode before any test computes)

sys.path.insert(0, str(Path(__file__).parent))

from server import ServerProcess  # noqa: E402
from tiny import build_tiny_llama  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    # NOTE: 2 cores are shared with any server a test starts; full-width torch on both
    # sides makes each step 8-22x slower (BENCH.md).
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def smol():
    """`llmserve run` on the default model (SmolLM2-135M-Instruct), shared by the end-to-end
    modules that need nothing else of it: a test must not assume what the others left in its
    prefix cache or counters (measure before and after instead)."""
    server = ServerProcess(None, "--max-model-len", "2048", "--kv-cache-memory", "256MiB")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_server(tiny_model):
    server = ServerProcess(str(tiny_model), "--served-model-name", "tiny",
                           "--served-model-name", "tiny-alias", "--num-kv-blocks", "200",
                           "--max-num-seqs", "32")
    yield server
    server.stop()
