"""What the sender puts on the wire: msgpack headers plus zero-copy frames of staged ring slots.

A chunk is `[header, slot]`: one frame per staged ring slot (`staged`), so no frame exceeds
`chunk_bytes`. Test faults (a corrupted chunk, a foreign protocol version) are applied here and nowhere
else.
"""

from __future__ import annotations

from typing import Any

import msgspec

import prfaas_sgl.transfer.faults as F  # not `from ..transfer import`: the package imports the sender, it us
from prfaas_sgl.transfer.items import StagePlan
from prfaas_sgl.transfer.messages import Chunk, Close, Codec, Message


class FrameMaker:
    """Encodes a sender's messages; loop thread only (its `Codec` is not thread-safe)."""

    def __init__(self, faults: tuple[F.Fault, ...]) -> None:
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

    def staged(self, tid: int, seq: int, plan: StagePlan, data: memoryview) -> list[Any]:
        """Frames of staged chunk `seq`: header (the stager's checksum of the slot), then the slot."""
        header = self.stamp(Chunk(transfer_id=tid, seq=seq, buffer_id=plan.buffer_id, offset=plan.offset,
                                  length=plan.length, nframes=1, checksum=plan.checksum))
        return [self.encode(header), *self._maybe_corrupt(header, [data])]

    def _maybe_corrupt(self, header: Chunk, frames: list[memoryview]) -> list[Any]:
        if self._corrupt is None or header.seq != self._corrupt.seq:
            return frames
        bad = bytearray(frames[0])
        bad[len(bad) // 2] ^= 0xFF
        return [bad, *frames[1:]]
