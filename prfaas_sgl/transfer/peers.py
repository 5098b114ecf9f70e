"""One sender→receiver link: its sockets, credit window and the transfers waiting to use it."""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from prfaas_sgl.transfer.config import PeerInfo
from prfaas_sgl.transfer.stats import LinkStats


HANDSHAKE_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)


class Link:
    """Loop-thread-only state of one peer.

    Window: at most `window` un-acknowledged chunk bytes (one chunk may always go when nothing is in
    flight, so a window smaller than a chunk cannot deadlock). Control messages bypass the window.
    """

    def __init__(self, peer: PeerInfo, socks: list[zmq.Socket], stats: LinkStats, window: int) -> None:
        self.peer = peer
        self.socks = socks
        # handshake monitors: a refused CURVE key or mechanism fails transfers now, not at their deadline
        self.monitors = [s.get_monitor_socket(HANDSHAKE_EVENTS) for s in socks]
        self.handshake_error: str | None = None
        self.stats = stats
        self.window = window
        self.inflight = 0
        self.blocked = False  # every socket refused the last message; poll for POLLOUT
        self.control: collections.deque[Any] = collections.deque()
        self._work: dict[int, Any] = {}  # transfers with queued jobs, FIFO (dict keeps insertion order)
        self._rr = 0

    def queue_work(self, transfer: Any) -> None:
        self._work.setdefault(transfer.tid, transfer)

    def has_credit(self, nbytes: int) -> bool:
        return self.inflight == 0 or self.inflight + nbytes <= self.window

    def on_sent(self, nbytes: int, queued_s: float) -> None:
        self.inflight += nbytes
        self.stats.on_send(nbytes, queued_s)

    def on_ack(self, nbytes: int, now: float) -> None:
        self.inflight -= nbytes
        self.stats.on_ack(nbytes, now)

    def forget(self, nbytes: int) -> None:
        self.inflight -= nbytes
        self.stats.forget_inflight(nbytes)

    def pump(self, emit_control: Callable[["Link", Any], bool],
             emit_job: Callable[["Link", Any, Any], bool], ready: Callable[[Any], bool]) -> None:
        """Send control messages, then jobs of ready transfers oldest first, until something refuses.

        Oldest-first finishes one request's KV before starting the next: lower mean time to first token
        than interleaving, and the same link utilisation.
        """
        while self.control:
            if not emit_control(self, self.control[0]):
                return
            self.control.popleft()
        for tid, t in list(self._work.items()):
            if not t.jobs:
                del self._work[tid]
                continue
            if not ready(t):
                continue
            while t.jobs:
                if not emit_job(self, t, t.jobs[0]):
                    return
                t.jobs.popleft()
            del self._work[tid]

    def try_send(self, frames: list[Any]) -> bool:
        """Send on the next socket that accepts without blocking (round-robin striping)."""
        if self.blocked:
            return False
        n = len(self.socks)
        for k in range(n):
            i = (self._rr + k) % n
            try:
                self.socks[i].send_multipart(frames, zmq.NOBLOCK, copy=False)
            except zmq.Again:
                continue
            self._rr = (i + 1) % n
            return True
        self.blocked = True
        return False

    def on_monitor(self, mon: zmq.Socket) -> str | None:
        """Read one handshake event; returns a failure reason for this peer, or None."""
        ev = recv_monitor_message(mon, zmq.NOBLOCK)
        if ev["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.handshake_error = None
        elif ev["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            self.handshake_error = (f"CURVE authentication refused by {self.peer.key()} (ZAP status "
                                    f"{int(ev['value'])}): this sender's client key is not authorized there")
        elif ev["event"] == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            why = zmq.Event(ev["value"]).name
            self.handshake_error = (f"handshake with {self.peer.key()} failed ({why}): CURVE on one side "
                                    "only, or a wrong server key?")
        return self.handshake_error

    def close(self) -> None:
        for s in self.socks:
            s.disable_monitor()
            s.close(0)
        for m in self.monitors:
            m.close(0)
