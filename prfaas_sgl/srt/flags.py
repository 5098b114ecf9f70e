"""The `--prfaas-*` flag group on SGLang's ServerArgs, and where the parsed `PrfaasConfig` lives.

Its own module, apart from `compat` (which registers these hooks): the transfer backend reads the config
back (`get_config`) while `compat` loads the backend, so both depend on this module and not on each other.
"""
from __future__ import annotations

from prfaas_sgl import config as prfaas_config

CONFIG_ATTR = "_prfaas_config"  # underscore attrs survive ServerArgs pickling and its post-resolve seal


def after_add_cli_args(result, parser, *args, **kwargs):
    prfaas_config.add_flags(parser)
    parser.set_defaults(_prfaas_parser=parser)  # lets from_cli_args report errors the argparse way
    return result


def around_from_cli_args(original, cls, ns, *args, **kwargs):
    server_args = original(cls, ns, *args, **kwargs)
    try:
        cfg = prfaas_config.from_namespace(ns)
    except ValueError as e:
        parser = getattr(ns, "_prfaas_parser", None)
        if parser is None:
            raise
        parser.error(str(e))  # exits 2 with usage and the message naming the flag
    setattr(server_args, CONFIG_ATTR, cfg)
    return server_args


def get_config(server_args) -> prfaas_config.PrfaasConfig:
    """The server's PrfaasConfig (defaults when the server was built without the CLI, e.g. Engine())."""
    return getattr(server_args, CONFIG_ATTR, None) or prfaas_config.PrfaasConfig()
