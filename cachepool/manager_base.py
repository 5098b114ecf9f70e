"""Contract of a per-layer-group manager. One small class per attention type answers the same few
questions (vLLM v1's SingleTypeKVCacheManager shape); the pool coordinates them without branching on
the type.

Units: token counts are tokens; `k`, `max_blocks` and hash positions are in attention blocks of
block_size tokens. hashes[i] is the chain hash of tokens [0, (i+1)*bs).
Mutation: only acquire_hit/grow/commit/release/drop_entry mutate, and only this group's index and the
shared BlockPool's refs/owners. Nothing here is thread-safe; the scheduler thread owns the pool.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, Iterator

from .allocation import GroupAllocation
from .block_pool import BlockPool
from .events import EventLog
from .specs import GroupSpec, PoolShape


class GroupManager(ABC):
    kind: ClassVar[str]

    def __init__(self, spec: GroupSpec, cfg: PoolShape, pool: BlockPool, events: EventLog) -> None:
        self.spec = spec
        self.name = spec.name
        self.block_size = cfg.block_size
        self.hash_seed = cfg.hash_seed
        self.pool = pool
        self.events = events

    # -- start-up ------------------------------------------------------------------------------
    @classmethod
    @abstractmethod
    def page_bytes(cls, spec: GroupSpec, block_size: int) -> int:
        """Bytes of one attention page of this group, or 0 if the group has no pages."""

    @classmethod
    @abstractmethod
    def validate(cls, spec: GroupSpec, cfg: PoolShape) -> None:
        """Raise PoolLayoutError naming the sizes if this group cannot live in the pool."""

    @abstractmethod
    def peak_blocks(self, num_tokens: int) -> int:
        """Blocks one request of num_tokens holds at once with no cache hit (admission bound)."""

    # -- lookup (read-only) ----------------------------------------------------------------------
    @abstractmethod
    def longest_hit(self, hashes: list[int], max_blocks: int) -> int:
        """Largest k <= max_blocks such that this group can resume a request after k cached blocks."""

    # -- per-request lifecycle -------------------------------------------------------------------
    @abstractmethod
    def new_state(self) -> Any:
        """Per-request bookkeeping record for this group."""

    @abstractmethod
    def acquire_hit(self, st: Any, hashes: list[int], k: int) -> None:
        """Reference the cached entries a hit of k blocks needs (k came from longest_hit)."""

    @abstractmethod
    def hit_blocks(self, hashes: list[int], k: int) -> list[int]:
        """The cached blocks a hit of k blocks references (acquire_hit's), tails first (release order)."""

    def mark_state(self, st: Any, num_tokens: int) -> None:
        """The caller holds the request's state at num_tokens once the next grow is computed (linear
        kinds checkpoint it there; others keep no state). 0 clears the mark."""

    @abstractmethod
    def blocks_to_grow(self, st: Any, num_tokens: int) -> int:
        """New blocks needed so the request covers tokens [0, num_tokens)."""

    @abstractmethod
    def grow(self, st: Any, num_tokens: int, blocks: list[int]) -> GroupAllocation:
        """Place exactly blocks_to_grow(st, num_tokens) fresh blocks (ref 1) into the request."""

    @abstractmethod
    def commit(self, st: Any, hashes: list[int], token_ids: list[int], num_computed: int) -> None:
        """Tokens [0, num_computed) are computed: cache what became reusable, drop what is no longer
        read. May emit BlockStored/BlockRemoved events."""

    @abstractmethod
    def release(self, st: Any) -> None:
        """Drop every reference the request holds (tails first, so they are evicted first)."""

    @abstractmethod
    def held_blocks(self, st: Any) -> list[int]:
        """Every block reference the request holds in this group (with repeats if any)."""

    # -- index -----------------------------------------------------------------------------------
    @abstractmethod
    def drop_entry(self, block_hash: int) -> list[int]:
        """Evict one index entry (called by BlockPool); return its blocks. Emits BlockRemoved."""

    @abstractmethod
    def index_entries(self) -> Iterator[tuple[int, list[int]]]:
        """(hash, blocks) for every cached entry."""

    @abstractmethod
    def clear_index(self) -> None:
        """Forget every entry without events (pool reset)."""
