"""Sending end (prefill side): per peer, `connections` DEALER sockets on one loop thread.

Per transfer: Open ─(wait OpenAck)─▶ chunks striped round-robin over the peer's connections, each
one zero-copy view of source memory, while the peer's window has credit ─▶ Close after the last piece
─(wait Done)─▶ DONE. Source memory must stay unchanged until the transfer is terminal.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import xxhash
import zmq

from prfaas_sgl.transfer import faults as F
from prfaas_sgl.transfer.buffers import register
from prfaas_sgl.transfer.chunking import ChunkPlan, plan_chunks
from prfaas_sgl.transfer.config import PeerInfo, TransferConfig
from prfaas_sgl.transfer.layout import MemoryLayout, Region
from prfaas_sgl.transfer.loop import SocketLoop, make_socket
from prfaas_sgl.transfer.messages import (Abort, Ack, Chunk, Close, Codec, DecodeError, Done, Failed, Open,
                                          OpenAck)
from prfaas_sgl.transfer.peers import Link
from prfaas_sgl.transfer.security import secure_client
from prfaas_sgl.transfer.states import UNKNOWN_STATUS, TransferState as S, TransferStatus
from prfaas_sgl.transfer.stats import StatsBook, StatsServer

_CLOSE = object()  # marks, in a transfer's job queue, where Close goes (after all its chunks)


@dataclass(slots=True)
class _OutTransfer:
    tid: int
    link: Link
    deadline: float
    timeout_s: float
    started: float
    state: S = S.OPENING
    reason: str = ""
    jobs: collections.deque = field(default_factory=collections.deque)  # (ChunkPlan, t_enqueued) | _CLOSE
    stream_pos: dict[int, int] = field(default_factory=dict)
    next_seq: int = 0
    inflight: int = 0
    acked: int = 0
    closed: bool = False


class ZmqSender(SocketLoop):
    """Sends from `buffers` (one per `layout` entry) to any number of `ZmqReceiver` peers."""

    def __init__(self, layout: MemoryLayout, buffers: Sequence[Any], cfg: TransferConfig,
                 faults: tuple[F.Fault, ...] = (), stats_port: int | None = None) -> None:
        super().__init__("transfer-send")
        self.layout, self.cfg = layout, cfg
        self._views = register(layout, buffers, writable=False)
        self._corrupt = F.find(faults, F.CorruptChunk)
        stamp = F.find(faults, F.StampVersion)
        self._version = stamp.v if stamp else None
        self._ctx = zmq.Context(io_threads=cfg.io_threads)
        self._codec = Codec()
        self._links: dict[str, Link] = {}
        self._by_sock: dict[zmq.Socket, Link] = {}
        self._transfers: dict[int, _OutTransfer] = {}
        self._status: dict[int, TransferStatus] = {}
        # non-terminal subset of _transfers, the only ones whose deadlines need checking
        self._active: dict[int, _OutTransfer] = {}
        self.stats = StatsBook()
        self.stats_server = StatsServer(self.stats, port=stats_port) if stats_port is not None else None
        self.start()

    # -- public API (any thread; never blocks on the network) --------------------------------------
    def send(self, transfer_id: int, peer: PeerInfo, regions: Sequence[Region], last: bool = False,
             timeout_s: float | None = None) -> None:
        """Queue `regions` (stream order per buffer) of `transfer_id` for `peer`; `last` closes it.

        The first call opens the transfer; its deadline is `timeout_s` (default cfg.timeout_s) from then.
        """
        for r in regions:
            self.layout.check_region(r)
        self.call(self._send, transfer_id, peer, list(regions), last, timeout_s or self.cfg.timeout_s)

    def poll(self, transfer_id: int) -> TransferStatus:
        return self._status.get(transfer_id, UNKNOWN_STATUS)

    def wait(self, transfer_id: int, timeout: float) -> TransferStatus:
        end = time.monotonic() + timeout
        while not self.poll(transfer_id).state.terminal and time.monotonic() < end:
            time.sleep(0.002)
        return self.poll(transfer_id)

    def abort(self, transfer_id: int, reason: str = "aborted by sender") -> None:
        self.call(self._abort_local, transfer_id, reason)

    def release(self, transfer_id: int) -> None:
        self.call(self._release, transfer_id)

    def close(self) -> None:
        self.stop()
        if self.stats_server is not None:
            self.stats_server.close()
        self._ctx.term()

    # -- loop thread: API handlers ----------------------------------------------------------------
    def _send(self, tid: int, peer: PeerInfo, regions: list[Region], last: bool, timeout_s: float) -> None:
        t = self._transfers.get(tid)
        if t is None:
            t = self._open(tid, peer, timeout_s)
            if t is None:
                return
        if t.state.terminal:
            return
        if t.closed or t.link.peer != peer:
            why = "send after the last piece" if t.closed else f"peer changed to {peer.key()}"
            self._fail(t, S.FAILED, f"bad send for transfer {tid}: {why}", notify=True)
            return
        now = time.monotonic()
        t.jobs.extend((c, now) for c in plan_chunks(regions, t.stream_pos, self.cfg.chunk_bytes))
        if last:
            t.closed = True
            t.jobs.append(_CLOSE)
        t.link.queue_work(t)

    def _open(self, tid: int, peer: PeerInfo, timeout_s: float) -> _OutTransfer | None:
        problem = peer.problem()
        if problem:
            self._status[tid] = TransferStatus(S.FAILED, problem)
            self.stats.link(str(peer.host)).on_failure("bad_peer")
            return None
        now = time.monotonic()
        link = self._link(peer)
        # the last handshake failed and none succeeded since: fail now rather than at the deadline
        if link.handshake_error:
            self._status[tid] = TransferStatus(S.FAILED, link.handshake_error)
            link.stats.on_failure("handshake")
            return None
        t = _OutTransfer(tid, link, now + timeout_s, timeout_s, now)
        self._transfers[tid] = t
        self._set(t, S.OPENING)
        t.link.control.append(self._stamp(Open(transfer_id=tid, layout=self.layout)))
        return t

    def _link(self, peer: PeerInfo) -> Link:
        link = self._links.get(peer.key())
        if link is None:
            socks = [self._dealer(peer) for _ in range(self.cfg.connections)]
            link = Link(peer, socks, self.stats.link(peer.key()), self.cfg.window_bytes)
            self._links[peer.key()] = link
            self._by_sock.update((s, link) for s in socks + link.monitors)
        return link

    def _dealer(self, peer: PeerInfo) -> zmq.Socket:
        sock = make_socket(self._ctx, zmq.DEALER, self.cfg)
        if self.cfg.keys_dir:
            secure_client(sock, self.cfg.keys_dir, peer.server_key)
        sock.connect(peer.endpoint)
        return sock

    def _abort_local(self, tid: int, reason: str) -> None:
        t = self._transfers.get(tid)
        if t is not None and not t.state.terminal:
            self._fail(t, S.ABORTED, reason, notify=True)

    def _release(self, tid: int) -> None:
        self._abort_local(tid, "released by sender")
        self._transfers.pop(tid, None)
        self._status.pop(tid, None)

    # -- loop thread: events ----------------------------------------------------------------------
    def poll_items(self) -> list[tuple[zmq.Socket, int]]:
        items = []
        for link in self._links.values():
            flags = zmq.POLLIN | (zmq.POLLOUT if link.blocked else 0)
            items.extend((s, flags) for s in link.socks)
            items.extend((m, zmq.POLLIN) for m in link.monitors)
        return items

    def on_event(self, sock: zmq.Socket, events: int) -> None:
        link = self._by_sock[sock]
        if sock in link.monitors:
            self._on_handshake(link, sock)
            return
        if events & zmq.POLLOUT:
            link.blocked = False
        if events & zmq.POLLIN:
            self._drain(sock)

    def _drain(self, sock: zmq.Socket) -> None:
        for _ in range(256):
            try:
                raw = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = self._codec.decode(raw)
            except DecodeError as e:
                msg = Failed(transfer_id=e.transfer_id, reason=f"receiver: {e.reason}")
            self._on_reply(msg)

    def _on_reply(self, msg: Any) -> None:
        t = self._transfers.get(msg.transfer_id)
        if t is None or t.state.terminal:
            return
        if isinstance(msg, OpenAck) and t.state is S.OPENING:
            self._set(t, S.TRANSFERRING)
            t.link.queue_work(t)
        elif isinstance(msg, Ack):
            t.inflight -= msg.length
            t.acked += msg.length
            t.link.on_ack(msg.length, time.monotonic())
        elif isinstance(msg, Done):
            # Done may overtake Acks that travel on other connections: it acknowledges everything.
            t.link.on_ack(t.inflight, time.monotonic())
            t.acked += t.inflight
            t.inflight = 0
            self._set(t, S.DONE)
            t.link.stats.on_done(time.monotonic() - t.started)
        elif isinstance(msg, (Failed, Abort)):
            state = S.FAILED if isinstance(msg, Failed) else S.ABORTED
            self._fail(t, state, f"receiver: {msg.reason}", notify=False)

    def _on_handshake(self, link: Link, mon: zmq.Socket) -> None:
        reason = link.on_monitor(mon)
        if reason is None:
            return
        for t in list(self._active.values()):
            if t.link is link:
                self._fail(t, S.FAILED, reason, notify=False)

    def next_deadline(self) -> float | None:
        return min((t.deadline for t in self._active.values()), default=None)

    def on_tick(self, now: float) -> None:
        for t in list(self._active.values()):
            if now >= t.deadline:
                hint = " (no OpenAck: peer unreachable, not expecting it, or CURVE key refused?)" \
                    if t.state is S.OPENING else ""
                self._fail(t, S.TIMED_OUT, f"timed out after {t.timeout_s:g} s in state {t.state.value}, "
                           f"{t.acked} bytes acknowledged{hint}", notify=True)
        for link in self._links.values():
            link.pump(self._emit_control, self._emit_job, lambda t: t.state is S.TRANSFERRING)

    # -- loop thread: emitting --------------------------------------------------------------------
    def _emit_control(self, link: Link, msg: Any) -> bool:
        return link.try_send([self._codec.encode(msg)])

    def _emit_job(self, link: Link, t: _OutTransfer, job: Any) -> bool:
        """Hand one job of `t` to ZeroMQ; False = no socket can take it now (keep it queued)."""
        if job is _CLOSE:
            close = Close(transfer_id=t.tid, nchunks=t.next_seq, totals=dict(t.stream_pos))
            return link.try_send([self._codec.encode(self._stamp(close))])
        plan, queued_at = job
        if not link.has_credit(plan.length):
            return False
        frames = [self._views[plan.buffer_id][off: off + n] for off, n in plan.segments]
        header = self._stamp(self._chunk_header(t, plan, frames))
        frames = self._maybe_corrupt(header, frames)
        if not link.try_send([self._codec.encode(header), *frames]):
            return False
        t.next_seq += 1
        t.inflight += plan.length
        link.on_sent(plan.length, time.monotonic() - queued_at)
        return True

    def _chunk_header(self, t: _OutTransfer, plan: ChunkPlan, frames: list[memoryview]) -> Chunk:
        h = xxhash.xxh3_64()
        for f in frames:
            h.update(f)
        return Chunk(transfer_id=t.tid, seq=t.next_seq, buffer_id=plan.buffer_id, offset=plan.offset,
                     length=plan.length, nframes=len(frames), checksum=h.intdigest())

    def _maybe_corrupt(self, header: Chunk, frames: list[memoryview]) -> list[Any]:
        if self._corrupt is None or header.seq != self._corrupt.seq:
            return frames
        bad = bytearray(frames[0])
        bad[len(bad) // 2] ^= 0xFF
        return [bad, *frames[1:]]

    def _stamp(self, msg: Any) -> Any:
        return msg if self._version is None else msgspec.structs.replace(msg, v=self._version)

    # -- loop thread: state -----------------------------------------------------------------------
    def _fail(self, t: _OutTransfer, state: S, reason: str, notify: bool) -> None:
        t.jobs.clear()
        t.link.forget(t.inflight)
        t.inflight = 0
        t.link.stats.on_failure(state.value)
        self._set(t, state, reason)
        if notify:
            t.link.control.append(Abort(transfer_id=t.tid, reason=reason))

    def _set(self, t: _OutTransfer, state: S, reason: str = "") -> None:
        t.state, t.reason = state, reason
        if state.terminal:
            self._active.pop(t.tid, None)
        else:
            self._active[t.tid] = t
        self._status[t.tid] = TransferStatus(state, reason, t.acked)

    def on_close(self) -> None:
        for link in self._links.values():
            link.close()
