"""HybridCachePool.evict_lru(): the public eviction step the SGLang backend (prfaas_sgl.srt.cachepool_backend)
drives when SGLang's own allocator runs dry; it must evict LRU entries in release order, emit
BlockRemoved, and stop at pinned entries."""
from __future__ import annotations

from prfaas_sgl.cachepool import BlockRemoved, GroupSpec, HybridCachePool, PoolConfig

BS = 4


def _pool() -> HybridCachePool:
    groups = (GroupSpec("full", "full", 1, kv_bytes_per_token=1),
              GroupSpec("linear", "linear", 1, state_bytes=BS, checkpoint_interval=8))
    return HybridCachePool(PoolConfig(32, BS, groups, enable_events=True))


def test_evict_lru_order_events_and_pins():
    pool = _pool()
    pool.admit("a", list(range(9)), num_tokens=8)
    pool.commit("a", 8)  # full blocks h0,h1 and the linear checkpoint at 8 tokens
    pool.free("a")
    hashes = pool.hashes(list(range(8)))
    pool.drain_events()
    pool.admit("pin", list(range(9)), num_tokens=8)  # a hit on 8 tokens pins all three entries
    assert pool.evict_lru() is False
    pool.free("pin")
    removed = []
    while pool.evict_lru():
        removed += [(e.group, e.block_hashes) for e in pool.drain_events() if isinstance(e, BlockRemoved)]
    # released tail first: linear checkpoint, then block 1, then block 0
    assert removed == [("linear", [hashes[1]]), ("full", [hashes[1]]), ("full", [hashes[0]])]
    assert pool.match(list(range(9))) == 0
    pool.check_integrity()
