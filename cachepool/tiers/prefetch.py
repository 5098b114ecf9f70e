"""Prefetch: a waiting request's storage-tier entries read and verified on a worker thread, so that the
scheduler thread, when it matches the request, only copies host memory into the device pool.

    enqueue   (scheduler) Prefetcher.start(rid, token ids): a Job, queued for the worker
    worker                hash blocks 0, 1, ...; an entry the device or the host tier holds is skipped; one
                          only storage may hold is read (get, under the call deadline), verified (MAC, CRC,
                          fingerprint: the same TierStack check as a synchronous load) and staged; a miss, a
                          refusal, a full stage or a cancel ends the job
    batch     (scheduler) a request whose job runs sits out the pass, for at most `hold_s` from its start;
                          then the job is cancelled and the request matched with what was staged:
                          StagedStack answers from staged payloads and the host tier, never from storage

What one job walks (a linear-attention model wants a state every `step` blocks; a sliding-window model the
window pages of the last `window_blocks` blocks of the run):

    blocks   [0 ..... device or host .....)[...... storage ......)  first miss / limit
    fetched                                 KV each block, STATE at each grid boundary, WINDOW in [e - w, e)

Nothing unverified is staged, and a staged payload is keyed by its content hash: whichever request's match
finds it loads the bytes that were written for that prefix, or (if evicted from the stage meanwhile) misses
and recomputes.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Optional

from ..hashing import extend_hashes
from .entry import KV, STATE, WINDOW, entry_size
from .stack import TierStack

log = logging.getLogger(__name__)
HASH_WINDOW = 64  # blocks hashed at a time: a prompt that misses early costs a window, not its length


@dataclass(frozen=True, slots=True)
class Chain:
    """What a hit needs per block; sizes: payload bytes by entry kind."""

    block_size: int
    seed: int
    sizes: dict[int, int] = field(hash=False)
    step: int = 0  # a STATE at every step-th block boundary (linear attention); 0: none
    window_blocks: int = 0  # WINDOW entries for the last window_blocks blocks of the run; 0: none


@dataclass(slots=True)
class PrefetchStats:
    """Counts since start. started/abandoned/used: scheduler thread; the rest: the worker."""

    started: int = 0  # jobs started (requests entering the queue)
    abandoned: int = 0  # jobs still running when their hold ran out (cancelled; the rest recomputed)
    used: int = 0  # staged entries a match loaded
    fetched: int = 0  # storage entries read, verified and staged
    fetched_bytes: int = 0
    stage_full: int = 0  # jobs ended because the stage had no room (their first entries stay staged)
    evicted: int = 0  # staged entries dropped unused (oldest first, for room)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class Staged:
    """Verified payloads by storage key, bounded in bytes, oldest out first, but never an entry of the job
    that is adding (a hit needs its prefix from the first block: a job larger than the stage keeps what it
    staged first and stops). The worker adds and the scheduler thread takes: every access holds the lock."""

    def __init__(self, capacity_bytes: int, stats: PrefetchStats) -> None:
        self.capacity, self.used, self._stats = capacity_bytes, 0, stats
        self._lru: OrderedDict[str, tuple[bytes, int]] = OrderedDict()  # key -> (payload, id of the job)
        self._lock = threading.Lock()

    def put(self, key: str, payload: bytes, job_id: int) -> bool:
        """Stage payload, evicting older jobs' entries for room; False if there is none."""
        if len(payload) > self.capacity:
            return False
        with self._lock:
            self._drop(key)
            while self.used + len(payload) > self.capacity and self._lru:
                oldest, (b, owner) = next(iter(self._lru.items()))
                if owner == job_id:
                    return False
                self._drop(oldest)
                self._stats.evicted += 1
            self._lru[key] = (payload, job_id)
            self.used += len(payload)
        return True

    def take(self, key: str) -> Optional[bytes]:
        with self._lock:
            return self._drop(key)

    def _drop(self, key: str) -> Optional[bytes]:
        entry = self._lru.pop(key, None)
        if entry is None:
            return None
        self.used -= len(entry[0])
        return entry[0]

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._lru

    def clear(self) -> None:
        with self._lock:
            self._lru.clear()
            self.used = 0


