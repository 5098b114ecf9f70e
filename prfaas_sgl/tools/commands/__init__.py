"""Subcommands of the `prfaas` CLI; each module has ``add_parser(subparsers)`` and ``run(args) -> int``."""
