"""Sending end (prefill side): per peer, `connections` DEALER sockets on one loop thread.

Per transfer: Open ─(wait OpenAck)─▶ chunks striped round-robin over the peer's connections, each
one zero-copy view of source memory, while the peer's window has credit ─▶ Close after the last piece
─(wait Done)─▶ DONE. Source memory must stay unchanged until the transfer is terminal. A link's
connections carry its secret token in their ROUTING_IDs, so only this link can feed its transfers.

Deadlines: a transfer fails when it makes no progress for `timeout_s` (see `TransferConfig.timeout_s`
for what counts), or when it outlives its size-derived cap (`TransferConfig.min_rate_bytes_s`).
An unexpected error while handling one transfer fails that transfer only; if the loop thread itself
dies, every pending transfer reads FAILED and `fatal` names the cause.
"""

from __future__ import annotations

import collections
import logging
import secrets
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
from prfaas_sgl.transfer.loop import LoopDead, SocketLoop, make_context, make_socket
from prfaas_sgl.transfer.messages import (Abort, Ack, Chunk, Close, Codec, DecodeError, Done, Failed, Open,
                                          OpenAck)
from prfaas_sgl.transfer.peers import Link, LinkTable
from prfaas_sgl.transfer.security import secure_client
from prfaas_sgl.transfer.states import UNKNOWN_STATUS, TransferState as S, TransferStatus
from prfaas_sgl.transfer.stats import StatsBook, StatsServer

log = logging.getLogger(__name__)
_TOKEN_BYTES = 16
_CLOSE = object()  # marks, in a transfer's job queue, where Close goes (after all its chunks)


def link_token() -> bytes:
    """A link's secret: its connections' ROUTING_IDs are `token + connection index` (one byte).

    The receiver binds a transfer to the session that opened it: peer address, CURVE client key and
    this token (see receiver `_session`). Without it, any process on the prefill's host (same address,
    same empty key in plaintext) could feed our transfers. First byte non-zero: libzmq reserves
    identities starting with 0 for the ones it generates, which carry no token.
    """
    return bytes([1 + secrets.randbelow(255)]) + secrets.token_bytes(_TOKEN_BYTES - 1)


