"""The staged data path, decode side: `Lander` writes verified chunk bytes into the pools.

Runs on the receiver's loop thread, under its write lock: a verified chunk's bytes go straight from the
frame into the host pool (index_copy_), or, for a device pool, through a pinned receive-ring slot, H2D and
index_copy_ on a copy stream with one event per chunk; `settled()` says when every copy of a transfer has
completed, and only then is Done sent. `settle()` (release) waits for them. The prefill side (`Stager`)
and the pieces both sides share (`Pools`, `Ring`) are in staging.py.
"""
from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

import torch

from prfaas_sgl.transfer import slicing
from prfaas_sgl.transfer.items import ByteRuns, ItemStream, spans
from prfaas_sgl.transfer.staging import Pools, Ring, is_cuda


class Lander:
    """Decode: writes verified chunk bytes into item streams (see the module docstring). Callers hold
    the receiver's write lock around every method."""

    def __init__(self, pools: Pools, slot_bytes: int, nslots: int) -> None:
        self.pools = pools
        self.ring = Ring(nslots, slot_bytes, pinned=True) if pools.cuda else None
        self._dev = ({d: torch.empty(nslots * slot_bytes, dtype=torch.uint8, device=d) for d in pools.cuda}
                     if pools.cuda else {})
        self._streams = {d: torch.cuda.Stream(device=d) for d in pools.cuda}
        self._pending: collections.deque[tuple[Any, int]] = collections.deque()  # (event, slot), FIFO

    def write(self, copies: list, b: int, stream: ItemStream, offset: int, frames: Sequence[memoryview]) -> None:
        """Write `frames` (consecutive stream bytes of buffer `b` from `offset`); device copies are
        appended to `copies` (the transfer's pending list) as events."""
        device = self.pools.devices[b]
        for f in frames:
            src = torch.frombuffer(f, dtype=torch.uint8) if len(f) else None
            if src is None:
                continue
            if is_cuda(device):
                copies.append(self._write_device(b, stream, offset, src, device))
            else:
                apply_spans(self.pools, b, stream, offset, src)
            offset += len(f)

    def _write_device(self, b: int, stream: ItemStream, offset: int, src: torch.Tensor, device: str) -> Any:
        slot = self._slot()
        n = src.numel()
        host = self.ring.slot(slot, n)
        host.copy_(src)  # out of libzmq's frame now: the frame may be freed, the H2D reads pinned memory
        cs = self._streams[device]
        with torch.cuda.stream(cs):
            dev = self._dev[device][slot * self.ring.slot_bytes: slot * self.ring.slot_bytes + n]
            dev.copy_(host, non_blocking=True)
            apply_spans(self.pools, b, stream, offset, dev)
            ev = torch.cuda.Event()
            ev.record(cs)
        self._pending.append((ev, slot))
        return ev

    def _slot(self) -> int:
        self.reclaim()
        while not self.ring.free:  # ring full: wait for the oldest copy (bounded: one chunk's H2D)
            ev, slot = self._pending.popleft()
            ev.synchronize()
            self.ring.free.append(slot)
        return self.ring.free.popleft()

    def reclaim(self) -> None:
        while self._pending and self._pending[0][0].query():
            self.ring.free.append(self._pending.popleft()[1])

    @staticmethod
    def settled(copies: list) -> bool:
        """Every device copy in `copies` has completed (drops the completed ones)."""
        while copies and copies[0].query():
            copies.pop(0)
        return not copies

    @staticmethod
    def settle(copies: list) -> None:
        """Block until every copy in `copies` completed (release: nothing may be written afterwards)."""
        for ev in copies:
            ev.synchronize()
        copies.clear()


def apply_spans(pools: Pools, b: int, stream: ItemStream, offset: int, src: torch.Tensor) -> None:
    """Write stream bytes [offset, offset + len(src)) of buffer `b` into its items (src on b's device)."""
    s = stream.stream_len
    sp = spans(offset, src.numel(), s)
    runs = stream.head if isinstance(stream.head, ByteRuns) and not stream.head.whole else None
    view = pools.view(b, None if isinstance(stream.head, ByteRuns) else stream.head)
    pos = 0
    if sp.head is not None:
        i, a, z = sp.head
        _write_part(view, int(stream.index[i]), a, src[pos: pos + z - a], runs)
        pos += z - a
    w0, w1 = sp.whole
    if w1 > w0:
        k = w1 - w0
        rows = src[pos: pos + k * s].view(k, *view.shape[1:]) if runs is None else src[pos: pos + k * s].view(k, s)
        if view.is_cuda and (stream.tensor_index is None or stream.tensor_index.device != view.device):
            stream.tensor_index = torch.from_numpy(stream.index).to(view.device)
        if runs is not None:
            slicing.write_rows(view, stream.index[w0:w1], stream.tensor_index[w0:w1] if view.is_cuda else None,
                               runs, rows)
        elif view.is_cuda:
            view.index_copy_(0, stream.tensor_index[w0:w1], rows)
        else:  # numpy's fancy assignment: 0.5 ms per MiB of 1 KiB rows here, torch's CPU index_copy_ 4 ms
            view.numpy()[stream.index[w0:w1]] = rows.numpy()
        pos += k * s
    if sp.tail is not None:
        i, z = sp.tail
        _write_part(view, int(stream.index[i]), 0, src[pos: pos + z], runs)


def _write_part(view: torch.Tensor, item: int, a: int, src: torch.Tensor, runs: ByteRuns | None) -> None:
    """Bytes [a, a + len(src)) of one stream item (a piece of an item larger than a chunk)."""
    if runs is not None:
        slicing.write_piece(view, item, runs, a, src)
        return
    dst = view[item]
    if dst.is_contiguous():
        dst.view(-1)[a: a + src.numel()].copy_(src)
        return
    tmp = dst.contiguous().view(-1)  # a head-sliced item is strided: read, patch, write back
    tmp[a: a + src.numel()] = src
    dst.copy_(tmp.view(dst.shape))
