"""`prfaas render TARGET --config DEPLOY.toml --out DIR`: write what an operator deploys around a deployment file.

One module per target (``TARGETS``); each has ``render(dep, out: Path) -> list[Path]`` and derives everything
from the same deployment file `prfaas up` reads, so targets, ports and keys never drift from the servers.
"""
from __future__ import annotations

import argparse
import importlib
from pathlib import Path

# target name -> module with render(dep, out) -> list[Path]
TARGETS = {
    "k8s": "prfaas_sgl.tools.deploy.k8s",
    "prometheus": "prfaas_sgl.tools.deploy.prometheus",
}


def add_parser(sub) -> None:
    p = sub.add_parser("render", help="write manifests/configs derived from a deployment file")
    p.add_argument("target", choices=sorted(TARGETS), help="what to render")
    p.add_argument("--config", required=True, help="deployment TOML (see docs/deploy-two-datacenters.toml)")
    p.add_argument("--out", required=True, help="output directory")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from prfaas_sgl.tools.deploy import config

    try:
        dep = config.load(args.config)
    except (ValueError, TypeError, OSError) as e:
        print(f"prfaas render: {args.config}: {e}")
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    written = importlib.import_module(TARGETS[args.target]).render(dep, out)
    for path in written:
        print(path)
    return 0
