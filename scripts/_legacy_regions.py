"""The pre-staged send path's byte-region vocabulary, kept only so benchmarks can measure it.

Before the staged path (`prfaas_sgl.transfer.items.ItemBatch`) the scheduler thread turned every page of
every buffer into a byte `Region` (`item_regions`) and `ZmqSender.send` checked each one
(`check_region`). The transport no longer accepts regions; scripts/bench_send_path.py rebuilds that
scheduler-thread work from these copies (its `legacy_ms`), and scripts/bench_transfer_worker.py uses
them to address Mooncake's raw memory. The code is the transport's former `layout.py`, unchanged apart
from `check_region`, which was a `MemoryLayout` method.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from prfaas_sgl.transfer.layout import MemoryLayout


@dataclass(frozen=True, slots=True)
class Region:
    """Bytes [offset, offset + length) of buffer `buffer_id`."""

    buffer_id: int
    offset: int
    length: int


def check_region(layout: MemoryLayout, r: Region) -> None:
    """Raise ValueError if `r` leaves its buffer."""
    if not 0 <= r.buffer_id < len(layout.buffers):
        raise ValueError(f"region buffer_id {r.buffer_id} not in 0..{len(layout.buffers) - 1}")
    size = layout.buffers[r.buffer_id].nbytes
    if r.offset < 0 or r.length <= 0 or r.offset + r.length > size:
        raise ValueError(f"region {r} outside buffer {r.buffer_id} of {size} bytes")


def coalesce(item_len: int, indices: Iterable[int]) -> list[tuple[int, int]]:
    """Group item indices, in the given order, into (byte offset, byte length) runs.

    Consecutive indices i, i+1, ... merge into one run; order is preserved (no sorting), because the
    order defines the byte stream. [3, 4, 5, 9, 1, 2] → runs for items [3..5], [9], [1..2].
    """
    runs: list[tuple[int, int]] = []
    start = prev = None
    for i in indices:
        if prev is not None and i == prev + 1:
            prev = i
            continue
        if start is not None:
            runs.append((start * item_len, (prev - start + 1) * item_len))
        start = prev = i
    if start is not None:
        runs.append((start * item_len, (prev - start + 1) * item_len))
    return runs


def item_regions(layout: MemoryLayout, buffer_ids: Iterable[int], indices: Sequence[int]) -> list[Region]:
    """Regions covering items `indices` (pages or slots) of every buffer in `buffer_ids`, coalesced."""
    out: list[Region] = []
    for b in buffer_ids:
        item_len = layout.buffers[b].item_len
        out.extend(Region(b, off, n) for off, n in coalesce(item_len, indices))
    return out
