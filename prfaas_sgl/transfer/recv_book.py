"""The receiver's per-transfer bookkeeping: states, the statuses other threads read and wait on, deadlines.

Plain Python on the loop thread, except `status` (a `states.StatusTable`: `poll()` and `wait()` read it
from any thread). Replies to the sender go through the `reply` callback the receiver passes in.

Deadlines: a transfer fails when nothing of it is accepted for its `timeout_s` (expect() to Open, then
between accepted Open/Chunk/Close), or when it outlives `TransferConfig.cap_s` of all its expected
bytes counted from its Open: the sender's formula, from the sender's first send(), so with the same
config the receiver never gives up before the sender's own cap.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prfaas_sgl.transfer.config import TransferConfig
from prfaas_sgl.transfer.items import ItemStream
from prfaas_sgl.transfer.messages import Abort, Close, Failed
from prfaas_sgl.transfer.states import StatusTable, TransferState as S, TransferStatus


@dataclass(slots=True)
class InTransfer:
    tid: int
    streams: dict[int, ItemStream]
    expected: int  # bytes, all streams
    progress: float  # expect(), then the last accepted Open, Chunk or Close (time.monotonic())
    timeout_s: float  # no-progress deadline
    opened: float | None = None  # when the Open was accepted: the size-derived cap counts from here
    state: S = S.WAITING
    reason: str = ""
    sender: bytes | None = None  # ROUTER identity replies go to: the opener's latest connection
    session: tuple[str, str, bytes] | None = None  # who opened it (see recv_gate.session_of)
    seqs: set[int] = field(default_factory=set)
    nbytes: int = 0
    close: Close | None = None
    revoked: bool = False  # released: its pages may belong to someone else; written under the write lock
    copies: list = field(default_factory=list)  # device copies (events) not known complete; write lock


class RecvBook:
    """The receiver's transfers by id. `reply(ident, msg)` sends `msg` to a sender connection."""

    def __init__(self, cfg: TransferConfig, reply: Callable[[bytes | None, Any], None]) -> None:
        self.cfg = cfg
        self._reply = reply
        self.transfers: dict[int, InTransfer] = {}
        self.status = StatusTable()  # what poll() and wait() read, from any thread
        # non-terminal subset of transfers, the only ones whose deadlines need checking
        self.active: dict[int, InTransfer] = {}

    def add(self, t: InTransfer) -> None:
        old = self.transfers.get(t.tid)
        if old is not None and not old.state.terminal:
            raise ValueError(f"transfer {t.tid} is already expected")
        self.transfers[t.tid] = t
        self.set(t, S.WAITING)

    def set(self, t: InTransfer, state: S, reason: str = "") -> None:
        t.state, t.reason = state, reason
        if state.terminal:
            self.active.pop(t.tid, None)
        else:
            self.active[t.tid] = t
        self.status.put(t.tid, TransferStatus(state, reason, t.nbytes))

    def finish(self, t: InTransfer, state: S, reason: str) -> None:
        """Terminal failure: record it and tell the sender (if one is known)."""
        self.set(t, state, reason)
        self._reply(t.sender, Failed(transfer_id=t.tid, reason=reason))

    def abort(self, tid: int, reason: str) -> None:
        t = self.transfers.get(tid)
        if t is not None and not t.state.terminal:
            self.set(t, S.ABORTED, reason)
            self._reply(t.sender, Abort(transfer_id=tid, reason=reason))

    def release(self, tid: int) -> None:
        self.abort(tid, "released by receiver")
        self.transfers.pop(tid, None)
        self.status.pop(tid)

    def fail_all(self, reason: str) -> None:
        for t in list(self.active.values()):
            self.set(t, S.FAILED, reason)

    # -- deadlines ---------------------------------------------------------------------------------
    def cap(self, t: InTransfer) -> float | None:
        cap_s = None if t.opened is None else self.cfg.cap_s(t.expected)
        return None if cap_s is None else t.opened + cap_s

    def deadline(self, t: InTransfer) -> float:
        cap = self.cap(t)
        end = t.progress + t.timeout_s
        return end if cap is None else min(end, cap)

    def next_deadline(self) -> float | None:
        return min((self.deadline(t) for t in self.active.values()), default=None)

    def expire_due(self, now: float) -> None:
        for t in list(self.active.values()):
            if now >= self.deadline(t):
                cap = self.cap(t)
                why = (f"exceeded its {self.cfg.cap_text(t.expected)}" if cap is not None and now >= cap
                       else f"timed out after {t.timeout_s:g} s")
                self.finish(t, S.TIMED_OUT, f"{why} in state {t.state.value}: {t.nbytes} of {t.expected} "
                            "bytes verified")
