"""Room bookkeeping of the prefill's control thread: which decode sessions may join a room, and the rooms
that wait for their prefill, bounded per decode host so that one signer cannot starve the others.

A room is one request. Its decode sends one Metadata per decode rank that receives from this prefill
rank: SGLang's `required_dst_info_num` of them (decode TP 4 → prefill TP 2: decode ranks 0 and 1 both
name prefill rank 0, so room R on prefill rank 0 waits for two sessions). The first Metadata binds the
room to that fan-out: later ones must state the same count, come from a decode at the same attention TP,
and the room takes no more sessions than the count. Without a per-host identity (one shared secret),
this is as far as a room can be bound to "its" decode: a holder of the secret who learns a room id
before the decode's own Metadata arrives still takes its place, and then the decode's Metadata is refused
and the room fails.
"""
from __future__ import annotations

import threading

from prfaas_sgl.srt.backend import control

MAX_UNSTARTED = 16384  # rooms with Metadata and no chunk yet (a Metadata is ~100 B, kept ~10 min)
MAX_UNSTARTED_PER_HOST = 4096  # of which one decode host may hold (sessions are cheap; hosts are not)


def join_problem(infos: dict[str, control.Metadata], msg: control.Metadata,
                 peers: dict[str, control.Register | None]) -> str | None:
    """Why session `msg.session` may not add itself to room `msg.room`, whose sessions so far are
    `infos`, or None. `peers`: the Registers of those sessions and of msg's (None: not admitted)."""
    if not infos or msg.session in infos:
        return None  # the room's first Metadata, or a session re-sending its own
    first = next(iter(infos.values()))
    if msg.required_dst_info_num != first.required_dst_info_num:
        return (f"it expects {msg.required_dst_info_num} decode ranks in the room, the room's first Metadata "
                f"(from {first.session}) {first.required_dst_info_num}")
    if len(infos) >= first.required_dst_info_num:
        return f"the room already has its {len(infos)} decode ranks ({', '.join(infos)})"
    mine, theirs = peers.get(msg.session), peers.get(first.session)
    if mine is not None and theirs is not None and mine.attn_tp_size != theirs.attn_tp_size:
        return (f"its attention TP {mine.attn_tp_size} differs from the room's first decode rank "
                f"({first.session}, TP {theirs.attn_tp_size})")
    return None


class Unstarted:
    """Rooms with Metadata whose prefill has not sent a chunk yet → when the Metadata came, in arrival
    order, with the decode host that asked. By then the decode gave up (waiting timeout), and SGLang's
    sender fails a room it cannot find, so the watch thread forgets them (`expired`).

    Added by the control thread, popped by the scheduler thread (first chunk) and the watch thread
    (expiry): a lock keeps the per-host counts exact."""

    def __init__(self, cap: int = MAX_UNSTARTED, per_host: int = MAX_UNSTARTED_PER_HOST) -> None:
        self.cap, self.per_host = cap, per_host
        self._since: dict[int, tuple[float, str]] = {}
        self._per_host: dict[str, int] = {}
        self._lock = threading.Lock()

    def refusal(self, room: int, host: str) -> tuple[str, str] | None:
        """(counter name, reason) when a new room of decode `host` must wait for others to start."""
        if room in self._since:
            return None
        if len(self._since) >= self.cap:
            return "too_many_rooms", f"{len(self._since)} rooms wait for their prefill already"
        if self._per_host.get(host, 0) >= self.per_host:
            return "too_many_rooms_of_host", f"{self._per_host[host]} rooms of host {host} wait already"
        return None

    def add(self, room: int, host: str, now: float) -> None:
        with self._lock:
            if room not in self._since:
                self._since[room] = (now, host)
                self._per_host[host] = self._per_host.get(host, 0) + 1

    def pop(self, room: int) -> bool:
        """Forget `room`; whether it was waiting."""
        with self._lock:
            entry = self._since.pop(room, None)
            if entry is None:
                return False
            left = self._per_host[entry[1]] - 1
            if left:
                self._per_host[entry[1]] = left
            else:
                del self._per_host[entry[1]]
            return True

    def expired(self, now: float, ttl_s: float) -> list[int]:
        """Rooms that arrived `ttl_s` or more before `now`, oldest first (not popped)."""
        with self._lock:
            items = list(self._since.items())
        out = []
        for room, (since, _) in items:
            if now - since < ttl_s:
                break  # insertion order is arrival order
            out.append(room)
        return out

    def __contains__(self, room: int) -> bool:
        return room in self._since

    def __len__(self) -> int:
        return len(self._since)

    def __iter__(self):
        return iter(list(self._since))

    def of_host(self, host: str) -> int:
        return self._per_host.get(host, 0)


def page_overflow(info: control.Metadata, index_slice: slice, npages: int) -> str | None:
    """Why pages [start, start + npages) of a chunk are not among the decode's allocated pages, or None."""
    start = index_slice.start or 0
    if start + npages > info.npages:
        return (f"prefill sends pages [{start}, {start + npages}) of room {info.room} but decode "
                f"{info.session} allocated {info.npages} pages (different prompt length or page size?)")
    return None
