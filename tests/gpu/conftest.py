"""GPU tests: tests marked `gpu` are skipped without a CUDA device, or without the toolchain
that builds llmserve's kernels (nvcc, ninja), with the reason in the skip message."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    from llmserve.kernels.build import missing_toolchain

    reason = missing_toolchain()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"needs a CUDA device and the kernel toolchain: {reason}")
    for item in gpu_items:
        item.add_marker(skip)


def pytest_runtest_logreport(report):
    """A failing gpu test's report, printed the moment it fails: a later test that takes the
    process down (a segfault inside a kernel call) would otherwise take pytest's end-of-run
    summary, and with it every failure's traceback, along. (Seen on the first H200 run.)"""
    if report.failed and "tests/gpu/" in report.nodeid.replace("\\", "/"):
        sys.stderr.write(f"\n==== FAILED {report.nodeid} ({report.when})\n{report.longreprtext}\n")
        sys.stderr.flush()
