"""Subscriber for SGLang's KV events (``--kv-events-config '{"publisher":"zmq","endpoint":"tcp://*:5557"}'``).

Wire format (sglang/srt/disaggregation/kv_events.py, 0.5.23): multipart ``[topic, seq (8 bytes big
endian), payload]``; payload is msgpack ``[ts, events, attn_dp_rank]`` and every event is a map tagged by
``type`` = class name (BlockStored / BlockRemoved / AllBlocksCleared). Unknown keys are ignored, so newer
optional fields do not break us.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Optional, Union

import msgspec
import zmq
import zmq.asyncio

from .prefix_index import ExactIndex

log = logging.getLogger(__name__)


class BlockStored(msgspec.Struct, tag=True):
    block_hashes: list[int]
    parent_block_hash: Optional[int] = None
    token_ids: list[int] = []
    block_size: int = 0
    medium: Optional[str] = None


class BlockRemoved(msgspec.Struct, tag=True):
    block_hashes: list[int]
    medium: Optional[str] = None


class AllBlocksCleared(msgspec.Struct, tag=True):
    pass


class KVEventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]
    attn_dp_rank: Optional[int] = None


DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def apply_batch(index: ExactIndex, batch: KVEventBatch) -> None:
    """Apply one decoded batch to ``index`` in order."""
    for ev in batch.events:
        if isinstance(ev, BlockStored):
            index.stored(ev.block_hashes, ev.parent_block_hash, ev.token_ids, ev.block_size, ev.medium)
        elif isinstance(ev, BlockRemoved):
            index.removed(ev.block_hashes, ev.medium)
        else:
            index.cleared()


class KVEventSubscriber:
    """One SUB socket in the router's event loop, feeding one ``ExactIndex``.

    A sequence gap means events were dropped (PUB drops on slow subscribers, a reconnect, a restarted
    server whose numbering starts over): lost ``BlockRemoved`` events would leave the index claiming blocks
    the server evicted, forever. So a gap, or a batch we cannot decode, clears the index; it refills from
    the events that follow (blocks whose parents we never saw stay out, counted as orphans).
    """

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, index: ExactIndex) -> None:
        self.endpoint, self.index = endpoint, index
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.last_seq: int | None = None
        self.gaps = 0
        self.resyncs = 0  # times the index was cleared because events were lost
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self.run(), name=f"kv-events {self.endpoint}")

    async def run(self) -> None:
        while True:
            self.handle(await self.sock.recv_multipart())

    def handle(self, frames: list[bytes]) -> None:
        """Apply one ``[topic, seq, payload]`` message."""
        if len(frames) != 3:
            log.warning("kv events %s: expected 3 frames, got %d", self.endpoint, len(frames))
            return
        _topic, seq_raw, payload = frames
        seq = int.from_bytes(seq_raw, "big")
        if self.last_seq is not None and seq != self.last_seq + 1:
            self.gaps += 1
            self._resync(f"sequence gap {self.last_seq} -> {seq}")
        self.last_seq = seq
        try:
            batch = DECODER.decode(payload)
        except msgspec.DecodeError as e:
            self._resync(f"undecodable batch seq={seq}: {e}")
            return
        apply_batch(self.index, batch)

    def _resync(self, why: str) -> None:
        log.warning("kv events %s: %s; clearing the prefix index (%d blocks) to refill from new events",
                    self.endpoint, why, len(self.index))
        self.index.cleared()
        self.resyncs += 1

    async def close(self) -> None:
        if self.task:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        self.sock.close(linger=0)
