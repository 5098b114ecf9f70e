"""The sender's per-transfer bookkeeping: states, the statuses other threads read, replies, deadlines.

Plain Python on the loop thread (no sockets): `ZmqSender` decides what happens on the wire, this table
records what it means for each transfer. Statuses live in a `states.StatusTable` that `poll()` and
`wait()` read from any thread; nothing else here is touched off the loop thread.

Deadlines: a transfer fails when it makes no progress for its `timeout_s` (see
`TransferConfig.timeout_s` for what counts), or when it outlives `TransferConfig.cap_s` of the bytes
queued so far, counted from its first send(). While its messages wait on the link (queued here, or sent
but unanswered behind other transfers' bytes), the link's acknowledgements are its progress:

    link queue:   [ A's bytes in flight ............ ][ t's chunks ][ t's Close ]      acks ──▶ A, A, A, ...
                                                                  ^ t.mark = link.sent_total here
    t waits on the link until acked_total >= t.mark + window: by then a whole window of bytes sent after
    t's last message was acknowledged, so t's own were not queued but lost (a dropped ZeroMQ connection
    discards its pipe), and t's own clock runs again.

Replies count only from the link that carries the transfer, and an Ack only for a chunk in flight there
with its length: a receiver cannot end another peer's transfer or return window it was never given.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prfaas_sgl.transfer.config import TransferConfig
from prfaas_sgl.transfer.messages import Abort, Ack, Done, Failed, Message, OpenAck
from prfaas_sgl.transfer.peers import Link
from prfaas_sgl.transfer.states import StatusTable, TransferState as S, TransferStatus

log = logging.getLogger(__name__)
CLOSE = object()  # marks, in a transfer's job queue, where Close goes (after all its chunks)


@dataclass(slots=True)
class OutTransfer:
    tid: int
    link: Link
    timeout_s: float
    started: float
    progress: float  # last send(), OpenAck or Ack of this transfer (time.monotonic())
    state: S = S.OPENING
    reason: str = ""
    jobs: collections.deque = field(default_factory=collections.deque)  # (StagePlan, t_enqueued) | CLOSE
    stream_pos: dict[int, int] = field(default_factory=dict)
    next_seq: int = 0
    inflight: int = 0  # == sum(sent.values())
    sent: dict[int, int] = field(default_factory=dict)  # seq -> length of chunks not yet acknowledged
    mark: int = 0  # link.sent_total when this transfer's latest message went out
    acked: int = 0
    queued: int = 0  # chunk bytes handed to send() so far
    closed: bool = False


class SendBook:
    """The sender's transfers by id; loop thread only, except `status` (read by `poll()`)."""

    def __init__(self, cfg: TransferConfig, on_drop: Callable[[Any], None] | None = None,
                 on_terminal: Callable[[int], None] | None = None) -> None:
        self.cfg = cfg
        self._on_drop = on_drop  # a job dropped unsent (staged slots go back to their ring)
        self._on_terminal = on_terminal  # a transfer's status just became terminal
        self.transfers: dict[int, OutTransfer] = {}
        self.status = StatusTable()  # what poll() and wait() read, from any thread
        # non-terminal subset of transfers, the only ones whose deadlines need checking
        self.active: dict[int, OutTransfer] = {}

    def add(self, t: OutTransfer) -> None:
        self.transfers[t.tid] = t
        self.set(t, S.OPENING)

    def refuse(self, tid: int, reason: str) -> None:
        """`tid` failed before it had a link (bad peer, no sockets, refused handshake)."""
        self.status.put(tid, TransferStatus(S.FAILED, reason))

    def set(self, t: OutTransfer, state: S, reason: str = "") -> None:
        t.state, t.reason = state, reason
        if state.terminal:
            self.active.pop(t.tid, None)
        else:
            self.active[t.tid] = t
        t.link.attach(t.tid, time.monotonic(), live=not state.terminal)
        self.status.put(t.tid, TransferStatus(state, reason, t.acked))
        if state.terminal and self._on_terminal is not None:
            try:
                self._on_terminal(t.tid)
            except Exception:  # a listener's bug must not break the bookkeeping
                log.exception("transfer %d: on_terminal callback failed", t.tid)

    def fail(self, t: OutTransfer, state: S, reason: str, notify: bool) -> None:
        """End `t` in `state`: drop its queued jobs, return its window; `notify` tells the receiver."""
        self.drop_jobs(t)
        t.link.forget(t.inflight)
        t.inflight = 0
        t.sent.clear()
        t.link.stats.on_failure(state.value)
        self.set(t, state, reason)
        if notify:
            t.link.control.append(Abort(transfer_id=t.tid, reason=reason))

    def drop_jobs(self, t: OutTransfer) -> None:
        jobs, t.jobs = list(t.jobs), collections.deque()
        if self._on_drop is not None:
            for job in jobs:
                try:
                    self._on_drop(job)
                except Exception:
                    log.exception("transfer %d: dropping a queued job failed", t.tid)

    def contain(self, tid: int, what: str, err: Exception) -> None:
        """An unexpected error while handling `tid`: fail that transfer only, keep the loop running."""
        log.error("transfer %d: unexpected error in %s", tid, what, exc_info=err)
        reason = f"sender internal error in {what}: {type(err).__name__}: {err}"
        t = self.transfers.get(tid)
        if t is None:
            self.refuse(tid, reason)
        elif not t.state.terminal:
            try:
                self.fail(t, S.FAILED, reason, notify=True)
            except Exception:  # the bookkeeping itself is broken: at least make the status terminal
                log.exception("transfer %d: failing it raised too", tid)
                self.set(t, S.FAILED, reason)

    def abort(self, tid: int, reason: str) -> None:
        t = self.transfers.get(tid)
        if t is not None and not t.state.terminal:
            self.fail(t, S.ABORTED, reason, notify=True)

    def release(self, tid: int) -> None:
        try:
            self.abort(tid, "released by sender")
        finally:
            self.transfers.pop(tid, None)
            self.status.pop(tid)

    def fail_all(self, reason: str) -> None:
        for t in list(self.active.values()):
            self.set(t, S.FAILED, reason)

    def fail_link(self, link: Link, reason: str) -> None:
        """The peer behind `link` refused us (e.g. its handshake): its live transfers fail now."""
        for t in list(self.active.values()):
            if t.link is link:
                self.fail(t, S.FAILED, reason, notify=False)

    def owns(self, link: Link, tid: int) -> bool:
        """Transfer `tid` travels on `link` (a reply from elsewhere must not touch it)."""
        t = self.transfers.get(tid)
        return t is not None and t.link is link

    def on_sent(self, t: OutTransfer, seq: int, nbytes: int) -> None:
        """Chunk `seq` of `t` (`nbytes`) was handed to ZeroMQ on t's link (after `link.on_sent`)."""
        t.sent[seq] = nbytes
        t.inflight += nbytes
        t.mark = t.link.sent_total

    def on_reply(self, msg: Message, link: Link, now: float) -> None:
        """Apply a receiver's answer (OpenAck/Ack/Done/Failed/Abort) that arrived on `link`."""
        t = self.transfers.get(msg.transfer_id)
        if t is None or t.state.terminal or t.link is not link:
            return  # another link's transfer: a receiver speaks only for what was sent to it
        if isinstance(msg, OpenAck) and t.state is S.OPENING:
            t.progress = now
            self.set(t, S.TRANSFERRING)
            t.link.queue_work(t)
        elif isinstance(msg, Ack):
            self._on_ack(t, msg, now)
        elif isinstance(msg, Done):
            self._on_done(t, now)
        elif isinstance(msg, (Failed, Abort)):
            state = S.FAILED if isinstance(msg, Failed) else S.ABORTED
            self.fail(t, state, f"receiver: {msg.reason}", notify=False)

    def _on_ack(self, t: OutTransfer, msg: Ack, now: float) -> None:
        length = t.sent.get(msg.seq)
        if length is None or length != msg.length:
            what = "not in flight" if length is None else f"sent with {length} B"
            self.fail(t, S.FAILED, f"receiver acknowledged chunk {msg.seq} with {msg.length} B, which is "
                      f"{what}: protocol violation", notify=True)
            return
        del t.sent[msg.seq]
        t.progress = now
        t.inflight -= length
        t.acked += length
        t.link.on_ack(length, now)

    def _on_done(self, t: OutTransfer, now: float) -> None:
        if not t.closed or t.jobs:
            self.fail(t, S.FAILED, "receiver reported Done before the sender sent Close: protocol violation",
                      notify=True)
            return
        # Done may overtake Acks that travel on other connections: it acknowledges everything.
        t.link.on_ack(t.inflight, now)
        t.acked += t.inflight
        t.inflight = 0
        t.sent.clear()
        self.set(t, S.DONE)
        t.link.stats.on_done(now - t.started)

    # -- deadlines ---------------------------------------------------------------------------------
    def cap(self, t: OutTransfer) -> float | None:
        """Absolute end of `t`: `cfg.cap_s` of the bytes queued so far, from its first send()."""
        cap_s = self.cfg.cap_s(t.queued)
        return None if cap_s is None else t.started + cap_s

    def deadline(self, t: OutTransfer) -> float:
        last = t.progress
        if _waits_on_link(t):  # the link's progress is ours (see the module docstring)
            last = max(last, t.link.last_progress)
        cap = self.cap(t)
        return last + t.timeout_s if cap is None else min(last + t.timeout_s, cap)

    def next_deadline(self) -> float | None:
        return min((self.deadline(t) for t in self.active.values()), default=None)

    def due(self, now: float) -> list[OutTransfer]:
        return [t for t in list(self.active.values()) if now >= self.deadline(t)]

    def expire(self, t: OutTransfer, now: float) -> None:
        """`t` passed its deadline: TIMED_OUT with what was missing, and the receiver is told."""
        cap = self.cap(t)
        why = (f"exceeded its {self.cfg.cap_text(t.queued)}" if cap is not None and now >= cap
               else f"timed out after {t.timeout_s:g} s")
        hint = (" (no OpenAck: peer unreachable, not expecting it, or CURVE key refused?)"
                if t.state is S.OPENING else " (no progress: receiver stalled or link down?)")
        self.fail(t, S.TIMED_OUT, f"{why} in state {t.state.value}, {t.acked} bytes acknowledged{hint}",
                  notify=True)


def _waits_on_link(t: OutTransfer) -> bool:
    """`t` waits behind other transfers' bytes on its link, not for its caller's next send()."""
    if t.jobs and t.state is S.TRANSFERRING:
        return True  # its turn comes once the transfers before it on the link are sent (oldest first)
    if not (t.sent or t.closed or t.state is S.OPENING):
        return False
    return t.link.acked_total < t.mark + t.link.window
