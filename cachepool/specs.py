"""What a layer group is, the pool's errors, and the part of the pool's layout a group manager reads.

This sits below both `config.py` and the managers: `PoolConfig` validates itself by asking each kind's
manager (`managers.manager_class`), so the managers must not import `config.py` back (that was an import
cycle); they read the pool's shape through `PoolShape`, which `PoolConfig` satisfies.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class PoolLayoutError(ValueError):
    """The layer layout cannot be laid onto one pool of equal blocks (raised at start-up)."""


class RequestTooLongError(ValueError):
    """The request needs more blocks than the whole pool has, even with nothing else cached."""


class PoolExhaustedError(RuntimeError):
    """Not enough free or evictable blocks right now; the caller should retry after frees."""


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """One group of layers of the same attention type.

    kind: registry key of the manager ("full", "swa", "linear").
    kv_bytes_per_token: K+V bytes of one token in ONE layer (attention kinds).
    state_bytes: recurrent + conv state bytes of ONE layer for one sequence (linear kind).
    window: sliding-window length in tokens, the current token included (swa kind).
    checkpoint_interval: tokens between cached linear-state checkpoints (linear kind); a multiple
        of the pool's block_size, because a state is only reusable at a block boundary.
    """

    name: str
    kind: str
    num_layers: int
    kv_bytes_per_token: int = 0
    state_bytes: int = 0
    window: int = 0
    checkpoint_interval: int = 0

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise PoolLayoutError(f"group {self.name!r}: num_layers={self.num_layers}; set it >= 1")


class PoolShape(Protocol):
    """The fields of `config.PoolConfig` a group manager reads (block_bytes is 0 while it validates)."""

    @property
    def block_size(self) -> int: ...

    @property
    def block_bytes(self) -> int: ...

    @property
    def hash_seed(self) -> int: ...
