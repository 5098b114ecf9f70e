"""Exact-id tests of the hybrid prefix cache pool: allocation, eviction order, hybrid hit rules."""
from __future__ import annotations

import pytest

from prfaas_sgl.cachepool import (NULL_BLOCK, BlockRemoved, BlockStored, GroupSpec, HybridCachePool,
                                  PoolConfig, PoolExhaustedError, block_hashes)

BS = 4  # tokens per block in every test here


def full(name="attn", layers=1):
    return GroupSpec(name, "full", layers, kv_bytes_per_token=8)


def linear(interval=8, state_bytes=40, layers=3):
    # 3 layers x 40 B = 120 B over 32-B blocks -> 4 blocks per state (last one padded)
    return GroupSpec("gdn", "linear", layers, state_bytes=state_bytes, checkpoint_interval=interval)


def swa(window):
    return GroupSpec("swa", "swa", 1, kv_bytes_per_token=8, window=window)


def make(num_blocks, *groups, events=False):
    return HybridCachePool(PoolConfig(num_blocks, BS, tuple(groups), enable_events=events))


def run(pool, req_id, tokens, transfer=False):
    """Admit, compute everything, commit; return the Allocation."""
    alloc = pool.admit(req_id, tokens, transfer=transfer)
    pool.commit(req_id, len(tokens))
    pool.check_integrity()
    return alloc


def test_full_attention_exact_ids_and_tail_first_release():
    pool = make(6, full())
    a = run(pool, "r1", list(range(10)))  # blocks 0,1 full, block 2 holds tokens 8..9
    assert a.group("attn").block_table == (0, 1, 2)
    pool.free("r1")
    # block 2 was never cached (partial) -> free list; 1 then 0 enter the LRU (tail evicted first)
    assert pool.blocks.free_blocks() == [3, 4, 5, 2]
    assert pool.blocks.lru_blocks() == [1, 0]
    b = pool.admit("r2", list(range(8)) + [99, 98, 97])
    assert b.num_cached_tokens == 8
    assert b.group("attn").block_table == (0, 1, 3)
    pool.check_integrity()


def test_hit_always_leaves_one_token_to_compute():
    pool = make(8, full())
    run(pool, "r1", list(range(8)))
    pool.free("r1")
    assert pool.match(list(range(8))) == 4  # 2 blocks cached, but token 7 must be computed
    assert pool.match(list(range(9))) == 8


def test_eviction_is_lru_and_reports_removed_hashes():
    pool = make(4, full(), events=True)
    t1, t2 = list(range(8)), list(range(100, 108))
    run(pool, "r1", t1), pool.free("r1")  # LRU: [1, 0]
    run(pool, "r2", t2), pool.free("r2")  # free list was [2, 3]: r2 took 2, 3 -> LRU [1, 0, 3, 2]
    assert pool.blocks.lru_blocks() == [1, 0, 3, 2]
    pool.drain_events()
    a = pool.admit("r3", list(range(200, 212)))  # 3 blocks: evicts 1 then 0 (r1's tail first)
    assert a.group("attn").block_table == (1, 0, 3)
    h1 = block_hashes(t1, BS)
    h2 = block_hashes(t2, BS)
    assert [e.block_hashes for e in pool.drain_events()] == [[h1[1]], [h1[0]], [h2[1]]]
    assert pool.match(t2 + [0]) == 4  # r2's first block survived, its second was evicted
    pool.check_integrity()


def test_exhausted_pool_changes_nothing():
    pool = make(4, full())
    pool.admit("r1", list(range(12)))
    before = (pool.blocks.free_blocks(), pool.blocks.lru_blocks(), list(pool.blocks.ref))
    with pytest.raises(PoolExhaustedError):
        pool.admit("r2", list(range(50, 58)))
    assert (pool.blocks.free_blocks(), pool.blocks.lru_blocks(), list(pool.blocks.ref)) == before
    assert pool.request_ids() == ["r1"]
    pool.check_integrity()


def test_linear_checkpoints_on_grid_and_restore():
    pool = make(40, full(), linear(interval=8))
    a = run(pool, "r1", list(range(18)))
    gdn = a.group("gdn")
    assert gdn.state_blocks == (5, 6, 7, 8)
    assert gdn.checkpoint_writes == ((8, (9, 10, 11, 12)), (16, (13, 14, 15, 16)))
    pool.free("r1")
    b = pool.admit("r2", list(range(20)))
    assert b.num_cached_tokens == 16
    assert b.group("gdn").restore_from == (13, 14, 15, 16)
    assert b.group("gdn").checkpoint_writes == ()
    pool.check_integrity()


