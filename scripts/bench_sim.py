"""Wall time to simulate one hour of paper-scale traffic (~12K requests). Seeded; prints JSON.

    python3 scripts/bench_sim.py [--rate 3.3] [--policy bandwidth_aware] [--controller] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from prfaas_sgl.router.planner import load_scenario
from prfaas_sgl.router.sim.config import sim_config
from prfaas_sgl.router.sim.run import build

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default=str(ROOT / "scenarios" / "paper_case_study.toml"))
    ap.add_argument("--rate", type=float, default=3.3, help="Poisson req/s (3.3 x 3600 s ~ 12K requests)")
    ap.add_argument("--policy", default="bandwidth_aware")
    ap.add_argument("--controller", action="store_true")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    scn = load_scenario(args.scenario)
    cfg = sim_config({**scn.sim, "arrival": {"kind": "poisson", "rate": args.rate}}, policy=args.policy,
                     duration_s=3600.0, controller=args.controller or None)
    runs = []
    for _ in range(max(args.repeat, 1)):
        t0 = time.perf_counter()
        sim = build(scn, cfg)  # includes workload generation
        sim.run()
        runs.append(time.perf_counter() - t0)
    done = sum(r.decode_end == r.decode_end for r in sim.reqs)
    print(json.dumps({"scenario": scn.name, "policy": args.policy, "controller": cfg.controller,
                      "requests": len(sim.reqs), "completed": done, "simulated_s": 3600.0,
                      "wall_s": runs, "best_wall_s": min(runs)}))


if __name__ == "__main__":
    main()
