"""In-process fake of the data plane, for tests of higher layers (scheduler glue, router, timeouts).

Same interface and the same state machine and failure reasons as the ZeroMQ transport, but bytes are
copied synchronously at `send(last=True)`, item by item. It is a `transfer.api.Transport`: the SGLang
backend's managers take it (`transport=FakeTransport()`), and it moves their `ItemBatch`es (without head
slices). Faults are injected per transfer id:

    net = FakeTransport(); rx = net.receiver(layout, dst); tx = net.sender(layout, src)
    net.fail(tid, "link down")      # the next send of tid fails with that reason on both sides
    net.hold(tid)                   # tid never completes (exercise timeouts); net.release_hold(tid)
    tx.fatal = "boom"               # a dead loop thread: pending transfers read FAILED (health checks)
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from prfaas_sgl.transfer.buffers import register
from prfaas_sgl.transfer.config import PeerInfo, TransferConfig
from prfaas_sgl.transfer.items import ItemBatch, as_index, check_items
from prfaas_sgl.transfer.layout import MemoryLayout
from prfaas_sgl.transfer.states import UNKNOWN_STATUS, StatusTable, TransferState as S, TransferStatus


@dataclass(slots=True)
class _Entry:
    deadline: float
    timeout_s: float = 0.0  # no-progress timeout behind `deadline`
    items: dict[int, list[int]] = field(default_factory=dict)  # per buffer: item ids, stream order

    def extend(self, more: dict[int, list[int]]) -> None:
        for b, ids in more.items():
            self.items.setdefault(b, []).extend(ids)


class _Side:
    """The transport's status table (`states.StatusTable`), with deadlines checked lazily on poll (no
    thread needed)."""

    def __init__(self, default_timeout: float) -> None:
        self._entries: dict[int, _Entry] = {}
        self.status = StatusTable()
        self._timeout = default_timeout
        self.fatal: str | None = None
        self.on_terminal: Callable[[int], None] | None = None  # as ZmqSender's: wakes the backend's watch

    def _put(self, tid: int, status: TransferStatus) -> None:
        self.status.put(tid, status)
        if status.state.terminal and self.on_terminal is not None:
            self.on_terminal(tid)

    def poll(self, tid: int) -> TransferStatus:
        e = self._entries.get(tid)
        if e is None:
            return UNKNOWN_STATUS
        st = self.status.get(tid)
        if self.fatal is not None and not st.state.terminal:
            self._put(tid, TransferStatus(S.FAILED, f"loop died: {self.fatal}", st.nbytes))
        elif not st.state.terminal and time.monotonic() >= e.deadline:
            self._put(tid, TransferStatus(S.TIMED_OUT, f"timed out in fake transport after "
                                                f"{self._timeout:g} s", st.nbytes))
        return self.status.get(tid)

    def wait(self, tid: int, timeout: float) -> TransferStatus:
        return self.status.wait(tid, timeout, read=self.poll, step=0.001)  # deadlines move only on poll

    def state(self, tid: int) -> S:
        return self.status.get(tid).state

    def set(self, tid: int, state: S, reason: str = "", nbytes: int = 0) -> None:
        if tid in self._entries and not self.state(tid).terminal:
            self._put(tid, TransferStatus(state, reason, nbytes))

    def abort(self, tid: int, reason: str = "aborted") -> None:
        self.set(tid, S.ABORTED, reason)

    def release(self, tid: int) -> None:
        self._entries.pop(tid, None)
        self.status.pop(tid)

    def close(self) -> None:
        for tid in list(self._entries):
            self.release(tid)


class FakeReceiver(_Side):
    def __init__(self, net: "FakeTransport", layout: MemoryLayout, buffers: Sequence[Any], timeout_s: float):
        super().__init__(timeout_s)
        self.layout, self.net = layout, net
        self.views = register(layout, buffers, writable=True)
        self.address = PeerInfo("127.0.0.1", next(net.ports))

    def expect(self, transfer_id: int, batch: ItemBatch, timeout_s: float | None = None) -> None:
        items = as_items(self.layout, batch)
        timeout = timeout_s or self._timeout
        self._entries[transfer_id] = _Entry(time.monotonic() + timeout, timeout, items=items)
        self.status.put(transfer_id, TransferStatus(S.WAITING))

    def entry(self, tid: int) -> _Entry | None:
        return self._entries.get(tid)


class FakeSender(_Side):
    def __init__(self, net: "FakeTransport", layout: MemoryLayout, buffers: Sequence[Any], timeout_s: float):
        super().__init__(timeout_s)
        self.layout, self.net = layout, net
        self.views = register(layout, buffers, writable=False)
        self.worker_fatal: str | None = None  # no helper threads here; a test may set it

    def send(self, transfer_id: int, peer: PeerInfo, batch: ItemBatch, last: bool = False,
             timeout_s: float | None = None) -> None:
        items = as_items(self.layout, batch)
        timeout = timeout_s or self._timeout
        e = self._entries.get(transfer_id)
        if e is None:
            e = self._entries[transfer_id] = _Entry(0.0)
            self.status.put(transfer_id, TransferStatus(S.TRANSFERRING))
        if self.state(transfer_id).terminal:
            return
        # no-progress deadlines, as on the wire: each piece sent refreshes both ends (the real receiver
        # sees its chunks arrive as they are sent; here the bytes move only at `last`)
        e.deadline = time.monotonic() + timeout
        self.net.progress(transfer_id, peer)
        e.extend(items)
        if last:
            self.net.deliver(self, transfer_id, peer, e.items)


class FakeTransport:
    """A fake network connecting any number of fake senders and receivers."""

    def __init__(self, timeout_s: float = 60.0) -> None:
        self.timeout_s = timeout_s
        self.ports = itertools.count(20000)
        self._receivers: dict[str, FakeReceiver] = {}
        self._fail: dict[int, str] = {}
        self._held: set[int] = set()

    # `cfg` and `opts` as `transfer.api.Transport`: the addresses, devices and stats port of the real
    # transport mean nothing in process; its faults are not modelled (use fail/hold), so refuse them
    def receiver(self, layout: MemoryLayout, buffers: Sequence[Any], cfg: TransferConfig | None = None,
                 **opts: Any) -> FakeReceiver:
        _no_faults(opts)
        rx = FakeReceiver(self, layout, buffers, self.timeout_s)
        self._receivers[rx.address.key()] = rx
        return rx

    def sender(self, layout: MemoryLayout, buffers: Sequence[Any], cfg: TransferConfig | None = None,
               **opts: Any) -> FakeSender:
        _no_faults(opts)
        tx = FakeSender(self, layout, buffers, self.timeout_s)
        tx.on_terminal = opts.get("on_terminal")
        return tx

    def fail(self, tid: int, reason: str) -> None:
        self._fail[tid] = reason

    def hold(self, tid: int) -> None:
        self._held.add(tid)

    def release_hold(self, tid: int) -> None:
        self._held.discard(tid)

    def progress(self, tid: int, peer: PeerInfo) -> None:
        """A piece of `tid` was sent: the receiver's no-progress deadline starts again."""
        rx = self._receivers.get(peer.key())
        e = rx.entry(tid) if rx is not None else None
        if e is not None and not rx.state(tid).terminal and tid not in self._held:
            e.deadline = time.monotonic() + e.timeout_s

    def deliver(self, tx: FakeSender, tid: int, peer: PeerInfo, items: dict[int, list[int]]) -> None:
        if tid in self._held:
            return
        rx = self._receivers.get(peer.key())
        reason = self._problem(tx, rx, tid, peer, items)
        if reason:
            tx.set(tid, S.FAILED, reason)
            if rx is not None:
                rx.set(tid, S.FAILED, reason)
            return
        nbytes = self._copy(tx, rx, tid, items)
        tx.set(tid, S.DONE, nbytes=nbytes)
        rx.set(tid, S.DONE, nbytes=nbytes)

    def _problem(self, tx: FakeSender, rx: FakeReceiver | None, tid: int, peer: PeerInfo,
                 items: dict[int, list[int]]) -> str:
        if tid in self._fail:
            return self._fail.pop(tid)
        if rx is None:
            return f"no receiver at {peer.key()}"
        e = rx.entry(tid)
        if e is None or rx.state(tid) is not S.WAITING:
            return f"receiver does not expect transfer {tid}"
        mismatch = rx.layout.mismatch(tx.layout)
        if mismatch:
            return mismatch
        sent, want = _stream_lengths(tx.layout, items), _stream_lengths(rx.layout, e.items)
        for b in sorted(set(sent) | set(want)):
            if sent.get(b, 0) != want.get(b, 0):
                return (f"buffer {b} stream length mismatch: sender sends {sent.get(b, 0)} B, "
                        f"receiver expects {want.get(b, 0)} B (different page count or page size)")
        return ""

    @staticmethod
    def _copy(tx: FakeSender, rx: FakeReceiver, tid: int, items: dict[int, list[int]]) -> int:
        """Byte k of each buffer's sent stream onto byte k of its expected one (equal item lengths: the
        layouts matched)."""
        nbytes = 0
        for b, dst_ids in rx.entry(tid).items.items():
            n = rx.layout.buffers[b].item_len
            for s, d in zip(items.get(b, []), dst_ids):
                rx.views[b][d * n: (d + 1) * n] = tx.views[b][s * n: (s + 1) * n]
            nbytes += n * len(dst_ids)
        return nbytes

def as_items(layout: MemoryLayout, batch: ItemBatch) -> dict[int, list[int]]:
    """Checked item ids of `batch` per buffer, in stream order, after its `ready` (page ids the scheduler
    still copies). Head slices (TP pairing) stay with the real transport."""
    if batch.ready is not None:
        batch.ready()
    out: dict[int, list[int]] = {}
    for g in batch.groups:
        if g.head is not None:
            raise NotImplementedError("fake transport: head slices move on ZmqSender/ZmqReceiver only")
        index = as_index(g.index)
        check_items(layout, g, index)
        for b in g.buffer_ids:
            out.setdefault(b, []).extend(index.tolist())
    return out


def _stream_lengths(layout: MemoryLayout, items: dict[int, list[int]]) -> dict[int, int]:
    return {b: layout.buffers[b].item_len * len(ids) for b, ids in items.items() if ids}


def _no_faults(opts: dict[str, Any]) -> None:
    if opts.get("faults"):
        raise ValueError("fake transport: inject faults with FakeTransport.fail/hold, not transfer.faults")