class Job:
    """One request's prefetch. `done` is set by the worker when it ends (end says why)."""

    __slots__ = ("rid", "tokens", "hold_until", "started", "done", "cancelled", "fetched", "end", "ended_s")

    def __init__(self, rid: str, tokens: Sequence[int], hold_until: float) -> None:
        self.rid, self.tokens, self.hold_until = rid, tokens, hold_until
        self.started = time.monotonic()
        self.done = threading.Event()
        self.cancelled = False
        self.fetched = 0
        self.end = ""  # miss | refused | full | cancelled | limit | error
        self.ended_s = 0.0  # seconds from start to end


class Prefetcher:
    def __init__(self, stack: TierStack, chain: Chain, on_device: Callable[[int, int], bool], hold_s: float,
                 staged_bytes: int, max_jobs: int = 4096) -> None:
        """on_device(kind, hash): whether the device pool holds the entry (read from the worker thread: a
        dict lookup, atomic under the GIL; a stale answer only fetches one entry too many or too few).
        hold_s: longest a request sits out the batch for its prefetch."""
        self.stack, self.chain, self.on_device, self.hold_s = stack, chain, on_device, hold_s
        self.stats = PrefetchStats()
        self.staged = Staged(staged_bytes, self.stats)
        self._jobs: OrderedDict[str, Job] = OrderedDict()  # scheduler thread only
        self._max_jobs = max_jobs
        self._queue: queue.SimpleQueue[Job] = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None

    # -- scheduler thread -----------------------------------------------------------------------
    def start(self, rid: str, tokens: Sequence[int]) -> Job:
        """Queue the request's prefetch (tokens: its ids, not changed afterwards by the caller)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="prfaas-tier-prefetch", daemon=True)
            self._thread.start()
        old = self._jobs.pop(rid, None)
        if old is not None:
            old.cancelled = True
        job = self._jobs[rid] = Job(rid, tokens, time.monotonic() + self.hold_s)
        while len(self._jobs) > self._max_jobs:  # requests aborted while waiting never ask again
            self._jobs.popitem(last=False)[1].cancelled = True
        self.stats.started += 1
        self._queue.put(job)
        return job

    def holding(self, rid: str) -> bool:
        """Whether the request should sit out this batch: its prefetch runs and its hold has not run out.
        A job that ended or ran out is forgotten here (cancelled if it still runs)."""
        job = self._jobs.get(rid)
        if job is None:
            return False
        if not job.done.is_set():
            if time.monotonic() < job.hold_until:
                return True
            job.cancelled = True
            self.stats.abandoned += 1
            log.warning("tier prefetch for %s still running after %.1f s: matched with %d entries staged, the rest "
                        "recomputed (counted in prefetch_abandoned)", rid, self.hold_s, job.fetched)
        del self._jobs[rid]
        return False

    def wait(self, timeout_s: float) -> None:
        """Block the caller (an idle scheduler) until the oldest running job ends, at most timeout_s."""
        for job in self._jobs.values():
            if not job.done.is_set():
                job.done.wait(timeout_s)
                return

    # -- worker thread --------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job.cancelled:
                    job.end = "cancelled"
                else:
                    self._walk(job)
            except Exception:  # a bug here must not kill the worker: the request is only matched shorter
                job.end = "error"
                log.exception("tier prefetch for %s failed", job.rid)
            finally:
                job.ended_s = time.monotonic() - job.started
                job.done.set()
            if job.fetched:
                log.info("tier prefetch for %s: %d entries staged in %.1f ms (ended: %s)", job.rid, job.fetched,
                         job.ended_s * 1e3, job.end)

    def _walk(self, job: Job) -> None:
        c, ids = self.chain, job.tokens
        n = max(0, len(ids) - 1) // c.block_size  # a match never covers the last token
        if c.step:
            n -= n % c.step  # a linear-attention hit ends on the grid: KV past its last boundary is never loaded
        hashes: list[int] = []
        run = 0
        while run < n:
            if run == len(hashes):
                extend_hashes(hashes, ids, c.block_size, c.seed, min(n, run + HASH_WINDOW))
            h = hashes[run]
            if not self._have(KV, h, job):
                break
            if c.step and (run + 1) % c.step == 0 and not self._have(STATE, h, job):
                break
            run += 1
        else:
            job.end = "limit"
        if c.window_blocks:
            for j in range(max(0, run - c.window_blocks), run):
                self._have(WINDOW, hashes[j], job)  # a missing window only lowers the hit the plan finds

    def _have(self, kind: int, h: int, job: Job) -> bool:
        """Whether the entry is on the device, in the host tier, or staged now (fetched if need be)."""
        if job.cancelled:
            job.end = "cancelled"
            return False
        if self.on_device(kind, h):
            return True
        key, host = self.stack.fp.key(kind, h), self.stack.host
        if key in self.staged or (host is not None and key in host):
            return True
        return self._fetch(kind, h, key, job)

    def _fetch(self, kind: int, h: int, key: str, job: Job) -> bool:
        size = self.chain.sizes[kind]
        if self.stack.storage is None:  # down at start, not attached yet (attach.py)
            job.end = "miss"
            return False
        # TierStack's own storage call (deadline, back-off) and check (counts and removes what is refused)
        blob = self.stack._call("get", None, key, entry_size(size))
        if blob is None:
            job.end = "miss"
            return False
        payload = self.stack._verified(kind, h, blob, size, key, from_host=False)
        if payload is None:
            job.end = "refused"
            return False
        if not self.staged.put(key, payload, id(job)):
            job.end = "full"
            self.stats.stage_full += 1
            return False
        job.fetched += 1
        self.stats.fetched += 1
        self.stats.fetched_bytes += len(payload)
        return True


class StagedStack:
    """A TierStack seen through its prefetcher: staged entries are present and load from host memory.
    While `scheduling` (the scheduler's batch pass, whose requests were prefetched) storage is never
    asked: what the prefetch did not stage is a miss, recomputed. Otherwise (any other caller) storage is
    asked as TierStack asks it. Every other attribute is the stack's."""

    _OWN = frozenset({"_stack", "prefetcher", "scheduling"})

    def __init__(self, stack: TierStack, prefetcher: Prefetcher) -> None:
        self._stack, self.prefetcher = stack, prefetcher
        self.scheduling = False

    def __getattr__(self, name: str):
        return getattr(self._stack, name)

    def __setattr__(self, name: str, value) -> None:  # e.g. retry_s, call_timeout_s: the stack's own
        if name in self._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self._stack, name, value)

    def _near(self, kind: int, h: int) -> bool:
        key, host = self._stack.fp.key(kind, h), self._stack.host
        return key in self.prefetcher.staged or (host is not None and key in host)

    def contains(self, kind: int, block_hash: int) -> bool:
        if self._near(kind, block_hash):
            return True
        return not self.scheduling and self._stack.contains(kind, block_hash)

    def present(self, wanted: Iterable[tuple[int, int]]) -> set[tuple[int, int]]:
        found, rest = set(), []
        for kh in wanted:
            (found.add if self._near(*kh) else rest.append)(kh)
        if rest and not self.scheduling:
            found |= self._stack.present(rest)
        return found

    def get(self, kind: int, block_hash: int, payload_bytes: int) -> Optional[bytes]:
        s = self._stack
        key = s.fp.key(kind, block_hash)
        payload = self.prefetcher.staged.take(key)
        if payload is not None and len(payload) == payload_bytes:  # verified at this size when fetched
            s.stats.storage_hits += 1
            self.prefetcher.stats.used += 1
            return s._loaded(payload)
        return s.get(kind, block_hash, payload_bytes, storage=not self.scheduling)

    def clear_host(self) -> None:
        self._stack.clear_host()
        self.prefetcher.staged.clear()

    def counters(self) -> dict[str, int]:
        out = self._stack.counters()
        out.update({f"prefetch_{k}": v for k, v in self.prefetcher.stats.as_dict().items()})
        return out
