"""The serving stack's own ceiling: `llmserve run` with a model runner that answers every step
at once (random tokens, no forward), loaded with serve_load.py's workload over HTTP. What it
reaches is the most any model can be served at by this process on this CPU: the Rust core
(schedule, commit, detokenize, SSE framing), the engine thread's Python and the HTTP side.
A GPU serves a small model's steps in a few milliseconds, so this is the roof its serving
figures meet (BENCH.md asks 30k output tok/s at concurrency 256 on an H200's host).

    python benches/serving_overhead.py [--concurrency 64 256] [--num-prompts 512] [--profile S]

--profile S: also sample the server's threads with py-spy for S seconds (needs py-spy) and
print where each thread's time went. Each run also reports the server's CPU time (user + system,
all threads) per output token, which the load generator's share of the cores does not skew as
it does the throughput. The default model's tokenizer and template are used; its weights load
but never run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]

# Runs inside the server process: every ModelRunner the engine builds answers at once.
PATCH = r"""
import sys
import numpy as np
from llmserve import worker
from llmserve.worker import runner as runner_mod
from llmserve.worker.sampler import SampleOutput

class InstantRunner(runner_mod.ModelRunner):
    def launch(self, plan, prev=None):
        n = len(plan.logits_indices)
        rng = getattr(self, "_rng", None) or np.random.default_rng(0)
        self._rng = rng
        tokens = rng.integers(1000, 20000, n).astype(np.int64)
        return runner_mod.finished(SampleOutput(tokens, np.zeros(n, np.float32), np.zeros((n, 0), np.int64),
                                                np.zeros((n, 0), np.float32)))

runner_mod.ModelRunner.launch = InstantRunner.launch
from llmserve.cli import main
sys.argv = ["llmserve"] + sys.argv[1:]
sys.exit(main())
"""


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def profile(pid: int, seconds: int) -> None:
    out = Path(f"/tmp/serving_overhead_{pid}.txt")
    subprocess.run(["py-spy", "record", "-d", str(seconds), "-r", "200", "-f", "raw", "-o", str(out),
                    "--pid", str(pid), "--threads"], check=True, capture_output=True)
    threads, own = Counter(), Counter()
    for line in out.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        frames = stack.split(";")
        thread = frames[0].split(": ")[-1]
        threads[thread] += int(n)
        own[(thread, frames[-1])] += int(n)
    possible = seconds * 200
    for thread, n in threads.most_common():
        print(f"  thread {thread}: {100 * n / possible:.0f}% of the time sampled busy or waiting")
        for (t, frame), m in own.most_common():
            if t == thread and m >= n * 0.02:
                print(f"    {100 * m / n:5.1f}%  {frame[:110]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--num-prompts", type=int, default=512)
    ap.add_argument("--workload", default="load")
    ap.add_argument("--port", type=int, default=18321)
    ap.add_argument("--profile", type=int, default=0, help="seconds of py-spy sampling in the last run")
    ap.add_argument("server_args", nargs="*", help="extra `llmserve run` arguments")
    args = ap.parse_args()
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
    cmd = [sys.executable, "-c", PATCH, "run", "--host", "127.0.0.1", "--port", str(args.port),
           "--max-num-seqs", str(max(args.concurrency)), "--max-model-len", "2048", "--threads", "1",
           *args.server_args]
    server = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{args.port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None:
                raise SystemExit("the server exited while starting")
            time.sleep(0.2)
        for i, c in enumerate(args.concurrency):
            cpu = cpu_seconds(server.pid)
            load = subprocess.Popen([sys.executable, str(ROOT / "benches" / "serve_load.py"), "--url", url,
                                     "--workload", args.workload, "--concurrency", str(c),
                                     "--num-prompts", str(args.num_prompts)], stdout=subprocess.PIPE, text=True)
            if args.profile and i == len(args.concurrency) - 1:
                time.sleep(3)
                profile(server.pid, args.profile)
            text = load.communicate()[0]
            cpu = cpu_seconds(server.pid) - cpu
            row = json.loads(text[text.index("{"):])
            tokens = row["out_tok_s"] * row["requests"] / row["req_s"]
            print(f"{row['workload']}: {row['out_tok_s']:8.0f} output tok/s, server CPU {1e6 * cpu / tokens:5.1f} us "
                  f"per output token, TTFT p50 {row['ttft_p50_ms']:7.1f} ms, TPOT p50 {row['tpot_p50_ms']:6.2f} ms, "
                  f"failed {row['failed']}", flush=True)
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
