"""`prfaas` command line: dispatches to one module per subcommand (prfaas_sgl.tools.commands.*)."""

from __future__ import annotations

import argparse
import importlib

SUBCOMMANDS = ("plan", "simulate", "bench", "up", "keys", "render")  # module names under prfaas_sgl.tools.commands


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prfaas", description="Prefill-as-a-Service tools")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMANDS:
        importlib.import_module(f"prfaas_sgl.tools.commands.{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