@dataclass(slots=True)
class _OutTransfer:
    tid: int
    link: Link
    timeout_s: float
    started: float
    progress: float  # last send(), OpenAck or Ack of this transfer (time.monotonic())
    state: S = S.OPENING
    reason: str = ""
    jobs: collections.deque = field(default_factory=collections.deque)  # (ChunkPlan, t_enqueued) | _CLOSE
    stream_pos: dict[int, int] = field(default_factory=dict)
    next_seq: int = 0
    inflight: int = 0
    acked: int = 0
    queued: int = 0  # chunk bytes handed to send() so far
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
        self._ctx = make_context(cfg)
        self._codec = Codec()
        self._links = LinkTable(self._new_link, cfg.max_links, cfg.link_idle_s)
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

        The first call opens the transfer with no-progress deadline `timeout_s` (default cfg.timeout_s);
        every call counts as progress. Never raises for a dead loop: `poll()` reports it.
        """
        for r in regions:
            self.layout.check_region(r)
        self._call(self._send, transfer_id, peer, list(regions), last, timeout_s or self.cfg.timeout_s)

    def poll(self, transfer_id: int) -> TransferStatus:
        status = self._status.get(transfer_id, UNKNOWN_STATUS)
        fatal = self.fatal
        if fatal is not None and not status.state.terminal:  # queued work will never run
            return TransferStatus(S.FAILED, f"sender loop died: {fatal}", status.nbytes)
        return status

    def wait(self, transfer_id: int, timeout: float) -> TransferStatus:
        end = time.monotonic() + timeout
        while not self.poll(transfer_id).state.terminal and time.monotonic() < end:
            time.sleep(0.002)
        return self.poll(transfer_id)

    def abort(self, transfer_id: int, reason: str = "aborted by sender") -> None:
        self._call(self._abort_local, transfer_id, reason)

    def release(self, transfer_id: int) -> None:
        if self.fatal is not None:
            self._status.pop(transfer_id, None)  # the loop is gone: nothing else touches the table
        self._call(self._release, transfer_id)

    def close(self) -> None:
        self.stop()
        if self.stats_server is not None:
            self.stats_server.close()
        if self._thread.is_alive():
            log.error("transfer-send loop did not stop; leaving its ZeroMQ context open")
            return
        self._ctx.destroy(linger=0)  # the loop closed its sockets unless on_close failed half-way

    def _call(self, fn: Any, *args: Any) -> None:
        try:
            self.call(fn, *args)
        except LoopDead:
            if self.fatal is None:
                raise  # used after close(): a caller bug

    # -- loop thread: API handlers ----------------------------------------------------------------
    def _send(self, tid: int, peer: PeerInfo, regions: list[Region], last: bool, timeout_s: float) -> None:
        try:
            self._queue(tid, peer, regions, last, timeout_s)
        except Exception as e:
            self._contain(tid, "send", e)

    def _queue(self, tid: int, peer: PeerInfo, regions: list[Region], last: bool, timeout_s: float) -> None:
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
        plans = plan_chunks(regions, t.stream_pos, self.cfg.chunk_bytes)
        t.jobs.extend((c, now) for c in plans)
        t.queued += sum(c.length for c in plans)
        t.progress = now
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
        try:
            link = self._links.get(peer)
        except (zmq.ZMQError, ValueError) as e:  # out of sockets/fds, or a CURVE key refused locally
            log.warning("transfer %d: cannot open a link to %s: %s", tid, peer.key(), e)
            self._status[tid] = TransferStatus(S.FAILED, f"cannot connect to {peer.key()}: {e}")
            self.stats.link(peer.key()).on_failure("connect")
            return None
        # the last handshake failed and none succeeded since: fail now rather than at the deadline
        if link.handshake_error:
            self._status[tid] = TransferStatus(S.FAILED, link.handshake_error)
            link.stats.on_failure("handshake")
            return None
        now = time.monotonic()
        t = _OutTransfer(tid, link, timeout_s, started=now, progress=now)
        self._transfers[tid] = t
        self._set(t, S.OPENING)
        t.link.control.append(self._stamp(Open(transfer_id=tid, layout=self.layout, chunk_bytes=self.cfg.chunk_bytes)))
        return t

    def _new_link(self, peer: PeerInfo) -> Link:
        token = link_token()
        socks: list[zmq.Socket] = []
        try:
            for i in range(self.cfg.connections):
                socks.append(self._dealer(peer, token + bytes([i])))
            return Link(peer, socks, self.stats.link(peer.key()), self.cfg.window_bytes, time.monotonic())
        except BaseException:
            for s in socks:
                s.close(0)
            raise

    def _dealer(self, peer: PeerInfo, routing_id: bytes) -> zmq.Socket:
        sock = make_socket(self._ctx, zmq.DEALER, self.cfg)
        try:
            sock.setsockopt(zmq.ROUTING_ID, routing_id)
            if self.cfg.keys_dir:
                secure_client(sock, self.cfg.keys_dir, peer.server_key)
            sock.connect(peer.endpoint)
        except BaseException:
            sock.close(0)
            raise
        return sock

    def _abort_local(self, tid: int, reason: str) -> None:
        t = self._transfers.get(tid)
        if t is not None and not t.state.terminal:
            self._fail(t, S.ABORTED, reason, notify=True)

    def _release(self, tid: int) -> None:
        try:
            self._abort_local(tid, "released by sender")
        finally:
            self._transfers.pop(tid, None)
            self._status.pop(tid, None)

    def _contain(self, tid: int, what: str, err: Exception) -> None:
        """An unexpected error while handling `tid`: fail that transfer only, keep the loop running."""
        log.error("transfer %d: unexpected error in %s", tid, what, exc_info=err)
        reason = f"sender internal error in {what}: {type(err).__name__}: {err}"
        t = self._transfers.get(tid)
        if t is None:
            self._status[tid] = TransferStatus(S.FAILED, reason)
        elif not t.state.terminal:
            try:
                self._fail(t, S.FAILED, reason, notify=True)
            except Exception:  # the bookkeeping itself is broken: at least make the status terminal
                log.exception("transfer %d: failing it raised too", tid)
                self._set(t, S.FAILED, reason)

    # -- loop thread: events ----------------------------------------------------------------------
    def poll_items(self) -> list[tuple[zmq.Socket, int]]:
        items = []
        for link in self._links:
            flags = zmq.POLLIN | (zmq.POLLOUT if link.blocked else 0)
            items.extend((s, flags) for s in link.socks)
            items.extend((m, zmq.POLLIN) for m in link.monitors)
        return items

    def on_event(self, sock: zmq.Socket, events: int) -> None:
        link = self._links.owner(sock)
        if link is None:
            return  # closed during this iteration
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
            try:
                self._on_reply(msg)
            except Exception as e:
                self._contain(msg.transfer_id, f"handling {type(msg).__name__}", e)

    def _on_reply(self, msg: Any) -> None:
        t = self._transfers.get(msg.transfer_id)
        if t is None or t.state.terminal:
            return
        now = time.monotonic()
        if isinstance(msg, OpenAck) and t.state is S.OPENING:
            t.progress = now
            self._set(t, S.TRANSFERRING)
            t.link.queue_work(t)
        elif isinstance(msg, Ack):
            t.progress = now
            t.inflight -= msg.length
            t.acked += msg.length
            t.link.on_ack(msg.length, now)
        elif isinstance(msg, Done):
            # Done may overtake Acks that travel on other connections: it acknowledges everything.
            t.link.on_ack(t.inflight, now)
            t.acked += t.inflight
            t.inflight = 0
            self._set(t, S.DONE)
            t.link.stats.on_done(now - t.started)
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

    # -- loop thread: deadlines -------------------------------------------------------------------
    def _cap(self, t: _OutTransfer) -> float | None:
        """Absolute end of `t`: `cfg.cap_s` of the bytes queued so far, from its first send()."""
        cap_s = self.cfg.cap_s(t.queued)
        return None if cap_s is None else t.started + cap_s

    def _deadline(self, t: _OutTransfer) -> float:
        last = t.progress
        if t.jobs:  # still queued behind other transfers on the link: their progress is ours
            last = max(last, t.link.last_progress)
        cap = self._cap(t)
        return last + t.timeout_s if cap is None else min(last + t.timeout_s, cap)

    def _expire(self, t: _OutTransfer, now: float) -> None:
        cap = self._cap(t)
        if cap is not None and now >= cap:
            why = f"exceeded its {self.cfg.cap_text(t.queued)}"
        else:
            why = f"timed out after {t.timeout_s:g} s"
        opening = t.state is S.OPENING
        hint = (" (no OpenAck: peer unreachable, not expecting it, or CURVE key refused?)"
                if opening else " (no progress: receiver stalled or link down?)")
        self._fail(t, S.TIMED_OUT, f"{why} in state {t.state.value}, {t.acked} bytes acknowledged{hint}",
                   notify=True)
        if opening and not t.link.active:
            # nobody answered on this link: the next transfer dials afresh instead of waiting out
            # ZeroMQ's reconnect back-off towards a peer that may have restarted meanwhile
            self._links.close(t.link)

    def next_deadline(self) -> float | None:
        return min((self._deadline(t) for t in self._active.values()), default=None)

    def on_tick(self, now: float) -> None:
        for t in list(self._active.values()):
            if now >= self._deadline(t):
                self._expire(t, now)
        self._links.close_idle(now)
        for link in self._links:
            try:
                link.pump(self._emit_control, self._emit_job, lambda t: t.state is S.TRANSFERRING)
            except Exception:
                log.exception("link %s: unexpected error while sending (loop continues)", link.peer.key())

    # -- loop thread: emitting --------------------------------------------------------------------
    def _emit_control(self, link: Link, msg: Any) -> bool:
        try:
            return link.try_send([self._codec.encode(msg)])
        except Exception as e:  # dropped: the transfer it belongs to fails instead of blocking the queue
            self._contain(msg.transfer_id, f"sending {type(msg).__name__}", e)
            return True

    def _emit_job(self, link: Link, t: _OutTransfer, job: Any) -> bool:
        """Hand one job of `t` to ZeroMQ; False = no socket can take it now (keep it queued)."""
        try:
            return self._try_job(link, t, job)
        except Exception as e:
            self._contain(t.tid, "sending a chunk", e)
            return True  # t is failed and its jobs are gone: go on with the next transfer

    def _try_job(self, link: Link, t: _OutTransfer, job: Any) -> bool:
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
        t.link.attach(t.tid, time.monotonic(), live=not state.terminal)
        self._status[t.tid] = TransferStatus(state, reason, t.acked)

    def on_fatal(self, reason: str) -> None:
        for t in list(self._active.values()):
            self._set(t, S.FAILED, f"sender loop died: {reason}")

    def on_close(self) -> None:
        self._links.close_all()
