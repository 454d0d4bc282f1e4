#!/usr/bin/env bash
# The GPU check, in ONE call of a few minutes on a CUDA machine (an H200 when the device tool
# lends one): build the csrc extension, run the gpu tests, run the kernel micro-benchmark,
# serve BENCH.md's GPU `load` workload (serve_load.py's `load-gpu`: ~1,024-token prompts, 128
# out) with `llmserve run --device cuda` at concurrency 1 / 64 / 256 (and once with ~100-token
# prompts), then side by side with LLMSERVE_FUSED_OPS=1, with that and
# LLMSERVE_PIECEWISE_GRAPHS=1, and with those and LLMSERVE_PREFILL_ATTENTION=varlen, and last
# profile decode and prefill steps (benches/step_profile.py) in what time is left; print one
# summary table. `make gpu-check` runs it.
# The first H200 run (2026-12-04) took 110 s of its 480. (It served 256 with
# --async-scheduling off too: 12.0k out tok/s against 14.4k with it on, ~100-token prompts.)
#
# Two modes:
#   bash benches/gpu_check.sh prepare   HERE (network, no GPU): fill target/gpu-carry with what
#                                       the GPU machine lacks: wheels for starlette, uvicorn,
#                                       orjson and gguf (Python 3.12), and a SmolLM2-135M-shaped model
#                                       folder without weights (config, tokenizer, template).
#   bash benches/gpu_check.sh           THERE. With the device tool:
#       run(command="bash benches/gpu_check.sh", timeout_s=600,
#           carry=["target/gpu-carry", "python/llmserve/_core.abi3.so"])
#     The Rust core travels as the abi3 extension built here (one build serves 3.11 and 3.12).
#
# GPU_CHECK_STAGES="bench serve" (say) runs only those of the stages after the build: tests,
# bench, serve, profile. GPU_CHECK_PREBUILT=1 loads the carried library instead of building.
#
# The GPU machine reaches no network, and the default model (a 98 MB GGUF) does not fit the
# 64 MiB a call may carry, so the serving benchmark uses SmolLM2-135M's exact shapes with
# random bf16 weights generated there: same FLOPs and bytes per token; `ignore_eos` fixes the
# output lengths, so the figures do not depend on the weights. Without the wheels the HTTP
# part is skipped with a message. Results also land in $OUT (when set) or target/gpu-check.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
CARRY=target/gpu-carry

