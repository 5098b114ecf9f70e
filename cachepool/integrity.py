"""check_integrity: invariants that hold between any two public calls of HybridCachePool.

1. free + cached idle + in use == total, each block in exactly one of them (BlockPool.check).
2. No block belongs to two index entries, across all groups.
3. Index subset of allocated: every indexed block is cached idle or in use, and its owner record
   points back at (manager, hash).
4. ref[b] == number of request references to b, over all requests, pins and groups.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Iterable, Sequence

from .block_pool import BlockPool
from .manager_base import GroupManager


def check_pool(pool: BlockPool, managers: Sequence[GroupManager], req_states: Sequence[Sequence[Any]],
               pins: Iterable[Sequence[Sequence[int]]] = ()) -> None:
    """pins: per pin, per group, the blocks it references (a lock holds blocks, no request state)."""
    pool.check()
    free = set(pool.free_blocks())
    indexed: dict[int, tuple[str, int]] = {}
    for m in managers:
        for h, blocks in m.index_entries():
            for b in blocks:
                assert b not in indexed, f"block {b} indexed twice: {indexed[b]} and {(m.name, h)}"
                indexed[b] = (m.name, h)
                assert b not in free, f"indexed block {b} ({m.name}) is on the free list"
                assert pool.owner[b] is m and pool.owner_hash[b] == h, f"block {b}: owner record != {(m.name, h)}"
    owned = [b for b in range(pool.num_blocks) if pool.owner[b] is not None]
    assert len(owned) == len(indexed), f"{len(owned)} blocks have owners, {len(indexed)} are indexed"
    refs: Counter[int] = Counter()
    for states in req_states:
        for m, st in zip(managers, states):
            refs.update(m.held_blocks(st))
    for held in pins:
        for blocks in held:
            refs.update(blocks)
    for b in range(pool.num_blocks):
        assert pool.ref[b] == refs[b], f"block {b}: ref {pool.ref[b]} but {refs[b]} request references"
