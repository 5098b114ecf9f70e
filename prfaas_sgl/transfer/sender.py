"""Sending end (prefill side): per peer, `connections` DEALER sockets on one loop thread.

Per transfer: Open ─(wait OpenAck)─▶ chunks striped round-robin over the peer's connections, each
one staged ring slot sent without a copy, while the peer's window has credit ─▶ Close after the last piece
─(wait Done)─▶ DONE. Source memory must stay unchanged until the transfer is terminal. A link's
connections carry its secret token in their ROUTING_IDs, so only this link can feed its transfers.

send() takes an `ItemBatch` (the staged path, on every device): the loop plans chunks of item ids in
O(chunks), `staging.Stager` gathers each into a ring slot on its own thread, and the loop sends each
staged slot as one tracked zero-copy frame.

Pieces: `peers.py` (links: sockets, window, queue), `send_book.py` (per-transfer state and deadlines),
`send_frames.py` (headers and zero-copy frames), `items.py` + `staging.py` (the staged path), `gates.py`
(batches held until their layer group is written); this file wires them to the loop and the API.
An unexpected error while handling one transfer fails that transfer only; if the loop thread itself
dies, every pending transfer reads FAILED and `fatal` names the cause.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq

import prfaas_sgl.transfer.faults as F  # not `from ..transfer import`: the package lazily imports us
from prfaas_sgl.transfer.buffers import check_host
from prfaas_sgl.transfer.config import PeerInfo, TransferConfig
from prfaas_sgl.transfer.gates import Parking
from prfaas_sgl.transfer.items import ItemBatch, StagePlan, plan_items
from prfaas_sgl.transfer.layout import MemoryLayout
from prfaas_sgl.transfer.loop import LoopDead, SocketLoop, make_context
from prfaas_sgl.transfer.messages import Codec, DecodeError, Failed, Open
from prfaas_sgl.transfer.peers import Link, LinkTable, open_link
from prfaas_sgl.transfer.send_book import CLOSE, OutTransfer, SendBook
from prfaas_sgl.transfer.send_frames import FrameMaker
from prfaas_sgl.transfer.states import TransferState as S, TransferStatus
from prfaas_sgl.transfer.stats import StatsBook, StatsServer

log = logging.getLogger(__name__)


class ZmqSender(SocketLoop):
    """Sends from `buffers` (one per `layout` entry) to any number of `ZmqReceiver` peers.

    devices: per buffer, "cpu" (default) or "cuda:N" (then the buffer is `(device address, nbytes)`).
    on_terminal(tid): called on the loop thread whenever a transfer's status becomes terminal (the
    prefill's watch thread waits on it instead of polling).
    """

    def __init__(self, layout: MemoryLayout, buffers: Sequence[Any], cfg: TransferConfig,
                 faults: tuple[F.Fault, ...] = (), stats_port: int | None = None,
                 stats_host: str = "127.0.0.1", devices: Sequence[str] | None = None,
                 on_terminal: Callable[[int], None] | None = None) -> None:
        super().__init__("transfer-send")
        self.layout, self.cfg = layout, cfg
        self._buffers, self._devices = list(buffers), list(devices or ["cpu"] * len(buffers))
        check_host(layout, self._buffers, self._devices, writable=False)
        self._frames = FrameMaker(faults)
        self._stager: Any = None  # staging.Stager, made at the first ItemBatch (torch loads only then)
        self._ctx = make_context(cfg)
        self._codec = Codec()  # replies
        self._links = LinkTable(self._new_link, cfg.max_links, cfg.link_idle_s, on_close=self._link_closed)
        self._book = SendBook(cfg, on_drop=self._drop_job, on_terminal=on_terminal)
        self.stats = StatsBook()
        self.stats.metrics.loop_alive.set_function(lambda: float(self.fatal is None and self._thread.is_alive()))
        self.stats_server = (StatsServer(self.stats, host=stats_host, port=stats_port, token=cfg.stats_token)
                             if stats_port is not None else None)
        self._pruned_at = 0.0
        self._parking = Parking(self._wake_loop)  # plans of layer groups not yet written (gates.py)
        self.start()

    # -- public API (any thread; never blocks on the network) --------------------------------------
    def send(self, transfer_id: int, peer: PeerInfo, batch: ItemBatch, last: bool = False,
             timeout_s: float | None = None) -> None:
        """Queue `batch` (stream order per buffer) of `transfer_id` for `peer`; `last` closes it. It costs
        the caller O(1): its ids are read and checked on the stager thread (a bad id fails the transfer
        there).

        The first call opens the transfer with no-progress deadline `timeout_s` (default cfg.timeout_s);
        every call counts as progress. Never raises for a dead loop: `poll()` reports it.
        """
        self._call(self._send, transfer_id, peer, batch, last, timeout_s or self.cfg.timeout_s)

    def poll(self, transfer_id: int) -> TransferStatus:
        status = self._book.status.get(transfer_id)
        fatal = self.fatal
        if fatal is not None and not status.state.terminal:  # queued work will never run
            return TransferStatus(S.FAILED, f"sender loop died: {fatal}", status.nbytes)
        return status

    def wait(self, transfer_id: int, timeout: float) -> TransferStatus:
        # `poll`, not the table: a dead loop reads FAILED without a put (hence the 2 ms re-check)
        return self._book.status.wait(transfer_id, timeout, read=self.poll, step=0.002)

    @property
    def worker_fatal(self) -> str | None:
        """Why one of this sender's other long-lived threads (the stager, the stats server) died, or None.
        `fatal` is the socket loop's; a health check reads both."""
        for name, worker in (("transfer-stage", self._stager), ("transfer-stats", self.stats_server)):
            reason = None if worker is None else worker.fatal
            if reason is not None:
                return f"{name} thread died: {reason}"
        return None

    def abort(self, transfer_id: int, reason: str = "aborted by sender") -> None:
        self._call(self._book.abort, transfer_id, reason)

    def release(self, transfer_id: int) -> None:
        if self.fatal is not None:
            self._book.status.pop(transfer_id)  # the loop is gone: nothing else touches the table
        self._call(self._book.release, transfer_id)

    def close(self) -> None:
        self.stop()
        if self._stager is not None:
            self._stager.close()
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
    def _send(self, tid: int, peer: PeerInfo, batch: ItemBatch, last: bool, timeout_s: float) -> None:
        try:
            self._queue(tid, peer, batch, last, timeout_s)
        except Exception as e:
            self._book.contain(tid, "send", e)

    def _queue(self, tid: int, peer: PeerInfo, batch: ItemBatch, last: bool, timeout_s: float) -> None:
        t = self._book.transfers.get(tid)
        if t is None:
            t = self._open(tid, peer, timeout_s)
            if t is None:
                return
        if t.state.terminal:
            return
        if t.closed or t.link.peer != peer:
            why = "send after the last piece" if t.closed else f"peer changed to {peer.key()}"
            self._book.fail(t, S.FAILED, f"bad send for transfer {tid}: {why}", notify=True)
            return
        now = time.monotonic()
        plans = plan_items(self.layout, batch, t.stream_pos, self.cfg.chunk_bytes)
        stager = self._staging()  # also for parked plans: dropping them cancels them there
        if batch.gate is not None and not batch.gate.is_open:
            self._parking.park(batch.gate, tid, plans)  # queued in order below, staged once it opens
        else:
            stager.submit(plans)
        t.jobs.extend((c, now) for c in plans)
        t.queued += sum(c.length for c in plans)
        t.progress = now
        if last:
            t.closed = True
            t.jobs.append(CLOSE)
        t.link.queue_work(t)

    def _open(self, tid: int, peer: PeerInfo, timeout_s: float) -> OutTransfer | None:
        problem = peer.problem()
        if problem:
            self._book.refuse(tid, problem)
            self.stats.link(str(peer.host)).on_failure("bad_peer")
            return None
        try:
            link = self._links.get(peer)
        except (zmq.ZMQError, ValueError) as e:  # out of sockets/fds, or a CURVE key refused locally
            log.warning("transfer %d: cannot open a link to %s: %s", tid, peer.key(), e)
            self._book.refuse(tid, f"cannot connect to {peer.key()}: {e}")
            self.stats.link(peer.key()).on_failure("connect")
            return None
        # the last handshake failed and none succeeded since: fail now rather than at the deadline
        if link.handshake_error:
            self._book.refuse(tid, link.handshake_error)
            link.stats.on_failure("handshake")
            return None
        now = time.monotonic()
        t = OutTransfer(tid, link, timeout_s, started=now, progress=now, mark=link.sent_total)
        self._book.add(t)
        t.link.control.append(self._frames.stamp(Open(transfer_id=tid, layout=self.layout,
                                                      chunk_bytes=self.cfg.chunk_bytes)))
        return t

    def _staging(self) -> Any:
        if self._stager is None:
            from prfaas_sgl.transfer.staging import Pools, Stager

            pools = Pools(self.layout, self._buffers, self._devices)
            self._stager = Stager(pools, self.cfg.chunk_bytes, self.cfg.stage_slots, self._wake_loop)
        return self._stager

    def _wake_loop(self) -> None:
        try:
            self.call(_nothing)  # a staged slot is ready: the loop sends it now, not at its next poll
        except LoopDead:
            pass

    def _drop_job(self, job: Any) -> None:
        """A failed transfer's queued job: a staged slot goes back to the ring."""
        if job is not CLOSE:
            self._stager.cancel(job[0])

    def _new_link(self, peer: PeerInfo) -> Link:
        return open_link(self._ctx, self.cfg, peer, self.stats.link(peer.key()), time.monotonic())

    def _link_closed(self, link: Link) -> None:
        """Its stats go with it, unless another link (same address, another key) still uses them."""
        key = link.peer.key()
        try:
            if all(other.peer.key() != key for other in self._links):
                self.stats.drop(key)
        except Exception:  # telemetry must not stop the other links from closing
            log.exception("link %s: dropping its stats failed", key)

    def _prune_stats(self, now: float) -> None:
        """Entries of peers refused before any link (bad address, no sockets) go once idle."""
        if now - self._pruned_at >= 1.0:
            self._pruned_at = now
            self.stats.prune({link.peer.key() for link in self._links}, now, self.cfg.link_idle_s)

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
            self._drain(link, sock)

    def _drain(self, link: Link, sock: zmq.Socket) -> None:
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
                self._book.on_reply(msg, link, time.monotonic())
            except Exception as e:
                if self._book.owns(link, msg.transfer_id):
                    self._book.contain(msg.transfer_id, f"handling {type(msg).__name__}", e)
                else:
                    log.exception("link %s: error handling a reply for transfer %d", link.peer.key(),
                                  msg.transfer_id)

    def _on_handshake(self, link: Link, mon: zmq.Socket) -> None:
        reason = link.on_monitor(mon)
        if reason is not None:
            self._book.fail_link(link, reason)

    def next_deadline(self) -> float | None:
        return min((d for d in (self._book.next_deadline(), self._parking.next_deadline()) if d is not None),
                   default=None)

    def _unpark(self, now: float) -> None:
        """Stage the plans of layer groups written since; fail transfers whose group's gate timed out."""
        opened, expired = self._parking.due(now)
        for p in opened:
            self._staging().submit(p.plans)  # plans of transfers ended meanwhile are CANCELLED: skipped
            self.stats.count("group_sends_in_forward" if p.gate.forward_running else "group_sends_after_forward")
        for p in expired:
            t = self._book.transfers.get(p.tid)
            if t is not None and not t.state.terminal:
                self._book.fail(t, S.FAILED, f"transfer {p.tid}: layer group {p.gate.name} was not written "
                                f"within {p.gate.timeout_s:g} s of its forward's start", notify=True)

    def on_tick(self, now: float) -> None:
        self._unpark(now)
        for t in self._book.due(now):
            opening = t.state is S.OPENING
            self._book.expire(t, now)
            if opening and not t.link.active:
                # nobody answered on this link: the next transfer dials afresh instead of waiting out
                # ZeroMQ's reconnect back-off towards a peer that may have restarted meanwhile
                self._links.close(t.link)
        self._links.close_idle(now)
        self._prune_stats(now)
        for link in self._links:
            try:
                link.pump(self._emit_control, self._emit_job, lambda t: t.state is S.TRANSFERRING,
                          waiting=_unstaged)
            except Exception:
                log.exception("link %s: unexpected error while sending (loop continues)", link.peer.key())

    def on_fatal(self, reason: str) -> None:
        self._book.fail_all(f"sender loop died: {reason}")

    def on_close(self) -> None:
        self._links.close_all()

    # -- loop thread: emitting --------------------------------------------------------------------
    def _emit_control(self, link: Link, msg: Any) -> bool:
        try:
            return link.try_send([self._frames.encode(msg)])
        except Exception as e:  # dropped: the transfer it belongs to fails instead of blocking the queue
            self._book.contain(msg.transfer_id, f"sending {type(msg).__name__}", e)
            return True

    def _emit_job(self, link: Link, t: OutTransfer, job: Any) -> bool:
        """Hand one job of `t` to ZeroMQ; False = no socket can take it now (keep it queued)."""
        try:
            return self._try_job(link, t, job)
        except Exception as e:
            self._book.contain(t.tid, "sending a chunk", e)
            return True  # t is failed and its jobs are gone: go on with the next transfer

    def _try_job(self, link: Link, t: OutTransfer, job: Any) -> bool:
        if job is CLOSE:
            return self._try_close(link, t)
        plan, queued_at = job
        return self._try_staged(link, t, plan, queued_at)

    def _try_close(self, link: Link, t: OutTransfer) -> bool:
        if not link.try_send(self._frames.close(t.tid, t.next_seq, t.stream_pos)):
            return False
        t.mark = link.sent_total
        return True

    def _try_staged(self, link: Link, t: OutTransfer, plan: StagePlan, queued_at: float) -> bool:
        from prfaas_sgl.transfer.staging import FAILED, STAGED

        if plan.state == FAILED:
            self._book.fail(t, S.FAILED, f"transfer {t.tid}: {plan.prep.error}", notify=True)
            return True
        if plan.state != STAGED or not link.has_credit(plan.length):
            return False  # the stager wakes the loop when it is; Acks return credit
        frames = self._frames.staged(t.tid, t.next_seq, plan, self._stager.frame(plan))
        sent, tracker = link.try_send_tracked(frames)
        if not sent:
            return False
        self._stager.sent(plan, tracker)
        link.on_sent(plan.length, time.monotonic() - queued_at)
        self._book.on_sent(t, t.next_seq, plan.length)
        t.next_seq += 1
        return True


def _nothing() -> None:
    pass


def _unstaged(job: Any) -> bool:
    """`job` is a chunk not staged yet (parked on a gate, or in the stager's queue): the link serves the
    next transfer meanwhile instead of waiting behind it."""
    from prfaas_sgl.transfer.staging import PENDING, STAGING

    return job is not CLOSE and job[0].state in (PENDING, STAGING)