if [ "${1:-}" = prepare ]; then
  set -e
  mkdir -p "$CARRY/wheels"
  rm -f "$CARRY"/wheels/*.whl
  # pure-Python or manylinux wheels for the GPU image's Python 3.12; the rest of their
  # dependencies (anyio, h11, click, typing-extensions) are already there (KINDS.md)
  for pkg in starlette==1.10.0 uvicorn==0.54.0 orjson==3.13.0 gguf==0.19.0; do
    $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d "$CARRY/wheels" "$pkg"
  done
  PYTHONPATH=python $PY - "$CARRY/smollm2-shape" <<'EOF'
import json, sys
from pathlib import Path

from llmserve.loaders import load_checkpoint

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
ck = load_checkpoint(None)                       # the default SmolLM2-135M-Instruct GGUF
cfg = dict(ck.hf_config, torch_dtype="bfloat16")
(out / "config.json").write_text(json.dumps(cfg, indent=1))
(out / "generation_config.json").write_text(json.dumps(ck.generation_config or {}))
# tokenizer.json from the GGUF vocabulary (transformers converts GGUF tokenizers)
from transformers import AutoTokenizer
from llmserve.loaders.load import default_model_path
gguf = Path(default_model_path())
tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
tok.save_pretrained(str(out))
tc = json.loads((out / "tokenizer_config.json").read_text())
tc["chat_template"] = ck.template_sources.get("gguf") or tc.get("chat_template")
tc["eos_token"] = ck.special_tokens.get("eos_token")
(out / "tokenizer_config.json").write_text(json.dumps(tc, indent=1))
print("model folder (no weights):", out, sorted(p.name for p in out.iterdir()))
EOF
  du -sh "$CARRY"
  [ -f python/llmserve/_core.abi3.so ] || echo "NOTE: build the Rust core first (make build): python/llmserve/_core.abi3.so is carried"
  echo "prepared. On the GPU machine: bash benches/gpu_check.sh (carry target/gpu-carry and python/llmserve/_core.abi3.so)"
  exit 0
fi

RESULTS=${OUT:-target/gpu-check}
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16}
T0=$(date +%s)
# The device tool kills a command at 600 s, and a killed script prints no table. So every
# stage gets at most what is left before DEADLINE, a stage that no longer fits is skipped
# (the table says so), and the summary runs on any exit.
DEADLINE=$(( T0 + ${GPU_CHECK_SECONDS:-540} ))
stamp() { echo "[gpu_check +$(( $(date +%s) - T0 ))s] $*"; }
# budget CAP: seconds the next stage may take: at most CAP, 0 once fewer than 20 are left
budget() {
  local left=$(( DEADLINE - $(date +%s) - 10 ))
  (( left > $1 )) && left=$1
  (( left < 20 )) && left=0
  echo $left
}
BUILD=skipped TESTS=skipped BENCH=skipped SERVE=skipped SKIPPED="" SERVER="" PORT=18123

ready() { $PY -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$PORT/ready', timeout=2)" 2>/dev/null; }
stop_server() {
  # SIGTERM drains what is in flight (a load run cut by its timeout leaves requests): bounded
  kill "$SERVER" 2>/dev/null
  timeout 20 tail --pid="$SERVER" -f /dev/null 2>/dev/null || kill -9 "$SERVER" 2>/dev/null
  wait "$SERVER" 2>/dev/null
  SERVER=""
}

summary() {
  [ -n "$SERVER" ] && stop_server
  stamp "summary"
  # how the server ran: KV-cache size, graphs captured, or why the kernels were not used
  [ -s "$RESULTS/server.log" ] && grep -E "KV cache:|captured|CUDA kernels not used|capture failed|Traceback" \
    "$RESULTS/server.log" | head -n 8
  $PY - "$RESULTS" "$BUILD" "$TESTS" "$BENCH" "$SERVE" "$SKIPPED" <<'EOF'
import json, sys
from pathlib import Path
res, build, tests, bench, serve, skipped = Path(sys.argv[1]), *sys.argv[2:7]


def num(x, spec):       # a run where every request failed has null (NaN) figures
    return "n/a" if x is None else format(x, spec)


print("=" * 78)
print(f"{'extension build':28} {build}")
parts = [x.strip() for x in tests.split("; ") if x.strip()]
print(f"{'gpu tests':28} {parts[0] if len(parts) == 1 else ''}")
for x in parts[1:] if len(parts) == 1 else parts:
    print(f"  {x}")
print(f"{'kernel micro-benchmark':28} {bench}")
kb = res / "kernel_bench.json"
if kb.is_file():
    data = json.loads(kb.read_text())
    print(f"{'copy bandwidth (measured)':28} {data['copy_tbs']:.2f} TB/s")
    for r in data["rows"]:
        goal = "  goal >= 65% peak" if r["batch"] * r["ctx"] >= 64 * 1024 else ""
        table = f" (table {r['table']})" if r.get("table", r["ctx"]) > r["ctx"] else ""
        print(f"decode {r['shape']:13} {r['batch']:4d}x{r['ctx']:<5d}{table} {r['us']:8.1f} us {r['tbs']:5.2f} TB/s "
              f"{r['pct_peak']:5.1f}% peak {r['pct_copy']:5.1f}% copy{goal}")
        if "pipelined_us" in r:
            print(f"  pipelined kernel (LLMSERVE_DECODE_PIPELINE=1): {r['pipelined_us']:.1f} us, "
                  f"{r['pipelined_pct_peak']:.1f}% peak")
        if "best_splits" in r and r["best_splits"] != r["splits"]:
            print(f"  ({r['splits']} splits chosen; {r['best_splits']} are faster: "
                  f"{r['best_us']:.1f} us, {r['best_pct_peak']:.1f}% peak)")
    for r in data.get("steps", []):
        goal = "  goal <= 1.3 ms" if r["batch"] == 1 and r["graphs"] else ""
        print(f"decode step smollm2 shape batch {r['batch']:3d} {'graphs' if r['graphs'] else 'eager':6} "
              f"{'fused' if r.get('fused') else 'torch':5} {r['step_ms']:7.3f} ms {r['tok_s']:9.0f} tok/s{goal}")
print(f"{'serving benchmark':28} {serve}")
sl = res / "serve_load.jsonl"
for line in sl.read_text().splitlines() if sl.is_file() else []:
    if line.startswith("{"):
        row = json.loads(line)
        print(f"serve {row['config']:8} {row['workload']:14} out {num(row.get('out_tok_s'), '7.0f')} tok/s "
              f"(server {num(row.get('server_gen_tok_s'), '7.0f')})  TTFT p50 {num(row.get('ttft_p50_ms'), '7.1f')} ms  "
              f"TPOT p50 {num(row.get('tpot_p50_ms'), '6.2f')} ms  failed {row.get('failed', 0)}")
if (res / "serve_load.jsonl").is_file():
    print("goals: load-gpu@c256 >= 30k out tok/s; batch-1 step (TPOT @c1) <= 1.3 ms")
if skipped.strip():
    print(f"{'skipped for time':28} {skipped.strip()}")
print("=" * 78)
EOF
}
trap summary EXIT

stamp "environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
$PY -c "import sys, torch; print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda', torch.version.cuda, '| device', torch.cuda.get_device_name() if torch.cuda.is_available() else None)"
# the build uses torch's CUDA_HOME, which need not be the nvcc on PATH
CUDA_HOME_TORCH=$($PY -c "from torch.utils.cpp_extension import CUDA_HOME; print(CUDA_HOME or '')" 2>/dev/null)
if [ -z "$CUDA_HOME_TORCH" ] && [ -x /usr/local/cuda/bin/nvcc ]; then
  export CUDA_HOME=/usr/local/cuda
  CUDA_HOME_TORCH=$CUDA_HOME
fi
echo "CUDA_HOME (torch): ${CUDA_HOME_TORCH:-none}"
command -v nvcc >/dev/null && nvcc --version | tail -n 2 | head -n 1
# the carried wheels before the tests: they import orjson too
if ls "$CARRY"/wheels/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$CARRY"/wheels/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
$PY -m pip show anyio h11 click 2>/dev/null | grep -E '^(Name|Version)' | paste -d ' ' - - | tr '\n' ';'; echo
# Without the carried core and wheels every stage after the build fails on an import: stop now
# rather than spend the device's minutes on ImportErrors.
if ! $PY -c "import llmserve._core, orjson" 2>/dev/null; then
  echo "ERROR: llmserve._core or orjson does not import: run 'bash benches/gpu_check.sh prepare' on the" \
       "CPU machine, then carry target/gpu-carry and python/llmserve/_core.abi3.so"
  exit 3
fi

load_kernels() {   # build (or load LLMSERVE_KERNELS_LIBRARY's) kernels in a fresh process
  local T
  T=$(budget 240)
  (( T > 0 )) || return 1
  timeout -k 10 "$T" $PY -c "
import time; t = time.time()
from llmserve import kernels
kernels.load()
print(f'kernels loaded in {time.time() - t:.0f} s')" 2>&1 | tee -a "$RESULTS/build.log" | tail -n 30
  grep -q "kernels loaded" "$RESULTS/build.log" 2>/dev/null
}
# A library linked here for the GPU machine's torch (benches/compile_check.sh with
# COMPILE_CHECK_TORCH), carried as $CARRY/llmserve_kernels.so, stands in when the build there
# fails, or replaces it with GPU_CHECK_PREBUILT=1 (a second call that cannot spend the build).
PREBUILT=$PWD/$CARRY/llmserve_kernels.so
: > "$RESULTS/build.log"
if [ "${GPU_CHECK_PREBUILT:-0}" = 1 ] && [ -f "$PREBUILT" ]; then
  stamp "load the carried prebuilt kernels library"
  export LLMSERVE_KERNELS_LIBRARY=$PREBUILT
  if load_kernels; then BUILD="not built: carried library loaded"; else BUILD=FAILED; fi
else
  stamp "build the CUDA extension (cached after the first build)"
  if load_kernels; then BUILD=ok; else BUILD=FAILED; fi
  if [ "$BUILD" = FAILED ] && [ -f "$PREBUILT" ]; then
    stamp "the build failed: load the carried prebuilt kernels library instead"
    export LLMSERVE_KERNELS_LIBRARY=$PREBUILT
    load_kernels && BUILD="FAILED (build.log); carried library loaded"
  fi
fi
KERNELS=no
grep -q "kernels loaded" "$RESULTS/build.log" && [[ "$BUILD" != FAILED ]] && KERNELS=yes

# GPU_CHECK_STAGES picks the stages after the build, for a second, shorter call (default: all).
stage() { [[ " ${GPU_CHECK_STAGES:-tests bench serve profile} " == *" $1 "* ]]; }
if [ "$KERNELS" = yes ] && stage tests; then
  stamp "gpu tests"
  # One process per file, so a crash in one (the first H200 run segfaulted inside a kernel
  # call) costs only that file's remaining tests; tests/gpu/conftest.py prints each failure
  # as it happens. A crashed file is run again under cuda-gdb for a native backtrace.
  # -W default: the GPU image's packages are not our pins, and a deprecation warning there
  # (an error under pyproject's filterwarnings) should be listed, not cost a kernel check.
  : > "$RESULTS/tests.log"
  TESTS=""
  # The kernels first; test_cuda_path_cpu.py runs on CPU in CI, not here. test_cuda_model.py
  # builds engines and captures graphs with each option, so it gets longer.
  for file in tests/gpu/test_kernels.py $(ls tests/gpu/test_*.py | grep -v -e "_cpu\.py$" -e "test_kernels\.py$"); do
    cap=90
    [[ $file == *cuda_model* ]] && cap=180
    T=$(budget $cap)
    if (( T == 0 )); then SKIPPED+=" $(basename "$file")"; continue; fi
    echo "== $file" >> "$RESULTS/tests.log"
    from=$(( $(wc -l < "$RESULTS/tests.log") + 1 ))
    timeout -k 10 "$T" $PY -m pytest -q -p no:cacheprovider -W default "$file" >> "$RESULTS/tests.log" 2>&1
    rc=$?
    # (this file's own summary line: none when it ran no test)
    line=$(tail -n +"$from" "$RESULTS/tests.log" | grep -E "passed|failed|error|skipped" | tail -n 1 | sed 's/=//g; s/^ *//; s/ *$//')
    [ -n "$line" ] || line="no summary (rc $rc)"
    if (( rc == 139 || rc == 134 )); then
      crashed=$(grep -oE "line [0-9]+ in test_[A-Za-z0-9_]+" "$RESULTS/tests.log" | tail -n 1 | awk '{print $4}')
      line="CRASHED (rc $rc) in ${crashed:-?}"
      T=$(budget 60)
      if [ -n "$crashed" ] && (( T > 0 )) && command -v cuda-gdb >/dev/null; then
        echo "== cuda-gdb backtrace of $file -k $crashed" >> "$RESULTS/tests.log"
        timeout -k 10 "$T" cuda-gdb -q -batch -ex run -ex bt --args $PY -m pytest -q -p no:cacheprovider \
          -p no:faulthandler -W default "$file" -k "$crashed" 2>&1 | grep -vE "^\[(New )?Thread|Detaching" \
          | tail -n 60 >> "$RESULTS/tests.log"
      fi
    elif (( rc == 124 )); then
      line="cut at $T s"
    fi
    TESTS+="$(basename "$file" .py): ${line:-no result}; "
  done
  grep -E "^== tests|^==== FAILED|Error|CRASHED|^#[0-9]+ " "$RESULTS/tests.log" | head -n 80
