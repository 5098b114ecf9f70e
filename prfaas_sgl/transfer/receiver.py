"""Receiving end (decode side): one ROUTER socket on one loop thread writes chunks in place.

A transfer completes only when Close has arrived, every chunk's checksum matched, no chunk repeated or
overlapped another, and every byte of every buffer stream was written; anything else ends FAILED /
ABORTED / TIMED_OUT with a reason. Only the connection that opened a transfer may feed or close it
(see `_session`); a message that no transfer may be failed for is refused alone: counted in
`refusal_counts()`, logged, answered with `Failed`. After `release()` returns, nothing more is written.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash
import zmq

from prfaas_sgl.transfer import faults as F
from prfaas_sgl.transfer.buffers import register
from prfaas_sgl.transfer.chunking import DestStream, dest_streams, scatter
from prfaas_sgl.transfer.config import PeerInfo, TransferConfig
from prfaas_sgl.transfer.layout import MemoryLayout, Region
from prfaas_sgl.transfer.loop import SocketLoop, make_socket
from prfaas_sgl.transfer.messages import (Abort, Ack, Chunk, Close, Codec, DecodeError, Done, Failed, Open,
                                          OpenAck)
from prfaas_sgl.transfer.security import secure_server, server_public_key
from prfaas_sgl.transfer.states import UNKNOWN_STATUS, TransferState as S, TransferStatus

log = logging.getLogger(__name__)
_DRAIN_MAX = 64  # messages handled per wake-up before deadlines are looked at again
# Above the largest legitimate frame (see max_frame_bytes): msgpack header fields and a peer whose layout
# differs a little from ours still fit, so that such a peer gets a named layout mismatch, not a drop.
_FRAME_SLACK = 64 << 10


def max_frame_bytes(layout: MemoryLayout, cfg: TransferConfig) -> int:
    """ZMQ_MAXMSGSIZE of the data listener (per frame): a sender's largest frame is a chunk's data frame
    (<= chunk_bytes) or the Open header, which carries the layout. libzmq drops the connection of a peer
    announcing a bigger frame before buffering any of it, so no peer can make us hold a 4 GiB frame.
    Prefill and decode must therefore run with the same chunk_bytes: a sender's Open announces its own,
    and a larger one is refused by name there (`_chunk_size_problem`) instead of dropped at its first chunk.
    """
    largest_open = Open(transfer_id=(1 << 64) - 1, layout=layout, chunk_bytes=cfg.chunk_bytes)
    open_header = len(Codec().encode(largest_open))
    return max(cfg.chunk_bytes, open_header) + _FRAME_SLACK


def _meta(frame: zmq.Frame, name: str) -> str:
    try:
        return frame.get(name)
    except zmq.ZMQError:  # property absent (no ZAP handler: no User-Id)
        return ""


def _session(ident: bytes, header: zmq.Frame) -> tuple[str, str, bytes]:
    """Whom a connection speaks for; only the session that opened a transfer may feed or end it.

    A sender stripes one transfer over several DEALER connections, each with its own ROUTER identity, so
    the identity alone cannot name the opener. What its connections share: the peer's IP address, its
    CURVE client key (User-Id, set by the ZAP handler; empty in plaintext), and, when the sender sets its
    routing ids to `link token + one connection byte`, the token. Identities libzmq generates start with
    a 0 byte and carry no token: such a session is "this host (and key)".
    """
    token = ident[:-1] if ident[:1] not in (b"", b"\x00") else b""
    return _meta(header, "Peer-Address"), _meta(header, "User-Id"), token


@dataclass(frozen=True, slots=True)
class _From:
    ident: bytes  # ROUTER identity of the connection: where replies to this message go
    session: tuple[str, str, bytes]


@dataclass(slots=True)
class _InTransfer:
    tid: int
    streams: dict[int, DestStream]
    expected: int  # bytes, all streams
    progress: float  # expect(), then the last accepted Open, Chunk or Close (time.monotonic())
    timeout_s: float  # no-progress deadline
    opened: float | None = None  # when the Open was accepted: the size-derived cap counts from here
    state: S = S.WAITING
    reason: str = ""
    sender: bytes | None = None  # ROUTER identity replies go to: the opener's latest connection
    session: tuple[str, str, bytes] | None = None  # who opened it (see _session)
    seqs: set[int] = field(default_factory=set)
    nbytes: int = 0
    close: Close | None = None
    revoked: bool = False  # released: its pages may belong to someone else; written under _write_lock


class ZmqReceiver(SocketLoop):
    """Receives into `buffers` (one per `layout` entry: bytearray / numpy / (address, nbytes))."""

    def __init__(self, layout: MemoryLayout, buffers: Sequence[Any], cfg: TransferConfig,
                 host: str = "127.0.0.1", port: int = 0, faults: tuple[F.Fault, ...] = ()) -> None:
        super().__init__("transfer-recv")
        self.layout, self.cfg = layout, cfg
        self._views = register(layout, buffers, writable=True)
        self._slow = F.find(faults, F.SlowReceiver)
        self._transfers: dict[int, _InTransfer] = {}
        self._status: dict[int, TransferStatus] = {}
        # non-terminal subset of _transfers, the only ones whose deadlines need checking
        self._active: dict[int, _InTransfer] = {}
        self._done_cv = threading.Condition()
        # Held around "still ours?" + scatter; release() takes it after revoking, so that once it returns
        # no write into the transfer's pages is in progress or can start (they may be reused at once).
        self._write_lock = threading.Lock()
        self._refusals: collections.Counter[str] = collections.Counter()
        self._codec = Codec()
        self._ctx = zmq.Context(io_threads=cfg.io_threads)
        self._sock = make_socket(self._ctx, zmq.ROUTER, cfg)
        self._max_frame = max_frame_bytes(layout, cfg)
        self._sock.setsockopt(zmq.MAXMSGSIZE, self._max_frame)
        self._auth = secure_server(self._ctx, self._sock, cfg.keys_dir) if cfg.keys_dir else None
        self._sock.bind(f"tcp://{host}:{port}")
        bound_port = int(self._sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        key = server_public_key(cfg.keys_dir) if cfg.keys_dir else None
        self.address = PeerInfo(host, bound_port, key)
        self.start()

    # -- public API (any thread) ------------------------------------------------------------------
    def expect(self, transfer_id: int, regions: Sequence[Region], timeout_s: float | None = None) -> None:
        """Pre-register destination `regions` (stream order per buffer) for `transfer_id`.

        It fails when nothing arrives for `timeout_s` (default cfg.timeout_s; every accepted Open, Chunk
        and Close counts), or when it outlives `cfg.cap_s` of its bytes counted from its Open.
        """
        for r in regions:
            self.layout.check_region(r)
        streams = dest_streams(regions)
        t = _InTransfer(transfer_id, streams, sum(s.total for s in streams.values()), time.monotonic(),
                        timeout_s or self.cfg.timeout_s)
        self.call_sync(self._add, t)

    def poll(self, transfer_id: int) -> TransferStatus:
        return self._status.get(transfer_id, UNKNOWN_STATUS)

    def wait(self, transfer_id: int, timeout: float) -> TransferStatus:
        """Block until the transfer is terminal or `timeout` seconds pass; returns the last status."""
        end = time.monotonic() + timeout
        with self._done_cv:
            while not self.poll(transfer_id).state.terminal and time.monotonic() < end:
                self._done_cv.wait(min(0.1, max(0.0, end - time.monotonic())))
        return self.poll(transfer_id)

    def abort(self, transfer_id: int, reason: str = "aborted by receiver") -> None:
        self.call(self._abort_local, transfer_id, reason)

    def release(self, transfer_id: int) -> None:
        """Forget a transfer: once this returns nothing more is written into its regions, so its pages
        may be reused at once; chunks still arriving are refused. Any thread, the loop thread included
        (which never holds the write lock while it runs calls). Blocks at most one chunk's scatter."""
        t = self._transfers.get(transfer_id)  # a loop-thread dict, read under the GIL: get() is atomic
        if t is not None:
            with self._write_lock:
                t.revoked = True
        try:
            self.call(self._release, transfer_id)
        except RuntimeError:  # the loop is gone (LoopDead): it writes nothing more, the barrier holds
            pass

    def refusal_counts(self) -> dict[str, int]:
        """Messages refused without failing a transfer, by kind (e.g. "not_opener", "unknown_transfer")."""
        return dict(self._refusals)

    def close(self) -> None:
        self.stop()
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()

    # -- loop thread ------------------------------------------------------------------------------
    def poll_items(self) -> list[tuple[zmq.Socket, int]]:
        return [(self._sock, zmq.POLLIN)]

    def on_close(self) -> None:
        self._sock.close(0)

    def on_fatal(self, reason: str) -> None:
        """The loop thread is dying: every pending transfer ends FAILED (nothing is written any more)."""
        for t in list(self._active.values()):
            self._set(t, S.FAILED, f"receiver loop died: {reason}")

    def next_deadline(self) -> float | None:
        return min((self._deadline(t) for t in self._active.values()), default=None)

    def on_tick(self, now: float) -> None:
        for t in list(self._active.values()):
            if now >= self._deadline(t):
                self._expire(t, now)

    def _cap(self, t: _InTransfer) -> float | None:
        cap_s = None if t.opened is None else self.cfg.cap_s(t.expected)
        return None if cap_s is None else t.opened + cap_s

    def _deadline(self, t: _InTransfer) -> float:
        cap = self._cap(t)
        end = t.progress + t.timeout_s
        return end if cap is None else min(end, cap)

    def _expire(self, t: _InTransfer, now: float) -> None:
        cap = self._cap(t)
        why = (f"exceeded its {self.cfg.cap_text(t.expected)}" if cap is not None and now >= cap
               else f"timed out after {t.timeout_s:g} s")
        self._finish(t, S.TIMED_OUT, f"{why} in state {t.state.value}: {t.nbytes} of {t.expected} bytes verified")

    def on_event(self, sock: zmq.Socket, events: int) -> None:
        for _ in range(_DRAIN_MAX):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            ident = frames[0].bytes
            self._dispatch(_From(ident, _session(ident, frames[1])), frames[1], frames[2:])

    def _dispatch(self, src: _From, header: zmq.Frame, data: list[zmq.Frame]) -> None:
        try:
            msg = self._codec.decode(header.buffer)
        except DecodeError as e:
            self._reject(src, e.transfer_id, e.reason)
            return
        handler = {Open: self._on_open, Chunk: self._on_chunk, Close: self._on_close,
                   Abort: self._on_abort}.get(type(msg))
        if handler is None:
            self._reject(src, msg.transfer_id, f"unexpected {type(msg).__name__} sent to a receiver")
            return
        try:
            handler(src, msg, data)
        except Exception as e:  # a bug handling one message fails its transfer, not the receiver thread
            log.exception("receiver: error handling %s of transfer %s", type(msg).__name__, msg.transfer_id)
            t = self._transfers.get(msg.transfer_id)
            if t is not None and not t.state.terminal and t.session in (None, src.session):
                self._finish(t, S.FAILED, f"receiver error handling {type(msg).__name__}: {e!r}")

    def _reject(self, src: _From, tid: int, reason: str) -> None:
        """A bad message: it fails its transfer if it may speak for it (opener, or none yet)."""
        t = self._transfers.get(tid)
        if t is not None and not t.state.terminal and t.session in (None, src.session):
            t.sender = t.sender or src.ident
            self._finish(t, S.FAILED, reason)
        else:
            self._refuse(src, tid, "bad_message", reason)

    def _refuse(self, src: _From, tid: int, kind: str, reason: str) -> None:
        """Drop a message without touching any transfer: count it, log it, tell its connection why."""
        self._refusals[kind] += 1
        n = self._refusals[kind]
        if n & (n - 1) == 0:  # the 1st, 2nd, 4th, 8th... of a kind: a flood cannot flood the log
            log.warning("refused %s message #%d from %s: %s", kind, n, src.session[0] or "?", reason)
        self._send(src.ident, Failed(transfer_id=tid, reason=reason))

    def _live(self, src: _From, tid: int) -> _InTransfer | None:
        """The transfer if it can take data; otherwise tell the sender why not and return None."""
        t = self._transfers.get(tid)
        if t is None:
            self._refuse(src, tid, "unknown_transfer", f"receiver does not expect transfer {tid}")
            return None
        if t.state.terminal:
            self._refuse(src, tid, "ended_transfer", t.reason or f"transfer already {t.state.value}")
            return None
        return t

    def _owned(self, src: _From, what: str, tid: int) -> _InTransfer | None:
        """The live transfer if `src` is the session that opened it; otherwise refuse the message."""
        t = self._live(src, tid)
        if t is None:
            return None
        if t.session != src.session:
            why = "before its Open" if t.session is None else "from a connection that did not open it"
            self._refuse(src, tid, "not_opener", f"{what} for transfer {tid} arrived {why}")
            return None
        t.sender = src.ident
        return t

    def _on_open(self, src: _From, msg: Open, _: list) -> None:
        t = self._live(src, msg.transfer_id)
        if t is None:
            return
        if t.session not in (None, src.session):
            self._refuse(src, t.tid, "not_opener",
                         f"transfer {t.tid} is already open from another connection")
            return
        t.sender, t.session = src.ident, src.session
        t.progress = time.monotonic()
        t.opened = t.opened or t.progress
        problem = self.layout.mismatch(msg.layout) or self._chunk_size_problem(msg.chunk_bytes)
        if problem:
            self._finish(t, S.FAILED, problem)
            return
        self._set(t, S.TRANSFERRING)
        self._send(src.ident, OpenAck(transfer_id=t.tid))

    def _chunk_size_problem(self, chunk_bytes: int) -> str | None:
        """A sender whose chunks' data frames could exceed our MAXMSGSIZE (0: an older sender, unknown)."""
        if chunk_bytes <= self._max_frame:
            return None
        return (f"sender chunk_bytes={chunk_bytes} exceeds this receiver's frame limit of {self._max_frame} B "
                f"(chunk_bytes={self.cfg.chunk_bytes} + slack): run prefill and decode with the same "
                "chunk_bytes (--prfaas-zmq-chunk-bytes)")

    def _on_chunk(self, src: _From, msg: Chunk, data: list[zmq.Frame]) -> None:
        if self._slow is not None:
            time.sleep(self._slow.seconds)
        t = self._owned(src, f"chunk {msg.seq}", msg.transfer_id)
        if t is None:
            return
        views = [f.buffer for f in data]
        problem = self._chunk_problem(t, msg, views)
        if problem:
            self._finish(t, S.FAILED, problem)
            return
        stream = t.streams[msg.buffer_id]
        if not self._write(t, msg, views):
            self._refuse(src, t.tid, "released",
                         f"chunk {msg.seq} for transfer {t.tid} arrived after release")
            return
        stream.covered.add(msg.offset, msg.offset + msg.length)
        t.progress = time.monotonic()
        t.nbytes += msg.length
        t.seqs.add(msg.seq)
        self._send(src.ident, Ack(transfer_id=t.tid, seq=msg.seq, length=msg.length))
        self._maybe_complete(t)

    def _write(self, t: _InTransfer, msg: Chunk, views: list[memoryview]) -> bool:
        """Scatter a verified chunk unless `t` was released; False = not written."""
        with self._write_lock:
            if t.revoked:
                return False
            scatter(self._views[msg.buffer_id], t.streams[msg.buffer_id], msg.offset, views)
            return True

    def _chunk_problem(self, t: _InTransfer, msg: Chunk, views: list[memoryview]) -> str | None:
        stream = t.streams.get(msg.buffer_id)
        if stream is None:
            return f"chunk {msg.seq} for buffer {msg.buffer_id}, which this transfer has no pages in"
        end = msg.offset + msg.length
        if msg.offset < 0 or msg.length <= 0 or end > stream.total:
            return (f"chunk {msg.seq} bytes [{msg.offset}, {end}) of buffer "
                    f"{msg.buffer_id} exceed the {stream.total} bytes expected (page count/size mismatch)")
        if len(views) != msg.nframes or sum(v.nbytes for v in views) != msg.length:
            return f"chunk {msg.seq} frames do not add up to its declared {msg.length} bytes"
        if msg.seq in t.seqs:
            return f"chunk {msg.seq} received twice"
        if stream.covered.overlaps(msg.offset, end):
            return (f"chunk {msg.seq} bytes [{msg.offset}, {end}) of buffer {msg.buffer_id} overlap bytes "
                    "already received")
        h = xxhash.xxh3_64()
        for v in views:
            h.update(v)
        if h.intdigest() != msg.checksum:
            return f"checksum mismatch in chunk {msg.seq} (buffer {msg.buffer_id}, offset {msg.offset})"
        return None

    def _on_close(self, src: _From, msg: Close, _: list) -> None:
        t = self._owned(src, "Close", msg.transfer_id)
        if t is None:
            return
        for b in sorted(set(t.streams) | set(msg.totals)):
            sent, want = msg.totals.get(b, 0), t.streams[b].total if b in t.streams else 0
            if sent != want:
                self._finish(t, S.FAILED, f"buffer {b} stream length mismatch: sender sends {sent} B, "
                             f"receiver expects {want} B (different page count or page size)")
                return
        t.close = msg
        t.progress = time.monotonic()
        self._maybe_complete(t)

    def _on_abort(self, src: _From, msg: Abort, _: list) -> None:
        t = self._transfers.get(msg.transfer_id)
        if t is None or t.state.terminal:
            return
        # an Abort may overtake its Open on another connection, so "no opener yet" may abort too
        if t.session not in (None, src.session):
            self._refuse(src, t.tid, "not_opener", f"Abort for transfer {t.tid} from a connection that did "
                         "not open it")
            return
        self._set(t, S.ABORTED, f"aborted by sender: {msg.reason}")

    def _maybe_complete(self, t: _InTransfer) -> None:
        """DONE when Close has come, all its chunks have, and every stream byte was written (coverage)."""
        if t.close is None or len(t.seqs) != t.close.nchunks:
            return
        for b, s in t.streams.items():
            gap = s.covered.gap(s.total)
            if gap is not None:
                self._finish(t, S.FAILED, f"all {t.close.nchunks} chunks arrived but bytes [{gap[0]}, "
                             f"{gap[1]}) of buffer {b} were never written")
                return
        self._set(t, S.DONE)
        self._send(t.sender, Done(transfer_id=t.tid, nbytes=t.nbytes))

    def _finish(self, t: _InTransfer, state: S, reason: str) -> None:
        """Terminal failure: record it and tell the sender (if one is known)."""
        self._set(t, state, reason)
        if t.sender is not None:
            self._send(t.sender, Failed(transfer_id=t.tid, reason=reason))

    def _set(self, t: _InTransfer, state: S, reason: str = "") -> None:
        t.state, t.reason = state, reason
        if state.terminal:
            self._active.pop(t.tid, None)
        else:
            self._active[t.tid] = t
        self._status[t.tid] = TransferStatus(state, reason, t.nbytes)
        if state.terminal:
            with self._done_cv:
                self._done_cv.notify_all()

    def _send(self, ident: bytes | None, msg: Any) -> None:
        if ident is None:
            return
        try:
            self._sock.send_multipart([ident, self._codec.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as e:  # peer gone or its queue full: it will time out on its own
            log.debug("reply %s dropped: %s", type(msg).__name__, e)

    def _add(self, t: _InTransfer) -> None:
        old = self._transfers.get(t.tid)
        if old is not None and not old.state.terminal:
            raise ValueError(f"transfer {t.tid} is already expected")
        self._transfers[t.tid] = t
        self._set(t, S.WAITING)

    def _abort_local(self, tid: int, reason: str) -> None:
        t = self._transfers.get(tid)
        if t is not None and not t.state.terminal:
            self._set(t, S.ABORTED, reason)
            if t.sender is not None:
                self._send(t.sender, Abort(transfer_id=tid, reason=reason))

    def _release(self, tid: int) -> None:
        self._abort_local(tid, "released by receiver")
        self._transfers.pop(tid, None)
        self._status.pop(tid, None)
