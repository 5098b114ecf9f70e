"""The storage tier's interface, and Mooncake Store behind it.

A backend stores opaque encoded entries (entry.py) by key. It may lose any entry at any time (evicted,
restarted empty, disk full): a failed put is a dropped entry and a failed get a miss. Backends return
False/None for what they know failed and may raise for the rest; TierStack turns both into misses.

SGLang's HiCache `file` backend is the embedded default (prfaas_sgl/srt/cachepool_backend/tier_storage.py
wraps it; this package does not import sglang). `MooncakeStoreBackend` talks to a Mooncake master over
TCP with Mooncake's own client (`mooncake.store.MooncakeDistributedStore`).
"""
from __future__ import annotations

import socket
from typing import Optional, Protocol


class StorageBackend(Protocol):
    def put(self, key: str, blob: bytes) -> bool:
        """Store blob under key (an existing key is kept as is); False if it was not stored."""

    def get(self, key: str, size: int) -> Optional[bytes]:
        """The blob under key, or None. size: the bytes a complete entry has (a backend that reads
        into a preallocated buffer needs it; a shorter or longer blob is still returned as is)."""

    def exists(self, key: str) -> bool: ...

    def batch_exists(self, keys: list[str]) -> list[bool]:
        """exists() of each key, in one round trip where the backend has one (a hit's plan asks for
        every entry it may load at once)."""

    def remove(self, key: str) -> None: ...

    def clear(self) -> None: ...


# a TCP connect names an absent master at once (refused) or after this long (unroutable)
PROBE_TIMEOUT_S = 2.0
NO_SPACE = -200  # measured: a put right after a master restart (segment not remounted yet); the store is up


class MooncakeStoreBackend:
    """Mooncake Store over TCP. local_host: the address this client's transfer engine listens on and
    advertises; pin it (127.0.0.1 on one machine) or Mooncake picks the first NIC (eth0).
    segment_bytes: memory this client contributes to the store (where puts land on one machine)."""

    def __init__(self, master: str, metadata: str = "P2PHANDSHAKE", local_host: str = "127.0.0.1",
                 segment_bytes: int = 256 << 20, buffer_bytes: int = 64 << 20) -> None:
        """Raises ConnectionError at once (a TCP connect, PROBE_TIMEOUT_S at most) when nothing listens at
        `master`, where Mooncake's setup would retry 20 times for ~88 s (measured) first."""
        from mooncake.store import MooncakeDistributedStore

        self.master = master
        _probe(master, PROBE_TIMEOUT_S)
        self._store = MooncakeDistributedStore()
        # a master that accepts and never answers (SIGSTOPped) still holds setup: Mooncake's setup keeps the
        # GIL, so no thread of this process can time it out (a join(1 s) did not return in 40 s, measured)
        rc = self._store.setup(local_host, metadata, segment_bytes, buffer_bytes, "tcp", "", master)
        if rc != 0:
            raise ConnectionError(f"Mooncake store setup against master {master} (metadata {metadata}) "
                                  f"returned {rc}; is mooncake_master running there?")

    # Mooncake answers with negative codes, not exceptions; a code that says the master or the
    # transfer failed (RPC_FAIL -900, ...) is raised so the tier stack backs off
    def put(self, key: str, blob: bytes) -> bool:
        if self.exists(key):
            return True
        rc = self._store.put(key, blob)
        if rc < 0 and rc != NO_SPACE:
            raise ConnectionError(f"Mooncake put {key}: error {rc}")
        return rc == 0

    def get(self, key: str, size: int) -> Optional[bytes]:
        blob = self._store.get(key)
        return blob if blob else None  # Mooncake answers a missing key with b""

    def exists(self, key: str) -> bool:
        rc = self._store.is_exist(key)
        if rc < 0:
            raise ConnectionError(f"Mooncake is_exist {key}: error {rc}")
        return rc == 1

    def batch_exists(self, keys: list[str]) -> list[bool]:
        """One BatchExistKey RPC to the master for all keys (is_exist is one RPC per key)."""
        codes = self._store.batch_is_exist(keys) if keys else []
        if len(codes) != len(keys) or any(c < 0 for c in codes):
            raise ConnectionError(f"Mooncake batch_is_exist of {len(keys)} keys: {sorted(set(codes))[:4]}")
        return [c == 1 for c in codes]

    def remove(self, key: str) -> None:
        # force: a get just took a 10 s lease on the object (the master's default_kv_lease_ttl), and a
        # corrupt entry must go now, not after it
        self._store.remove(key, True)

    def clear(self) -> None:
        self._store.remove_all()

    def close(self) -> None:
        self._store.close()


def _probe(master: str, timeout_s: float) -> None:
    """ConnectionError naming the master unless it accepts a TCP connection within timeout_s."""
    from .auth import host_of

    host, port = host_of(master), int(master.rsplit(":", 1)[-1])
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as e:
        raise ConnectionError(f"mooncake_master {master} is not reachable ({e.strerror or type(e).__name__}); "
                              "start it, or fix --prfaas-tier-mooncake-master") from None
