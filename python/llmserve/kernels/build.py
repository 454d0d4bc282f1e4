"""Find csrc/ and build it into a torch extension on first use (torch.utils.cpp_extension.load).

The extension is compiled on the machine that runs it, for that machine's GPU, and cached by
torch (~/.cache/torch_extensions): the first call on a fresh machine compiles the sources (about
40 s of CPU time, spread by ninja over the cores), later processes load the cached library.
Nothing here runs at `import llmserve`; a machine without a GPU or nvcc never gets here (see
`llmserve.kernels.available`).

A machine without nvcc can use a library built elsewhere for the same torch, CUDA and GPU
architecture: `LLMSERVE_KERNELS_LIBRARY=/path/llmserve_kernels.so` loads it instead of building
(benches/compile_check.sh links one).
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

log = logging.getLogger("llmserve.kernels")

EXTENSION_NAME = "llmserve_kernels"
# NOTE: the same flags as benches/compile_check.sh, so the CPU-side compile check builds what
# a GPU machine builds. The __CUDA_NO_HALF* defines are added by torch itself.
CUDA_FLAGS = ["-O3", "--use_fast_math", "--expt-relaxed-constexpr"]
CXX_FLAGS = ["-O3"]
PREBUILT_ENV = "LLMSERVE_KERNELS_LIBRARY"


class KernelsUnavailable(RuntimeError):
    """The CUDA extension cannot be built or loaded here (no GPU, no nvcc, no ninja, no sources)."""


def source_dir() -> Path:
    """llmserve/csrc/: the CUDA sources live inside the package, so that an installed wheel can
    build them on a GPU machine (the repository's top-level csrc/ is a link to it)."""
    src = Path(__file__).resolve().parent.parent / "csrc"
    if not (src / "ops.cpp").is_file():
        raise KernelsUnavailable(f"llmserve's CUDA sources were not found at {src}")
    return src


def sources() -> list[Path]:
    src = source_dir()
    return sorted(src.glob("*.cpp")) + sorted(src.glob("*.cu"))


def prebuilt_library() -> Path | None:
    """The library LLMSERVE_KERNELS_LIBRARY names, loaded instead of building; None when unset."""
    path = os.environ.get(PREBUILT_ENV, "").strip()
    return Path(path) if path else None


def missing_toolchain() -> str | None:
    """Why the extension cannot be built (or its prebuilt library loaded) here, or None."""
    import torch

    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    if torch.version.cuda is None:
        return "this torch build has no CUDA support"
    if (library := prebuilt_library()) is not None:
        return None if library.is_file() else f"{PREBUILT_ENV}={library} is not a file"
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None or not (Path(cpp_extension.CUDA_HOME) / "bin" / "nvcc").exists():
        return ("nvcc (the CUDA compiler) was not found: install the CUDA toolkit matching torch "
                f"(CUDA {torch.version.cuda}) and set CUDA_HOME, or `pip install nvidia-cuda-nvcc`")
    if shutil.which("ninja") is None:
        return "ninja was not found: `pip install ninja` (torch builds extensions with it)"
    return None


def build_and_load(verbose: bool = False) -> Path:
    """Compile (or reuse the cached build of) csrc/ and load it into this process.
    Returns the shared library's path. Raises KernelsUnavailable with the reason."""
    reason = missing_toolchain()
    if reason is not None:
        raise KernelsUnavailable(f"cannot build llmserve's CUDA kernels: {reason}")
    if (library := prebuilt_library()) is not None:
        import torch

        try:
            torch.ops.load_library(str(library))
        except Exception as e:  # a library built for another torch or CUDA fails here
            raise KernelsUnavailable(f"loading {PREBUILT_ENV}={library} failed: {e}") from e
        log.info("loaded llmserve's CUDA kernels from %s (%s)", library, PREBUILT_ENV)
        return library
    from torch.utils import cpp_extension

    srcs = [str(p) for p in sources()]
    log.info("building/loading CUDA kernels from %s (the first build compiles them)", source_dir())
    try:
        cpp_extension.load(name=EXTENSION_NAME, sources=srcs, extra_cflags=CXX_FLAGS,
                           extra_cuda_cflags=CUDA_FLAGS, is_python_module=False, verbose=verbose)
    except Exception as e:  # compiler output is in the message; keep it
        raise KernelsUnavailable(f"building llmserve's CUDA kernels failed: {e}") from e
    build_dir = Path(cpp_extension._get_build_directory(EXTENSION_NAME, verbose=False))
    return build_dir / f"{EXTENSION_NAME}.so"
