"""prfaas_hybrid's size queries at a GPU-sized cache: microseconds per call (O(1) counters vs the
LRU scan they replaced).

SGLang's scheduler asks the tree cache for its evictable / protected sizes several times per step
(prefill budget, decode `_allocatable_tokens`, pool stats), so a query that scans the cache adds its
scan to every step. This fills the backend, through the calls SGLang makes (one `checkpoint` per
chunk end, then `on_release`), until `--blocks` cached blocks are idle, and times each query.

--naive also times the pre-fix queries (cache.py's `_idle()` at commit a7974a9: a copy and scan of the
whole LRU per call) on the same cache, so one run gives the before/after pair.

Run:  .venv/bin/python scripts/bench_cachepool_sizes.py --blocks 200000 --naive --out out/bench_cachepool_sizes.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time
from array import array
from types import SimpleNamespace as NS

import torch

from prfaas_sgl.srt.cachepool_backend import cache as backend

QUERIES = ("evictable_size", "protected_size", "mamba_evictable_size", "mamba_protected_size")


def fake_ctx(kv_tokens: int, mamba_slots: int, chunk: int, max_len: int):
    """The parts of SGLang's TreeCacheBuildContext the backend touches; Mamba slots are never
    exhausted (a counter), state copies are no-ops (the index never reads state memory)."""
    slots = itertools.count()
    mamba_alloc = NS(alloc=lambda n: torch.tensor([next(slots)], dtype=torch.int64), free=lambda s: None)
    req_pool = NS(req_to_token=torch.zeros((1, max_len), dtype=torch.int32), mamba_allocator=mamba_alloc,
                  mamba_pool=NS(size=mamba_slots, copy_from=lambda src, dst: None),
                  translate_mamba_indices=lambda idx: idx, free_mamba_cache=lambda req: None)
    allocator = NS(size=kv_tokens, device="cpu", free=lambda slots: None)
    params = NS(page_size=1, token_to_kv_pool_allocator=allocator, req_to_token_pool=req_pool)
    return NS(params=params, server_args=NS(chunked_prefill_size=chunk, disaggregation_mode="null"),
              is_hybrid_ssm=True, is_hybrid_swa=False, enable_hierarchical_cache=False,
              disable_radix_cache=False)


def serve(cache, tokens: list[int], first_slot: int, chunk: int) -> None:
    """One request as SGLang runs it: a checkpoint at every chunk end, then release."""
    cache.req_to_token_pool.req_to_token[0, :len(tokens)] = torch.arange(first_slot, first_slot + len(tokens))
    kv = NS(req_pool_idx=0, mamba_pool_idx=torch.tensor(0), holds_mamba=False)
    req = NS(rid=f"bench-{first_slot}", extra_key=None, cache_salt=None, full_untruncated_fill_ids=array("q", tokens),
             kv=kv)
    for up_to in range(chunk, len(tokens) + 1, chunk):
        cache.checkpoint(req, up_to=up_to)
    cache.on_release(req, checkpointed=True)


def fill(blocks: int, prompt: int, chunk: int):
    """A backend whose pool holds >= `blocks` cached idle blocks (full KV + one state per chunk).
    Request i's tokens are [i * prompt, (i + 1) * prompt): no two requests share a block."""
    cache = backend.build(fake_ctx(kv_tokens=16 * blocks, mamba_slots=blocks // 8, chunk=chunk, max_len=prompt))
    first = 0
    while cache.pool.blocks.num_cached_idle() < blocks:
        serve(cache, list(range(first, first + prompt)), first, chunk)
        first += prompt
    return cache


def naive_queries(cache) -> dict:
    """The size queries as they were before the counters: each call copies and scans the LRU."""
    def idle() -> tuple[int, int]:
        full, owner = cache.pool.managers[0], cache.pool.blocks.owner
        lru = cache.pool.blocks.lru_blocks()
        n_full = sum(1 for b in lru if owner[b] is full)
        return n_full, len(lru) - n_full
    return {
        "evictable_size": lambda: idle()[0] * cache.bs,
        "protected_size": lambda: len(cache.mirror.kv_of) * cache.bs - idle()[0] * cache.bs,
        "mamba_evictable_size": lambda: idle()[1],
        "mamba_protected_size": lambda: len(cache.mirror.state_of) - idle()[1],
    }


def time_calls(fn, calls: int) -> dict:
    """Per-call microseconds over `calls` calls after 3 warm-ups: median, min, max."""
    for _ in range(3):
        fn()
    us = []
    for _ in range(calls):
        t0 = time.perf_counter_ns()
        fn()
        us.append((time.perf_counter_ns() - t0) / 1e3)
    return {"median_us": round(statistics.median(us), 3), "min_us": round(min(us), 3), "max_us": round(max(us), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=200_000, help="cached idle blocks to reach")
    ap.add_argument("--prompt", type=int, default=8192, help="tokens per request")
    ap.add_argument("--chunk", type=int, default=1024, help="chunked-prefill size = state checkpoint interval")
    ap.add_argument("--calls", type=int, default=200, help="timed calls per query")
    ap.add_argument("--naive", action="store_true", help="also time the pre-fix scanning queries")
    ap.add_argument("--out", help="write the JSON here too")
    a = ap.parse_args()
    t0 = time.perf_counter()
    cache = fill(a.blocks, a.prompt, a.chunk)
    fill_s = time.perf_counter() - t0
    impls = {"counters": {q: getattr(cache, q) for q in QUERIES}}
    if a.naive:
        impls["naive_scan"] = naive_queries(cache)
    result = {
        "cached_idle_blocks": cache.pool.blocks.num_cached_idle(),
        "idle_kv_tokens": cache.evictable_size(), "idle_states": cache.mamba_evictable_size(),
        "block_size": cache.bs, "fill_s": round(fill_s, 2), "calls": a.calls,
        "per_call": {impl: {q: time_calls(fn, a.calls) for q, fn in qs.items()} for impl, qs in impls.items()},
        "loadavg_1_5_15": os.getloadavg(),
    }
    if a.naive:  # both paths must agree on the answer
        assert all(impls["naive_scan"][q]() == getattr(cache, q)() for q in QUERIES), "counters != scan"
    text = json.dumps(result, indent=1)
    print(text)
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
