"""The CUDA sources ship inside the package (llmserve/csrc), so that a pip-installed llmserve
can build its ops on a GPU machine; the repository's top-level csrc/ is a link to them."""

from pathlib import Path

import pytest

import llmserve
from llmserve.kernels import build


def test_sources_are_inside_the_package():
    package = Path(llmserve.__file__).resolve().parent
    src = build.source_dir()
    assert src == package / "csrc"
    names = {p.name for p in build.sources()}
    kernel_units = {f"paged_attention_{t}_hd{d}.cu" for t in ("f16", "bf16") for d in (64, 128)}
    assert {"ops.cpp", "paged_attention.cpp", "kv_cache.cu", "layer_ops.cu"} | kernel_units <= names
    # the headers they include ship beside them (build.sources() lists only what is compiled)
    for header in ("common.cuh", "dispatch.h", "paged_attention.h", "paged_attention_kernels.cuh"):
        assert (src / header).is_file(), header


def test_top_level_csrc_is_the_same_folder():
    root = Path(__file__).resolve().parents[2]
    if not (root / "csrc").exists():
        pytest.skip("an installed package tested outside a checkout")
    assert (root / "csrc").resolve() == build.source_dir()
