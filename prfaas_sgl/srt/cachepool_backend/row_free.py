"""Giving a released request's KV row back to SGLang's allocator, in one free.

    row     [protected ......................................... end)
    stored        [blk i)     [blk j)                                 the tree's now (kept)
    freed   [....)       [...)       [............................)  one allocator free
"""
from __future__ import annotations

from collections.abc import Callable

import torch


def outside(ranges: list[tuple[int, int]], stored: dict[int, int], bs: int) -> list[tuple[int, int]]:
    """The parts of the row ranges outside the stored blocks (block positions of bs tokens)."""
    pieces = []
    for start, end in ranges:
        pos = start
        for i in sorted(b for b in stored if start < (b + 1) * bs and b * bs < end):
            if pos < i * bs:
                pieces.append((pos, i * bs))
            pos = max(pos, (i + 1) * bs)
        if pos < end:
            pieces.append((pos, end))
    return pieces


def free(cache, kv, pieces: list[tuple[int, int]], sglang_free_kv_row: Callable) -> None:
    """Free these ranges of kv's row in one allocator free. Without window pages at page size 1,
    SGLang's free_kv_row comes down to a free of the row's slots (free_kv_row_segments: no dead window
    range, every page whole), so the slices go there directly; otherwise through it, in one free group
    when there are several pieces."""
    allocator = cache.token_to_kv_pool_allocator
    if cache.sliding_window_size is None and cache.page_size == 1:
        table, r = cache.req_to_token_pool.req_to_token, kv.req_pool_idx
        slots = [table[r, start:end] for start, end in pieces if start < end]  # one index op a piece
        if slots:
            allocator.free(slots[0] if len(slots) == 1 else torch.cat(slots))
        return
    if len(pieces) < 2 or getattr(allocator, "free_group", False) is not None:
        if pieces:  # one piece, or a free group the caller already opened collects them
            sglang_free_kv_row(kv, pieces)
        return
    allocator.free_group_begin()
    try:
        sglang_free_kv_row(kv, pieces)
    finally:
        allocator.free_group_end()
