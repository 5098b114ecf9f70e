"""In-process fake of the data plane, for tests of higher layers (scheduler glue, router, timeouts).

Same interface and the same state machine and failure reasons as the ZeroMQ transport, but bytes are
copied synchronously at `send(last=True)`. Faults are injected per transfer id:

    net = FakeTransport(); rx = net.receiver(layout, dst); tx = net.sender(layout, src)
    net.fail(tid, "link down")      # the next send of tid fails with that reason on both sides
    net.hold(tid)                   # tid never completes (exercise timeouts); net.release_hold(tid)
    tx.fatal = "boom"               # a dead loop thread: pending transfers read FAILED (health checks)
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from prfaas_sgl.transfer.buffers import register
from prfaas_sgl.transfer.chunking import dest_streams, scatter
from prfaas_sgl.transfer.config import PeerInfo
from prfaas_sgl.transfer.layout import MemoryLayout, Region, stream_lengths
from prfaas_sgl.transfer.states import UNKNOWN_STATUS, TransferState as S, TransferStatus


@dataclass(slots=True)
class _Entry:
    state: S
    deadline: float
    timeout_s: float = 0.0  # no-progress timeout behind `deadline`
    reason: str = ""
    nbytes: int = 0
    regions: list[Region] = field(default_factory=list)


class _Side:
    """Status table with deadlines checked lazily on poll (no thread needed)."""

    def __init__(self, default_timeout: float) -> None:
        self._entries: dict[int, _Entry] = {}
        self._timeout = default_timeout
        self.fatal: str | None = None

    def poll(self, tid: int) -> TransferStatus:
        e = self._entries.get(tid)
        if e is None:
            return UNKNOWN_STATUS
        if self.fatal is not None and not e.state.terminal:
            e.state, e.reason = S.FAILED, f"loop died: {self.fatal}"
        if not e.state.terminal and time.monotonic() >= e.deadline:
            e.state, e.reason = S.TIMED_OUT, f"timed out in fake transport after {self._timeout:g} s"
        return TransferStatus(e.state, e.reason, e.nbytes)

    def wait(self, tid: int, timeout: float) -> TransferStatus:
        end = time.monotonic() + timeout
        while not self.poll(tid).state.terminal and time.monotonic() < end:
            time.sleep(0.001)
        return self.poll(tid)

    def set(self, tid: int, state: S, reason: str = "", nbytes: int = 0) -> None:
        e = self._entries.get(tid)
        if e is not None and not e.state.terminal:
            e.state, e.reason, e.nbytes = state, reason, nbytes

    def abort(self, tid: int, reason: str = "aborted") -> None:
        self.set(tid, S.ABORTED, reason)

    def release(self, tid: int) -> None:
        self._entries.pop(tid, None)

    def close(self) -> None:
        self._entries.clear()


class FakeReceiver(_Side):
    def __init__(self, net: "FakeTransport", layout: MemoryLayout, buffers: Sequence[Any], timeout_s: float):
        super().__init__(timeout_s)
        self.layout, self.net = layout, net
        self.views = register(layout, buffers, writable=True)
        self.address = PeerInfo("127.0.0.1", next(net.ports))

    def expect(self, transfer_id: int, regions: Sequence[Region], timeout_s: float | None = None) -> None:
        for r in regions:
            self.layout.check_region(r)
        timeout = timeout_s or self._timeout
        self._entries[transfer_id] = _Entry(S.WAITING, time.monotonic() + timeout, timeout, regions=list(regions))

    def entry(self, tid: int) -> _Entry | None:
        return self._entries.get(tid)


class FakeSender(_Side):
    def __init__(self, net: "FakeTransport", layout: MemoryLayout, buffers: Sequence[Any], timeout_s: float):
        super().__init__(timeout_s)
        self.layout, self.net = layout, net
        self.views = register(layout, buffers, writable=False)

    def send(self, transfer_id: int, peer: PeerInfo, regions: Sequence[Region], last: bool = False,
             timeout_s: float | None = None) -> None:
        for r in regions:
            self.layout.check_region(r)
        timeout = timeout_s or self._timeout
        e = self._entries.setdefault(transfer_id, _Entry(S.TRANSFERRING, 0.0))
        if e.state.terminal:
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

    def receiver(self, layout: MemoryLayout, buffers: Sequence[Any]) -> FakeReceiver:
        rx = FakeReceiver(self, layout, buffers, self.timeout_s)
        self._receivers[rx.address.key()] = rx
        return rx

    def sender(self, layout: MemoryLayout, buffers: Sequence[Any]) -> FakeSender:
        return FakeSender(self, layout, buffers, self.timeout_s)

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
        if e is not None and not e.state.terminal and tid not in self._held:
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
        if e is None or e.state is not S.WAITING:
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

