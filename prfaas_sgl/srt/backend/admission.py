"""Which decode sessions a prefill sends KV to. A `Register` chooses the destination address and the
CURVE key the KV is encrypted for, and arrives on SGLang's plaintext control socket, which any host that
reaches the prefill can write to. So a Register is admitted only when:

- its MAC verifies under register.secret (when keys are configured; `control.authentic`),
- the decode's data host is its control endpoint *and* the TCP peer the message came from (a local
  process may also write over loopback),
- every field is in range (`register_problem`: TP 0 used to divide by zero on the scheduler thread),
- its data address is well formed, and with CURVE on its server key is one this prefill trusts,
- its layout can be served (`fit`: page size, buffers, TP head and state slices), so a session that
  cannot work is refused with the reason and its rooms fail with it, never at the first chunk.

A `Metadata` creates room state for the waiting timeout, so it passes the same MAC and TCP-peer checks,
its fields are range-checked against the session's Register (`metadata_problem`), and it must name an
admitted session (or a refused one, so that the decode learns why its rooms fail).

Refusals are counted per reason and logged at powers of two (a sweep of 16k forged Registers must not
flood the log). The book keeps at most `cap` sessions (`per_host` from one host), least recently used
first out: a decode restart brings a new session (a new control port), and the old one is never
announced gone. A session used within `hold_s` may have rooms in flight, so it is never evicted: the
new Register is refused instead ("too_many_sessions"), and its decode registers again later.
"""
from __future__ import annotations

import collections
import ipaddress
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prfaas_sgl.srt.backend import control
from prfaas_sgl.transfer.config import PeerInfo
from prfaas_sgl.transfer.security import server_key_problem

log = logging.getLogger(__name__)
MAX_PEERS = 4096  # decode sessions remembered (a few KB each: the layout)
MAX_PEERS_PER_HOST = 512  # sessions of one decode host (a TP-8 decode restarted 64 times within hold_s)
MAX_REFUSALS = 256  # sessions whose last refusal is kept to explain a later Metadata failure
MAX_PAGES = 1 << 24  # pages one Metadata may announce (16M tokens at page size 1)
MAX_STATE_ITEMS = 1 << 16  # state indices one Metadata may carry, all components together
MAX_TP = 1024  # attention TP size of a decode; also bounds the decode ranks one room fans out to
MAX_PAGE_SIZE = 1 << 16  # tokens per page
MAX_BUFFERS = 1 << 14  # buffers of one layout (layers x K/V + states + aux)
I64 = 1 << 63  # every other integer field: what a signed 64-bit SGLang/numpy index can hold
HOLD_S = 660.0  # SGLang's default waiting + bootstrap timeouts: how long a used session may have rooms

Fit = Callable[[control.Register], "str | None"]


def _range_problem(checks: Iterable[tuple[str, object, int, int]]) -> str | None:
    """The first (name, value, lo, hi) whose value is not an int (a bool is not) in [lo, hi]."""
    for name, value, lo, hi in checks:
        if type(value) is not int or not lo <= value <= hi:
            return f"{name}={value!r} is not an integer in [{lo}, {hi}]"
    return None


def register_problem(msg: control.Register) -> str | None:
    """Why a Register's fields are out of range, or None."""
    problem = _range_problem([
        ("dst_port", msg.dst_port, 1, 65535), ("data_port", msg.data_port, 1, 65535),
        ("page_size", msg.page_size, 1, MAX_PAGE_SIZE), ("attn_tp_size", msg.attn_tp_size, 1, MAX_TP),
        ("layout buffers", len(msg.layout.buffers), 1, MAX_BUFFERS)])
    if problem is None and type(msg.attn_tp_size) is int:
        problem = _range_problem([("tp_rank", msg.tp_rank, 0, msg.attn_tp_size - 1)])
    for i, b in enumerate(msg.layout.buffers):
        problem = problem or _range_problem([(f"buffer {i} item_len", b.item_len, 1, I64 - 1),
                                             (f"buffer {i} num_items", b.num_items, 0, I64 - 1)])
    return problem


def metadata_problem(msg: control.Metadata, peer: control.Register | None) -> str | None:
    """Why a Metadata's fields are out of range, or None; `peer`: its session's Register, whose page size
    and pool sizes bound the prefix and the aux and state indices (None: only the generic bounds)."""
    page = peer.page_size if peer is not None else 1
    items = [i for s in msg.state_indices if s is not None for i in s]
    problem = _range_problem([
        ("room", msg.room, 0, 2 * I64 - 1), ("dst_port", msg.dst_port, 1, 65535),
        ("npages", msg.npages, 0, MAX_PAGES), ("required_dst_info_num", msg.required_dst_info_num, 1, MAX_TP),
        ("decode_prefix_len", msg.decode_prefix_len, 0, MAX_PAGES * page),
        ("state components", len(msg.state_indices), 0, 64), ("state indices", len(items), 0, MAX_STATE_ITEMS)])
    if problem is None and msg.decode_prefix_len % page:
        problem = f"decode_prefix_len={msg.decode_prefix_len} is not a multiple of page_size {page}"
    if problem is None and msg.aux_index is not None:
        problem = _range_problem([("aux_index", msg.aux_index, 0, _rows(peer, "aux") - 1)])
    if problem is None and items:
        slots = _rows(peer, "state")
        bad = next((i for i in items if type(i) is not int or not 0 <= i < slots), None)
        problem = None if bad is None else f"state index {bad!r} is not an integer in [0, {slots - 1}]"
    if problem is None and type(msg.is_dummy) is not bool:
        problem = f"is_dummy={msg.is_dummy!r} is not a bool"
    return problem


