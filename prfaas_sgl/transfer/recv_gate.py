"""Who may speak for a receiver's transfer: sessions, and the gate every message passes first.

A transfer belongs to the session whose Open it accepted (`session_of`); Chunk and Close from any other
session are refused alone, without touching the transfer: counted by kind, logged (1st, 2nd, 4th...
of a kind, so a flood cannot flood the log), and answered with `Failed` naming why.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from prfaas_sgl.transfer.messages import Failed
from prfaas_sgl.transfer.recv_book import InTransfer, RecvBook
from prfaas_sgl.transfer.states import TransferState as S

log = logging.getLogger(__name__)
Session = tuple[str, str, bytes]  # (peer IP, CURVE client key, link token)


def _meta(frame: zmq.Frame, name: str) -> str:
    try:
        return frame.get(name)
    except zmq.ZMQError:  # property absent (no ZAP handler: no User-Id)
        return ""


def session_of(ident: bytes, header: zmq.Frame) -> Session:
    """Whom a connection speaks for; only the session that opened a transfer may feed or end it.

    A sender stripes one transfer over several DEALER connections, each with its own ROUTER identity, so
    the identity alone cannot name the opener. What its connections share: the peer's IP address, its
    CURVE client key (User-Id, set by the ZAP handler; empty in plaintext), and, when the sender sets its
    routing ids to `link token + one connection byte` (ZmqSender does), the token. Identities libzmq
    generates start with a 0 byte and carry no token: such a session is "this host (and key)".
    """
    token = ident[:-1] if ident[:1] not in (b"", b"\x00") else b""
    return _meta(header, "Peer-Address"), _meta(header, "User-Id"), token


@dataclass(frozen=True, slots=True)
class From:
    ident: bytes  # ROUTER identity of the connection: where replies to this message go
    session: Session


class Gate:
    """Loop thread only. `reply(ident, msg)` answers the connection a refused message came from."""

    def __init__(self, book: RecvBook, reply: Callable[[bytes | None, Any], None]) -> None:
        self._book = book
        self._reply = reply
        self.refusals: collections.Counter[str] = collections.Counter()

    def reject(self, src: From, tid: int, reason: str) -> None:
        """A bad message: it fails its transfer if it may speak for it (opener, or none yet)."""
        t = self._book.transfers.get(tid)
        if t is not None and not t.state.terminal and self.speaks_for(src, t):
            t.sender = t.sender or src.ident
            self._book.finish(t, S.FAILED, reason)
        else:
            self.refuse(src, tid, "bad_message", reason)

    def refuse(self, src: From, tid: int, kind: str, reason: str) -> None:
        """Drop a message without touching any transfer: count it, log it, tell its connection why."""
        self.refusals[kind] += 1
        n = self.refusals[kind]
        if n & (n - 1) == 0:  # the 1st, 2nd, 4th, 8th... of a kind: a flood cannot flood the log
            log.warning("refused %s message #%d from %s: %s", kind, n, src.session[0] or "?", reason)
        self._reply(src.ident, Failed(transfer_id=tid, reason=reason))

    def live(self, src: From, tid: int) -> InTransfer | None:
        """The transfer if it can take data; otherwise tell the sender why not and return None."""
        t = self._book.transfers.get(tid)
        if t is None:
            self.refuse(src, tid, "unknown_transfer", f"receiver does not expect transfer {tid}")
            return None
        if t.state.terminal:
            self.refuse(src, tid, "ended_transfer", t.reason or f"transfer already {t.state.value}")
            return None
        return t

    def owned(self, src: From, what: str, tid: int) -> InTransfer | None:
        """The live transfer if `src` is the session that opened it; otherwise refuse the message."""
        t = self.live(src, tid)
        if t is None:
            return None
        if t.session != src.session:
            why = "before its Open" if t.session is None else "from a connection that did not open it"
            self.refuse(src, tid, "not_opener", f"{what} for transfer {tid} arrived {why}")
            return None
        t.sender = src.ident
        return t

    @staticmethod
    def speaks_for(src: From, t: InTransfer) -> bool:
        """`src` opened `t`, or nobody has yet (an Abort may overtake its Open on another connection)."""
        return t.session in (None, src.session)
