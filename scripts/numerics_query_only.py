"""How far query-only extend attention is from SGLang's padded torch_native computation, next to how far the
padded computation already is from itself under two context lengths (two chunk grids), on the tiny hybrid's
attention shapes (4 query heads, 2 KV heads, head dim 16, float32). Seeded; prints both counts.

    .venv/bin/python scripts/numerics_query_only.py --shapes 300
"""
from __future__ import annotations

import argparse
import random

import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa

HQ, HK, D, SCALE = 4, 2, 16, 0.25


def qkv(n: int):
    return torch.randn(1, HQ, n, D), torch.randn(1, HK, n, D), torch.randn(1, HK, n, D)


def query_only_vs_padded(rng: random.Random) -> float:
    """Rows after a prefix p: padded causal (stock) vs new queries only under a mask. 0.0 when bit-equal."""
    n = rng.randint(2, 1600)
    p = rng.randint(1, n - 1)
    q, k, v = qkv(n)
    padded = sdpa(q, k, v, enable_gqa=True, is_causal=True, scale=SCALE)[:, :, p:]
    mask = torch.ones(n - p, n, dtype=torch.bool).tril(diagonal=p)
    only = sdpa(q[:, :, p:], k, v, attn_mask=mask, enable_gqa=True, scale=SCALE)
    return (padded - only).abs().max().item()


def padded_under_two_lengths(rng: random.Random) -> float:
    """The first m rows, padded causal over contexts n and m (two chunk grids). 0.0 when bit-equal."""
    n = rng.randint(3, 1600)
    m = rng.randint(1, n - 1)
    q, k, v = qkv(n)
    long = sdpa(q, k, v, enable_gqa=True, is_causal=True, scale=SCALE)[:, :, :m]
    short = sdpa(q[:, :, :m], k[:, :, :m], v[:, :, :m], enable_gqa=True, is_causal=True, scale=SCALE)
    return (long - short).abs().max().item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for name, fn in (("query-only vs padded", query_only_vs_padded),
                     ("padded, two context lengths", padded_under_two_lengths)):
        torch.manual_seed(args.seed)
        rng = random.Random(args.seed)
        diffs = [fn(rng) for _ in range(args.shapes)]
        print(f"{name}: {sum(d > 0 for d in diffs)} of {args.shapes} shapes differ, max {max(diffs):.2e}")


if __name__ == "__main__":
    main()