def _rows(peer: control.Register | None, kind: str) -> int:
    """Items of the peer's `kind` buffers (the smallest pool for aux rows, the largest for state slots,
    whose pools differ per state kind); I64 when unknown."""
    sizes = [b.num_items for b in peer.layout.buffers if b.kind == kind and b.num_items] if peer else []
    if not sizes:
        return I64
    return min(sizes) if kind == "aux" else max(sizes)


@dataclass(frozen=True, slots=True)
class Admission:
    secret: bytes | None  # register.secret; None = no keys (loopback, or --prfaas-zmq-insecure)
    keys_dir: str | None

    def refusal(self, frames: list[bytes], msg: control.Register, peer_ip: str | None) -> tuple[str, str] | None:
        """(counter name, reason) when `msg` must not be used, else None. `peer_ip`: the TCP peer the
        frames came from, None when unknown."""
        return self.signer_refusal(frames, msg, peer_ip) or self.field_refusal(msg)

    def signer_refusal(self, frames: list[bytes], msg: control.Register,
                       peer_ip: str | None) -> tuple[str, str] | None:
        """Whether `msg` may speak for its session at all (MAC, TCP peer, data host)."""
        problem = self._signer_problem(frames, msg.endpoint, peer_ip)
        if problem:
            return problem
        if msg.data_host != msg.endpoint:
            return "host_mismatch", (f"data host {msg.data_host} and control endpoint {msg.endpoint} must be the "
                                     f"address the Register came from ({peer_ip}); set SGLANG_HOST_IP on the decode "
                                     "to the address that routes to this prefill")
        return None

    def field_refusal(self, msg: control.Register) -> tuple[str, str] | None:
        problem = register_problem(msg)
        if problem:
            return "bad_register", problem
        problem = PeerInfo(msg.data_host, msg.data_port, msg.server_key).problem()
        if problem:
            return "bad_address", problem
        if self.keys_dir:
            problem = server_key_problem(self.keys_dir, msg.server_key)
            if problem:
                return "untrusted_key", problem
        return None

    def metadata_refusal(self, frames: list[bytes], msg: control.Metadata, peer_ip: str | None,
                         peer: control.Register | None = None) -> tuple[str, str] | None:
        """(counter name, reason) when `msg` must not create room state (session aside), else None."""
        problem = self._signer_problem(frames, msg.endpoint, peer_ip)
        if problem:
            return problem
        problem = metadata_problem(msg, peer)
        return ("bad_metadata", problem) if problem else None

    def _signer_problem(self, frames: list[bytes], endpoint: str, peer_ip: str | None) -> tuple[str, str] | None:
        if self.secret is not None and not control.authentic(frames, self.secret):
            name = "unsigned" if len(frames) < 3 else "bad_mac"
            return name, "no valid MAC (a decode without this prefill's register.secret, or a forgery)"
        if not same_host(peer_ip, endpoint, strict=self.secret is not None):
            return "host_mismatch", (f"control endpoint {endpoint} must be the address the message came from "
                                     f"({peer_ip}); set SGLANG_HOST_IP on the decode to the address that routes "
                                     "to this prefill")
        return None


def same_host(peer_ip: str | None, endpoint: str, strict: bool) -> bool:
    """Whether a message from TCP peer `peer_ip` may speak for `endpoint`. `strict` (keys configured): an
    unknown TCP peer is a mismatch, not a pass. A loopback peer may speak for any address of this host."""
    if peer_ip is None:
        return not strict
    try:
        peer, claimed = ipaddress.ip_address(peer_ip), ipaddress.ip_address(endpoint)
    except ValueError:
        return peer_ip == endpoint
    peer = getattr(peer, "ipv4_mapped", None) or peer
    return peer == claimed or peer.is_loopback


