"""Deadline: a storage call that does not answer in time is a failure, not a stall of the caller.

A store that is down refuses connections and fails fast, but one that hangs (a stopped master, a stuck
NFS mount) holds each Mooncake call for its client's RPC timeout: 30 s measured with a SIGSTOPped
`mooncake_master`, on the scheduler thread, per call. So each call runs on a worker thread and the
caller waits at most `timeout_s`:

    caller ──submit──> worker ──storage.get/put/...──> store
       └── waits ≤ timeout_s ── then StorageStalled; the worker stays stuck on that call, and every
           later call raises StorageStalled at once until it returns (never a queue behind a hung store)

One Deadline per calling thread (the scheduler's and the publisher's), so neither waits behind the other.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable, Optional


class StorageStalled(RuntimeError):
    """The storage call did not answer within its deadline, or an earlier one still has not."""


class Deadline:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tier-storage-call")
        self._stuck: Optional[Future] = None

    def call(self, fn: Callable, *args):
        if self._stuck is not None:
            if not self._stuck.done():
                raise StorageStalled(f"an earlier storage call is still unanswered after {self.timeout_s} s")
            self._stuck = None
        fut = self._pool.submit(fn, *args)
        try:
            return fut.result(self.timeout_s)
        except FutureTimeout:
            self._stuck = fut
            raise StorageStalled(f"storage call {getattr(fn, '__name__', fn)} did not answer within "
                                 f"{self.timeout_s} s") from None
