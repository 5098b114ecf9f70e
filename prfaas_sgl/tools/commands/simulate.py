"""`prfaas simulate SCENARIO`: discrete-event simulation with the router's own policies."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from prfaas_sgl.router.planner import ProfileError, load_scenario
from prfaas_sgl.router.planner.model_config import add_model_args
from prfaas_sgl.router.policy import POLICIES
from prfaas_sgl.router.sim.config import sim_config


def add_parser(sub) -> None:
    p = sub.add_parser("simulate", help="discrete-event simulation of both clusters and the link")
    p.add_argument("scenario", help="scenario file (.toml or .json) with an optional [sim] table")
    add_model_args(p)
    p.add_argument("--policy", choices=sorted(POLICIES), help="routing policy (default: the scenario's)")
    p.add_argument("--rate", type=float, help="Poisson arrival rate, req/s (overrides [sim.arrival])")
    p.add_argument("--trace", help="Mooncake-style JSONL trace (timestamp ms, input_length, output_length, hash_ids)")
    p.add_argument("--duration", type=float, help="seconds of arrivals (synthetic workloads)")
    p.add_argument("--threshold", type=float, help="tokens (default: the planner's optimum)")
    p.add_argument("--controller", action="store_true", help="run the long-term controller")
    p.add_argument("--seed", type=int)
    p.add_argument("--json", action="store_true", help="print the full JSON result (with time series)")
    p.add_argument("--out", type=Path, help="write result.json and timeseries.png here")
    p.set_defaults(func=run)


def _config(args, scn):
    over = {"policy": args.policy, "duration_s": args.duration, "threshold": args.threshold, "seed": args.seed,
            "controller": True if args.controller else None}
    cfg = sim_config(scn.sim, **over)
    if args.rate is not None:
        cfg = replace(cfg, arrival=replace(cfg.arrival, kind="poisson", rate=args.rate))
    if args.trace is not None:
        cfg = replace(cfg, arrival=replace(cfg.arrival, kind="trace", path=str(Path(args.trace).resolve())))
    return cfg


def run(args: argparse.Namespace) -> int:
    from prfaas_sgl.router.sim.run import simulate

    try:
        scn = load_scenario(args.scenario, args.model_config, args.kv_dtype)
        doc = simulate(scn, _config(args, scn))
    except ProfileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.out is not None:
        from prfaas_sgl.router.sim.plots import plot_timeseries

        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "result.json").write_text(json.dumps(doc, indent=1))
        plot_timeseries({doc["config"]["policy"]: doc}, args.out / "timeseries.png", scn.name)
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        print(json.dumps({"scenario": doc["scenario"], "config": doc["config"], "totals": doc["totals"]}, indent=1))
    return 0
