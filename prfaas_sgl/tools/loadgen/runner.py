"""Drive a workload against an endpoint: warmup, open- or closed-loop sending, caps, progress bar.

Caps: at most ``max_requests`` requests (turns) are sent and none after ``max_duration_s`` from the
start; requests in flight at that moment get ``drain_timeout_s`` more to finish before they are cancelled
and recorded as errors. Without a duration cap the run ends with the workload (each request is bounded
by the client's timeout). A failed turn ends its session (later turns would build on a context that never existed).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field

import aiohttp
from tqdm import tqdm

from prfaas_sgl.tools.loadgen.client import OpenAIClient, RequestRecord
from prfaas_sgl.tools.loadgen.prom import MetricsSampler
from prfaas_sgl.tools.loadgen.prompts import PromptBuilder
from prfaas_sgl.tools.loadgen.workload import Session, Workload

_WARMUP_KEY = 2**32  # private-block namespace for warmup prompts: never shares a block with the run


@dataclass(frozen=True, slots=True)
class RunSpec:
    concurrency: int = 0  # 0: open loop at the sessions' start times; N > 0: N closed-loop workers
    max_requests: int = 0  # 0: no cap
    max_duration_s: float = 0.0  # 0: no cap; no request is sent after this
    drain_timeout_s: float = 600.0
    warmup: int = 0  # requests sent (and discarded) before the measured run
    progress: bool = True

    def __post_init__(self) -> None:
        if min(self.concurrency, self.max_requests, self.warmup) < 0:
            raise ValueError("--concurrency, --max-requests and --warmup must be >= 0")
        if self.max_duration_s < 0 or self.drain_timeout_s <= 0:
            raise ValueError("--max-duration must be >= 0 and --drain-timeout > 0 seconds")


@dataclass(slots=True)
class RunResult:
    records: list[RequestRecord]
    warmup: list[RequestRecord]
    started_unix: float  # wall clock of t0, for the JSON
    duration_s: float  # t0 to the end of the drain
    stopped_by: str  # "workload", "max_requests" or "max_duration"
    sampler: MetricsSampler | None = None


@dataclass(slots=True)
class _State:
    t0: float
    budget: int  # requests still allowed
    deadline: float  # perf_counter time after which nothing is sent
    records: list[RequestRecord] = field(default_factory=list)
    stopped_by: str = "workload"
    index: itertools.count = field(default_factory=itertools.count)


class Runner:
    def __init__(self, client: OpenAIClient, builder: PromptBuilder, workload: Workload, spec: RunSpec,
                 sampler: MetricsSampler | None = None) -> None:
        self.client, self.builder, self.workload, self.spec = client, builder, workload, spec
        self.sampler = sampler
        self._bar: tqdm | None = None

    async def run(self) -> RunResult:
        """Warm up, run, drain. The caller starts and closes the client."""
        warm = await self._warmup()
        return await self._measured(warm)

    async def _warmup(self) -> list[RequestRecord]:
        turns = [t for s in self.workload.sessions for t in s.turns][: self.spec.warmup]
        t0 = time.perf_counter()
        recs = [RequestRecord(i, -1, 0, t.input_len, t.output_len, warmup=True) for i, t in enumerate(turns)]
        sem = asyncio.Semaphore(max(1, min(4, self.spec.concurrency or 4)))

        async def one(rec: RequestRecord) -> None:
            async with sem:
                key = (_WARMUP_KEY + rec.index,)
                prompt = await asyncio.to_thread(self.builder.build, (), rec.input_len, key)
                await self.client.send(rec, prompt, t0)

        await asyncio.gather(*(one(r) for r in recs))
        return recs

    async def _measured(self, warm: list[RequestRecord]) -> RunResult:
        spec = self.spec
        planned = min(spec.max_requests or self.workload.n_requests, self.workload.n_requests)
        t0 = time.perf_counter()
        deadline = t0 + spec.max_duration_s if spec.max_duration_s else float("inf")
        st = _State(t0, spec.max_requests or 2**62, deadline)
        started_unix = time.time()
        stop = asyncio.Event()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            scraper = None
            if self.sampler:
                await self.sampler.scrape_once(http, t0)
                scraper = asyncio.create_task(self.sampler.run(http, t0, stop))
            with tqdm(total=planned, disable=not spec.progress, unit="req", dynamic_ncols=True) as bar:
                self._bar = bar
                tasks = self._closed(st) if spec.concurrency else await self._open(st)
                await _drain(tasks, st.deadline, spec.drain_timeout_s)
            stop.set()
            if scraper:
                await scraper
        _mark_cancelled(st.records)
        return RunResult(st.records, warm, started_unix, time.perf_counter() - t0, st.stopped_by,
                         self.sampler)

    async def _open(self, st: _State) -> list[asyncio.Task]:
        tasks = []
        for s in sorted(self.workload.sessions, key=lambda s: s.start_s):
            delay = min(st.t0 + s.start_s, st.deadline) - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if not self._may_send(st):
                break
            tasks.append(asyncio.create_task(self._session(s, st)))
        return tasks

    def _closed(self, st: _State) -> list[asyncio.Task]:
        sessions = iter(self.workload.sessions)

        async def worker() -> None:
            for s in sessions:  # one shared iterator: safe, all workers run on this event loop
                if not self._may_send(st):
                    return
                await self._session(s, st)

        return [asyncio.create_task(worker()) for _ in range(self.spec.concurrency)]

    def _may_send(self, st: _State) -> bool:
        if st.budget <= 0:
            st.stopped_by = "max_requests"
            return False
        if time.perf_counter() >= st.deadline:
            st.stopped_by = "max_duration"
            return False
        return True

    async def _session(self, s: Session, st: _State) -> None:
        for k, turn in enumerate(s.turns):
            if k and s.think_s:
                await asyncio.sleep(s.think_s)
            if not self._may_send(st):
                return
            st.budget -= 1
            rec = RequestRecord(next(st.index), s.index, k, turn.input_len, turn.output_len)
            st.records.append(rec)
            prompt = await asyncio.to_thread(self.builder.build, turn.hash_ids, turn.input_len, (s.index, k))
            await self.client.send(rec, prompt, st.t0)
            self._bar.update()
            if not rec.ok:
                return


async def _drain(tasks: list[asyncio.Task], deadline: float, drain_s: float) -> None:
    """Wait for ``tasks``; with a finite ``deadline`` give up ``drain_s`` after it and cancel the rest.

    Without a deadline every request is still bounded by the client's per-request timeout.
    """
    if not tasks:
        return
    timeout = None if deadline == float("inf") else max(0.0, deadline - time.perf_counter()) + drain_s
    _, pending = await asyncio.wait(tasks, timeout=timeout)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


def _mark_cancelled(records: list[RequestRecord]) -> None:
    for r in records:
        if r.error is None and r.e2e_s is None:
            r.error = "cancelled: still running at the drain timeout"
