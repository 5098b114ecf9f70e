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
import subprocess
import sys
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
# a child's Mooncake setup against a healthy master takes ~0.15 s (interpreter + import + setup, measured on
# 2 idle cores); a stopped master holds it until the child is killed at this bound
SETUP_PROBE_TIMEOUT_S = 5.0
NO_SPACE = -200  # measured: a put right after a master restart (segment not remounted yet); the store is up


class MooncakeStoreBackend:
    """Mooncake Store over TCP. local_host: the address this client's transfer engine listens on and
    advertises; pin it (127.0.0.1 on one machine) or Mooncake picks the first NIC (eth0).
    segment_bytes: memory this client contributes to the store (where puts land on one machine)."""

    def __init__(self, master: str, metadata: str = "P2PHANDSHAKE", local_host: str = "127.0.0.1",
                 segment_bytes: int = 256 << 20, buffer_bytes: int = 64 << 20) -> None:
        """Raises ConnectionError at once (a TCP connect, PROBE_TIMEOUT_S at most) when nothing listens at
        `master`, where Mooncake's setup would retry 20 times for ~88 s (measured) first, and within
        SETUP_PROBE_TIMEOUT_S when it accepts and does not answer (stopped), where setup would never return."""
        from mooncake.store import MooncakeDistributedStore

        self.master = master
        _probe(master, PROBE_TIMEOUT_S)
        _probe_setup(master, metadata, local_host, SETUP_PROBE_TIMEOUT_S)
        self._store = MooncakeDistributedStore()
        # a master that hangs between the probe and here still holds this setup (it keeps the GIL)
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


# Run by a child interpreter: Mooncake's setup keeps the GIL while it waits for the master, so no thread of
# this process can time it out (a join(1 s) did not return in 40 s, measured); a child can be killed. No
# segment is mounted (nothing can be placed in a client about to vanish) and the child exits without
# close(), which waits ~1 s for Mooncake's threads; the master drops the client after its TTL.
_SETUP_IN_CHILD = """
import os, sys
from mooncake.store import MooncakeDistributedStore
store = MooncakeDistributedStore()  # held: its destructor is the ~1 s close()
print(store.setup(sys.argv[1], sys.argv[2], 0, 0, "tcp", "", sys.argv[3]), flush=True)
os._exit(0)
"""


def _probe_setup(master: str, metadata: str, local_host: str, timeout_s: float) -> None:
    """ConnectionError unless a child process's Mooncake client sets up against `master` within timeout_s
    (the child is killed then). The child prints setup's return code (0: set up) and exits 0 either way."""
    try:
        out = subprocess.run([sys.executable, "-c", _SETUP_IN_CHILD, local_host, metadata, master],
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             timeout=timeout_s).stdout
    except subprocess.TimeoutExpired:
        raise ConnectionError(f"mooncake_master {master} accepts connections but a client's setup got no answer "
                              f"within {timeout_s} s (stopped or overloaded?)") from None
    if out.strip() != b"0":
        raise ConnectionError(f"Mooncake store setup against master {master} (metadata {metadata}) failed in a "
                              f"probe process (answer {out.strip()[-40:]!r}); is mooncake_master running there?")
