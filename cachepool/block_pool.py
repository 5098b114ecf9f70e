"""The shared pool of equal blocks: free list, ref counts, LRU of evictable cached blocks.

Plain Python, no tensors. Every block is in exactly one state:
    free      ref == 0, not cached     -> in `_free` (reused first, oldest-freed first)
    cached    ref == 0, cached         -> in `_lru`  (evicted only when `_free` runs dry, LRU first)
    in use    ref  > 0 (cached or not) -> referenced by request tables
Managers own the prefix index; a cached block records (manager, hash) so eviction can ask its
manager to drop the whole entry (a linear-state checkpoint spans several blocks).

`_idle[m]` counts the blocks of `_lru` owned by manager m. SGLang asks for evictable sizes several
times per scheduler step, so the count is kept at the three places a block enters or leaves `_lru`
(decref, incref, eviction) instead of scanning it. An owner is only ever set on an in-use block and
only cleared on eviction, so a block's owner cannot change while it sits in `_lru`.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from typing import Optional, Protocol

from .specs import PoolExhaustedError


class EntryOwner(Protocol):
    def drop_entry(self, block_hash: int) -> list[int]:
        """Forget the index entry; return all of its blocks (each cached with ref 0)."""


class BlockPool:
    __slots__ = ("num_blocks", "ref", "owner", "owner_hash", "_free", "_lru", "_idle")

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        # owner[b] is the manager whose index holds b, under owner_hash[b]; two flat lists rather
        # than a tuple per block keep the hot path free of GC-tracked allocations
        self.owner: list[Optional[EntryOwner]] = [None] * num_blocks
        self.owner_hash: list[int] = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._idle: dict[EntryOwner, int] = {}  # owner -> its blocks in _lru

    # -- counts -------------------------------------------------------------------------------
    def num_free(self) -> int:
        return len(self._free)

    def num_cached_idle(self) -> int:
        return len(self._lru)

    def num_idle(self, owner: EntryOwner) -> int:
        """Blocks of `owner`'s index that no request references (evictable now). O(1)."""
        return self._idle.get(owner, 0)

    def idle_counts(self) -> dict:
        """The live owner -> idle-blocks dict num_idle reads (cleared in place, never replaced)."""
        return self._idle

    def num_available(self) -> int:
        """Blocks an allocation may take now: free plus evictable."""
        return len(self._free) + len(self._lru)

    # -- allocation ---------------------------------------------------------------------------
    def take(self, n: int) -> list[int]:
        """Return n blocks with ref 1, evicting LRU cached blocks if the free list runs dry.

        Raises PoolExhaustedError (nothing mutated) if free + evictable < n.
        """
        if n > len(self._free) + len(self._lru):
            raise PoolExhaustedError(
                f"need {n} blocks, {len(self._free)} free + {len(self._lru)} evictable")
        while len(self._free) < n:
            self._evict_one()
        free, ref = self._free, self.ref
        out = [free.popleft() for _ in range(n)]
        for b in out:
            ref[b] = 1
        return out

    def evict_one(self, owner: Optional[EntryOwner] = None) -> bool:
        """Evict the least recently released cached entry (all of its blocks) to the free list, or
        `owner`'s least recently released one. Returns False when nothing (of owner's) is evictable.
        For callers that mirror the index onto memory they allocate themselves and must give memory
        back on demand (an SGLang SWA model is short of window pages, not of full-attention KV)."""
        if owner is None:
            if not self._lru:
                return False
            self._evict_one()
            return True
        if not self._idle.get(owner):
            return False
        owners = self.owner
        block = next(b for b in self._lru if owners[b] is owner)  # O(LRU) scan: eviction is rare
        self.evict_entry(block)
        return True

    def _evict_one(self) -> None:
        self.evict_entry(next(iter(self._lru)))  # least recently released

    def evict_entry(self, block: int) -> None:
        """Evict the idle cached entry holding `block` (all of its blocks) to the free list, out of
        LRU order. Raises ValueError if `block` is not idle and cached."""
        if block not in self._lru:
            raise ValueError(f"block {block} is not an idle cached block")
        manager = self.owner[block]
        dropped = manager.drop_entry(self.owner_hash[block])  # type: ignore[union-attr]
        for b in dropped:
            del self._lru[b]
            self.owner[b] = None
            self._free.append(b)
        self._idle[manager] -= len(dropped)  # type: ignore[index]

    def uncache(self, manager: EntryOwner, block_hash: int) -> None:
        """Drop manager's entry now, referenced or not. Idle blocks go to the free list; referenced
        ones stay with their holders as uncached blocks (freed at their last decref). For a caller
        whose memory cannot back an entry the pool indexed (SGLang's SWA pages already freed)."""
        lru, owner, free = self._lru, self.owner, self._free
        for b in manager.drop_entry(block_hash):
            owner[b] = None
            if b in lru:
                del lru[b]
                free.append(b)
                self._idle[manager] -= 1

    # -- references ---------------------------------------------------------------------------
    def incref(self, blocks: list[int]) -> None:
        """Take a reference on each block (a cache hit); cached idle blocks leave the LRU."""
        ref, lru, owner, idle = self.ref, self._lru, self.owner, self._idle
        run_owner, run = None, 0  # a call's cached blocks share one owner: one counter update per run
        for b in blocks:
            if ref[b] == 0:
                del lru[b]
                o = owner[b]
                if o is not run_owner:
                    if run:
                        idle[run_owner] -= run  # type: ignore[index]
                    run_owner, run = o, 0
                run += 1
            ref[b] += 1
        if run:
            idle[run_owner] -= run  # type: ignore[index]

    def touch(self, blocks: list[int]) -> None:
        """A cached entry a request just recomputed (past a gap in its hit, so it was not a hit): it
        counts as used now. Idle blocks move to the LRU's recent end, in the order given (tails first);
        referenced ones are unchanged."""
        self.incref(blocks)
        self.decref(blocks)

    def decref(self, blocks: list[int]) -> None:
        """Drop a reference on each block, in the order given: the first to reach 0 is evicted
        first, so callers pass tails before prefixes."""
        ref, lru, owner, idle, free = self.ref, self._lru, self.owner, self._idle, self._free
        run_owner, run = None, 0  # as in incref
        for b in blocks:
            r = ref[b] - 1
            ref[b] = r
            if r == 0:
                o = owner[b]
                if o is None:
                    free.append(b)
                    continue
                lru[b] = None
                if o is not run_owner:
                    if run:
                        idle[run_owner] = idle.get(run_owner, 0) + run  # type: ignore[index]
                    run_owner, run = o, 0
                run += 1
        if run:
            idle[run_owner] = idle.get(run_owner, 0) + run  # type: ignore[index]

    def set_owner(self, block: int, manager: EntryOwner, block_hash: int) -> None:
        """Mark an in-use block as cached under (manager, hash)."""
        self.owner[block] = manager
        self.owner_hash[block] = block_hash

    # -- inspection ---------------------------------------------------------------------------
    def free_blocks(self) -> list[int]:
        return list(self._free)

    def lru_blocks(self) -> list[int]:
        """Evictable blocks, next to be evicted first."""
        return list(self._lru)

    def reset(self) -> None:
        """Forget everything (caller guarantees no request holds blocks)."""
        self.ref = [0] * self.num_blocks
        self.owner = [None] * self.num_blocks
        self.owner_hash = [0] * self.num_blocks
        self._free = deque(range(self.num_blocks))
        self._lru.clear()
        self._idle.clear()

    def check(self) -> None:
        """Pool-local invariants; raises AssertionError naming the first violation."""
        free, lru = set(self._free), set(self._lru)
        assert len(free) == len(self._free), "a block is in the free list twice"
        assert not (free & lru), f"blocks both free and cached: {sorted(free & lru)[:8]}"
        for b in range(self.num_blocks):
            r = self.ref[b]
            assert r >= 0, f"block {b} has ref {r}"
            if b in free:
                assert r == 0 and self.owner[b] is None, f"free block {b}: ref {r}, owner set"
            elif b in lru:
                assert r == 0 and self.owner[b] is not None, f"idle cached block {b}: ref {r} or no owner"
            else:
                assert r > 0, f"block {b} is neither free, cached nor referenced (leaked)"
        self._check_idle()

    def _check_idle(self) -> None:
        """The per-owner idle counters equal a count over `_lru`."""
        counted: dict[EntryOwner, int] = {}
        for b in self._lru:
            o = self.owner[b]
            counted[o] = counted.get(o, 0) + 1  # type: ignore[index]
        kept = {o: n for o, n in self._idle.items() if n}
        names = lambda d: {getattr(o, "name", o): n for o, n in d.items()}  # noqa: E731
        assert kept == counted, f"idle counters {names(kept)} != LRU count {names(counted)}"
