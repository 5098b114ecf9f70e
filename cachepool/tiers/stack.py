"""TierStack: host tier over a storage tier, with the fault rules of the lower tiers in one place.

    device pool --evict--> put()  -> host (LRU, bounded) --full--> storage --full/down--> dropped
    device miss --------> get()  <- host, else storage (header + checksum verified) else None

Nothing raised below this class reaches the caller (the scheduler thread): a storage exception is
logged once per kind of failure, counted, and answered as "not stored" / "miss". A store that is down
answers each call only after its RPC timeout (Mooncake: ~4.4 s measured, 30 s for a hung master), so every
call has a deadline (`call_timeout_s`, deadline.py) and after a failure the storage tier is skipped for
`retry_s` (puts dropped, gets missed): one bounded stall per window, not one per block. A corrupt, truncated
or foreign entry is counted and dropped from the tier it came from; so is, with a tier key, an entry
whose MAC does not verify (unsigned, signed under another key, forged): nothing unverified is returned.
With `publish_queue_bytes`, `publish()` also writes what the device computes to storage (publish.py).
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Optional

from .deadline import Deadline
from .entry import CorruptEntry, Fingerprint, Unauthenticated, decode, encode, entry_size
from .host import HostTier
from .publish import Publisher
from .storage import StorageBackend

log = logging.getLogger(__name__)

# Longest a storage call may hold its caller (the scheduler thread): above a healthy store's answer for one
# entry (ms on loopback; a 1 MiB entry over a 5 Mbit/s link is ~1.7 s), far below a hung store's 30 s.
CALL_TIMEOUT_S = 5.0


@dataclass(slots=True)
class TierStats:
    """Counts since start (entries unless named bytes); written on the scheduler thread, except
    storage_errors (under TierStack's lock: the publisher's worker fails too)."""

    put: int = 0  # entries the device pool demoted
    host_hits: int = 0
    storage_hits: int = 0
    misses: int = 0
    corrupt: int = 0  # failed header/checksum checks (dropped)
    refused_mac: int = 0  # entries whose MAC did not verify under the tier key (dropped, never loaded)
    stored: int = 0  # entries demoted into storage
    stored_bytes: int = 0  # their encoded bytes
    dropped: int = 0  # entries no tier kept (no storage, storage full or down)
    storage_errors: int = 0  # storage backend failures (each skips the tier for retry_s)
    loaded_bytes: int = 0  # payload bytes returned by get()
    storage_attach_failures: int = 0  # attempts to reach a storage tier that was down at start (attach.py)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class TierStack:
    def __init__(self, fp: Fingerprint, host: Optional[HostTier], storage: Optional[StorageBackend],
                 retry_s: float = 5.0, key: Optional[bytes] = None, publish_queue_bytes: int = 0,
                 call_timeout_s: float = CALL_TIMEOUT_S, storage_pending: bool = False) -> None:
        """key: the tier key (auth.py) entries are signed and verified with; None: unsigned, unverified.
        publish_queue_bytes > 0 (with a storage tier): publish() writes through, queued up to that many
        payload bytes. storage_pending: the storage tier is down and attach_storage() may add it later."""
        if host is None and storage is None and not storage_pending:
            raise ValueError("a tier stack needs a host tier, a storage tier, or both")
        self.fp, self.host, self.storage, self.key = fp, host, storage, key
        self.retry_s, self.call_timeout_s = retry_s, call_timeout_s
        self._deadlines = threading.local()  # one Deadline per calling thread
        self._skip_until = 0.0  # time.monotonic() before which the storage tier counts as down
        self._lock = threading.Lock()  # _skip_until and storage_errors: the publisher's worker calls storage too
        self.stats = TierStats()
        self._logged: set[str] = set()
        self.publisher = Publisher(self._put_computed, publish_queue_bytes) \
            if publish_queue_bytes > 0 and (storage is not None or storage_pending) else None

    def attach_storage(self, storage: StorageBackend) -> None:
        """Add the storage tier that was down at start (from the attacher's thread: the scheduler thread
        reads self.storage once per call, and a reference assignment is atomic)."""
        self.storage = storage

    def counters(self) -> dict[str, int]:
        """Every counter, the publisher's included (a snapshot for /stats and /metrics)."""
        out = self.stats.as_dict()
        if self.publisher is not None:
            out.update(self.publisher.stats.as_dict(), publish_queued_bytes=self.publisher.queued_bytes)
        return out

    def publish(self, kind: int, block_hash: int, payload: bytes) -> None:
        """Write one entry the device pool just computed through to storage (asynchronously; a no-op
        without a publisher). The caller keeps its own copy: `payload` must not change afterwards."""
        if self.publisher is not None:
            self.publisher.offer(kind, block_hash, payload)

    def _put_computed(self, kind: int, block_hash: int, payload: bytes) -> int:
        """Worker thread: encode, sign and store one entry; its encoded size, or 0 if not stored."""
        blob = encode(self.fp, kind, block_hash, payload, self.key)
        return len(blob) if self._call("put", False, self.fp.key(kind, block_hash), blob) else 0

    def put(self, kind: int, block_hash: int, payload: bytes) -> None:
        """Demote one evicted entry's bytes: into the host tier, whose overflow goes to storage."""
        self.stats.put += 1
        key, blob = self.fp.key(kind, block_hash), encode(self.fp, kind, block_hash, payload, self.key)
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

    def present(self, wanted: Iterable[tuple[int, int]]) -> set[tuple[int, int]]:
        """Which (kind, hash) entries a tier holds: the host tier looked up, the rest asked of storage in
        one batch call (one RPC to a Mooncake master, under one deadline). A storage failure answers
        "none stored" for those, as contains() does."""
        found, ask = set(), []
        for kh in wanted:
            key = self.fp.key(*kh)
            if self.host is not None and key in self.host:
                found.add(kh)
            else:
                ask.append((kh, key))
        if ask and self.storage is not None:
            answers = self._call("batch_exists", [], [key for _, key in ask])
            found.update(kh for (kh, _), hit in zip(ask, answers) if hit)
        return found

    def get(self, kind: int, block_hash: int, payload_bytes: int, storage: bool = True) -> Optional[bytes]:
        """The verified payload of the entry, or None (absent, corrupt, storage down). `storage=False` reads
        the host tier only (a batch pass under prefetch makes no storage call on the scheduler thread)."""
        key = self.fp.key(kind, block_hash)
        blob = self.host.get(key) if self.host is not None else None
        if blob is not None:
            payload = self._verified(kind, block_hash, blob, payload_bytes, key, from_host=True)
            if payload is not None:
                self.stats.host_hits += 1
                return self._loaded(payload)
        if storage and self.storage is not None:
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
            return decode(self.fp, kind, block_hash, blob, payload_bytes, self.key)
        except CorruptEntry as e:
            refused = isinstance(e, Unauthenticated)
            if refused:
                self.stats.refused_mac += 1
            else:
                self.stats.corrupt += 1
            self._log_once("mac" if refused else "corrupt", "tier entry %s refused and dropped: %s (counted in %s; "
                           "logged once)", key, e, "refused_mac" if refused else "corrupt")
            if from_host:
                self.host.pop(key)  # type: ignore[union-attr]
            else:
                self._call("remove", None, key)
            return None

    def _store(self, key: str, blob: bytes) -> None:
        if self.storage is not None and self._call("put", False, key, blob):
            self.stats.stored += 1
            self.stats.stored_bytes += len(blob)
        else:
            self.stats.dropped += 1

    def _call(self, name: str, failed, *args):
        """storage.<name>(*args); `failed` if it raises (the store is down, restarting, or full)."""
        storage = self.storage  # None until a storage tier down at start is attached
        if storage is None or time.monotonic() < self._skip_until:
            return failed
        try:
            return self._deadline().call(getattr(storage, name), *args)
        except Exception as e:  # any backend failure is a miss: never an exception into the scheduler
            with self._lock:
                self.stats.storage_errors += 1
                self._skip_until = time.monotonic() + self.retry_s
            self._log_once(f"{name}:{type(e).__name__}", "storage tier %s failed (%s: %s); treated as a miss",
                           name, type(e).__name__, e)
            return failed

    def _deadline(self) -> Deadline:
        d = getattr(self._deadlines, "d", None)
        if d is None:
            d = self._deadlines.d = Deadline(self.call_timeout_s)
        return d

    def _log_once(self, tag: str, msg: str, *args) -> None:
        if tag not in self._logged:
            self._logged.add(tag)
            log.warning(msg, *args)
