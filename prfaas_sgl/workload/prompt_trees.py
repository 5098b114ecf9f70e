"""Random prompt trees: seeded prompts that share prefixes of random lengths, for differential tests of
prefix caches (tests/sglang/prompt_trees.py at CI size, scripts/pool_differential.py at length).

Each prompt is one of, drawn in order from the seed:

    p < 0.25 (and the first)  fresh      a random slice of `text`, 80-1,199 tokens
    p < 0.40                  re-send    an earlier prompt, unchanged (a full hit)
    p < 0.75                  extension  an earlier prompt + 5-299 fresh tokens (a multi-turn follow-up)
    else                      branch     an earlier prompt cut anywhere (on and off any chunk grid or
                                         block size) + 5-399 fresh tokens

An extension or branch whose earlier prompt is too long for `max_len` keeps less of its head and all of
its fresh tokens, so it still ends in tokens no earlier prompt has. Sized against a small pool, the tree's
tokens overflow it and entries are evicted between hits.
"""
from __future__ import annotations

import random
from collections.abc import Sequence


def prompt_tree(text: Sequence[int], seed: int, n: int, max_len: int = 1500) -> list[list[int]]:
    """`n` prompts drawn from token list `text` (>= 1,300 tokens)."""
    if len(text) < 1300:
        raise ValueError(f"prompt_tree: text has {len(text)} tokens; needs >= 1300 for its fresh slices")
    rng = random.Random(seed)

    def fresh(k: int) -> list[int]:
        i = rng.randrange(0, len(text) - k)
        return list(text[i:i + k])

    out: list[list[int]] = []
    for _ in range(n):
        r = rng.random()
        if not out or r < 0.25:
            ids = fresh(min(rng.randrange(80, 1200), max_len))
        elif r < 0.4:
            ids = list(rng.choice(out))
        else:
            p, k = rng.choice(out), rng.randrange(5, 300 if r < 0.75 else 400)
            k = min(k, max_len - 1)
            head = len(p) if r < 0.75 else rng.randrange(1, len(p))
            ids = p[:min(head, max_len - k)] + fresh(k)
        out.append(ids)
    return out

def kinds(prompts: Sequence[Sequence[int]]) -> dict[str, int]:
    """How many prompts re-send, extend or branch off an earlier one (longest shared head), for reports."""
    counts = {"fresh": 0, "resend": 0, "shares_prefix": 0}
    for i, ids in enumerate(prompts):
        best = max((_common(ids, p) for p in prompts[:i]), default=0)
        kind = "resend" if best == len(ids) else "shares_prefix" if best >= 16 else "fresh"
        counts[kind] += 1
    return counts


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
