"""A realistic request mix for bench_cachepool_gpu_sizes.py: seeded token sequences of three kinds,
served one after another on a filled cache, with the scheduler-thread time of each request's cache calls.

    short   one of SYSTEMS shared system prompts (6K-20K tokens) + a question (50-500 tokens)    60 %
    doc     a fresh document (32K-120K tokens) + a question: nothing to hit                       10 %
    turn    a conversation's next turn: its previous sequence + the answer (100-400 tokens) + the
            next message (50-300 tokens); a conversation starts from a system prompt and starts
            over past 100K tokens                                                                  30 %

Token ids are drawn from a 150K vocabulary, so unrelated texts share no block. A sequence stands for
prompt + output as the tree caches it at release (decode steps are not replayed).
"""
from __future__ import annotations

import random
import statistics
from array import array
from collections.abc import Callable

SYSTEMS, CONVERSATIONS, VOCAB = 4, 8, 150_000
KINDS = (("short", 0.6), ("doc", 0.1), ("turn", 0.3))


def _text(rng: random.Random, lo: int, hi: int) -> array:
    return array("q", (rng.randrange(VOCAB) for _ in range(rng.randint(lo, hi))))


def requests(n: int, seed: int) -> list[tuple[str, array]]:
    """n (kind, token ids) pairs, the same for a seed."""
    rng = random.Random(seed)
    systems = [_text(rng, 6_000, 20_000) for _ in range(SYSTEMS)]
    convs = [array("q", rng.choice(systems)) for _ in range(CONVERSATIONS)]
    out = []
    for _ in range(n):
        kind = rng.choices([k for k, _ in KINDS], [w for _, w in KINDS])[0]
        if kind == "short":
            ids = rng.choice(systems) + _text(rng, 50, 500)
        elif kind == "doc":
            ids = _text(rng, 32_000, 120_000) + _text(rng, 20, 200)
        else:
            c = rng.randrange(CONVERSATIONS)
            if len(convs[c]) > 100_000:
                convs[c] = array("q", rng.choice(systems))
            convs[c] = ids = convs[c] + _text(rng, 100, 400) + _text(rng, 50, 300)
        out.append((kind, ids))
    return out


def run(serve: Callable[[array, str], int], reqs: list[tuple[str, array]], now: Callable[[], float]) -> dict:
    """Serve each request (serve(ids, rid) -> matched tokens); per kind and in all: requests, ms per
    request mean / p50 / p99 / total, tokens and hit tokens."""
    per: dict[str, list[tuple[float, int, int]]] = {}
    for i, (kind, ids) in enumerate(reqs):
        t0 = now()
        hit = serve(ids, f"mix-{i}")
        per.setdefault(kind, []).append(((now() - t0) * 1e3, len(ids), hit))
    per["all"] = [x for k, _ in KINDS for x in per.get(k, [])]
    return {kind: _summary(rows) for kind, rows in per.items()}


def _summary(rows: list[tuple[float, int, int]]) -> dict:
    ms = sorted(r[0] for r in rows)
    return {"requests": len(rows), "ms_mean": round(statistics.fmean(ms), 3), "ms_p50": round(ms[len(ms) // 2], 3),
            "ms_p99": round(ms[min(len(ms) - 1, int(0.99 * len(ms)))], 3), "ms_total": round(sum(ms), 1),
            "tokens": sum(r[1] for r in rows), "hit_tokens": sum(r[2] for r in rows)}
