"""Per-instance prefix index over chained hashes of full token blocks.

Block i covers tokens [i*B, (i+1)*B); its hash chains the previous one, so equal hashes mean equal
prefixes::

    tokens   |---- b0 ----|---- b1 ----|---- b2 ----|-- tail (< B, never cached) --|
    hashes   h0 = H(seed, b0)  h1 = H(h0, b1)  h2 = H(h1, b2)

The hash is ``cachepool.hashing.block_hashes`` (one definition for the cache pool and the router).

Two sources fill an index:
- ``ApproxIndex``: what this router routed there; LRU over a modelled capacity (blocks). The simulator
  models every instance's prefix cache with it too, so it routes on the cache the router assumes.
- ``ExactIndex``: the server's own KV events (BlockStored / BlockRemoved / AllBlocksCleared). Events carry
  token ids, so we rehash them with our hash and keep a map server hash -> our hash for removals.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol, Sequence

from prfaas_sgl.cachepool.hashing import block_hashes

class PrefixIndex(Protocol):
    def match(self, hashes: Sequence[int]) -> int:
        """Number of leading blocks of ``hashes`` cached on the instance."""
        ...

    def insert(self, hashes: Sequence[int]) -> None: ...


class ApproxIndex:
    """Blocks this router sent to the instance, LRU-evicted at ``capacity_blocks``.

    Blocks of one prompt are touched child-first, so parents are more recent than their children and
    eviction takes leaves first, as SGLang's radix cache does.
    """

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = capacity_blocks
        self.lru: OrderedDict[int, None] = OrderedDict()

    def match(self, hashes: Sequence[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self.lru:
                break
            n += 1
        return n

    def insert(self, hashes: Sequence[int]) -> None:
        if self.capacity <= 0:
            return
        lru = self.lru
        for h in reversed(hashes):
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > self.capacity:
            lru.popitem(last=False)

    def __len__(self) -> int:
        return len(self.lru)


class ExactIndex:
    """Mirror of one server's prefix cache built from its KV events.

    ``ours`` maps the server's block hash to (our hash, set of storage media holding it); a block counts
    as cached while any medium (GPU, CPU_PINNED, ...) holds it.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.ours: dict[int, tuple[int, set[str]]] = {}
        self.present: dict[int, int] = {}  # our hash -> server hash
        self.orphans = 0  # stored blocks whose parent we never saw (missed events)
        self.mismatched = 0  # events whose block size differs from ours: cannot be matched

    def match(self, hashes: Sequence[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self.present:
                break
            n += 1
        return n

    def insert(self, hashes: Sequence[int]) -> None:
        """Exact indexes learn only from events; routing does not guess."""

    def stored(self, server_hashes: Sequence[int], parent: int | None, token_ids: Sequence[int],
               block_size: int, medium: str | None) -> None:
        if block_size != self.block_size:
            self.mismatched += 1
            return
        if parent is None:
            ours = block_hashes(token_ids, block_size)
        elif parent in self.ours:
            ours = block_hashes(token_ids, block_size, self.ours[parent][0])
        else:
            self.orphans += 1
            return
        # A trailing partial page has a server hash but no full block of ours: zip stops before it.
        for sh, oh in zip(server_hashes, ours):
            entry = self.ours.setdefault(sh, (oh, set()))
            entry[1].add(medium or "GPU")
            self.present[oh] = sh

    def removed(self, server_hashes: Sequence[int], medium: str | None) -> None:
        for sh in server_hashes:
            entry = self.ours.get(sh)
            if entry is None:
                continue
            entry[1].discard(medium or "GPU")
            if not entry[1]:
                del self.ours[sh]
                self.present.pop(entry[0], None)

    def cleared(self) -> None:
        self.ours.clear()
        self.present.clear()

    def __len__(self) -> int:
        return len(self.present)
