"""HybridCachePool.uncache and group-targeted evict_lru: what an SGLang SWA backend needs from the pool
(docs/cachepool-swa.md). uncache drops an entry the backend's memory cannot back (a referenced block
stays with its holder as an uncached block), or one no hit can reach any more (an idle block is free at
once); evict_lru(group) frees window pages without touching full-attention KV."""
from __future__ import annotations

from prfaas_sgl.cachepool import BlockRemoved, GroupSpec, HybridCachePool, PoolConfig

BS = 4


def make(num_blocks: int, window: int = 5) -> HybridCachePool:
    groups = (GroupSpec("full", "full", 1, kv_bytes_per_token=1),
              GroupSpec("swa", "swa", 1, kv_bytes_per_token=1, window=window))
    return HybridCachePool(PoolConfig(num_blocks, BS, groups, enable_events=True))


def test_uncache_a_referenced_block_leaves_it_to_its_request_and_frees_it_at_release():
    pool = make(20)
    tokens = list(range(13))
    pool.admit("r", tokens)
    pool.commit("r", 12)  # 3 full blocks in both groups; SWA (window 5) keeps only block 2 referenced
    hashes = pool.hashes(tokens)
    swa = pool.managers[1]
    held = pool.held("r")[1]
    pool.drain_events()
    pool.uncache("swa", [hashes[2]])
    assert hashes[2] not in swa.index and [e.block_hashes for e in pool.drain_events()] == [[hashes[2]]]
    pool.check_integrity()  # still referenced by "r", no owner: in use, not cached
    free_before = pool.blocks.num_free()
    pool.free("r")
    pool.check_integrity()
    assert held[-1] in pool.blocks.free_blocks() and pool.blocks.num_free() > free_before
    # the full entry is intact: a hit needs the window's SWA block, so it stops before block 2
    assert pool.match(tokens) == 8


def test_uncache_an_idle_block_frees_it_and_skips_hashes_the_group_lacks():
    pool = make(20)
    tokens = list(range(13))
    pool.admit("r", tokens)
    pool.commit("r", 12)
    pool.free("r")
    hashes = pool.hashes(tokens)
    idle_swa = pool.idle_blocks("swa")
    pool.drain_events()
    pool.uncache("swa", [hashes[0], 12345])
    assert pool.idle_blocks("swa") == idle_swa - 1
    assert [e.block_hashes for e in pool.drain_events()] == [[hashes[0]]]
    pool.check_integrity()


def test_evict_lru_of_one_group_leaves_the_other_alone():
    pool = make(20)
    tokens = list(range(13))
    pool.admit("r", tokens)
    pool.commit("r", 12)
    pool.free("r")
    pool.drain_events()
    full_idle = pool.idle_blocks("full")
    while pool.evict_lru("swa"):
        pass
    assert pool.idle_blocks("swa") == 0 and pool.idle_blocks("full") == full_idle
    assert all(isinstance(e, BlockRemoved) and e.group == "swa" for e in pool.drain_events())
    assert pool.evict_lru("swa") is False and pool.evict_lru("full") is True
    pool.check_integrity()
