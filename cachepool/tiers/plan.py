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


def window_extension(hashes: Sequence[int], start: int, limit: int, window_blocks: int,
                     has_kv: Callable[[int], bool], device_window: Callable[[int], bool],
                     tier_window: Callable[[int], bool]) -> int:
    """The longest hit k (blocks) in [start, limit] a sliding-window model can resume from: KV for every
    block of [start, k) and the window pages of the w = window_blocks blocks before k, or `start` if
    nothing extends. Windows before `start` must be on the device (a load indexes nothing before the
    device hit); from `start` on, on the device or in a tier.

        blocks   [0 ....... start)[start ............ k)     limit
        windows                        [k - w ...... k)      device or tier (device only before start)
    Nearest-to-the-end k first; tier_window is asked once per block at most (the caller answers it from
    one batched lookup, TierStack.present).
    """
    end = start
    while end < min(limit, len(hashes)) and has_kv(hashes[end]):
        end += 1
    known: dict[int, bool] = {}

    def window(j: int) -> bool:
        h = hashes[j]
        if h not in known:
            known[h] = device_window(h) or (j >= start and tier_window(h))
        return known[h]

    for k in range(end, start, -1):
        if all(window(j) for j in range(k - 1, max(0, k - window_blocks) - 1, -1)):
            return k
    return start
