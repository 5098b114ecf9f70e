"""Build and run one simulation from a scenario; the entry point of `prfaas simulate` and the studies."""

from __future__ import annotations

from dataclasses import asdict, replace

from ..planner.optimize import plan_homogeneous, plan_prfaas
from ..planner.scenario import Scenario
from .config import SimConfig
from .engine import Simulator
from .metrics import summarize
from .workload import PrefixConfig, read_trace, synthetic


def workload(scn: Scenario, cfg: SimConfig):
    """Requests and the arrival window (s)."""
    if cfg.arrival.kind == "trace":
        reqs = read_trace(scn.base_dir / cfg.arrival.path, time_scale=cfg.arrival.time_scale)
        window = max((r.arrival for r in reqs), default=0.0) or 1.0
        return reqs, window
    pfx = cfg.prefix if cfg.prefix.hit_rate > 0 else PrefixConfig(scn.hit_rate, scn.cached_fraction)
    reqs = synthetic(cfg.arrival, pfx, scn.raw_lengths, int(scn.system.output_tokens), cfg.duration_s, cfg.seed,
                     cfg.phases, block_tokens=cfg.block_tokens)
    return reqs, cfg.duration_s


def build(scn: Scenario, cfg: SimConfig) -> Simulator:
    """local_only runs on the homogeneous baseline cluster; every other policy on the PrfaaS-PD one."""
    homog = cfg.policy == "local_only"
    sys = replace(scn.baseline, remote=None, n_remote=0) if homog else scn.system
    plan = plan_homogeneous(scn.baseline) if homog else plan_prfaas(scn.system, scn.fixed_split)
    split = (plan.stages.n_p, plan.stages.n_d)
    if cfg.prefill >= 0:
        split = (cfg.prefill, sys.n_local - cfg.prefill)
    threshold = cfg.threshold if cfg.threshold >= 0 else min(plan.stages.t, 1e12)
    reqs, _ = workload(scn, cfg)
    return Simulator(sys, cfg, split, threshold, reqs)


def simulate(scn: Scenario, cfg: SimConfig) -> dict:
    sim = build(scn, cfg)
    _, window = (None, max((r.arrival for r in sim.reqs), default=1.0)) if cfg.arrival.kind == "trace" \
        else (None, cfg.duration_s)
    t0 = float(sim.policy.threshold)
    wall = sim.run()
    split = (sum(s.pool == "local_prefill" for s in sim.prefill.values()), len(sim.decode))
    doc = summarize(sim.reqs, sim.samples, cfg, window, wall, t0, split)
    doc["scenario"] = scn.name
    doc["switches"] = [asdict(sw) for sw in sim.mover.done] if sim.mover is not None else []
    return doc
