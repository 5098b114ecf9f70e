"""The pool's index mirrored onto SGLang memory: chain hash -> KV slot indices / Mamba state slot.

HybridCachePool decides what is cached, referenced and evicted (on virtual block ids); SGLang owns
the memory. Events are the only channel between them: BlockStored binds a hash to the memory the
request computed it in, BlockRemoved gives that memory back to SGLang's allocators.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from prfaas_sgl.cachepool import AllBlocksCleared, BlockRemoved, BlockStored

FULL, LINEAR = "full", "linear"  # group names in the pool config


@dataclass(slots=True)
class Insert:
    """What one checkpoint offers: block i of the request is row[i*bs:(i+1)*bs]; `state` is a state
    slot holding the request's state at exactly `state_hash`'s boundary (or None)."""

    row: Any  # torch int64 [num_tokens]: the request's KV slot per token
    pos_of: dict[int, int]  # chain hash -> block position in the request
    state_hash: Optional[int] = None
    state: Any = None  # torch int64 [1]
    stored_blocks: list[int] = field(default_factory=list)  # positions the tree took over


class Mirror:
    def __init__(self, block_size: int, free_kv: Callable[[Any], None], free_state: Callable[[Any], None]):
        self.bs = block_size
        self.kv_of: dict[int, Any] = {}  # full-group hash -> int64 [block_size] KV slots
        self.state_of: dict[int, Any] = {}  # linear-group hash -> int64 [1] Mamba slot
        self._free_kv, self._free_state = free_kv, free_state

    def apply(self, events: list, insert: Optional[Insert] = None) -> tuple[int, int]:
        """Apply drained pool events; returns (KV tokens, state slots) given back to SGLang."""
        tokens = states = 0
        for ev in events:
            if isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    if ev.group == FULL:
                        self._free_kv(self.kv_of.pop(h))
                        tokens += self.bs
                    else:
                        self._free_state(self.state_of.pop(h))
                        states += 1
            elif isinstance(ev, BlockStored):
                self._store(ev, insert)
            elif isinstance(ev, AllBlocksCleared):
                self.kv_of.clear()
                self.state_of.clear()
        return tokens, states

    def _store(self, ev: BlockStored, insert: Optional[Insert]) -> None:
        assert insert is not None, "BlockStored outside a checkpoint"
        for h in ev.block_hashes:
            if ev.group == FULL:
                i = insert.pos_of[h]
                self.kv_of[h] = insert.row[i * self.bs:(i + 1) * self.bs].clone()
                insert.stored_blocks.append(i)
            else:
                # the pool only plans checkpoints the backend vouched for (see cache._commit_point)
                assert h == insert.state_hash and insert.state is not None, "checkpoint without a state"
                self.state_of[h] = insert.state
                insert.state = None

    def check(self, pool) -> None:
        """The mirror equals the pool's index, and no SGLang slot is held twice."""
        full, *linear = pool.managers  # a decode server's pool has no linear group
        assert set(full.index) == set(self.kv_of), "KV mirror differs from the full-attention index"
        assert set(linear[0].index if linear else ()) == set(self.state_of), \
            "state mirror differs from the linear index"
        slots = [int(x) for t in self.kv_of.values() for x in t.tolist()]
        assert len(slots) == len(set(slots)), "a KV slot is cached under two hashes"
        states = [int(t.item()) for t in self.state_of.values()]
        assert len(states) == len(set(states)), "a state slot is cached under two hashes"
