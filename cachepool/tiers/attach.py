"""StorageAttacher: a storage tier that is down when the server starts is attached once it comes up.

A server whose store is absent at start serves without it (the store is a cache: nothing it holds is
needed for correct tokens) rather than refusing to start or blocking its start-up. Servers and their
store start in any order (Kubernetes starts a Deployment's pods in no particular order, a master may be
rescheduled), so the attempt is repeated on a daemon thread until the store answers:

    start:   build() ── ok ──> TierStack.attach_storage(backend)
               └─ ConnectionError ─> log (once, naming the store and why), count storage_attach_failures,
                                     retry every `retry_s` on the thread below
    thread:  sleep retry_s -> build() -> ... until one succeeds or stop()
"""
from __future__ import annotations

import logging
import threading
from typing import Callable, Optional

from .stack import TierStack
from .storage import StorageBackend

log = logging.getLogger(__name__)


class StorageAttacher:
    def __init__(self, stack: TierStack, build: Callable[[], StorageBackend], what: str, retry_s: float) -> None:
        """build(): a connected backend, or raises OSError (ConnectionError) within a bounded time (Mooncake:
        a TCP connect, then setup in a child process killed at storage.SETUP_PROBE_TIMEOUT_S)."""
        self.stack, self._build, self.what, self.retry_s = stack, build, what, retry_s
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def first_try(self) -> bool:
        """One attempt on the caller's thread; if it fails, the retry thread is started."""
        if self._attempt(first=True):
            return True
        self._thread = threading.Thread(target=self._run, name="prfaas-tier-attach", daemon=True)
        self._thread.start()
        return False

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.retry_s):
            if self._attempt(first=False):
                return

    def _attempt(self, first: bool) -> bool:
        try:
            backend = self._build()
        except OSError as e:
            self.stack.stats.storage_attach_failures += 1
            if first:
                log.error("prfaas_hybrid tiers: storage tier %s unavailable at start: %s. Serving without it "
                          "(misses recompute); retrying every %.0f s, failures counted in "
                          "prfaas_tier_storage_attach_failures_total", self.what, e, self.retry_s)
            return False
        self.stack.attach_storage(backend)
        if not first:
            log.warning("prfaas_hybrid tiers: storage tier %s attached after %d failed attempts", self.what,
                        self.stack.stats.storage_attach_failures)
        return True
