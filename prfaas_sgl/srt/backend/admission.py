"""Which decode sessions a prefill sends KV to. A `Register` chooses the destination address and the
CURVE key the KV is encrypted for, and arrives on SGLang's plaintext control socket, which any host that
reaches the prefill can write to. So a Register is admitted only when:

- its MAC verifies under register.secret (when keys are configured; `control.authentic`),
- the decode's data host is its control endpoint *and* the TCP peer the message came from (a local
  process may also write over loopback),
- its data address is well formed, and with CURVE on its server key is one this prefill trusts.

A `Metadata` creates room state for the waiting timeout, so it passes the same MAC and TCP-peer checks
and must name an admitted session (or a refused one, so that the decode learns why its rooms fail),
with a sane page count and state index list.

Refusals are counted per reason and logged at powers of two (a sweep of 16k forged Registers must not
flood the log). The book keeps at most `cap` sessions, least recently used first out: a decode restart
brings a new session (a new control port), and the old one is never announced gone.
"""
from __future__ import annotations

import collections
import ipaddress
import logging
from dataclasses import dataclass

from prfaas_sgl.srt.backend import control
from prfaas_sgl.transfer.config import PeerInfo
from prfaas_sgl.transfer.security import server_key_problem

log = logging.getLogger(__name__)
MAX_PEERS = 4096  # decode sessions remembered (a few KB each: the layout)
MAX_REFUSALS = 256  # sessions whose last refusal is kept to explain a later Metadata failure
MAX_PAGES = 1 << 24  # pages one Metadata may announce (16M tokens at page size 1)
MAX_STATE_ITEMS = 1 << 16  # state indices one Metadata may carry, all components together


@dataclass(frozen=True, slots=True)
class Admission:
    secret: bytes | None  # register.secret; None = no keys (loopback, or --prfaas-zmq-insecure)
    keys_dir: str | None

    def refusal(self, frames: list[bytes], msg: control.Register, peer_ip: str | None) -> tuple[str, str] | None:
        """(counter name, reason) when `msg` must not be used, else None. `peer_ip`: the TCP peer the
        frames came from, None when unknown."""
        problem = self._signer_problem(frames, msg.endpoint, peer_ip)
        if problem:
            return problem
        if msg.data_host != msg.endpoint:
            return "host_mismatch", (f"data host {msg.data_host} and control endpoint {msg.endpoint} must be the "
                                     f"address the Register came from ({peer_ip}); set SGLANG_HOST_IP on the decode "
                                     "to the address that routes to this prefill")
        problem = PeerInfo(msg.data_host, msg.data_port, msg.server_key).problem()
        if problem:
            return "bad_address", problem
        if self.keys_dir:
            problem = server_key_problem(self.keys_dir, msg.server_key)
            if problem:
                return "untrusted_key", problem
        return None

    def metadata_refusal(self, frames: list[bytes], msg: control.Metadata,
                         peer_ip: str | None) -> tuple[str, str] | None:
        """(counter name, reason) when `msg` must not create room state (session aside), else None."""
        problem = self._signer_problem(frames, msg.endpoint, peer_ip)
        if problem:
            return problem
        items = sum(len(s) for s in msg.state_indices if s)
        if not 0 <= msg.npages <= MAX_PAGES or len(msg.state_indices) > 64 or items > MAX_STATE_ITEMS:
            return "bad_metadata", (f"{msg.npages} pages, {len(msg.state_indices)} state components, "
                                    f"{items} state indices")
        return None

    def _signer_problem(self, frames: list[bytes], endpoint: str, peer_ip: str | None) -> tuple[str, str] | None:
        if self.secret is not None and not control.authentic(frames, self.secret):
            name = "unsigned" if len(frames) < 3 else "bad_mac"
            return name, "no valid MAC (a decode without this prefill's register.secret, or a forgery)"
        if not _same_host(peer_ip, endpoint, strict=self.secret is not None):
            return "host_mismatch", (f"control endpoint {endpoint} must be the address the message came from "
                                     f"({peer_ip}); set SGLANG_HOST_IP on the decode to the address that routes "
                                     "to this prefill")
        return None


def _same_host(peer_ip: str | None, endpoint: str, strict: bool) -> bool:
    """`strict` (keys configured): an unknown TCP peer is a mismatch, not a pass."""
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
    only; the scheduler thread reads with `get` (single dict operations are atomic under the GIL)."""

    def __init__(self, admission: Admission, cap: int = MAX_PEERS) -> None:
        self.admission, self.cap = admission, cap
        self._peers: collections.OrderedDict[str, control.Register] = collections.OrderedDict()
        self._refused: collections.OrderedDict[str, str] = collections.OrderedDict()
        self.refusals: collections.Counter[str] = collections.Counter()

    def admit(self, frames: list[bytes], msg: control.Register, peer_ip: str | None) -> bool:
        refusal = self.admission.refusal(frames, msg, peer_ip)
        if refusal is not None:
            self._refuse(msg.session, *refusal)
            return False
        self._peers[msg.session] = msg
        self._peers.move_to_end(msg.session)
        self._refused.pop(msg.session, None)
        while len(self._peers) > self.cap:
            old, _ = self._peers.popitem(last=False)
            log.warning("prfaas_zmq: forgetting decode %s (%d sessions registered since it was used)", old, self.cap)
        return True

    def admit_metadata(self, frames: list[bytes], msg: control.Metadata, peer_ip: str | None) -> bool:
        """Whether `msg` may create room state: it passes `metadata_refusal` and names a session that
        registered (admitted, or refused: its rooms then fail with the refusal's reason). A signed one
        may name an unknown session (a prefill restarted under a decode): its rooms fail at once."""
        refusal = self.admission.metadata_refusal(frames, msg, peer_ip)
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

    def get(self, session: str) -> control.Register | None:
        return self._peers.get(session)

    def __contains__(self, session: str) -> bool:
        return session in self._peers

    def __len__(self) -> int:
        return len(self._peers)

    def unregistered(self, session: str) -> str:
        """Why `session` has no admitted Register (for the failure of a room it sent Metadata for)."""
        why = self._refused.get(session)
        return f"its Register was refused: {why}" if why else "without registering its data address"

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
