"""Test hooks that inject faults into the real transport. Plain frozen records, so they pickle into
spawned test processes. Production code passes none."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CorruptChunk:
    """Sender flips one payload byte of chunk `seq` *after* computing its checksum (source untouched)."""

    seq: int


@dataclass(frozen=True, slots=True)
class StampVersion:
    """Sender stamps every message with protocol version `v` instead of its own."""

    v: int


@dataclass(frozen=True, slots=True)
class SlowReceiver:
    """Receiver sleeps `seconds` before handling each chunk (a slow consumer, for backpressure tests)."""

    seconds: float


Fault = CorruptChunk | StampVersion | SlowReceiver


def find(faults: tuple[Fault, ...], kind: type) -> Fault | None:
    return next((f for f in faults if isinstance(f, kind)), None)