def test_full_attention_hit_is_capped_at_last_checkpoint():
    pool = make(40, full(), linear(interval=8))
    run(pool, "r1", list(range(22)))  # full KV cached for 5 blocks = 20 tokens; states at 8, 16
    pool.free("r1")
    assert pool.match(list(range(22))) == 16  # full KV could give 20; the state exists at 16 only
    assert pool.match(list(range(14)) + [1000] * 8) == 8  # diverges in block 3: KV for 12, state at 8
    assert pool.match(list(range(7)) + [1000] * 8) == 0  # KV for 4 tokens, no state at 4


def test_linear_state_must_match_exactly_at_the_boundary():
    pool = make(40, full(), linear(interval=8))
    run(pool, "r1", list(range(18)))
    pool.free("r1")
    # evict the checkpoint at 16 only: it is not first in the LRU, so drop it through its manager
    gdn = pool.managers[1]
    h16 = block_hashes(list(range(16)), BS)[-1]
    pool.blocks.evict_entry(gdn.index[h16][0])
    pool.check_integrity()
    assert pool.match(list(range(20))) == 8  # full KV still covers 16 tokens


@pytest.mark.parametrize("window, lru, cached, hit", [
    # commit(17) slides blocks [0, (17 - (window-1)) // 4) out oldest first; free() then releases
    # the rest tail first (block 4 is partial, never cached). Then 2 blocks are evicted.
    (5, [0, 1, 2, 3], [False, False, True, True], 16),  # needs block 3 only
    (9, [0, 1, 3, 2], [False, False, True, True], 16),  # needs blocks 2, 3
    (13, [0, 3, 2, 1], [False, True, True, False], 0),  # needs 3 blocks in a row: none left
])
def test_swa_hit_needs_only_the_window(window, lru, cached, hit):
    pool = make(5, swa(window))
    run(pool, "r1", list(range(17)))
    pool.free("r1")
    assert pool.blocks.lru_blocks() == lru
    pool.admit("x", list(range(500, 512)))  # 3 blocks: the free block 4 + the two LRU-first
    pool.free("x")
    index = pool.managers[0].index
    assert [h in index for h in block_hashes(list(range(16)), BS)] == cached
    assert pool.match(list(range(17))) == hit
    pool.check_integrity()


def test_swa_table_has_null_blocks_before_window():
    pool = make(10, swa(5))
    run(pool, "r1", list(range(17)))
    pool.free("r1")
    a = pool.admit("r2", list(range(17)) + [7])
    assert a.num_cached_tokens == 16
    t = a.group("swa").block_table
    assert t[:3] == (NULL_BLOCK,) * 3 and t[3] != NULL_BLOCK and len(t) == 5
    pool.check_integrity()


def test_transfer_blocks_freed_when_transfer_completes():
    pool = make(40, full(), linear(interval=8))
    pool.admit("p", list(range(18)), transfer=True)
    pool.commit("p", 18)
    u = pool.usage()
    # tail block (tokens 16..17) + working state (4 blocks) are transfer-only
    assert (u.in_use, u.transfer) == (4 + 1 + 4, 5)
    pool.free("p")  # transfer done
    u = pool.usage()
    assert (u.in_use, u.transfer, u.cached_idle) == (0, 0, 4 + 8)
    assert u.free + u.cached_idle + u.in_use == u.total


def test_decode_growth_caches_new_full_blocks():
    pool = make(10, full(), events=True)
    toks = list(range(6))
    pool.admit("r", toks)
    pool.commit("r", 6)
    toks = toks + [50, 51]
    a = pool.grow("r", 8, toks)
    assert a.group("attn").block_table == (0, 1) and a.group("attn").new_blocks == ()
    pool.commit("r", 8)
    stored = [e for e in pool.drain_events() if isinstance(e, BlockStored)]
    assert [e.token_ids for e in stored] == [[0, 1, 2, 3], [4, 5, 50, 51]]
    assert stored[1].parent_block_hash == stored[0].block_hashes[0]
    pool.free("r")
    assert pool.match(toks + [1]) == 8


def test_events_without_token_ids_keep_hashes_and_parents():
    """A reader of hashes only (the SGLang backend's mirror) asks for no token ids: a chunk's events
    then hold no Python int per token."""
    pool = HybridCachePool(PoolConfig(40, BS, (full(), linear()), enable_events=True, event_token_ids=False))
    run(pool, "r", list(range(17)))
    stored = [e for e in pool.drain_events() if isinstance(e, BlockStored)]
    hashes = block_hashes(list(range(16)), BS)
    assert [(e.group, e.block_hashes, e.token_ids) for e in stored] == [
        ("attn", hashes, []), ("gdn", [hashes[1]], []), ("gdn", [hashes[3]], [])]
    assert [e.parent_block_hash for e in stored] == [None, hashes[0], hashes[2]]