fi
if [ "$KERNELS" = yes ] && stage bench; then
  stamp "kernel micro-benchmark"
  STEP=()
  [ -f "$CARRY/smollm2-shape/config.json" ] && STEP=(--step-config "$CARRY/smollm2-shape/config.json")
  T=$(budget 150)
  if (( T > 0 )); then
    # (its table is kernel_bench.json; $OUT brings back 8 files at most)
    if timeout -k 10 "$T" $PY benches/kernel_bench.py --json "$RESULTS/kernel_bench.json" "${STEP[@]}" 2>&1
    then BENCH=ok; else BENCH="FAILED or cut at $T s"; fi
  else
    SKIPPED+=" kernel-bench"
  fi
fi
# serve_runs LABEL "workload:c:n ..." [server flags]: one server, serve_load.py's workload at
# each concurrency c with n prompts, rows appended to serve_load.jsonl with config LABEL;
# "workload:c:n:warm" runs without keeping its row (a warm-up). BENCH.md's GPU `load` is serve_load's `load-gpu`
# (~1,024-token prompts); `load` (~100-token prompts) is the CPU one.
serve_runs() {
  local label=$1 specs=$2 T spec c n workload warm
  shift 2
  T=$(budget 90)
  if (( T == 0 )); then SKIPPED+=" server($label)"; return; fi
  stamp "llmserve run --device cuda --max-num-seqs 256 $* ($label)"
  $PY -m llmserve.cli run "$MODEL" --device cuda --host 127.0.0.1 --port $PORT --max-num-seqs 256 \
    --max-model-len 2048 --served-model-name smollm2-shape "$@" >> "$RESULTS/server.log" 2>&1 &
  SERVER=$!
  local until=$(( $(date +%s) + T ))   # weights load, KV allocation and graph capture
  while (( $(date +%s) < until )); do
    ready && break
    kill -0 "$SERVER" 2>/dev/null || break
    sleep 0.5
  done
  if ready; then
    [ "$SERVE" = skipped ] && SERVE=ok
    for spec in $specs; do
      IFS=: read -r workload c n warm <<< "$spec"
      T=$(budget 120)
      if (( T == 0 )); then SKIPPED+=" $workload@c$c($label)"; continue; fi
      stamp "$workload workload: concurrency $c, $n prompts${warm:+ (warm-up)}"
      timeout -k 10 "$T" $PY benches/serve_load.py --url "http://127.0.0.1:$PORT" --served-name smollm2-shape \
        --workload "$workload" --concurrency "$c" --num-prompts "$n" > "$RESULTS/last_run.json" || SERVE=partial
      # (one file for every server's rows, each labelled: $OUT brings back 8 files at most)
      [ -n "$warm" ] || $PY - "$RESULTS/last_run.json" "$label" <<'EOF' | tee -a "$RESULTS/serve_load.jsonl"
import json, sys
text = open(sys.argv[1]).read()
if "{" in text:
    row, _ = json.JSONDecoder().raw_decode(text, text.find("{"))
    print(json.dumps(dict(row, config=sys.argv[2])))
EOF
    done
    rm -f "$RESULTS/last_run.json"
  else
    echo "server did not become ready:"; tail -n 40 "$RESULTS/server.log"; SERVE=FAILED
  fi
  stop_server
}

