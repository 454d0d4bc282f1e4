"""Decoding sequences that share a long prompt (`n` > 1 sampling) on CPU: output tokens per
second through the offline engine on the default model.

    python benches/forked_decode.py [--prompt-tokens 1500] [--n 1 4 8] [--tokens 64] [--repeats 3]

Each round samples `n` choices (temperature 1, a seed, `ignore_eos`) of one prompt of about
`--prompt-tokens` tokens; the prompt is computed once and its blocks are shared by the `n`
sequences, whose decode attention reads them (rust/kernels/src/decode.rs groups rows that
begin with the same block and reads each shared block once for all of them). Figures: output
tok/s over the whole round, prompt included, and of the decoding alone (the round less a round
of one token, which is its prompt: the tokens after each choice's first over that time); each
the median of the repeats after a warm-up. The prefix cache is off, so each round computes its
prompt. Run it on two builds, one after the other, to compare them; nothing else should run.
"""

from __future__ import annotations

import argparse
import statistics
import time

from llmserve.engine.offline import LLM

WORDS = ("river stone lantern harbor meadow copper violin orchard thunder pebble canyon "
         "whisper garden falcon marble ember willow compass saddle beacon").split()


def prompt(tokens: int) -> str:
    # ~1.3 tokens a word on SmolLM2's tokenizer
    words = [WORDS[(i * 7 + i // 20) % len(WORDS)] for i in range(int(tokens / 1.3))]
    return "Summarize this list of words in one sentence: " + " ".join(words)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-tokens", type=int, default=1500)
    ap.add_argument("--n", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    options = {"threads": args.threads} if args.threads else {}
    llm = LLM(None, max_model_len=4096, enable_prefix_caching=False, **options)
    text = prompt(args.prompt_tokens)
    print(f"{'n':>3} {'prompt':>7} {'out tok/s':>10} {'decode tok/s':>13}  rounds (s)")
    for n in args.n:
        params = {"n": n, "temperature": 1.0, "seed": 1, "max_tokens": args.tokens, "ignore_eos": True}
        llm.generate(text, params)       # warm-up

        def timed(p: dict) -> tuple[float, dict]:
            t = time.perf_counter()
            usage = llm.generate(text, p)[0].usage
            return time.perf_counter() - t, usage

        rounds = [timed(params) for _ in range(args.repeats)]
        prompt_only = statistics.median(timed({**params, "max_tokens": 1})[0] for _ in range(args.repeats))
        seconds = [s for s, _ in rounds]
        out, size = rounds[0][1]["completion_tokens"], rounds[0][1]["prompt_tokens"]
        whole = statistics.median(seconds)
        print(f"{n:>3} {size:>7} {out / whole:>10.1f} {(out - n) / (whole - prompt_only):>13.1f}  "
              f"{' '.join(f'{s:.2f}' for s in seconds)} (prompt {prompt_only:.2f})", flush=True)


if __name__ == "__main__":
    main()