def test_a_pin_references_the_hit_and_allocates_nothing():
    """A lock on a match (the SGLang backend's inc_lock_ref) pins the hit's entries in every group: they
    are not evictable while pinned, and no block is taken for it."""
    pool = make(40, full(), linear())
    tokens = list(range(17))
    run(pool, "r", tokens)
    pool.free("r")
    hashes = block_hashes(tokens, BS)
    free, idle = pool.usage().free, pool.usage().cached_idle
    assert pool.pin("lock", hashes[:4]) == 4  # blocks 0-3 and the state at 16
    assert pool.usage().free == free and pool.usage().cached_idle == idle - 4 - 4
    pool.check_integrity()
    while pool.evict_lru():
        pass
    assert pool.match(tokens[:16] + [99]) == 16  # the pinned hit survived
    pool.free("lock")
    pool.check_integrity()
    assert pool.usage().cached_idle == 8


@pytest.mark.parametrize("groups", [(full(), linear()), (full(), swa(6))], ids=["linear", "swa"])
def test_a_pin_releases_its_hit_in_the_order_an_admitted_request_does(groups):
    """A pin holds its blocks only (no request state), so its free must leave the LRU exactly as an
    admitted request holding the same hit leaves it: tails first, the last group first."""
    tokens, order = list(range(17)), []
    for way in ("pin", "admit"):
        pool = make(60, *groups)
        run(pool, "r", tokens)
        run(pool, "other", list(range(100, 117)))
        pool.free("r")
        pool.free("other")
        hashes = block_hashes(tokens, BS)
        if way == "pin":
            assert pool.pin("p", hashes[:4]) == 4 and pool.request_ids() == ["p"]
        else:
            pool.admit("p", tokens[:16] + [99], num_tokens=16)
        assert sum(map(len, pool.held("p"))) >= 4
        pool.check_integrity()
        pool.free("p")
        pool.check_integrity()
        order.append(pool.blocks.lru_blocks())
    assert order[0] == order[1]


@pytest.mark.parametrize("groups", [(full(), linear()), (full(), swa(6))], ids=["linear", "swa"])
def test_a_pin_after_evictions_pins_what_a_match_would_hit(groups):
    """A pin takes the whole hit when every group still holds its blocks, and otherwise the hit a match
    finds now (each eviction in LRU order, one at a time), never a block outside it."""
    tokens = list(range(17))
    pool = make(60, *groups)
    run(pool, "r", tokens)
    pool.free("r")
    hashes = block_hashes(tokens, BS)[:4]
    while True:
        want = pool._hit_blocks(hashes, 4 * BS + 1)
        assert pool.pin("p", hashes) == want
        assert pool.held("p") == [m.hit_blocks(hashes, want) for m in pool.managers]
        pool.check_integrity()
        pool.free("p")
        if not pool.evict_lru():
            break
    assert want == 0


def test_duplicate_content_keeps_first_copy():
    pool = make(10, full())
    pool.admit("a", list(range(9)))
    pool.admit("b", list(range(9)))  # admitted before a committed: no hit, own blocks
    pool.commit("a", 9), pool.commit("b", 9)
    pool.check_integrity()
    pool.free("b")
    assert pool.blocks.free_blocks()[-3:] == [5, 4, 3]  # b's copies were never indexed
    pool.free("a")
    pool.check_integrity()


def test_events_removed_and_cleared():
    pool = make(4, full(), events=True)
    run(pool, "r", list(range(8)))
    pool.free("r")
    pool.reset()
    kinds = [type(e).__name__ for e in pool.drain_events()]
    assert kinds == ["BlockStored", "AllBlocksCleared"]
    assert pool.usage().free == 4
    assert not any(isinstance(e, BlockRemoved) for e in pool.drain_events())


def test_evicting_one_state_block_drops_the_whole_checkpoint():
    pool = make(11, full(), linear(interval=8), events=True)
    run(pool, "r1", list(range(9)))  # KV 0..2, working state 3..6, checkpoint at 8 -> 7..10
    pool.free("r1")
    assert pool.blocks.lru_blocks() == [7, 8, 9, 10, 1, 0]  # committed checkpoint released first
    pool.drain_events()
    # 2 KV + 4 state = 6 blocks; free are 3..6 (r1's working state) and 2 (its partial tail)
    pool.admit("r2", list(range(100, 105)))
    removed = [(e.group, len(e.block_hashes)) for e in pool.drain_events()]
    assert removed == [("gdn", 1)]  # one entry, four blocks
    assert pool.blocks.free_blocks() == [8, 9, 10]
    pool.check_integrity()


@pytest.mark.parametrize("corrupt, msg", [
    (lambda p: p.blocks.ref.__setitem__(0, 2), "block 0: ref 2 but 1 request references"),
    (lambda p: p.blocks._free.append(0), "neither free|both free and cached|free block 0"),
    (lambda p: p.managers[0].index.__setitem__(123, 5), "indexed block 5 .* free list"),
])
def test_check_integrity_catches_corruption(corrupt, msg):
    pool = make(8, full())
    pool.admit("r", list(range(6)))
    pool.commit("r", 6)
    corrupt(pool)
    with pytest.raises(AssertionError, match=msg):
        pool.check_integrity()
