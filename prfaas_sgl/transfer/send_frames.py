"""What the sender puts on the wire: msgpack headers plus zero-copy views of source memory.

A chunk is `[header, *data]`, one data frame per source segment of its `ChunkPlan` (a view into the
registered buffer, never a copy), or one frame per staged ring slot (`staged`), so no frame
exceeds `chunk_bytes`. Test faults (a corrupted chunk,
a foreign protocol version) are applied here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import xxhash

import prfaas_sgl.transfer.faults as F  # not `from ..transfer import`: the package imports the sender, it us
from prfaas_sgl.transfer.chunking import ChunkPlan
from prfaas_sgl.transfer.items import StagePlan
from prfaas_sgl.transfer.messages import Chunk, Close, Codec, Message


class FrameMaker:
    """Encodes a sender's messages; loop thread only (its `Codec` is not thread-safe)."""

    def __init__(self, views: Sequence[memoryview], faults: tuple[F.Fault, ...]) -> None:
        self._views = views
        self._codec = Codec()
        self._corrupt = F.find(faults, F.CorruptChunk)
        stamp = F.find(faults, F.StampVersion)
        self._version = stamp.v if stamp else None

    def encode(self, msg: Message) -> bytes:
        return self._codec.encode(msg)

    def stamp(self, msg: Any) -> Any:
        """`msg` with the protocol version a StampVersion fault asks for (else unchanged)."""
        return msg if self._version is None else msgspec.structs.replace(msg, v=self._version)

    def close(self, tid: int, nchunks: int, totals: dict[int, int]) -> list[Any]:
        return [self.encode(self.stamp(Close(transfer_id=tid, nchunks=nchunks, totals=dict(totals))))]

    def chunk(self, tid: int, seq: int, plan: ChunkPlan) -> list[Any]:
        """Frames of chunk `seq` of `tid`: header (checksum over the source bytes), then the views."""
        frames = [self._views[plan.buffer_id][off: off + n] for off, n in plan.segments]
        header = self.stamp(self.chunk_header(tid, seq, plan, frames))
        return [self.encode(header), *self._maybe_corrupt(header, frames)]

    def staged(self, tid: int, seq: int, plan: StagePlan, data: memoryview) -> list[Any]:
        """Frames of staged chunk `seq`: header (the stager's checksum of the slot), then the slot."""
        header = self.stamp(Chunk(transfer_id=tid, seq=seq, buffer_id=plan.buffer_id, offset=plan.offset,
                                  length=plan.length, nframes=1, checksum=plan.checksum))
        return [self.encode(header), *self._maybe_corrupt(header, [data])]

    def chunk_header(self, tid: int, seq: int, plan: ChunkPlan, frames: list[memoryview]) -> Chunk:
        h = xxhash.xxh3_64()
        for f in frames:
            h.update(f)
        return Chunk(transfer_id=tid, seq=seq, buffer_id=plan.buffer_id, offset=plan.offset,
                     length=plan.length, nframes=len(frames), checksum=h.intdigest())

    def _maybe_corrupt(self, header: Chunk, frames: list[memoryview]) -> list[Any]:
        if self._corrupt is None or header.seq != self._corrupt.seq:
            return frames
        bad = bytearray(frames[0])
        bad[len(bad) // 2] ^= 0xFF
        return [bad, *frames[1:]]
