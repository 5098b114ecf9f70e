"""KV cache events for a router's prefix index, shaped like SGLang 0.5.23's
(`sglang/srt/disaggregation/kv_events.py`): tagged msgpack maps, optional fields omitted when None.

Our one addition is `group` (the layer group's name): a hybrid hit needs every group, so a router
indexes (group, hash). A decoder built from SGLang's structs ignores the unknown key.
A linear-state checkpoint is reported as one stored "block" whose hash is the chain hash at the
checkpoint boundary and whose token_ids are that last block's tokens.
"""
from __future__ import annotations

from typing import Optional, Union

import msgspec


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of all events; `type` in the encoded map is the class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]  # no default, as in SGLang, so SGLang's decoder accepts our encoding
    medium: Optional[str] = None
    group: Optional[str] = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: Optional[str] = None
    group: Optional[str] = None


class AllBlocksCleared(KVCacheEvent):
    pass


AnyEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class EventBatch(msgspec.Struct, array_like=True, gc=False):
    """Same positional batch SGLang publishes: [ts, events, attn_dp_rank]."""

    ts: float
    events: list[AnyEvent]
    attn_dp_rank: Optional[int] = None


class EventLog:
    """Buffer of events since the last drain(); disabled logs record nothing and cost one branch."""

    __slots__ = ("enabled", "_events")

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._events: list[AnyEvent] = []

    def stored(self, group: str, hashes: list[int], parent: Optional[int], token_ids: list[int],
               block_size: int) -> None:
        self._events.append(BlockStored(hashes, parent, token_ids, block_size, None, group=group))

    def removed(self, group: str, hashes: list[int]) -> None:
        self._events.append(BlockRemoved(hashes, group=group))

    def cleared(self) -> None:
        self._events.append(AllBlocksCleared())

    def drain(self) -> list[AnyEvent]:
        """Return and forget the buffered events (oldest first)."""
        out, self._events = self._events, []
        return out
