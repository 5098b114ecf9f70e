#!/usr/bin/env python3
"""The fault campaign: router + real SGLang PD servers (prfaas_zmq, tiny hybrid model, CPU) under a
seeded load while a seeded schedule kills -9 and restarts the remote prefill, the local prefill and one
decode, and drops the emulated inter-DC link to zero. Needs root. See docs/reliability.md.

    sudo .venv/bin/python scripts/chaos.py --out out/chaos.json                # 200 requests over 12 min
    sudo .venv/bin/python scripts/chaos.py --preset ci --seed 3 --out ci.json  # the CI size: 50 over 220 s

Prints the counts; exits 0 only when there was no hang, wrong token, lost, late, dropped or unclear answer
and every recovery probe succeeded.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from prfaas_sgl.tools.chaos.campaign import run_campaign
from prfaas_sgl.tools.chaos.config import CI, FULL
from prfaas_sgl.tools.chaos.outcome import VIOLATIONS


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=("full", "ci"), default="full")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--requests", type=int, default=None, help="override the preset's request count")
    ap.add_argument("--span-s", type=float, default=None, help="override the preset's load duration")
    ap.add_argument("--no-curve", action="store_true", help="plaintext data plane")
    ap.add_argument("--out", default="out/chaos.json", help="JSON report")
    ap.add_argument("--log-dir", default=None, help="server/router logs (default: out/chaos-<time>)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    cfg = CI if args.preset == "ci" else FULL
    overrides = {"seed": args.seed, "curve": not args.no_curve}
    if args.requests is not None:
        overrides["n_requests"] = args.requests
    if args.span_s is not None:
        overrides["span_s"] = args.span_s
    cfg = dataclasses.replace(cfg, **overrides)
    log_dir = Path(args.log_dir or f"out/chaos-{time.strftime('%Y%m%d-%H%M%S')}")
    print(f"[chaos] {cfg.n_requests} requests over {cfg.span_s:.0f}s, seed {cfg.seed}, bound {cfg.bound_s:.0f}s, "
          f"logs {log_dir}", flush=True)
    rep = run_campaign(cfg, log_dir)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rep, indent=1))
    print_summary(rep)
    print(f"[chaos] report: {args.out}")
    return 0 if rep["clean"] else 1


def print_summary(rep: dict) -> None:
    c = rep["counts"]
    print(f"[chaos] commit {rep['commit']}  bound {rep['bound_s']:.0f}s  timeline {rep['timeline_s']}")
    for f in rep["faults"]:
        print(f"[chaos] fault {f}")
    print(f"[chaos] sent {c['sent']} = completed {c['completed']} + errored {c['errored']}"
          + "".join(f" + {v} {c[v]}" for v in VIOLATIONS) + f" + lost {c['lost']}")
    print(f"[chaos] errors by status {c['errors_by_status']}; ok by route {c['ok_by_route']}; "
          f"max elapsed {c['max_elapsed_s']}s")
    r = rep["recovery"]
    print(f"[chaos] recovery probes: {r['completed']}/{r['sent']} ok; log tracebacks {rep['log_tracebacks']}")
    for res in rep["results"]:
        if res["outcome"] in VIOLATIONS:
            print(f"[chaos] {res['outcome'].upper()} #{res['index']} {res['kind']} {res['n_tokens']} tok "
                  f"at {res['send_s']}s: {res['detail'][:300]}")
    print(f"[chaos] {'CLEAN' if rep['clean'] else 'NOT CLEAN'}")


if __name__ == "__main__":
    sys.exit(main())
