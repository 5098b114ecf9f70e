"""The pool's index mirrored onto SGLang memory: chain hash -> KV slot indices / Mamba state slot.

HybridCachePool decides what is cached, referenced and evicted (on virtual block ids); SGLang owns
the memory. Events are the only channel between them: BlockStored binds a hash to the memory the
request computed it in, BlockRemoved gives that memory back to SGLang's allocators.

KV slots live in one table on the allocator's device, one row per cached full-attention entry:

    kv_table[kv_of[hash]] = the block_size KV slots of that entry            (int64 [rows, bs])

Rows are the mirror's own (a free list), not the pool's block ids: the pool's ids also number state
blocks and head-room, so a table per pool block would cost num_blocks x bs x 8 bytes (hundreds of MB
with chunk-sized blocks), while the entries that hold slots are at most kv_tokens // bs.

so a checkpoint stores all of its new blocks with one gather from the request's row, a match hands
SGLang its prefix with one gather, and the slots of everything evicted in one call go back to SGLang
with one gather and one allocator free (each `free` there concatenates the whole free list, so a free
per block costs O(blocks x pool) — seconds at GPU pool sizes).

A sliding-window model's SWA entries own the window pages of full entries' slots (swa.py): a hash is
in `swa_of` only while its full entry's slots all have live peers the tree owns.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from prfaas_sgl.cachepool import AllBlocksCleared, BlockRemoved, BlockStored

from .swa import SWA, SwaMemory

FULL, LINEAR = "full", "linear"  # group names in the pool config


@dataclass(slots=True)
class Insert:
    """What one checkpoint offers: block i of the request is row[i*bs:(i+1)*bs] for i in pos_of's
    values; `state` is a state slot holding the request's state at exactly `state_hash`'s boundary."""

    row: Any  # torch int [>= num_tokens]: the request's KV slot per token (a view of req_to_token)
    pos_of: dict[int, int]  # chain hash -> block position in the request (the blocks it may store)
    state_hash: Optional[int] = None
    state: Any = None  # torch int64 [1]
    stored_blocks: list[int] = field(default_factory=list)  # positions the tree took over
    # SWA: blocks ending past swa_limit (row positions) must not give the tree their window pages
    # (the request may still free them); hashes the SWA group stored that memory cannot back
    swa_limit: int = 0
    swa_rejected: list[int] = field(default_factory=list)


class Mirror:
    def __init__(self, block_size: int, rows: int, device: torch.device, free_kv: Callable[[Any], None],
                 free_state: Callable[[Any], None], swa: Optional[SwaMemory] = None) -> None:
        """rows: kv_table rows to start with (entries that can hold slots; grows if short). free_kv
        frees full slots (for a sliding-window model: slots whose window pages are already gone)."""
        self.bs, self.device = block_size, device
        self.kv_table = torch.zeros((max(1, rows), block_size), dtype=torch.int64, device=device)
        self._free_rows = list(range(len(self.kv_table) - 1, -1, -1))  # pop() takes row 0 first
        self.kv_of: dict[int, int] = {}  # full-group hash -> its row of kv_table
        self.state_of: dict[int, Any] = {}  # linear-group hash -> int64 [1] Mamba slot
        self.swa, self.swa_of = swa, set()  # SWA-group hashes (window pages: see module doc)
        self._free_kv, self._free_state = free_kv, free_state
        self._gone_rows: list[int] = []  # rows removed, slots not yet given back (see flush)
        self._gone_states: list[Any] = []
        self._gone_windows: list[int] = []  # rows whose window pages go back (SWA removed)
        self._gone_both: list[int] = []  # full entries removed with their SWA entry
        self.orphans: list[int] = []  # SWA entries whose full entry went: the pool must drop them
        self._dropped: set[int] = set()  # SWA hashes with no memory of their own, removal pending

    def apply(self, events: list, insert: Optional[Insert] = None) -> tuple[int, int, int]:
        """Apply drained pool events; returns (KV tokens, state slots, window tokens) removed.
        Removed memory goes back to SGLang at the next flush(), all of it in one free per kind."""
        tokens = states = windows = 0
        stores: list[BlockStored] = []
        for ev in events:
            if isinstance(ev, BlockRemoved):
                if ev.group == FULL:
                    windows += self._remove_full(ev.block_hashes)
                    tokens += self.bs * len(ev.block_hashes)
                elif ev.group == SWA:
                    windows += self._remove_windows(ev.block_hashes)
                else:
                    self._gone_states += [self.state_of.pop(h) for h in ev.block_hashes]
                    states += len(ev.block_hashes)
            elif isinstance(ev, BlockStored):
                stores.append(ev)
            elif isinstance(ev, AllBlocksCleared):
                self.kv_of.clear()
                self.state_of.clear()
                self.swa_of.clear()
        if stores:
            # a row removed above may be taken again below: its old slots must leave kv_table
            # before the new ones overwrite them
            self.flush()
            self._store(stores, insert)
        return tokens, states, windows

    def _remove_full(self, hashes: list[int]) -> int:
        """A full entry takes its SWA entry along (a window without its prefix is never a hit);
        returns the window tokens freed."""
        windows = 0
        for h in hashes:
            row = self.kv_of.pop(h)
            if h in self.swa_of:
                self.swa_of.remove(h)
                self._gone_both.append(row)
                self.orphans.append(h)
                self._dropped.add(h)
                windows += self.bs
            else:
                self._gone_rows.append(row)
        return windows

    def _remove_windows(self, hashes: list[int]) -> int:
        windows = 0
        for h in hashes:
            if h in self.swa_of:
                self.swa_of.remove(h)
                self._gone_windows.append(self.kv_of[h])
                windows += self.bs
            else:  # rejected at its store, or its full entry went first: nothing of its own to free
                self._dropped.remove(h)
        return windows

    def flush(self) -> None:
        """Give the slots of every entry removed since the last flush back to SGLang; their rows
        become free."""
        if self._gone_windows:  # first: the full-only frees below expect their peers gone
            self.swa.free_window(self.kv_slots_of_rows(self._gone_windows))
            self._gone_windows = []
        if self._gone_rows:
            self._free_kv(self.kv_slots_of_rows(self._gone_rows))
            self._free_rows += reversed(self._gone_rows)  # pop() hands them out in order again
            self._gone_rows = []
        if self._gone_both:
            self.swa.free_both(self.kv_slots_of_rows(self._gone_both))
            self._free_rows += reversed(self._gone_both)
            self._gone_both = []
        if self._gone_states:
            self._free_state(torch.cat(self._gone_states))
            self._gone_states = []

    def take_orphans(self) -> list[int]:
        """SWA hashes whose full entry was removed since the last call (their memory is freed)."""
        out, self.orphans = self.orphans, []
        return out

    def _store(self, stores: list[BlockStored], insert: Optional[Insert]) -> None:
        assert insert is not None, "BlockStored outside a checkpoint"
        rows, positions, windows = [], [], []
        for ev in stores:
            for h in ev.block_hashes:
                if ev.group == FULL:
                    rows.append(self._take_row())
                    positions.append(insert.pos_of[h])
                    self.kv_of[h] = rows[-1]
                elif ev.group == SWA:
                    windows.append(h)
                else:
                    # the pool only plans states the backend marked and copied (see linear._state_at)
                    assert h == insert.state_hash and insert.state is not None, "checkpoint without a state"
                    self.state_of[h] = insert.state
                    insert.state = None
        if rows:
            self._gather(insert.row, positions, rows)
            insert.stored_blocks += positions
        if windows:
            self._store_windows(windows, insert)

    def _take_row(self) -> int:
        if not self._free_rows:  # doubles: more entries than the start-up estimate hold slots
            n = len(self.kv_table)
            self.kv_table = torch.cat([self.kv_table, torch.zeros_like(self.kv_table)])
            self._free_rows = list(range(2 * n - 1, n - 1, -1))
        return self._free_rows.pop()

    def _store_windows(self, hashes: list[int], insert: Insert) -> None:
        """Index an SWA block only if its full entry holds this row's slots (not another request's
        copy), their window pages are all live, and the request will not free them (swa_limit);
        the rest go to insert.swa_rejected, for the backend to drop from the pool."""
        pos = torch.tensor([insert.pos_of[h] for h in hashes], dtype=torch.int64, device=self.device)
        row_slots = insert.row[torch.arange(self.bs, device=self.device) + pos[:, None] * self.bs].to(torch.int64)
        cached = self.kv_slots([*hashes]).view(len(hashes), self.bs)
        ok = (row_slots == cached).all(1) & self.swa.alive(row_slots).all(1) & ((pos + 1) * self.bs <= insert.swa_limit)
        for h, good in zip(hashes, ok.tolist()):
            if good:
                self.swa_of.add(h)
            else:
                insert.swa_rejected.append(h)
                self._dropped.add(h)

    def _gather(self, row: Any, positions: list[int], rows: list[int]) -> None:
        """kv_table[rows[j]] = row[positions[j]*bs : (positions[j]+1)*bs] for all j, in one copy. A run
        of positions (a checkpoint's new blocks usually are one) is a slice of the row and a run of
        rows a slice of the table, so no index tensor is built for them."""
        bs, n = self.bs, len(positions)
        if _is_run(positions):
            src = row[positions[0] * bs:(positions[0] + n) * bs].view(n, bs)
        else:
            pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
            src = row[torch.arange(bs, device=self.device) + pos[:, None] * bs]  # [n, bs]
        if _is_run(rows):
            self.kv_table[rows[0]:rows[0] + n].copy_(src)
        else:
            self.kv_table[torch.tensor(rows, dtype=torch.int64, device=self.device)] = src.to(torch.int64)

    def kv_slots(self, hashes) -> torch.Tensor:
        """KV slots of cached hashes, in order: int64 [len(hashes) * bs]."""
        return self.kv_slots_of_rows([self.kv_of[h] for h in hashes])

    def locked_kv_slots(self, hashes) -> torch.Tensor:
        """kv_slots for hashes a lock pins: a run of rows is a view of kv_table, not a copy. A pinned
        entry is not evicted, so its row is not reused while the lock is held (SGLang reads a locked
        match's path once, to write it into the request's row)."""
        rows = [self.kv_of[h] for h in hashes]
        if rows and _is_run(rows):
            return self.kv_table[rows[0]:rows[0] + len(rows)].view(-1)
        return self.kv_slots_of_rows(rows)

    def kv_slots_of_rows(self, rows: list[int]) -> torch.Tensor:
        """A copy (the rows are reused once their entries go): int64 [len(rows) * bs]."""
        if not rows:
            return torch.empty((0,), dtype=torch.int64, device=self.device)
        if _is_run(rows):
            return self.kv_table[rows[0]:rows[0] + len(rows)].reshape(-1).clone()
        table = self.kv_table
        if len(rows) <= _FEW_ROWS:  # a short hit: its runs of rows as slices, one cat (no index tensor)
            return torch.cat([table[a:b].view(-1) for a, b in _runs(rows)])
        # index_select: half the time of table[index] (advanced indexing) on the CPU
        return table.index_select(0, torch.tensor(rows, dtype=torch.int64, device=self.device)).view(-1)

    def check(self, pool) -> None:
        """The mirror equals the pool's index, and no SGLang slot is held twice."""
        groups = {m.name: m for m in pool.managers}  # a decode server's pool has no linear group
        full, linear, swa = groups[FULL], groups.get(LINEAR), groups.get(SWA)
        assert set(full.index) == set(self.kv_of), "KV mirror differs from the full-attention index"
        assert set(linear.index if linear else ()) == set(self.state_of), \
            "state mirror differs from the linear index"
        assert set(swa.index if swa else ()) == self.swa_of, "window mirror differs from the SWA index"
        assert self.swa_of <= set(self.kv_of), "an SWA entry outlived its full-attention entry"
        assert not (self._gone_rows or self._gone_states or self._gone_windows or self._gone_both), \
            "removed slots not flushed"
        rows = list(self.kv_of.values()) + self._free_rows
        assert sorted(rows) == list(range(len(self.kv_table))), "a kv_table row is lost or used twice"
        assert not (self.orphans or self._dropped), "SWA entries the pool should have dropped"
        if self.swa_of:
            assert bool(self.swa.alive(self.kv_slots(list(self.swa_of))).all()), "a cached window page is gone"
        slots = self.kv_slots(list(self.kv_of)).tolist()
        assert len(slots) == len(set(slots)), "a KV slot is cached under two hashes"
        states = [int(t.item()) for t in self.state_of.values()]
        assert len(states) == len(set(states)), "a state slot is cached under two hashes"


_FEW_ROWS = 16


def _runs(xs: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each maximal run of consecutive values in xs, in order."""
    out, start = [], xs[0]
    for prev, x in zip(xs, xs[1:]):
        if x != prev + 1:
            out.append((start, prev + 1))
            start = x
    out.append((start, xs[-1] + 1))
    return out


def _is_run(xs: list[int]) -> bool:
    """xs == [x0, x0 + 1, ..., x0 + len - 1] (xs not empty)."""
    return xs[-1] - xs[0] == len(xs) - 1 and (len(xs) < 3 or xs == list(range(xs[0], xs[0] + len(xs))))
