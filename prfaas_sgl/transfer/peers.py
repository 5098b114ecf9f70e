"""Sender→receiver links: one link's sockets, credit window and waiting transfers, and the table of links.

A link is named by the receiver's full identity, (host, port, CURVE server key): a decode that restarts
on the same port with a new key is a new peer, and sockets still holding the old key would fail every
handshake. Unused links close (LRU beyond `max_links`, and after `link_idle_s`): every link holds
3 sockets per connection and redials its peer forever, and decodes come and go. A link's connections
carry its secret token in their ROUTING_IDs (`link_token`), so only this link can feed its transfers.
"""

from __future__ import annotations

import collections
import secrets
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from prfaas_sgl.transfer.config import PeerInfo, TransferConfig
from prfaas_sgl.transfer.loop import make_socket
from prfaas_sgl.transfer.security import secure_client
from prfaas_sgl.transfer.stats import LinkStats


HANDSHAKE_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
_TOKEN_BYTES = 16


def link_token() -> bytes:
    """A link's secret: its connections' ROUTING_IDs are `token + connection index` (one byte).

    The receiver binds a transfer to the session that opened it: peer address, CURVE client key and
    this token (see `recv_gate.session_of`). Without it, any process on the prefill's host (same address,
    same empty key in plaintext) could feed our transfers. First byte non-zero: libzmq reserves
    identities starting with 0 for the ones it generates, which carry no token.
    """
    return bytes([1 + secrets.randbelow(255)]) + secrets.token_bytes(_TOKEN_BYTES - 1)


def open_link(ctx: zmq.Context, cfg: TransferConfig, peer: PeerInfo, stats: LinkStats, now: float) -> "Link":
    """`cfg.connections` DEALERs dialling `peer` under one fresh token (may raise: nothing is left open)."""
    token = link_token()
    socks: list[zmq.Socket] = []
    try:
        for i in range(cfg.connections):
            socks.append(_dealer(ctx, cfg, peer, token + bytes([i])))
        return Link(peer, socks, stats, cfg.window_bytes, now)
    except BaseException:
        for s in socks:
            s.close(0)
        raise


def _dealer(ctx: zmq.Context, cfg: TransferConfig, peer: PeerInfo, routing_id: bytes) -> zmq.Socket:
    sock = make_socket(ctx, zmq.DEALER, cfg)
    try:
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
        if cfg.keys_dir:
            secure_client(sock, cfg.keys_dir, peer.server_key)
        sock.connect(peer.endpoint)
    except BaseException:
        sock.close(0)
        raise
    return sock


