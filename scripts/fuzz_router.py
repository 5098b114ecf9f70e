"""Fuzz the router's HTTP API from docs/openapi.yaml for longer than the fast test does (not a test).

Same cases and rig as tests/fast/test_router_fuzz.py (router + stand-in servers in this process); instead of
stopping at the first failure it counts every answer and prints one JSON document:
statuses per case kind, every input-caused 5xx (first 20 with their inputs), RSS growth (with hypothesis's own bookkeeping, and on a replay of the same requests: the router's),
leftover state.

    python scripts/fuzz_router.py --examples 5000 --seed 1 --out out/fuzz_router.json
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.fast.test_router_fuzz import (VALID_CHAT, Case, FuzzRig, load_spec,  # noqa: E402
                                         replay_growth, rss_bytes, run_fuzz)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--examples", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="", help="also write the JSON here")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rig = FuzzRig(Path(tmp))
        try:
            report = fuzz(rig, args.examples, args.seed)
        finally:
            rig.close()
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        Path(args.out).write_text(text + "\n")
    sys.exit(1 if report["server_errors"] or not report["serving_after"] else 0)


def fuzz(rig: FuzzRig, examples: int, seed: int) -> dict:
    counts: collections.Counter[str] = collections.Counter()
    errors: list[dict] = []
    sent: list[Case] = []

    def record(case: Case, status: int, body: bytes) -> None:
        sent.append(case)
        counts[f"{case.kind} {case.method} {case.path} {status}"] += 1
        if status >= 500:
            errors.append({"case": repr(case), "status": status,
                           "body": body[:500].decode(errors="replace")})

    for _ in range(20):
        rig.send(VALID_CHAT)
    gc.collect()
    rss0, state0, t0 = rss_bytes(), rig.state(), time.monotonic()
    run_fuzz(rig, load_spec(), examples, seed, record, shrink=False)
    elapsed = time.monotonic() - t0
    serving = rig.send(Case("GET", "/health", None, "get"))[0] == 200 and rig.send(VALID_CHAT)[0] == 200
    gc.collect()
    growth, state = rss_bytes() - rss0, rig.state()
    replay = replay_growth(rig, sent, lambda *_: None)
    return {"examples": examples, "seed": seed, "seconds": round(elapsed, 1), "requests": sum(counts.values()),
            "server_errors": len(errors),
            "first_server_errors": errors[:20], "serving_after": serving,
            "rss_growth_mib": round(growth / 2**20, 1), "rss_growth_on_replay_mib": round(replay / 2**20, 1),
            "state_before": state0, "state_after": state, "counts": dict(sorted(counts.items()))}


if __name__ == "__main__":
    main()
