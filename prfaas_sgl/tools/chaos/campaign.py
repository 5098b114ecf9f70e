"""One whole campaign run: link, servers, references, router, load + faults, recovery probes, report.

    start 5 servers (PD x4 + colocated) ---- references on colocated as soon as it is up; then stop it
    router ---- t0: load (plan) || faults (schedule) ---- all restarts healthy ---- recovery probes

Needs root (network namespace + tc). Everything started here is stopped, and the link removed, in
`finally` blocks, also when the run fails.
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import subprocess
import time
from pathlib import Path

from prfaas_sgl.tools.models.tiny import ensure
from prfaas_sgl.tools.netns import emulated_link, root_problem
from prfaas_sgl.transfer.security import generate_keys

from .config import CampaignConfig
from .outcome import count
from .plan import PlannedRequest, make_plan, make_probes
from .reference import references
from .runner import LoadRun, run_faults, run_load
from .schedule import make_schedule
from .topology import PD_ROLES, Fleet, server_specs, start_router

MODEL = "tiny-qwen35-hybrid"


def run_campaign(cfg: CampaignConfig, log_dir: Path) -> dict:
    """Runs the campaign; returns the report (see `report`). Raises RuntimeError when it cannot run."""
    problem = root_problem()
    if problem:
        raise RuntimeError(f"the fault campaign {problem}")
    log_dir.mkdir(parents=True, exist_ok=True)
    model = str(ensure(MODEL))
    keys = str(log_dir / "keys") if cfg.curve else None
    if keys:
        generate_keys(keys)
    clock, commit = {"start": time.monotonic()}, _commit()  # the code the servers start with
    with emulated_link(cfg.link_rate, tag=f"c{os.getpid() % 100000}") as link:
        fleet = Fleet.start(server_specs(cfg, link, model, log_dir, keys))
        try:
            plan, refs = _prepare(cfg, fleet, clock)
            return {"commit": commit, **asyncio.run(_serve(cfg, fleet, link, plan, refs, model, log_dir, clock))}
        finally:
            fleet.stop_all()


def _prepare(cfg: CampaignConfig, fleet: Fleet, clock: dict) -> tuple[tuple[PlannedRequest, ...], dict]:
    """References from the colocated server (while the PD servers still start), then stop it."""
    full = make_plan(cfg.load_spec(), cfg.seed) + make_probes(cfg.load_spec(), cfg.seed, cfg.recovery_probes)
    url = fleet.servers["colocated"].wait_healthy(600).url
    plan, refs = references(url, full, cfg.max_new_tokens)
    fleet.stop("colocated")  # frees a server's CPU and memory for the run
    clock["refs_done"] = time.monotonic()
    for name in PD_ROLES:
        fleet.servers[name].wait_healthy(600)
    clock["servers_up"] = time.monotonic()
    return plan, refs


async def _serve(cfg, fleet, link, plan, refs, model, log_dir, clock) -> dict:
    router = start_router(cfg, fleet.specs, model, log_dir)
    try:
        await asyncio.to_thread(router.wait_healthy, 60.0)
        load, probes = plan[:cfg.n_requests], plan[cfg.n_requests:]
        schedule = make_schedule(cfg.schedule_spec(), cfg.seed)
        t0 = clock["t0"] = time.monotonic()
        run = LoadRun()
        _, faults = await asyncio.gather(run_load(router.url, load, refs, cfg, t0, run),
                                         run_faults(fleet, link, schedule, t0, cfg.link_rate, run))
        clock["load_done"] = time.monotonic()
        await asyncio.sleep(2 * cfg.health_interval_s + 1)  # the router's probes see restarted servers again
        rec = LoadRun()
        await run_load(router.url, probes, refs, dataclasses.replace(cfg, max_inflight=1), time.monotonic(), rec)
        clock["end"] = time.monotonic()
        return report(cfg, run, rec, schedule, faults, refs, clock, log_dir)
    finally:
        router.stop(grace_s=5.0)


def report(cfg, run, rec, schedule, faults, refs, clock, log_dir) -> dict:
    counts, recovery = count(run.sent, run.results), count(rec.sent, rec.results)
    t = {k: round(v - clock["start"], 1) for k, v in clock.items()}
    return {
        "config": dataclasses.asdict(cfg), "bound_s": cfg.bound_s,
        "client_timeout_s": cfg.client_timeout_s, "counts": counts.to_json(), "recovery": recovery.to_json(),
        "clean": counts.clean and recovery.clean and recovery.by_outcome["ok"] == len(rec.sent),
        "schedule": [e.to_json() for e in schedule], "faults": faults, "timeline_s": t,
        "reference": {"redraws": sum(r.redraws for r in refs.values()),
                      "min_margin": min(r.min_margin for r in refs.values())},
        "log_dir": str(log_dir), "log_tracebacks": tracebacks(log_dir),
        "results": [r.to_json() for r in sorted(run.results, key=lambda r: r.index)],
        "recovery_results": [r.to_json() for r in rec.results],
    }


def tracebacks(log_dir: Path) -> dict[str, int]:
    """Python tracebacks per server/router log: where to look first when a count is not 0."""
    out = {}
    for p in sorted(log_dir.glob("*.log")):
        n = len(re.findall(r"^Traceback ", p.read_text(errors="replace"), flags=re.M))
        if n:
            out[p.name] = n
    return out


def _commit() -> str:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parent)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True, cwd=Path(__file__).resolve().parent).stdout.strip()
    return r.stdout.strip() + ("+dirty" if dirty else "")
