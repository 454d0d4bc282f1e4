"""A fixed multi-step schedule for comparing runners: prompts whose lengths are not multiples
of the block size, a prompt split into chunks (the second continues a cached prefix), steps
mixing prefill and decode, then decode-only steps of 4 and 5 sequences (5 pads to a captured
size of 8). Tokens are predetermined (teacher forcing), so every runner sees exactly the same
plans and only the numbers it computes can differ."""

from __future__ import annotations

import numpy as np

from _plans import Paged

BLOCK = 16


def scenario_plans(vocab: int, num_blocks: int = 64, decode_steps: int = 20, seed: int = 0,
                   loras: dict[int, int] | None = None) -> list:
    """`loras`: the LoRA adapter index of sequences 0-4 (none: 0)."""
    rng = np.random.default_rng(seed)
    loras = loras or {}

    def toks(n):
        return [int(t) for t in rng.integers(0, vocab, n)]

    paged = Paged(num_blocks, BLOCK)
    plans = []
    paged.add(0, toks(37), loras.get(0, 0))
    paged.add(1, toks(5), loras.get(1, 0))
    paged.add(2, toks(50), loras.get(2, 0))
    plans.append(paged.step({0: 37, 1: 5, 2: 20}))          # C: first chunk, no sampling row
    for s in (0, 1):
        paged.append(s, toks(1)[0])
    paged.add(3, toks(16), loras.get(3, 0))
    plans.append(paged.step({0: 1, 1: 1, 2: 30, 3: 16}))     # C: 30 more over a 20-token prefix
    live = [0, 1, 2, 3]
    for step in range(decode_steps):
        if step == 8:
            paged.add(4, toks(23), loras.get(4, 0))
            for s in live:
                paged.append(s, toks(1)[0])
            plans.append(paged.step({**{s: 1 for s in live}, 4: 23}))
            live.append(4)
            continue
        if step == 14:
            live.remove(1)                                    # a finished sequence: batch of 4
        for s in live:
            paged.append(s, toks(1)[0])
        plans.append(paged.step({s: 1 for s in live}))
    return plans
