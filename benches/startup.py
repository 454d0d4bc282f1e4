"""Startup: seconds from starting `llmserve run` (default model) to `/ready` answering 200, and
from SIGTERM to exit, for one or more Python interpreters side by side (each with its own
llmserve installed, e.g. a venv holding a wheel of an older commit), alternating runs.

    python benches/startup.py [--python /path/to/other/python ...] [--repeats 3] [--port 8795]

Without --python it times this interpreter only. Prints each run's figures and the medians.
"""

from __future__ import annotations

import argparse
import signal
import statistics
import subprocess
import sys
import time

import httpx


def one_start(python: str, port: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    proc = subprocess.Popen([python, "-m", "llmserve.cli", "run", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/")
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{python}: llmserve run exited with {proc.returncode}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        ready = time.perf_counter() - t0
        t1 = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        return ready, time.perf_counter() - t1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", action="append", default=[], help="another interpreter to time")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--port", type=int, default=8795)
    args = ap.parse_args()
    pythons = [sys.executable, *args.python]
    runs: dict[str, list[tuple[float, float]]] = {p: [] for p in pythons}
    for _ in range(args.repeats):
        for python in pythons:
            runs[python].append(one_start(python, args.port))
    for python, got in runs.items():
        ready = [r for r, _ in got]
        stop = [s for _, s in got]
        print(f"{python}: ready {', '.join(f'{r:.2f}' for r in ready)} s (median "
              f"{statistics.median(ready):.2f}); stop {', '.join(f'{s:.2f}' for s in stop)} s")


if __name__ == "__main__":
    main()
