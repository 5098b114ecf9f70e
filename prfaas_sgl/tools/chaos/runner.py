"""The campaign's two concurrent halves: the seeded load through the router, and the fault schedule.

Every planned request is sent exactly once (no client retries: retrying is the router's job) and ends in
one RequestResult; faults run at their planned times, except that a kill waits for restarts still under
way on its target, or on the other prefill (the record says when each fault really ran).
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp

from prfaas_sgl.tools.netns import Link
from prfaas_sgl.router.names import ROUTE_HEADER

from .config import CampaignConfig
from .outcome import Answer, RequestResult, classify
from .plan import PlannedRequest
from .reference import Reference, generate_body
from .schedule import FaultEvent
from .topology import ZERO_RATE, Fleet, set_link_rate


async def post(session: aiohttp.ClientSession, url: str, body: dict, timeout_s: float) -> tuple[Answer, str]:
    """(what the client saw, the router's route header)."""
    t = time.monotonic()
    try:
        async with session.post(url + "/generate", json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            raw = await r.read()
            try:
                parsed: object = json.loads(raw)
            except ValueError:
                parsed = raw.decode(errors="replace")
            return Answer(r.status, parsed, time.monotonic() - t), r.headers.get(ROUTE_HEADER, "")
    except asyncio.TimeoutError:
        return Answer(None, None, time.monotonic() - t, "no answer (client timeout)", timed_out=True), ""
    except aiohttp.ClientError as e:
        return Answer(None, None, time.monotonic() - t, f"{type(e).__name__}: {e}"), ""


@dataclass
class LoadRun:
    sent: list[int] = field(default_factory=list)
    results: list[RequestResult] = field(default_factory=list)
    inflight: int = 0  # requests open right now: a fault that meets none tested only recovery


async def run_load(router_url: str, plan: tuple[PlannedRequest, ...], refs: dict[int, Reference],
                   cfg: CampaignConfig, t0: float, run: LoadRun) -> None:
    """Send each request at t0 + send_at_s (later if max_inflight requests are open); fills `run`."""
    gate = asyncio.Semaphore(cfg.max_inflight)
    conn = aiohttp.TCPConnector(limit=0, force_close=True)  # a request never waits on a pooled socket

    async def one(session: aiohttp.ClientSession, req: PlannedRequest) -> None:
        await asyncio.sleep(max(0.0, t0 + req.send_at_s - time.monotonic()))
        async with gate:
            send_s = time.monotonic() - t0
            run.sent.append(req.index)
            run.inflight += 1
            try:
                ans, route = await post(session, router_url, generate_body(req.input_ids(), cfg.max_new_tokens),
                                        cfg.client_timeout_s)
            finally:
                run.inflight -= 1
        outcome, detail = classify(ans, refs[req.index].output_ids, cfg.bound_s)
        run.results.append(RequestResult(req.index, req.kind, req.n_tokens, round(send_s, 3), round(ans.elapsed_s, 3),
                                         outcome, ans.status, route, detail[:500]))

    async with aiohttp.ClientSession(connector=conn) as session:
        await asyncio.gather(*(one(session, r) for r in plan))


async def run_faults(fleet: Fleet, link: Link, schedule: tuple[FaultEvent, ...], t0: float,
                     link_rate: str, load: LoadRun) -> list[dict]:
    """Execute the schedule; returns one record per event (when it ran, when the server was back)."""
    starting: dict[str, asyncio.Task] = {}
    records: list[dict] = []
    for ev in schedule:
        await asyncio.sleep(max(0.0, t0 + ev.at_s - time.monotonic()))
        for name in _wait_for(ev, starting):
            await starting.pop(name)
        await until_load(load, MEET_LOAD_S)
        rec = {**ev.to_json(), "ran_at_s": round(time.monotonic() - t0, 2), "inflight": load.inflight}
        records.append(rec)
        if ev.kind == "kill":
            await asyncio.to_thread(fleet.servers[ev.target].kill)
            await asyncio.sleep(ev.restart_after_s)
            starting[ev.target] = asyncio.create_task(_restart(fleet, ev.target, rec, t0))
        else:
            await _link_down(link, ev.duration_s, link_rate, rec, t0)
    await asyncio.gather(*starting.values())
    return records


PREFILLS = ("remote_prefill", "local_prefill")
MEET_LOAD_S = 30.0  # at ~1 request per 6 s (CI), a fault fired between requests met none in ~1 of 2 tries


async def until_load(load: LoadRun, limit_s: float) -> None:
    """Waits (at most `limit_s`) until a request is in flight: a fault that meets none tests only recovery.
    The fault may run late, never early, as with `_wait_for`."""
    deadline = time.monotonic() + limit_s
    while load.inflight == 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


def _wait_for(ev: FaultEvent, starting: dict[str, asyncio.Task]) -> list[str]:
    """Servers whose restart must finish before `ev`: the target itself (never kill a server that is still
    starting) and, for a prefill, the other prefill: one prefill always serves, so faults interleave with
    requests that must come back correct instead of turning into a burst of 503s. A link drop waits for
    the remote prefill: with nothing behind the link, dropping it tests nothing."""
    if ev.kind != "kill":
        names: tuple[str, ...] = ("remote_prefill",)
    else:
        names = PREFILLS if ev.target in PREFILLS else (ev.target,)
    return [n for n in names if n in starting]


async def _restart(fleet: Fleet, name: str, rec: dict, t0: float) -> None:
    srv = fleet.restart(name)
    rec["restarted_at_s"] = round(time.monotonic() - t0, 2)
    try:
        await asyncio.to_thread(srv.wait_healthy, 600.0)
        rec["healthy_at_s"] = round(time.monotonic() - t0, 2)
    except (RuntimeError, TimeoutError) as e:  # the campaign goes on; the report names the failed restart
        rec["restart_error"] = str(e)[-2000:]


async def _link_down(link: Link, duration_s: float, rate: str, rec: dict, t0: float) -> None:
    await asyncio.to_thread(set_link_rate, link, ZERO_RATE)
    try:
        await asyncio.sleep(duration_s)
    finally:
        await asyncio.to_thread(set_link_rate, link, rate)
        rec["restored_at_s"] = round(time.monotonic() - t0, 2)
