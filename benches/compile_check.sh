#!/usr/bin/env bash
# Compile-check csrc/ for the H200 (sm_90) on a machine WITHOUT a GPU, then link the objects
# into a shared library and load it into torch to prove the op schemas register and that the
# Python wrappers' fake (meta) implementations agree with them.
#
#   bash benches/compile_check.sh            # uses nvcc on PATH / $CUDA_HOME, else installs
#                                            # nvidia-cuda-nvcc (matching torch's CUDA) into target/nvcc
#
# Needs a CUDA build of torch (its headers and libc10_cuda); never run by CI (it downloads nvcc).
# Prints ptxas register / spill figures for every instantiated kernel.
#
# For another torch than this Python's (a GPU machine's, say), unpack that torch wheel's include/
# and lib/ and name its torch/ folder, with an nvcc of that torch's CUDA (it holds the runtime):
#   COMPILE_CHECK_TORCH=/tmp/t/torch CUDA_HOME=/tmp/nvcc/nvidia/cu13 bash benches/compile_check.sh
# The library is then only linked, not loaded; LLMSERVE_KERNELS_LIBRARY loads it there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${COMPILE_CHECK_OUT:-target/compile_check}
mkdir -p "$OUT"

read -r TORCH_CUDA SITE ABI PYINC < <($PY - <<'EOF'
import sysconfig, torch, site
print(torch.version.cuda or "none", site.getsitepackages()[0], int(torch._C._GLIBCXX_USE_CXX11_ABI),
      sysconfig.get_paths()["include"])
EOF
)
if [ "$TORCH_CUDA" = none ]; then
  echo "compile_check: this torch is a CPU-only build (no CUDA headers); nothing to check" >&2
  exit 1
fi

NVCC=""
if [ -n "${CUDA_HOME:-}" ] && [ -x "$CUDA_HOME/bin/nvcc" ]; then
  NVCC="$CUDA_HOME/bin/nvcc"
elif command -v nvcc >/dev/null; then
  NVCC=$(command -v nvcc); CUDA_HOME=$(dirname "$(dirname "$NVCC")")
else
  major=${TORCH_CUDA%%.*}
  CUDA_HOME=target/nvcc/nvidia/cu$major
  if [ ! -x "$CUDA_HOME/bin/nvcc" ]; then
    # NOTE: pin the compiler's pieces (crt, nvvm, runtime headers) to the runtime torch uses;
    # left to themselves pip takes the newest, and a newer cicc emits PTX the ptxas rejects.
    V=$($PY -c "import importlib.metadata as m; print(m.version('nvidia-cuda-runtime'))" 2>/dev/null || echo "$TORCH_CUDA.*")
    echo "compile_check: installing nvidia-cuda-nvcc==$V into target/nvcc"
    $PY -m pip install -q --target target/nvcc "nvidia-cuda-nvcc==$V" "nvidia-cuda-crt==$V" "nvidia-nvvm==$V" \
      "nvidia-cuda-runtime==$V"
  fi
  NVCC="$CUDA_HOME/bin/nvcc"
fi
export CUDA_HOME
echo "compile_check: $($NVCC --version | tail -n 2 | head -n 1) | torch ${COMPILE_CHECK_TORCH:-CUDA $TORCH_CUDA}"

