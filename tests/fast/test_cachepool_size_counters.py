"""prfaas_hybrid's size queries (called several times per SGLang scheduler step) read
per-owner idle counters instead of scanning the LRU. Pins: the counters equal the scan after every
pool operation (eviction and reset included), and a query never iterates the LRU."""
from __future__ import annotations

import importlib.util
from collections import OrderedDict
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis.stateful import invariant, precondition, rule

from tests.fast.test_cachepool_property import PoolMachine

_BENCH = Path(__file__).resolve().parents[2] / "scripts" / "bench_cachepool_sizes.py"


def _bench():
    """The microbenchmark's SGLang stand-ins and its pre-fix scanning queries (one copy of each)."""
    spec = importlib.util.spec_from_file_location("bench_cachepool_sizes", _BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _scan(pool) -> dict[str, int]:
    """Idle (ref 0, cached) blocks per group, recomputed from the LRU: what the counters must equal."""
    out = {m.name: 0 for m in pool.managers}
    for b in pool.blocks.lru_blocks():
        out[pool.blocks.owner[b].name] += 1
    return out


class _NoIter(OrderedDict):
    """The LRU with iteration forbidden: a size query that scans it fails the test."""

    def __iter__(self):
        raise AssertionError("a size query iterated the LRU")


def test_backend_sizes_equal_the_scan_without_iterating_the_lru():
    bench = _bench()
    cache = bench.fill(blocks=5_000, prompt=2048, chunk=256)  # 37 requests x 136 blocks
    naive = {q: fn() for q, fn in bench.naive_queries(cache).items()}
    assert naive["evictable_size"] > 0 and naive["mamba_evictable_size"] > 0
    blocks, lru = cache.pool.blocks, cache.pool.blocks._lru
    blocks._lru = _NoIter(lru)
    try:
        assert {q: getattr(cache, q)() for q in bench.QUERIES} == naive
        scan = bench.naive_queries(cache)["evictable_size"]
        try:
            scan()
        except AssertionError:
            pass
        else:
            raise AssertionError("the LRU guard did not see the scan")
    finally:
        blocks._lru = lru
    cache.check_integrity()


def test_backend_sizes_track_locks_and_eviction():
    """A lock moves its blocks from evictable to protected; eviction lowers both counters."""
    bench = _bench()
    cache = bench.fill(blocks=600, prompt=512, chunk=128)
    tokens = list(range(10**7, 10**7 + 512))  # shares no block with the fill
    bench.serve(cache, tokens, first_slot=10**6, chunk=128)
    sizes = lambda: {q: getattr(cache, q)() for q in bench.QUERIES}  # noqa: E731
    before = sizes()
    assert before == {q: fn() for q, fn in bench.naive_queries(cache).items()}
    node = cache.match_prefix(_Params(tokens)).last_device_node
    assert len(node.tokens) == 384  # the last state checkpoint below token 511
    receipt = cache.inc_lock_ref(node)
    locked = sizes()
    assert locked == {q: fn() for q, fn in bench.naive_queries(cache).items()}
    assert locked["evictable_size"] == before["evictable_size"] - 384
    assert locked["protected_size"] == before["protected_size"] + 384
    assert locked["mamba_protected_size"] == before["mamba_protected_size"] + 1  # the state at 384
    cache.dec_lock_ref(node, receipt.to_dec_params())
    assert sizes() == before
    while cache.pool.evict_lru():
        cache._drain()
        assert sizes() == {q: fn() for q, fn in bench.naive_queries(cache).items()}
    assert cache.evictable_size() == cache.mamba_evictable_size() == 0
    cache.check_integrity()


class _Params:
    """The parts of SGLang's MatchPrefixParams (and RadixKey) match_prefix reads, no request."""

    def __init__(self, ids: list[int]) -> None:
        self.key, self.req, self.cow_mamba = self, None, False
        self.ids, self.is_bigram, self.extra_key, self.cache_salt = ids, False, None, None
        self.token_ids = ids  # uncapped (no limit)

    def __len__(self) -> int:
        return len(self.ids)

    def raw_token_ids(self) -> list[int]:
        return self.ids


class CounterMachine(PoolMachine):
    """test_cachepool_property's machine plus eviction and reset, checking the counters each step."""

    @rule()
    def evict(self):
        self.pool.evict_lru()

    @precondition(lambda self: not self.live)
    @rule()
    def reset(self):
        self.pool.reset()

    @invariant()
    def counters_equal_scan(self):
        assert {m.name: self.pool.idle_blocks(m.name) for m in self.pool.managers} == _scan(self.pool)


TestCounterMachine = CounterMachine.TestCase
TestCounterMachine.settings = settings(max_examples=40, stateful_step_count=40, deadline=None,
                                       suppress_health_check=[HealthCheck.too_slow])
