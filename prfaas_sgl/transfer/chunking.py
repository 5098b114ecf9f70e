"""Pure byte-stream math: cut a sender's regions into chunks, scatter a chunk into receiver runs.

Each buffer id has its own stream (see layout.py). A chunk covers stream bytes
[offset, offset + length) of one buffer and is at most `chunk_bytes` long:

    sender regions of buffer b:  |--run A--|    |------run B------|       (source memory, any order)
    stream of b:                 0         a    a                 a+b
    chunks (chunk_bytes = c):    [0, c) [c, 2c) ... each chunk = 1..k source segments = k data frames
    receiver runs of b:          |---run X---|--run Y--|                  (destination memory)
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from prfaas_sgl.transfer.layout import Region


@dataclass(slots=True)
class ChunkPlan:
    """One chunk: buffer, stream offset, and the source (offset, length) segments it sends."""

    buffer_id: int
    offset: int
    length: int = 0
    segments: list[tuple[int, int]] = field(default_factory=list)


def plan_chunks(regions: Iterable[Region], stream_pos: dict[int, int], chunk_bytes: int) -> list[ChunkPlan]:
    """Cut `regions` into chunks; advances `stream_pos[buffer_id]` (mutated) by the bytes planned.

    Consecutive regions of one buffer share chunks, so many small pages still make few messages.
    """
    chunks: list[ChunkPlan] = []
    cur: ChunkPlan | None = None
    for r in regions:
        off, left = r.offset, r.length
        while left:
            if cur is None or cur.buffer_id != r.buffer_id or cur.length == chunk_bytes:
                cur = ChunkPlan(r.buffer_id, stream_pos.get(r.buffer_id, 0))
                chunks.append(cur)
            take = min(left, chunk_bytes - cur.length)
            cur.segments.append((off, take))
            cur.length += take
            stream_pos[r.buffer_id] = stream_pos.get(r.buffer_id, 0) + take
            off += take
            left -= take
    return chunks


@dataclass(slots=True)
class Coverage:
    """Stream bytes written so far: disjoint, merged intervals [starts[i], ends[i]), sorted.

    A correct sender's chunks never overlap, but arrive in any order (striped over connections):

        stream:   0 ─────────────────────────────────────── total
        covered:  [0, 3c)        [5c, 6c)                      (ends[i] < starts[i+1]: gaps stay visible)
        chunk [3c, 4c) merges left → [0, 4c);   chunk [2c, 3c) overlaps → refused before writing

    Tracking intervals (not a byte count) means "complete" is a fact about the bytes, not about sums:
    overlapping chunks can no longer add up to `total` while a gap keeps stale data.
    """

    starts: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)

    def overlaps(self, start: int, end: int) -> bool:
        i = bisect.bisect_right(self.starts, start) - 1  # last interval starting at or before `start`
        if i >= 0 and self.ends[i] > start:
            return True
        return i + 1 < len(self.starts) and self.starts[i + 1] < end

    def __len__(self) -> int:
        """Disjoint intervals: each `add` that joins neither neighbour costs O(len) (a list insert)."""
        return len(self.starts)

    def isolated(self, start: int, end: int) -> bool:
        """Adding [start, end) would make a new interval (it touches neither neighbour)."""
        i = bisect.bisect_right(self.starts, start)
        return not (i > 0 and self.ends[i - 1] == start) and not (i < len(self.starts) and self.starts[i] == end)

    def add(self, start: int, end: int) -> None:
        """Mark [start, end) written; caller checked `not overlaps(start, end)` and start < end."""
        i = bisect.bisect_right(self.starts, start)
        joins_left = i > 0 and self.ends[i - 1] == start
        joins_right = i < len(self.starts) and self.starts[i] == end
        if joins_left and joins_right:
            self.ends[i - 1] = self.ends[i]
            del self.starts[i], self.ends[i]
        elif joins_left:
            self.ends[i - 1] = end
        elif joins_right:
            self.starts[i] = start
        else:
            self.starts.insert(i, start)
            self.ends.insert(i, end)

    def gap(self, total: int) -> tuple[int, int] | None:
        """The first never-written interval of [0, total), or None when all of it is covered."""
        pos = 0
        for start, end in zip(self.starts, self.ends):
            if start > pos:
                return pos, start
            pos = end
        return (pos, total) if pos < total else None


@dataclass(slots=True)
class DestStream:
    """A receiver's runs of one buffer, in stream order. `starts[i]` = stream offset of `runs[i]`."""

    runs: list[tuple[int, int]]
    starts: list[int]
    total: int
    covered: Coverage = field(default_factory=Coverage)

    @classmethod
    def of(cls, runs: Sequence[tuple[int, int]]) -> "DestStream":
        starts, pos = [], 0
        for _, n in runs:
            starts.append(pos)
            pos += n
        return cls(list(runs), starts, pos)


def scatter(dst: memoryview, stream: DestStream, offset: int, frames: Sequence[memoryview]) -> None:
    """Copy `frames` (consecutive stream bytes starting at `offset`) into `dst` along `stream`'s runs.

    Caller guarantees offset + sum(len(frames)) <= stream.total. One memcpy per (frame, run) overlap.
    """
    i = bisect.bisect_right(stream.starts, offset) - 1
    pos = offset
    for src in frames:
        s, n = 0, len(src)
        while s < n:
            run_off, run_len = stream.runs[i]
            within = pos - stream.starts[i]
            take = min(run_len - within, n - s)
            dst[run_off + within: run_off + within + take] = src[s: s + take]
            s += take
            pos += take
            if within + take == run_len:
                i += 1


def dest_streams(regions: Iterable[Region]) -> dict[int, DestStream]:
    """Group a receiver's regions by buffer, keeping order."""
    runs: dict[int, list[tuple[int, int]]] = {}
    for r in regions:
        runs.setdefault(r.buffer_id, []).append((r.offset, r.length))
    return {b: DestStream.of(rs) for b, rs in runs.items()}
