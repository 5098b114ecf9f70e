"""Publisher: write-through of what the device pool computes into the shared storage tier.

    scheduler thread: pool stores block h -> bytes copied out of the device -> offer()  (never blocks)
    worker thread:    encode + sign -> storage put (Mooncake: one is_exist + one put RPC per entry)

Demotion writes an entry to storage only when the device and host tiers have no room for it; a server
in another cluster that shares the store can load a prefix only if it is there while the writer still
holds it, so `--prfaas-tier-publish` puts each stored block and state checkpoint as it is computed.
The copy out of the device must happen on the scheduler thread (the slots may be reused right after);
the rest runs on one worker so a slow or dead store never stalls a forward. The queue is bounded in
bytes: when the store cannot keep up, new entries are dropped and counted (a later reader misses
them and recomputes), never queued without bound.
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import asdict, dataclass


@dataclass(slots=True)
class PublishStats:
    published: int = 0  # entries the store took (worker thread)
    published_bytes: int = 0  # their encoded bytes (worker thread)
    publish_failed: int = 0  # puts the store refused or that raised (worker thread)
    publish_dropped: int = 0  # offers refused because the queue was full (scheduler thread)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class Publisher:
    """put_blob(kind, block_hash, payload) -> bool runs on the worker thread (TierStack.store_computed)."""

    def __init__(self, put_blob, max_queued_bytes: int) -> None:
        self._put, self.max_queued_bytes = put_blob, max_queued_bytes
        self._queue: deque[tuple[int, int, bytes]] = deque()
        self._queued_bytes = 0
        self._busy = False
        self._cv = threading.Condition()
        self._closed = False
        self.stats = PublishStats()
        self._thread = threading.Thread(target=self._run, name="prfaas-tier-publish", daemon=True)
        self._thread.start()

    def offer(self, kind: int, block_hash: int, payload: bytes) -> bool:
        """Queue one entry; False (counted) if the queue is full."""
        with self._cv:
            if self._queued_bytes + len(payload) > self.max_queued_bytes:
                self.stats.publish_dropped += 1
                return False
            self._queue.append((kind, block_hash, payload))
            self._queued_bytes += len(payload)
            self._cv.notify()
        return True

    @property
    def queued_bytes(self) -> int:
        return self._queued_bytes

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued entry was tried; False on timeout (tests, shutdown)."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue and not self._busy, timeout_s)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue or self._closed)
                if self._closed:
                    return
                kind, block_hash, payload = self._queue.popleft()
                self._busy = True
            try:
                n = self._put(kind, block_hash, payload)
            except Exception:  # put_blob already turns store failures into 0; this is a last guard
                n = 0
            with self._cv:
                self._busy = False
                self._queued_bytes -= len(payload)
                if n:
                    self.stats.published += 1
                    self.stats.published_bytes += n
                else:
                    self.stats.publish_failed += 1
                self._cv.notify_all()
