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


def test_a_recomputed_duplicate_counts_as_used_so_a_resent_prompt_keeps_its_chain():
    """A prompt whose head was evicted misses entirely when re-sent (no hit past the gap), recomputes, and
    finds its later blocks and checkpoints already cached: those copies must count as used by the re-send.
    Before, they kept their old LRU place, were evicted before anything released in between, and the
    prompt was left with no usable prefix (CI: a 700-token prompt re-sent twice hit 0 tokens both times)."""
    pool = _pool()

    def serve(rid: str, tokens: list[int]) -> None:
        pool.admit(rid, tokens + [999], num_tokens=len(tokens))
        pool.commit(rid, len(tokens))
        pool.free(rid)

    a = list(range(16))  # 4 full blocks + checkpoints at 8 and 16 tokens: 6 entries
    serve("z", list(range(100, 116)))  # oldest: 6 entries
    serve("a", a)
    serve("y", list(range(200, 216)))  # released after a, before a's re-send: 6 entries
    head = pool.managers[0].index[pool.hashes(a)[0]]
    pool.blocks.evict_entry(head)  # a's first block is gone: a re-send of a hits nothing
    assert pool.match(a + [999]) == 0
    serve("a2", a)
    for _ in range(12):  # z's and y's entries: both were used before a's re-send
        assert pool.evict_lru()
    assert pool.match(a + [999]) == 16
    pool.check_integrity()
