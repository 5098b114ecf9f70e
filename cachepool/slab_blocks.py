"""SlabBlocks: the ONE free list of a slab's blocks, shared by the KV side and the state side.

Plain Python over the cache pool's `BlockPool` (free list + ref counts): a block is free, or holds KV
tokens, or holds one linear-attention state, never two at once. Block 0 is never handed out (SGLang
writes padded tokens to KV slot 0 and padded requests to state slot 0, both of which lie in block 0).

Capacity is one number seen from two sides. `reserve()` (a callable) is how many free blocks the KV
side leaves alone, so that a state asked for later finds one (SGLang fails loudly if a request's working
state is missing, `alloc_req_slots`). The SGLang wiring picks it (srt/cachepool_backend/unified.py):
a small constant where states are priced when SGLang admits a request (slab_admission.py), or the
scheduler's free request rows where they cannot be (a PD decode server). With F free blocks, R = reserve():

    KV    may take  usable = max(0, F - R) blocks        capacity = owned KV blocks + usable
    state may take  F blocks (F - R - 1 while KV owns     capacity = state blocks + what it may take
                    none: the KV capacity never reaches 0, SGLang divides by it for its usage gauges)

Both capacities move as blocks change hands; SGLang's idle leak check (available + cached == total)
holds on each side because each side's total is computed from the same counts as its available.
"""
from __future__ import annotations

from collections.abc import Callable

from .block_pool import BlockPool

FREE, KV, STATE, PAD = 0, 1, 2, 3
KIND_NAMES = {FREE: "free", KV: "kv", STATE: "state", PAD: "pad"}


class SlabBlocks:
    def __init__(self, num_blocks: int, reserve: Callable[[], int] = lambda: 0) -> None:
        if num_blocks < 3:
            raise ValueError(f"num_blocks={num_blocks}: a slab needs block 0 (padding) plus at least "
                             f"one KV block and one state block")
        self.num_blocks = num_blocks
        self.reserve = reserve
        self._pool = BlockPool(num_blocks)
        self.kind = [FREE] * num_blocks
        self._count = {FREE: num_blocks, KV: 0, STATE: 0, PAD: 0}
        padding = self._take(PAD, 1)  # a statement, not an assert: `python -O` drops asserts with their effects
        if padding != [0]:
            raise RuntimeError(f"SlabBlocks: the block pool handed out {padding} first; block 0 must be padding")

    # -- counts -------------------------------------------------------------------------------
    def num_free(self) -> int:
        return self._pool.num_free()

    def count(self, kind: int) -> int:
        return self._count[kind]

    def kv_usable(self) -> int:
        """Free blocks the KV side may take now."""
        return max(0, self.num_free() - self.reserve())

    def kv_capacity(self) -> int:
        """Blocks the KV side holds or may take now."""
        return self._count[KV] + self.kv_usable()

    def state_available(self) -> int:
        """Free blocks the state side may take now."""
        if self._count[KV]:
            return self.num_free()
        return max(0, self.num_free() - self.reserve() - 1)

    def state_capacity(self) -> int:
        """Blocks the state side holds or may take now."""
        return self._count[STATE] + self.state_available()

    # -- allocation ---------------------------------------------------------------------------
    def take_kv(self, n: int) -> list[int] | None:
        """n blocks for KV tokens, or None (nothing changed) if fewer than n are usable."""
        return self._take(KV, n) if n <= self.kv_usable() else None

    def take_state(self, n: int) -> list[int] | None:
        """n blocks, one state each, or None (nothing changed) if fewer than n are available."""
        return self._take(STATE, n) if n <= self.state_available() else None

    def give(self, blocks: list[int], kind: int) -> None:
        """Return blocks of `kind` to the free list. Raises ValueError (nothing changed) if a block
        is not of that kind: a double free or a free through the wrong side."""
        wrong = [b for b in blocks if self.kind[b] != kind]
        if wrong or len(set(blocks)) != len(blocks):
            raise ValueError(f"give({KIND_NAMES[kind]}): blocks {wrong[:8] or blocks[:8]} are "
                             f"{[KIND_NAMES[self.kind[b]] for b in wrong[:8]]} or repeat")
        for b in blocks:
            self.kind[b] = FREE
        self._count[kind] -= len(blocks)
        self._count[FREE] += len(blocks)
        self._pool.decref(blocks)

    def clear(self, kind: int) -> None:
        """Free every block of `kind` (SGLang's allocator clear(), e.g. flush_cache)."""
        self.give([b for b in range(self.num_blocks) if self.kind[b] == kind], kind)

    def _take(self, kind: int, n: int) -> list[int]:
        out = self._pool.take(n)
        for b in out:
            self.kind[b] = kind
        self._count[kind] += n
        self._count[FREE] -= n
        return out

    # -- integrity ----------------------------------------------------------------------------
    def check(self) -> None:
        """Every block is in exactly one state; the free list and the kinds agree."""
        self._pool.check()
        free = set(self._pool.free_blocks())
        for b, k in enumerate(self.kind):
            assert (k == FREE) == (b in free), f"block {b} is {KIND_NAMES[k]} but {'' if b in free else 'not '}free"
        counted = {k: self.kind.count(k) for k in KIND_NAMES}
        assert counted == self._count, f"kind counts {self._count} != census {counted}"
        assert self.kind[0] == PAD, "block 0 was handed out"
