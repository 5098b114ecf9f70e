"""How far a prefix hit extends past the device pool's, given what each tier holds (bookkeeping only)."""
from __future__ import annotations

from collections.abc import Callable, Sequence


def extension(hashes: Sequence[int], start: int, limit: int, step: int,
              has_kv: Callable[[int], bool], has_state: Callable[[int], bool]) -> int:
    """The longest hit k (blocks) in [start, limit] a linear-attention model can resume from: KV for
    every block of [start, k) and a state at every checkpoint boundary of (start, k] (every `step`
    blocks), in the device pool or a lower tier; k is on the grid, or `start` if nothing extends.

        blocks   [start ....................... k)     limit
        grid          |step      |step      |k           a state at each |
    A state is needed at every boundary, not only at k: the pool indexes a chain one checkpoint at a
    time, and a boundary it crosses without a state would stop the chain there (LinearStateCache).
    """
    best = start
    for j in range(start, min(limit, len(hashes))):
        if not has_kv(hashes[j]):
            break
        if (j + 1) % step == 0:
            if not has_state(hashes[j]):
                break
            best = j + 1
    return best
