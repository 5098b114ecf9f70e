#!/usr/bin/env python3
"""Write a seeded Mooncake-style trace (JSONL: timestamp ms, input_length, output_length, hash_ids).

Uses the load generator's synthetic workload, so multi-turn sessions and shared system prompts show up
as shared leading hash ids. Example (paper lengths, Poisson 2 req/s, 4 turns, 4 shared 2K prefixes):
    python scripts/make_trace.py --out trace.jsonl --num-sessions 50 --rate 2 --turns 4 \
        --think-time 5 --shared-prefix 2048 --prefix-groups 4 --seed 1
"""

import argparse
import sys

from prfaas_sgl.tools.loadgen.workload import SyntheticSpec, synthesize, to_trace
from prfaas_sgl.workload.arrivals import ARRIVAL_KINDS, ArrivalSpec
from prfaas_sgl.workload.traces import write_trace


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="output .jsonl path")
    p.add_argument("--num-sessions", type=int, default=100)
    p.add_argument("--input-len", default="paper", help="length spec, see prfaas_sgl/workload/lengths.py")
    p.add_argument("--output-len", default="fixed:1024")
    p.add_argument("--scale", type=float, default=1.0, help="multiply lengths and the block size")
    p.add_argument("--turns", type=int, default=1)
    p.add_argument("--followup-len", default="fixed:256")
    p.add_argument("--think-time", type=float, default=0.0, help="seconds between turns")
    p.add_argument("--shared-prefix", type=int, default=0, help="shared system-prompt tokens")
    p.add_argument("--prefix-groups", type=int, default=1)
    p.add_argument("--block-size", type=int, default=512, help="tokens per hash id")
    p.add_argument("--max-context", type=int, default=131072, help="sessions end before passing this")
    p.add_argument("--arrival", choices=ARRIVAL_KINDS, default="poisson")
    p.add_argument("--rate", type=float, default=1.0, help="sessions/s")
    p.add_argument("--burst-on", type=float, default=5.0)
    p.add_argument("--burst-off", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    try:
        spec = SyntheticSpec(a.num_sessions, a.input_len, a.output_len, a.scale, a.turns, a.followup_len,
                             a.think_time, a.shared_prefix, a.prefix_groups, a.block_size,
                             a.max_context)
        workload = synthesize(spec, ArrivalSpec(a.arrival, a.rate, a.burst_on, a.burst_off), a.seed)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    n = write_trace(a.out, to_trace(workload))
    print(f"wrote {n} requests ({len(workload.sessions)} sessions, block size {workload.block_size}) to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
