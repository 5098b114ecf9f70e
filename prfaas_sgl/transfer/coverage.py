"""Which bytes of a receiver's stream have been written: a transfer is complete when they all have.

Each buffer id has its own stream (see layout.py); a chunk covers stream bytes [offset, offset + length)
of one buffer, and chunks arrive in any order (striped over connections).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field


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
