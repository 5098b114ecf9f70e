"""In-process fake of the data plane, for tests of higher layers (scheduler glue, router, timeouts).

Same interface and the same state machine and failure reasons as the ZeroMQ transport, but bytes are
copied synchronously at `send(last=True)`. It is a `transfer.api.Transport`: the SGLang backend's managers
take it (`transport=FakeTransport()`), and it accepts their `ItemBatch`es (without head slices). Faults are
injected per transfer id:

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
from prfaas_sgl.transfer.chunking import dest_streams, scatter
from prfaas_sgl.transfer.config import PeerInfo, TransferConfig
from prfaas_sgl.transfer.items import ItemBatch, as_index, check_items
from prfaas_sgl.transfer.layout import MemoryLayout, Region, item_regions, stream_lengths
from prfaas_sgl.transfer.states import UNKNOWN_STATUS, StatusTable, TransferState as S, TransferStatus


@dataclass(slots=True)
class _Entry:
    deadline: float
    timeout_s: float = 0.0  # no-progress timeout behind `deadline`
    regions: list[Region] = field(default_factory=list)


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

    def expect(self, transfer_id: int, regions: Sequence[Region] | ItemBatch, timeout_s: float | None = None) -> None:
        regions = as_regions(self.layout, regions)
        timeout = timeout_s or self._timeout
        self._entries[transfer_id] = _Entry(time.monotonic() + timeout, timeout, regions=list(regions))
        self.status.put(transfer_id, TransferStatus(S.WAITING))

    def entry(self, tid: int) -> _Entry | None:
        return self._entries.get(tid)


class FakeSender(_Side):
    def __init__(self, net: "FakeTransport", layout: MemoryLayout, buffers: Sequence[Any], timeout_s: float):
        super().__init__(timeout_s)
        self.layout, self.net = layout, net
        self.views = register(layout, buffers, writable=False)
        self.worker_fatal: str | None = None  # no helper threads here; a test may set it

    def send(self, transfer_id: int, peer: PeerInfo, regions: Sequence[Region] | ItemBatch, last: bool = False,
             timeout_s: float | None = None) -> None:
        regions = as_regions(self.layout, regions)
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
        e.regions.extend(regions)
        if last:
            self.net.deliver(self, transfer_id, peer, e.regions)


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

    def deliver(self, tx: FakeSender, tid: int, peer: PeerInfo, regions: list[Region]) -> None:
        if tid in self._held:
            return
        rx = self._receivers.get(peer.key())
        reason = self._problem(tx, rx, tid, peer, regions)
        if reason:
            tx.set(tid, S.FAILED, reason)
            if rx is not None:
                rx.set(tid, S.FAILED, reason)
            return
        nbytes = self._copy(tx, rx, tid, regions)
        tx.set(tid, S.DONE, nbytes=nbytes)
        rx.set(tid, S.DONE, nbytes=nbytes)

    def _problem(self, tx: FakeSender, rx: FakeReceiver | None, tid: int, peer: PeerInfo,
                 regions: list[Region]) -> str:
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
        sent, want = stream_lengths(regions), stream_lengths(e.regions)
        for b in sorted(set(sent) | set(want)):
            if sent.get(b, 0) != want.get(b, 0):
                return (f"buffer {b} stream length mismatch: sender sends {sent.get(b, 0)} B, "
                        f"receiver expects {want.get(b, 0)} B (different page count or page size)")
        return ""

    @staticmethod
    def _copy(tx: FakeSender, rx: FakeReceiver, tid: int, regions: list[Region]) -> int:
        streams = dest_streams(rx.entry(tid).regions)
        pos: dict[int, int] = {}
        for r in regions:
            view = tx.views[r.buffer_id][r.offset: r.offset + r.length]
            scatter(rx.views[r.buffer_id], streams[r.buffer_id], pos.get(r.buffer_id, 0), [view])
            pos[r.buffer_id] = pos.get(r.buffer_id, 0) + r.length
        return sum(pos.values())



def as_regions(layout: MemoryLayout, what: Sequence[Region] | ItemBatch) -> list[Region]:
    """Checked regions of `what`; an `ItemBatch` (the backend's staged path) becomes its items' regions in
    stream order, after its `ready` (page ids the scheduler still copies). Head slices (TP pairing) stay
    with the real transport: no region list describes them."""
    if not isinstance(what, ItemBatch):
        for r in what:
            layout.check_region(r)
        return list(what)
    if what.ready is not None:
        what.ready()
    out: list[Region] = []
    for g in what.groups:
        if g.head is not None:
            raise NotImplementedError("fake transport: head slices move on ZmqSender/ZmqReceiver only")
        index = as_index(g.index)
        check_items(layout, g, index)
        out += item_regions(layout, g.buffer_ids, index.tolist())
    return out


def _no_faults(opts: dict[str, Any]) -> None:
    if opts.get("faults"):
        raise ValueError("fake transport: inject faults with FakeTransport.fail/hold, not transfer.faults")
