"""The pool's index mirrored onto SGLang memory: chain hash -> KV slot indices / Mamba state slot.

HybridCachePool decides what is cached, referenced and evicted (on virtual block ids); SGLang owns
the memory. Events are the only channel between them: BlockStored binds a hash to the memory the
request computed it in, BlockRemoved gives that memory back to SGLang's allocators.

KV slots live in one table indexed by the pool's (virtual) block id, on the allocator's device:

    kv_table[block] = the block_size KV slots of the cached block `block`   (int64 [num_blocks, bs])

so a checkpoint stores all of its new blocks with one gather from the request's row, a match hands
SGLang its prefix with one gather, and the slots of everything evicted in one call go back to SGLang
with one gather and one allocator free (each `free` there concatenates the whole free list, so a free
per block costs O(blocks x pool) — seconds at GPU pool sizes).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from prfaas_sgl.cachepool import AllBlocksCleared, BlockRemoved, BlockStored

FULL, LINEAR = "full", "linear"  # group names in the pool config


@dataclass(slots=True)
class Insert:
    """What one checkpoint offers: block i of the request is row[i*bs:(i+1)*bs] for i in pos_of's
    values; `state` is a state slot holding the request's state at exactly `state_hash`'s boundary."""

    row: Any  # torch int [>= num_tokens]: the request's KV slot per token (a view of req_to_token)
    pos_of: dict[int, int]  # chain hash -> block position in the request (the blocks it may store)
    state_hash: Optional[int] = None
    state: Any = None  # torch int64 [1]
    stored_blocks: list[int] = field(default_factory=list)  # positions the tree took over


class Mirror:
    def __init__(self, block_size: int, num_blocks: int, device: torch.device,
                 block_of: Callable[[int], int], free_kv: Callable[[Any], None],
                 free_state: Callable[[Any], None]) -> None:
        """block_of(hash): the pool block of a cached full-attention hash."""
        self.bs, self.device = block_size, device
        self.kv_table = torch.zeros((num_blocks, block_size), dtype=torch.int64, device=device)
        self.kv_of: dict[int, int] = {}  # full-group hash -> pool block (its row of kv_table)
        self.state_of: dict[int, Any] = {}  # linear-group hash -> int64 [1] Mamba slot
        self._block_of, self._free_kv, self._free_state = block_of, free_kv, free_state
        self._gone_blocks: list[int] = []  # removed, slots not yet given back (see flush)
        self._gone_states: list[Any] = []

    def apply(self, events: list, insert: Optional[Insert] = None) -> tuple[int, int]:
        """Apply drained pool events; returns (KV tokens, state slots) removed. Removed memory goes
        back to SGLang at the next flush(), all of it in one free per allocator."""
        tokens = states = 0
        stores: list[BlockStored] = []
        for ev in events:
            if isinstance(ev, BlockRemoved):
                if ev.group == FULL:
                    self._gone_blocks += [self.kv_of.pop(h) for h in ev.block_hashes]
                    tokens += self.bs * len(ev.block_hashes)
                else:
                    self._gone_states += [self.state_of.pop(h) for h in ev.block_hashes]
                    states += len(ev.block_hashes)
            elif isinstance(ev, BlockStored):
                stores.append(ev)
            elif isinstance(ev, AllBlocksCleared):
                self.kv_of.clear()
                self.state_of.clear()
        if stores:
            # a block removed above may be stored again below (the pool reuses freed block ids):
            # its old slots must leave kv_table before the new ones overwrite them
            self.flush()
            self._store(stores, insert)
        return tokens, states

    def flush(self) -> None:
        """Give the slots of every entry removed since the last flush back to SGLang."""
        if self._gone_blocks:
            self._free_kv(self.kv_slots_of_blocks(self._gone_blocks))
            self._gone_blocks = []
        if self._gone_states:
            self._free_state(torch.cat(self._gone_states))
            self._gone_states = []

    def _store(self, stores: list[BlockStored], insert: Optional[Insert]) -> None:
        assert insert is not None, "BlockStored outside a checkpoint"
        blocks, positions = [], []
        for ev in stores:
            for h in ev.block_hashes:
                if ev.group == FULL:
                    blocks.append(self._block_of(h))
                    positions.append(insert.pos_of[h])
                    self.kv_of[h] = blocks[-1]
                else:
                    # the pool only plans checkpoints the backend vouched for (see cache._commit_point)
                    assert h == insert.state_hash and insert.state is not None, "checkpoint without a state"
                    self.state_of[h] = insert.state
                    insert.state = None
        if blocks:
            self._gather(insert.row, positions, blocks)
            insert.stored_blocks += positions

    def _gather(self, row: Any, positions: list[int], blocks: list[int]) -> None:
        """kv_table[blocks[j]] = row[positions[j]*bs : (positions[j]+1)*bs] for all j, in one gather."""
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        slots = torch.arange(self.bs, device=self.device) + pos[:, None] * self.bs  # [n, bs]
        self.kv_table[torch.tensor(blocks, dtype=torch.int64, device=self.device)] = row[slots].to(torch.int64)

    def kv_slots(self, hashes) -> torch.Tensor:
        """KV slots of cached hashes, in order: int64 [len(hashes) * bs]."""
        return self.kv_slots_of_blocks([self.kv_of[h] for h in hashes])

    def kv_slots_of_blocks(self, blocks: list[int]) -> torch.Tensor:
        if not blocks:
            return torch.empty((0,), dtype=torch.int64, device=self.device)
        return self.kv_table[torch.tensor(blocks, dtype=torch.int64, device=self.device)].reshape(-1)

    def check(self, pool) -> None:
        """The mirror equals the pool's index, and no SGLang slot is held twice."""
        full, *linear = pool.managers  # a decode server's pool has no linear group
        assert set(full.index) == set(self.kv_of), "KV mirror differs from the full-attention index"
        assert all(full.index[h] == b for h, b in self.kv_of.items()), "KV mirror rows differ from the index"
        assert set(linear[0].index if linear else ()) == set(self.state_of), \
            "state mirror differs from the linear index"
        assert not (self._gone_blocks or self._gone_states), "removed slots not flushed"
        slots = self.kv_slots(list(self.kv_of)).tolist()
        assert len(slots) == len(set(slots)), "a KV slot is cached under two hashes"
        states = [int(t.item()) for t in self.state_of.values()]
        assert len(states) == len(set(states)), "a state slot is cached under two hashes"
