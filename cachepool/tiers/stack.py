"""TierStack: host tier over a storage tier, with the fault rules of the lower tiers in one place.

    device pool --evict--> put()  -> host (LRU, bounded) --full--> storage --full/down--> dropped
    device miss --------> get()  <- host, else storage (header + checksum verified) else None

Nothing raised below this class reaches the caller (the scheduler thread): a storage exception is
logged once per kind of failure, counted, and answered as "not stored" / "miss". A store that is down
answers each call only after its RPC timeout (Mooncake: ~4.4 s measured), so after a failure the storage
tier is skipped for `retry_s` (puts dropped, gets missed): one stall per window, not one per block. A corrupt, truncated
or foreign entry is counted and dropped from the tier it came from.
"""
from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from typing import Optional

from .entry import CorruptEntry, Fingerprint, decode, encode, entry_size
from .host import HostTier
from .storage import StorageBackend

log = logging.getLogger(__name__)


@dataclass(slots=True)
class TierStats:
    """Counts since start (entries unless named bytes)."""

    put: int = 0  # entries the device pool demoted
    host_hits: int = 0
    storage_hits: int = 0
    misses: int = 0
    corrupt: int = 0  # failed header/checksum checks (dropped)
    stored: int = 0  # entries written to storage
    dropped: int = 0  # entries no tier kept (no storage, storage full or down)
    storage_errors: int = 0  # storage backend failures (each skips the tier for retry_s)
    loaded_bytes: int = 0  # payload bytes returned by get()

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class TierStack:
    def __init__(self, fp: Fingerprint, host: Optional[HostTier], storage: Optional[StorageBackend],
                 retry_s: float = 5.0) -> None:
        if host is None and storage is None:
            raise ValueError("a tier stack needs a host tier, a storage tier, or both")
        self.fp, self.host, self.storage = fp, host, storage
        self.retry_s = retry_s
        self._skip_until = 0.0  # time.monotonic() before which the storage tier counts as down
        self.stats = TierStats()
        self._logged: set[str] = set()

    def put(self, kind: int, block_hash: int, payload: bytes) -> None:
        """Demote one evicted entry's bytes: into the host tier, whose overflow goes to storage."""
        self.stats.put += 1
        key, blob = self.fp.key(kind, block_hash), encode(self.fp, kind, block_hash, payload)
        spilled = self.host.put(key, blob) if self.host is not None else [(key, blob)]
        for k, b in spilled:
            self._store(k, b)

    def contains(self, kind: int, block_hash: int) -> bool:
        """Whether a tier holds the entry (a later get() may still miss: storage may lose it, or it may
        not verify)."""
        key = self.fp.key(kind, block_hash)
        if self.host is not None and key in self.host:
            return True
        return self.storage is not None and bool(self._call("exists", False, key))

    def get(self, kind: int, block_hash: int, payload_bytes: int) -> Optional[bytes]:
        """The verified payload of the entry, or None (absent, corrupt, storage down)."""
        key = self.fp.key(kind, block_hash)
        blob = self.host.get(key) if self.host is not None else None
        if blob is not None:
            payload = self._verified(kind, block_hash, blob, payload_bytes, key, from_host=True)
            if payload is not None:
                self.stats.host_hits += 1
                return self._loaded(payload)
        if self.storage is not None:
            blob = self._call("get", None, key, entry_size(payload_bytes))
            if blob is not None:
                payload = self._verified(kind, block_hash, blob, payload_bytes, key, from_host=False)
                if payload is not None:
                    self.stats.storage_hits += 1
                    return self._loaded(payload)
        self.stats.misses += 1
        return None

    def clear_host(self) -> None:
        if self.host is not None:
            self.host.clear()

    def _loaded(self, payload: bytes) -> bytes:
        self.stats.loaded_bytes += len(payload)
        return payload

    def _verified(self, kind: int, block_hash: int, blob: bytes, payload_bytes: int, key: str,
                  from_host: bool) -> Optional[bytes]:
        try:
            return decode(self.fp, kind, block_hash, blob, payload_bytes)
        except CorruptEntry as e:
            self.stats.corrupt += 1
            self._log_once("corrupt", "tier entry %s dropped: %s", key, e)
            if from_host:
                self.host.pop(key)  # type: ignore[union-attr]
            else:
                self._call("remove", None, key)
            return None

    def _store(self, key: str, blob: bytes) -> None:
        if self.storage is not None and self._call("put", False, key, blob):
            self.stats.stored += 1
        else:
            self.stats.dropped += 1

    def _call(self, name: str, failed, *args):
        """storage.<name>(*args); `failed` if it raises (the store is down, restarting, or full)."""
        if time.monotonic() < self._skip_until:
            return failed
        try:
            return getattr(self.storage, name)(*args)
        except Exception as e:  # any backend failure is a miss: never an exception into the scheduler
            self.stats.storage_errors += 1
            self._skip_until = time.monotonic() + self.retry_s
            self._log_once(f"{name}:{type(e).__name__}", "storage tier %s failed (%s: %s); treated as a miss",
                           name, type(e).__name__, e)
            return failed

    def _log_once(self, tag: str, msg: str, *args) -> None:
        if tag not in self._logged:
            self._logged.add(tag)
            log.warning(msg, *args)