if ! stage serve; then
  :
elif ! $PY -c "import starlette, uvicorn, orjson, llmserve._core" 2>/dev/null; then
  echo "SKIP serving benchmark: starlette/uvicorn/orjson or llmserve._core missing (run 'bash benches/gpu_check.sh prepare' here and carry target/gpu-carry + python/llmserve/_core.abi3.so)"
elif [ ! -f "$CARRY/smollm2-shape/config.json" ]; then
  echo "SKIP serving benchmark: $CARRY/smollm2-shape is missing (bash benches/gpu_check.sh prepare)"
elif [ "$KERNELS" != yes ]; then
  echo "SKIP serving benchmark: the kernels did not build"
elif (( $(budget 60) == 0 )); then
  SKIPPED+=" serving"
else
  stamp "random bf16 weights with SmolLM2-135M's shapes"
  MODEL=/tmp/smollm2-shape
  rm -rf "$MODEL"; cp -r "$CARRY/smollm2-shape" "$MODEL"
  $PY - "$MODEL" <<'EOF'
import json, sys
from pathlib import Path
sys.path.insert(0, "benches")
from kernel_bench import random_weights
from safetensors.torch import save_file

folder = Path(sys.argv[1])
w = {k: t.cpu() for k, t in random_weights(json.loads((folder / "config.json").read_text())).items()}
save_file(w, str(folder / "model.safetensors"))
print(f"{sum(t.numel() for t in w.values()) / 1e6:.0f}M parameters written")
EOF
  : > "$RESULTS/server.log"; : > "$RESULTS/serve_load.jsonl"
  serve_runs base "load-gpu:1:32 load-gpu:64:512 load-gpu:256:1000 load:256:1000"
  # side by side, each server warmed up first as the first was by its earlier runs (c1 is the
  # batch-1 step's TPOT): the fused layer ops (csrc/layer_ops.cu); those and the piecewise
  # graphs for steps with prompt tokens (cuda_graphs.PiecewiseGraphs); those and every prompt
  # chunk of a step in one varlen_attn call (cuda_attention.py), which leaves a piecewise step
  # a few launches per layer between its pieces
  if [ "$SERVE" = ok ]; then
    LLMSERVE_FUSED_OPS=1 serve_runs fused "load-gpu:64:128:warm load-gpu:1:32 load-gpu:256:1000"
    LLMSERVE_FUSED_OPS=1 LLMSERVE_PIECEWISE_GRAPHS=1 serve_runs fused+pw \
      "load-gpu:64:128:warm load-gpu:256:1000 load-gpu:1:32"
    LLMSERVE_FUSED_OPS=1 LLMSERVE_PIECEWISE_GRAPHS=1 LLMSERVE_PREFILL_ATTENTION=varlen serve_runs fused+pw+vl \
      "load-gpu:64:128:warm load-gpu:256:1000"
  fi
fi
# Last: the step profile explains the figures above but is none of them, so it takes what
# time the serving left.
if [ "$KERNELS" = yes ] && stage profile; then
  stamp "decode and prefill steps, profiled"
  T=$(budget 90)
  if (( T > 0 )) && [ -f "$CARRY/smollm2-shape/config.json" ]; then
    timeout -k 10 "$T" $PY benches/step_profile.py "$CARRY/smollm2-shape/config.json" > "$RESULTS/profile.log" 2>&1
    grep -E "^== |one step ahead" "$RESULTS/profile.log" || tail -n 20 "$RESULTS/profile.log"
  else
    SKIPPED+=" step-profile"
  fi
fi
