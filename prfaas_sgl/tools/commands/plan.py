"""`prfaas plan SCENARIO`: the throughput-optimal threshold and split vs the two baselines."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from prfaas_sgl.router.planner import ProfileError, load_scenario
from prfaas_sgl.router.planner.model_config import add_model_args
from prfaas_sgl.router.planner.report import plan_doc, plan_table, write_plots


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="throughput model: optimal threshold/split vs baselines")
    p.add_argument("scenario", help="scenario file (.toml or .json)")
    add_model_args(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--out", type=Path, default=None, help="write lambda_vs_t.png / lambda_vs_split.png here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        scn = load_scenario(args.scenario, args.model_config, args.kv_dtype)
    except ProfileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    doc = plan_doc(scn)
    if args.out is not None:
        doc["plots"] = [str(p) for p in write_plots(scn, args.out)]
    print(json.dumps(doc, indent=2) if args.json else plan_table(doc))
    return 0
