"""Receiving end (decode side): one ROUTER socket on one loop thread writes chunks in place.

A transfer completes only when Close has arrived, every chunk's checksum matched, no chunk repeated or
overlapped another, and every byte of every buffer stream was written; anything else ends FAILED /
ABORTED / TIMED_OUT with a reason. Only the connection that opened a transfer may feed or close it
(see `recv_gate.session_of`); a message that no transfer may be failed for is refused alone: counted
in `refusal_counts()`, logged, answered with `Failed`. After `release()` returns, nothing more is written.

Destinations are an `ItemBatch` (the staged path, any device): `landing.Lander` writes each verified
chunk with index_copy_, on a copy stream for device pools; Done waits until those copies completed, and
release() waits for them too.

Pieces: `recv_gate.py` (who may speak), `recv_checks.py` (what may be written: pure), `recv_book.py`
(per-transfer state and deadlines); this file owns the socket, the destination memory and the order.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import zmq

import prfaas_sgl.transfer.faults as F  # not `from ..transfer import`: the package lazily imports us
from prfaas_sgl.transfer.buffers import check_host
from prfaas_sgl.transfer.config import PeerInfo, TransferConfig
from prfaas_sgl.transfer.items import ItemBatch, item_streams
from prfaas_sgl.transfer.layout import MemoryLayout
from prfaas_sgl.transfer.loop import SocketLoop, make_socket
from prfaas_sgl.transfer.messages import Abort, Ack, Chunk, Close, Codec, DecodeError, Done, Open, OpenAck
from prfaas_sgl.transfer.recv_book import InTransfer, RecvBook
from prfaas_sgl.transfer.recv_checks import (chunk_problem, chunk_size_problem, close_problem, gap_problem,
                                             max_frame_bytes, max_ranges)
from prfaas_sgl.transfer.recv_gate import From, Gate, session_of
from prfaas_sgl.transfer.security import secure_server, server_public_key
from prfaas_sgl.transfer.states import TransferState as S, TransferStatus

__all__ = ["ZmqReceiver", "max_frame_bytes"]
log = logging.getLogger(__name__)
_DRAIN_MAX = 64  # messages handled per wake-up before deadlines are looked at again


class ZmqReceiver(SocketLoop):
    """Receives into `buffers` (one per `layout` entry: bytearray / numpy / (address, nbytes) / Strided);
    `devices` per buffer, "cpu" (default) or "cuda:N"."""

    def __init__(self, layout: MemoryLayout, buffers: Sequence[Any], cfg: TransferConfig,
                 host: str = "127.0.0.1", port: int = 0, faults: tuple[F.Fault, ...] = (),
                 devices: Sequence[str] | None = None) -> None:
        super().__init__("transfer-recv")
        self.layout, self.cfg = layout, cfg
        self._buffers, self._devices = list(buffers), list(devices or ["cpu"] * len(buffers))
        check_host(layout, self._buffers, self._devices, writable=True)
        if len(self._buffers) != len(layout.buffers):
            raise ValueError(f"{len(buffers)} buffers given for a layout of {len(layout.buffers)}")
        self._lander: Any = None  # landing.Lander, made at the first ItemBatch (torch loads only then)
        self._settling: dict[int, InTransfer] = {}  # complete on the wire, device copies still running
        self._slow = F.find(faults, F.SlowReceiver)
        self._book = RecvBook(cfg, self._send)
        # Held around "still ours?" + landing; release() takes it after revoking, so that once it returns
        # no write into the transfer's pages is in progress or can start (they may be reused at once).
        self._write_lock = threading.Lock()
        self._gate = Gate(self._book, self._send)
        self._codec = Codec()
        self._ctx = zmq.Context(io_threads=cfg.io_threads)
        self._sock = make_socket(self._ctx, zmq.ROUTER, cfg)
        self._max_frame = max_frame_bytes(layout, cfg)
        self._max_ranges = max_ranges(cfg)
        self._sock.setsockopt(zmq.MAXMSGSIZE, self._max_frame)
        # Senders name their connections (link token + index): one that redials while we still hold its
        # half-open old pipe must get the identity, not be refused until that pipe dies. Only the holder
        # of the secret token can take a tokened identity over (libzmq's generated ids are guessable, but
        # taking one over gains no session: it can only cut off a tokenless, i.e. older, sender).
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._auth = secure_server(self._ctx, self._sock, cfg.keys_dir) if cfg.keys_dir else None
        self._sock.bind(f"tcp://{host}:{port}")
        bound_port = int(self._sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        key = server_public_key(cfg.keys_dir) if cfg.keys_dir else None
        self.address = PeerInfo(host, bound_port, key)
        self.start()

    # -- public API (any thread) ------------------------------------------------------------------
    def expect(self, transfer_id: int, batch: ItemBatch, timeout_s: float | None = None) -> None:
        """Pre-register the destination items of `transfer_id` (stream order per buffer).

        It fails when nothing arrives for `timeout_s` (default cfg.timeout_s; every accepted Open, Chunk
        and Close counts), or when it outlives `cfg.cap_s` of its bytes counted from its Open.
        """
        streams = item_streams(self.layout, batch)  # vectorised checks, no per-item work
        self._landing()
        t = InTransfer(transfer_id, streams, sum(s.total for s in streams.values()), time.monotonic(),
                       timeout_s or self.cfg.timeout_s)
        self.call_sync(self._book.add, t)

    def poll(self, transfer_id: int) -> TransferStatus:
        return self._book.status.get(transfer_id)

    def wait(self, transfer_id: int, timeout: float) -> TransferStatus:
        """Block until the transfer is terminal or `timeout` seconds pass; returns the last status."""
        return self._book.status.wait(transfer_id, timeout)

    def abort(self, transfer_id: int, reason: str = "aborted by receiver") -> None:
        self.call(self._book.abort, transfer_id, reason)

    def release(self, transfer_id: int) -> None:
        """Forget a transfer: once this returns nothing more is written into its items, so its pages
        may be reused at once; chunks still arriving are refused. Any thread, the loop thread included
        (which never holds the write lock while it runs calls). Blocks at most one chunk's landing."""
        t = self._book.transfers.get(transfer_id)  # a loop-thread dict, read under the GIL: get() is atomic
        if t is not None:
            with self._write_lock:
                t.revoked = True
                if t.copies:  # device copies already queued write until they complete: wait for them
                    self._lander.settle(t.copies)
        try:
            self.call(self._book.release, transfer_id)
        except RuntimeError:  # the loop is gone (LoopDead): it writes nothing more, the barrier holds
            pass

    def refusal_counts(self) -> dict[str, int]:
        """Messages refused without failing a transfer, by kind (e.g. "not_opener", "unknown_transfer")."""
        return dict(self._gate.refusals)

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
        self._book.fail_all(f"receiver loop died: {reason}")

    def next_deadline(self) -> float | None:
        if self._settling:
            return time.monotonic() + 0.0005  # device copies finish in microseconds: look again soon
        return self._book.next_deadline()

    def on_tick(self, now: float) -> None:
        self._book.expire_due(now)
        if self._settling:
            for t in list(self._settling.values()):
                self._maybe_complete(t)

    def _landing(self) -> Any:
        if self._lander is None:
            from prfaas_sgl.transfer.landing import Lander
            from prfaas_sgl.transfer.staging import Pools

            pools = Pools(self.layout, self._buffers, self._devices)
            lander = Lander(pools, self.cfg.chunk_bytes, self.cfg.stage_slots)
            self.call_sync(setattr, self, "_lander", lander)  # the loop reads it: set it there
        return self._lander

    def on_event(self, sock: zmq.Socket, events: int) -> None:
        for _ in range(_DRAIN_MAX):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            ident = frames[0].bytes
            self._dispatch(From(ident, session_of(ident, frames[1])), frames[1], frames[2:])

    def _dispatch(self, src: From, header: zmq.Frame, data: list[zmq.Frame]) -> None:
        try:
            msg = self._codec.decode(header.buffer)
        except DecodeError as e:
            self._gate.reject(src, e.transfer_id, e.reason)
            return
        handler = {Open: self._on_open, Chunk: self._on_chunk, Close: self._on_close,
                   Abort: self._on_abort}.get(type(msg))
        if handler is None:
            self._gate.reject(src, msg.transfer_id, f"unexpected {type(msg).__name__} sent to a receiver")
            return
        try:
            handler(src, msg, data)
        except Exception as e:  # a bug handling one message fails its transfer, not the receiver thread
            log.exception("receiver: error handling %s of transfer %s", type(msg).__name__, msg.transfer_id)
            t = self._book.transfers.get(msg.transfer_id)
            if t is not None and not t.state.terminal and self._gate.speaks_for(src, t):
                self._book.finish(t, S.FAILED, f"receiver error handling {type(msg).__name__}: {e!r}")

    # -- loop thread: messages ---------------------------------------------------------------------
    def _on_open(self, src: From, msg: Open, _: list) -> None:
        t = self._gate.live(src, msg.transfer_id)
        if t is None:
            return
        if not self._gate.speaks_for(src, t):
            self._gate.refuse(src, t.tid, "not_opener", f"transfer {t.tid} is already open from another connection")
            return
        t.sender, t.session = src.ident, src.session
        t.progress = time.monotonic()
        t.opened = t.opened or t.progress
        sliced = [b for b, s in t.streams.items() if s.head is not None]
        problem = (self.layout.mismatch(msg.layout, sliced)
                   or chunk_size_problem(msg.chunk_bytes, self._max_frame, self.cfg.chunk_bytes))
        if problem:
            self._book.finish(t, S.FAILED, problem)
            return
        self._book.set(t, S.TRANSFERRING)
        self._send(src.ident, OpenAck(transfer_id=t.tid))

    def _on_chunk(self, src: From, msg: Chunk, data: list[zmq.Frame]) -> None:
        if self._slow is not None:
            time.sleep(self._slow.seconds)
        t = self._gate.owned(src, f"chunk {msg.seq}", msg.transfer_id)
        if t is None:
            return
        views = [f.buffer for f in data]
        problem = chunk_problem(t, msg, views, self._max_ranges)
        if problem:
            self._book.finish(t, S.FAILED, problem)
            return
        if not self._write(t, msg, views):
            self._gate.refuse(src, t.tid, "released", f"chunk {msg.seq} for transfer {t.tid} arrived after release")
            return
        t.streams[msg.buffer_id].covered.add(msg.offset, msg.offset + msg.length)
        t.progress = time.monotonic()
        t.nbytes += msg.length
        t.seqs.add(msg.seq)
        self._send(src.ident, Ack(transfer_id=t.tid, seq=msg.seq, length=msg.length))
        self._maybe_complete(t)

    def _write(self, t: InTransfer, msg: Chunk, views: list[memoryview]) -> bool:
        """Land a verified chunk unless `t` was released; False = not written."""
        with self._write_lock:
            if t.revoked:
                return False
            self._lander.write(t.copies, msg.buffer_id, t.streams[msg.buffer_id], msg.offset, views)
            return True

    def _on_close(self, src: From, msg: Close, _: list) -> None:
        t = self._gate.owned(src, "Close", msg.transfer_id)
        if t is None:
            return
        problem = close_problem(t, msg)
        if problem:
            self._book.finish(t, S.FAILED, problem)
            return
        t.close = msg
        t.progress = time.monotonic()
        self._maybe_complete(t)

    def _on_abort(self, src: From, msg: Abort, _: list) -> None:
        t = self._book.transfers.get(msg.transfer_id)
        if t is None or t.state.terminal:
            return
        # an Abort may overtake its Open on another connection, so "no opener yet" may abort too
        if not self._gate.speaks_for(src, t):
            self._gate.refuse(src, t.tid, "not_opener", f"Abort for transfer {t.tid} from a connection that "
                              "did not open it")
            return
        self._book.set(t, S.ABORTED, f"aborted by sender: {msg.reason}")

    def _maybe_complete(self, t: InTransfer) -> None:
        """DONE when Close has come, all its chunks have, every stream byte was written (coverage), and
        every device copy of them completed."""
        if t.state.terminal:
            self._settling.pop(t.tid, None)
            return
        if t.close is None or len(t.seqs) != t.close.nchunks:
            return
        problem = gap_problem(t)
        if problem:
            self._book.finish(t, S.FAILED, problem)
            return
        if t.copies:
            with self._write_lock:
                settled = self._lander.settled(t.copies)
            if not settled:
                self._settling[t.tid] = t
                return
        self._settling.pop(t.tid, None)
        self._book.set(t, S.DONE)
        self._send(t.sender, Done(transfer_id=t.tid, nbytes=t.nbytes))

    def _send(self, ident: bytes | None, msg: Any) -> None:
        if ident is None:
            return
        try:
            self._sock.send_multipart([ident, self._codec.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as e:  # peer gone or its queue full: it will time out on its own
            log.debug("reply %s dropped: %s", type(msg).__name__, e)