class Link:
    """Loop-thread-only state of one peer.

    Window: at most `window` un-acknowledged chunk bytes (one chunk may always go when nothing is in
    flight, so a window smaller than a chunk cannot deadlock). Control messages bypass the window.
    """

    def __init__(self, peer: PeerInfo, socks: list[zmq.Socket], stats: LinkStats, window: int,
                 now: float) -> None:
        self.peer = peer
        self.socks = socks
        # handshake monitors: a refused CURVE key or mechanism fails transfers now, not at their deadline
        self.monitors: list[zmq.Socket] = []
        try:
            self.monitors.extend(s.get_monitor_socket(HANDSHAKE_EVENTS) for s in socks)
        except BaseException:  # e.g. out of sockets: leave nothing open behind
            self.close()
            raise
        self.handshake_error: str | None = None
        self.active: set[int] = set()  # ids of non-terminal transfers on this link
        self.last_used = now  # when a transfer last started or ended here
        self.last_progress = now  # when the peer last acknowledged a chunk
        self.stats = stats
        self.window = window
        self.inflight = 0
        # cumulative chunk bytes handed to ZeroMQ / acknowledged: where a transfer's last message sits in
        # the link's queue, and whether the acks since have overtaken it (see SendBook.deadline)
        self.sent_total = 0
        self.acked_total = 0
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
        self.sent_total += nbytes
        self.stats.on_send(nbytes, queued_s)

    def on_ack(self, nbytes: int, now: float) -> None:
        self.inflight -= nbytes
        self.acked_total += nbytes
        self.last_progress = now
        self.stats.on_ack(nbytes, now)

    def attach(self, tid: int, now: float, live: bool) -> None:
        """Count transfer `tid` as using this link while `live` (non-terminal)."""
        if live:
            self.active.add(tid)
        else:
            self.active.discard(tid)
        self.last_used = now

    def forget(self, nbytes: int) -> None:
        self.inflight -= nbytes
        self.stats.forget_inflight(nbytes)

    def pump(self, emit_control: Callable[["Link", Any], bool],
             emit_job: Callable[["Link", Any, Any], bool], ready: Callable[[Any], bool],
             waiting: Callable[[Any], bool] = lambda job: False) -> None:
        """Send control messages, then jobs of ready transfers oldest first, until something refuses.
        A transfer whose next job is `waiting` (not staged yet) is passed over until it is not.

        Oldest-first finishes one request's KV before starting the next: lower mean time to first token
        than interleaving, and the same link utilisation. Passing over an unstaged head keeps the link busy
        while a request's next layer group is still computing.
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
                job = t.jobs[0]
                if waiting(job):
                    break
                if not emit_job(self, t, job):
                    return
                if t.jobs and t.jobs[0] is job:  # emit_job may have failed t and cleared its jobs
                    t.jobs.popleft()
            else:
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

    def try_send_tracked(self, frames: list[Any]) -> tuple[bool, Any]:
        """`try_send` that also returns ZeroMQ's tracker of the last frame (done once libzmq let go of
        it: a staged slot may be reused only then); (False, None) when no socket takes it now."""
        if self.blocked:
            return False, None
        n = len(self.socks)
        for k in range(n):
            i = (self._rr + k) % n
            try:
                tracker = self.socks[i].send_multipart(frames, zmq.NOBLOCK, copy=False, track=True)
            except zmq.Again:
                continue
            self._rr = (i + 1) % n
            return True, tracker
        self.blocked = True
        return False, None

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
            s.disable_monitor()  # no-op on a socket whose monitor never started
            s.close(0)
        for m in self.monitors:
            m.close(0)


class LinkTable:
    """The sender's links by full peer identity; loop thread only. `make(peer)` opens a new link;
    `on_close(link)` runs after a link left the table."""

    def __init__(self, make: Callable[[PeerInfo], Link], max_links: int, idle_s: float,
                 on_close: Callable[[Link], None] | None = None) -> None:
        self._make = make
        self._on_close = on_close
        self._max, self._idle_s = max_links, idle_s
        self._links: dict[PeerInfo, Link] = {}
        self._by_sock: dict[zmq.Socket, Link] = {}

    def __iter__(self):
        return iter(list(self._links.values()))

    def __len__(self) -> int:
        return len(self._links)

    def owner(self, sock: zmq.Socket) -> Link | None:
        return self._by_sock.get(sock)

    def get(self, peer: PeerInfo) -> Link:
        """The link to `peer`, opened if needed (may raise zmq.ZMQError / ValueError: nothing is kept)."""
        link = self._links.get(peer)
        if link is not None:
            return link
        for old in list(self._links.values()):
            # same address, another key: the decode there restarted; its old sockets are useless
            if old.peer.key() == peer.key() and not old.active:
                self.close(old)
        idle = sorted((x for x in self._links.values() if not x.active), key=lambda x: x.last_used)
        for old in idle[:max(0, len(self._links) + 1 - self._max)]:
            self.close(old)
        link = self._make(peer)
        self._links[peer] = link
        self._by_sock.update((s, link) for s in link.socks + link.monitors)
        return link

    def close_idle(self, now: float) -> None:
        for link in list(self._links.values()):
            if not link.active and now - link.last_used >= self._idle_s:
                self.close(link)

    def close(self, link: Link) -> None:
        """Close `link` now; control messages still queued on it (Aborts) are dropped."""
        if self._links.get(link.peer) is link:
            del self._links[link.peer]
        for s in link.socks + link.monitors:
            self._by_sock.pop(s, None)
        link.close()
        if self._on_close is not None:
            self._on_close(link)

    def close_all(self) -> None:
        for link in list(self._links.values()):
            self.close(link)
