"""Immutable allocation results handed to the scheduler / storage; no pool internals leak out."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

NULL_BLOCK = -1  # table entry for a block the request no longer holds (slid out of an SWA window)


@dataclass(frozen=True, slots=True)
class PagedAllocation:
    """Attention group. block_table[i] holds tokens [i*bs, (i+1)*bs); NULL_BLOCK where released.
    new_blocks: blocks added by this step (to be written by the forward pass)."""

    group: str
    block_table: tuple[int, ...]
    new_blocks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class StateAllocation:
    """Linear-attention group. state_blocks: the request's working state (split over whole blocks).
    restore_from: checkpoint blocks to copy into state_blocks before computing (empty: zero state).
    checkpoint_writes: (token boundary, blocks) pairs added by this step: after computing exactly
    `boundary` tokens, copy the working state into `blocks` (then commit() caches them)."""

    group: str
    state_blocks: tuple[int, ...]
    restore_from: tuple[int, ...]
    checkpoint_writes: tuple[tuple[int, tuple[int, ...]], ...]


GroupAllocation = Union[PagedAllocation, StateAllocation]


@dataclass(frozen=True, slots=True)
class Allocation:
    """Result of admit()/grow(). num_cached_tokens: prefix reused from the cache (a multiple of
    block_size, < num_tokens). num_tokens: tokens the request's blocks now cover."""

    req_id: str
    num_cached_tokens: int
    num_tokens: int
    groups: tuple[GroupAllocation, ...]

    def group(self, name: str) -> GroupAllocation:
        for g in self.groups:
            if g.group == name:
                return g
        raise KeyError(f"no group {name!r}; groups are {[g.group for g in self.groups]}")


@dataclass(frozen=True, slots=True)
class PoolUsage:
    """Block counts; free + cached_idle + in_use == total. transfer: in-use blocks held only by
    transfer-bound requests and not in the prefix cache (freed when their transfer completes)."""

    total: int
    free: int
    cached_idle: int
    in_use: int
    transfer: int