class PeerBook:
    """Admitted decode sessions (`session` = decode control `ip:port`). Written by the control thread
    only; the scheduler thread reads with `get` (single dict operations are atomic under the GIL).
    `fit(register)`: why this prefill cannot serve that decode's layout, or None."""

    def __init__(self, admission: Admission, cap: int = MAX_PEERS, *, fit: Fit | None = None,
                 per_host: int = MAX_PEERS_PER_HOST, hold_s: float = HOLD_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.admission, self.cap, self.per_host, self.hold_s = admission, cap, per_host, hold_s
        self.fit, self.clock = fit or (lambda msg: None), clock
        self._peers: collections.OrderedDict[str, control.Register] = collections.OrderedDict()
        self._used: dict[str, float] = {}  # session → when it last registered or named a room
        self._refused: collections.OrderedDict[str, str] = collections.OrderedDict()
        self.refusals: collections.Counter[str] = collections.Counter()

    def admit(self, frames: list[bytes], msg: control.Register, peer_ip: str | None) -> bool:
        refusal = self.admission.signer_refusal(frames, msg, peer_ip)
        if refusal is not None:  # not that session speaking: whatever it had stays
            self._refuse(msg.session, *refusal)
            return False
        refusal = self.admission.field_refusal(msg) or self._fit_refusal(msg) or self._room_for(msg)
        if refusal is not None:  # that session, with a layout or values we cannot serve: forget the old one
            self._forget(msg.session)
            self._refuse(msg.session, *refusal)
            return False
        self._peers[msg.session] = msg
        self._peers.move_to_end(msg.session)
        self._used[msg.session] = self.clock()
        self._refused.pop(msg.session, None)
        return True

    def _fit_refusal(self, msg: control.Register) -> tuple[str, str] | None:
        try:
            problem = self.fit(msg)
        except Exception as e:  # layout math on a peer's values must not end the control thread
            log.exception("prfaas_zmq: layout check of decode %s failed", msg.session)
            problem = f"layout check failed: {type(e).__name__}: {e}"
        return ("incompatible", problem) if problem else None

    def _room_for(self, msg: control.Register) -> tuple[str, str] | None:
        """Make room for a new session: evict the least recently used idle one of its host (past
        `per_host`), then of all (past `cap`); refuse when the candidates may still have rooms in flight."""
        if msg.session in self._peers:
            return None
        host = [s for s, r in self._peers.items() if r.endpoint == msg.endpoint]
        if len(host) >= self.per_host and not self._evict(host[0]):
            return "too_many_sessions", f"{len(host)} sessions of host {msg.endpoint} are in use"
        if len(self._peers) >= self.cap and not self._evict(next(iter(self._peers))):
            return "too_many_sessions", f"{len(self._peers)} decode sessions are in use"
        return None

    def _evict(self, session: str) -> bool:
        if self.clock() - self._used.get(session, 0.0) < self.hold_s:
            return False
        self._forget(session)
        log.warning("prfaas_zmq: forgetting decode %s (idle, and %d sessions registered since)", session, self.cap)
        return True

    def _forget(self, session: str) -> None:
        self._peers.pop(session, None)
        self._used.pop(session, None)

    def admit_metadata(self, frames: list[bytes], msg: control.Metadata, peer_ip: str | None) -> bool:
        """Whether `msg` may create room state: it passes `metadata_refusal` and names a session that
        registered (admitted, or refused: its rooms then fail with the refusal's reason). A signed one
        may name an unknown session (a prefill restarted under a decode): its rooms fail at once."""
        refusal = self.admission.metadata_refusal(frames, msg, peer_ip, self._peers.get(msg.session))
        known = msg.session in self._peers or msg.session in self._refused or self.admission.secret is not None
        if refusal is None and not known:
            refusal = "unregistered", "no Register from this session"
        if refusal is not None:
            self.count(f"metadata_{refusal[0]}", msg.session, refusal[1])
        return refusal is None

    def touch(self, session: str) -> None:
        """`session` is in use (a Metadata named it): keep it out of eviction's way."""
        if session in self._peers:
            self._peers.move_to_end(session)
            self._used[session] = self.clock()

    def get(self, session: str) -> control.Register | None:
        return self._peers.get(session)

    def __contains__(self, session: str) -> bool:
        return session in self._peers

    def __len__(self) -> int:
        return len(self._peers)

    @property
    def refused(self) -> dict[str, str]:
        """Session → why its last Register was refused (the most recent MAX_REFUSALS)."""
        return dict(self._refused)

    def unregistered(self, session: str) -> str:
        """Why `session` has no admitted Register (for the failure of a room it sent Metadata for). Unless
        the decode's own Register was refused for its values, the reason tells it to register again."""
        why = self._refused.get(session)
        if why and not why.startswith("too_many_sessions"):
            return f"its Register was refused: {why}"
        return f"{control.REREGISTER}: {why or 'no Register from it (evicted, or this prefill restarted)'}"

    def _refuse(self, session: str, name: str, reason: str) -> None:
        self._refused[session] = f"{name}: {reason}"
        self._refused.move_to_end(session)
        while len(self._refused) > MAX_REFUSALS:
            self._refused.popitem(last=False)
        self.count(name, session, reason)

    def count(self, name: str, session: str, reason: str) -> None:
        """Count a refused control message; log at powers of two (a sweep must not flood the log)."""
        self.refusals[name] += 1
        n = self.refusals[name]
        if n & (n - 1) == 0:
            what = "Metadata" if name.startswith("metadata_") else "Register"
            log.error("prfaas_zmq: refused %s from decode %s (%s, %d so far): %s", what, session, name, n, reason)
