"""KV cache events for a router's prefix index, shaped like SGLang 0.5.23's
(`sglang/srt/disaggregation/kv_events.py`): tagged msgpack maps, optional fields omitted when None.

Our one addition is `group` (the layer group's name): a hybrid hit needs every group, so a router
indexes (group, hash). A decoder built from SGLang's structs ignores the unknown key.
A linear-state checkpoint is reported as one stored "block" whose hash is the chain hash at the
checkpoint boundary and whose token_ids are that last block's tokens.
"""
from __future__ import annotations

from collections.abc import Sequence
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
    """Buffer of events since the last drain(); disabled logs record nothing and cost one branch.
    with_tokens=False leaves BlockStored.token_ids empty: a reader that keys on hashes alone (the SGLang
    backend's mirror) then costs no Python int per stored token (8,192 per 8K-token chunk)."""

    __slots__ = ("enabled", "with_tokens", "_events")

    def __init__(self, enabled: bool, with_tokens: bool = True) -> None:
        self.enabled, self.with_tokens = enabled, with_tokens
        self._events: list[AnyEvent] = []

    def stored(self, group: str, hashes: list[int], parent: Optional[int], token_ids: Sequence[int],
               span: tuple[int, int], block_size: int) -> None:
        """The blocks `hashes`, whose tokens are token_ids[span[0]:span[1]]."""
        tokens = list(token_ids[span[0]:span[1]]) if self.with_tokens else []
        self._events.append(BlockStored(hashes, parent, tokens, block_size, None, group=group))

    def removed(self, group: str, hashes: list[int]) -> None:
        self._events.append(BlockRemoved(hashes, group=group))

    def cleared(self) -> None:
        self._events.append(AllBlocksCleared())

    def pending(self) -> bool:
        return bool(self._events)

    def drain(self) -> list[AnyEvent]:
        """Return and forget the buffered events (oldest first)."""
        out, self._events = self._events, []
        return out
