"""Named transfer states, the status record both sides report, and the table `poll()` reads them from."""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass


class TransferState(enum.Enum):
    """Life of a transfer. Terminal states never change again.

    sender:   OPENING ─OpenAck─▶ TRANSFERRING ─Done─▶ DONE
    receiver: WAITING ─Open────▶ TRANSFERRING ─all chunks verified + Close─▶ DONE
    any non-terminal state ─▶ FAILED (reason) | ABORTED (either side) | TIMED_OUT (deadline)
    """

    WAITING = "waiting"
    OPENING = "opening"
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"
    ABORTED = "aborted"
    TIMED_OUT = "timed_out"
    UNKNOWN = "unknown"

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL


_TERMINAL = frozenset({TransferState.DONE, TransferState.FAILED, TransferState.ABORTED,
                       TransferState.TIMED_OUT})


@dataclass(frozen=True, slots=True)
class TransferStatus:
    """Snapshot of one transfer. `nbytes`: payload bytes verified (receiver) / acknowledged (sender)."""

    state: TransferState
    reason: str = ""
    nbytes: int = 0

    @property
    def ok(self) -> bool:
        return self.state is TransferState.DONE


UNKNOWN_STATUS = TransferStatus(TransferState.UNKNOWN, "no such transfer")


def first_failure(statuses: Iterable[TransferStatus]) -> TransferStatus | None:
    """The first status that ended without success, or None: the one rule by which both sides of the SGLang
    backend fail a room (a room of several transfers fails with its first failure's reason)."""
    return next((s for s in statuses if s.state.terminal and not s.ok), None)


class StatusTable:
    """The latest `TransferStatus` of each transfer, by id: one table behind the ZeroMQ sender, receiver and
    the tests' fake transport. One thread writes (the side's loop); any thread reads: `get` is one dict
    lookup under the GIL, and `wait` sleeps until a status is terminal, woken by every terminal `put`."""

    def __init__(self) -> None:
        self._status: dict[int, TransferStatus] = {}
        self._terminal = threading.Condition()

    def get(self, tid: int) -> TransferStatus:
        return self._status.get(tid, UNKNOWN_STATUS)

    def put(self, tid: int, status: TransferStatus) -> None:
        self._status[tid] = status
        if status.state.terminal:
            with self._terminal:
                self._terminal.notify_all()

    def pop(self, tid: int) -> None:
        self._status.pop(tid, None)

    def wait(self, tid: int, timeout: float, read: Callable[[int], TransferStatus] | None = None,
             step: float = 0.1) -> TransferStatus:
        """Block until `read(tid)` (default `get`) is terminal or `timeout` seconds pass; returns the last
        status. `read` is re-checked at least every `step` s, for sides whose status can change without
        a `put` (the sender's dead loop, the fake's lazy deadlines)."""
        read = read or self.get
        end = time.monotonic() + timeout
        with self._terminal:
            while not read(tid).state.terminal and time.monotonic() < end:
                self._terminal.wait(min(step, max(0.0, end - time.monotonic())))
        return read(tid)