TORCH_DIR="${COMPILE_CHECK_TORCH:-$SITE/torch}"
# CUDA runtime headers / libs ship in the nvidia-cuda-runtime wheel next to torch (cu12 or cu13).
RT_DIR=$(ls -d "$SITE"/nvidia/cu1[0-9] "$SITE"/nvidia/cuda_runtime 2>/dev/null | head -n 1 || true)
[ -n "${COMPILE_CHECK_TORCH:-}" ] && RT_DIR=$CUDA_HOME
# NOTE: torch's runtime headers go first: pip may have pulled a newer runtime into the nvcc
# folder, and CCCL refuses headers newer than the compiler.
INCS=(-I"$TORCH_DIR/include" -I"$TORCH_DIR/include/torch/csrc/api/include" -I"$PYINC")
[ -n "$RT_DIR" ] && INCS+=(-I"$RT_DIR/include")
[ -n "$RT_DIR" ] && [ -d "$RT_DIR/include/cccl" ] && INCS+=(-I"$RT_DIR/include/cccl")
INCS+=(-I"$CUDA_HOME/include")
# torch >= 2.12 headers need C++20; older ones build as C++17 (what torch's own builder picks).
STD=c++17
grep -q "C++20 or later" "$TORCH_DIR/include/torch/csrc/api/include/torch/all.h" 2>/dev/null && STD=c++20
DEFS=(-DTORCH_EXTENSION_NAME=llmserve_kernels -DTORCH_API_INCLUDE_EXTENSION_H -D_GLIBCXX_USE_CXX11_ABI=$ABI)
# The same flags as python/llmserve/kernels/build.py (torch adds the __CUDA_NO_HALF* ones too).
NVFLAGS=(-std=$STD -O3 --use_fast_math -Xcompiler -fPIC -gencode arch=compute_90,code=sm_90
         -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__
         -D__CUDA_NO_HALF2_OPERATORS__ --expt-relaxed-constexpr -Xptxas -v -Werror all-warnings)

status=0
for src in csrc/*.cu; do
  obj="$OUT/$(basename "$src" .cu).o"
  echo "== nvcc $src"
  if ! $NVCC "${NVFLAGS[@]}" "${INCS[@]}" "${DEFS[@]}" -c "$src" -o "$obj" 2>"$OUT/$(basename "$src").log"; then
    cat "$OUT/$(basename "$src").log"; status=1; continue
  fi
  # ptxas -v: one "Compiling entry" line per kernel, then its registers / spills.
  $PY - "$OUT/$(basename "$src").log" <<'EOF'
import re, subprocess, sys
name = None
for line in open(sys.argv[1]):
    if m := re.search(r"Compiling entry function '(\w+)'", line):
        name = subprocess.run(["c++filt", m.group(1)], capture_output=True, text=True).stdout.strip()
        name = re.sub(r"\(anonymous namespace\)::|llmserve::", "", name)
        name = re.sub(r"^void |\(.*$", "", name)
    elif m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line):
        spills = f"spills {m.group(1)}/{m.group(2)} B"
    elif m := re.search(r"Used (\d+) registers.*?(?:(\d+) bytes smem)?$", line.strip()):
        print(f"   {name:58} {m.group(1):>3} regs  {m.group(2) or 0:>6} B smem  {spills}")
EOF
done
for src in csrc/*.cpp; do
  echo "== g++ $src"
  g++ -std=$STD -O2 -fPIC -Wall -Werror "${INCS[@]}" "${DEFS[@]}" -c "$src" -o "$OUT/$(basename "$src" .cpp).o" || status=1
done
[ $status -eq 0 ] || { echo "compile_check: FAILED"; exit 1; }

echo "== link $OUT/llmserve_kernels.so"
CUDART_DIR=${RT_DIR:+$RT_DIR/lib}
g++ -shared "$OUT"/*.o -o "$OUT/llmserve_kernels.so" -L"$TORCH_DIR/lib" -lc10 -lc10_cuda -ltorch -ltorch_cpu \
  -ltorch_cuda ${CUDART_DIR:+-L"$CUDART_DIR"} -l:libcudart.so."${TORCH_CUDA%%.*}" -Wl,--no-undefined \
  -Wl,-rpath,"$TORCH_DIR/lib"${CUDART_DIR:+,-rpath,"$CUDART_DIR"}

if [ -n "${COMPILE_CHECK_TORCH:-}" ]; then
  echo "compile_check: OK (built against $TORCH_DIR: linked, not loaded here)"
  exit 0
fi
echo "== load into torch, check schemas and fake implementations"
PYTHONPATH=python${PYTHONPATH:+:$PYTHONPATH} $PY - "$OUT/llmserve_kernels.so" <<'EOF'
import sys
import torch
from llmserve import kernels

kernels.load_library(sys.argv[1])
for name in ("paged_attention_decode", "write_kv_cache", "rms_norm", "fused_add_rms_norm", "silu_and_mul",
             "rotary_embedding"):
    print("  ", getattr(torch.ops.llmserve, name).default._schema)
kernels.check_fake_impls()
print("   fake implementations: ok (meta-device calls of every op)")
EOF
echo "compile_check: OK"
