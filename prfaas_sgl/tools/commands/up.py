"""`prfaas up --config FILE [--machine NAME]`: start this machine's share of a deployment."""
from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("up", help="start the servers and router of a deployment file placed on this machine")
    p.add_argument("--config", required=True, help="deployment TOML (see docs/deploy-two-datacenters.toml)")
    p.add_argument("--machine", default=None, help="start only what is placed on this machine (default: all)")
    p.add_argument("--log-dir", default="out/up", help="server and router logs")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from prfaas_sgl.tools.deploy import config, up

    try:
        dep = config.load(args.config)
    except (ValueError, TypeError, OSError) as e:
        print(f"prfaas up: {args.config}: {e}")
        return 2
    return up.run(dep, args.machine, Path(args.log_dir))
