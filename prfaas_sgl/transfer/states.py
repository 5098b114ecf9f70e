"""Named transfer states and the status record both sides report."""

from __future__ import annotations

import enum
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
