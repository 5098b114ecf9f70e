"""The generated command lines stay what users type: the flags of the router, the `--prfaas-*` SGLang flags
and the load generator, compared with a snapshot taken before their three generators became one
(`prfaas_sgl/cliargs.py`). Regenerate the snapshot only for a deliberate flag change:
``python tests/fast/test_cli_flags.py > tests/fast/data/cli_flags.json``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SNAPSHOT = Path(__file__).parent / "data" / "cli_flags.json"
# Flags added since the snapshot, on purpose: PolicyParams' pacing knobs became router flags when the
# router's policy settings started to be generated from PolicyParams (before, only /admin/routing set them).
# The supervisor actuator's flags: the controller acts on servers `prfaas up` owns.
# --prfaas-unified-pool: one slab for KV and linear-attention states.
# --prfaas-layerwise-*: layer-group streaming of a prompt's KV while later layers compute (off by default).
# --prfaas-optimistic-max-held-tokens: a cap on what optimistic prefill holds ahead of its decodes.
# --prfaas-tier-*: host and storage tiers below the prfaas_hybrid device pool (off by default), the key that
# signs their entries, and their write-through to a shared store.
# The router's admission limits (requests at once, body bytes in flight, body deadline) and its per-instance
# circuit breaker.
# The PrfaaS prefills' KV streaming settings (chunk size, layer-wise groups), for the router's remote estimate.
# The shared store tier across clusters: its members, its modelled size, and the pricing of a prefix load.
# --prfaas-cpu-query-only-attention: CPU extend attention over the new queries only, as GPU backends compute it.
ADDED = {"router": {"--pace-max-s", "--pace-step-s", "--actuator", "--supervisor-urls", "--supervisor-token",
                    "--switch-confirm", "--switch-dwell-s", "--max-concurrent-requests", "--max-body-bytes-in-flight",
                    "--body-timeout-s", "--breaker-failures", "--breaker-cooldown-s", "--store-instances",
                    "--store-capacity-tokens", "--fetch-gbps", "--fetch-rtt-s", "--fetch-grid-tokens",
                    "--chunk-tokens", "--attention-layers", "--layerwise-layers-per-group", "--layerwise-min-tokens"},
         "prfaas": {"--prfaas-unified-pool", "--prfaas-layerwise-layers-per-group", "--prfaas-layerwise-min-tokens",
                    "--prfaas-optimistic-max-held-tokens",
                    "--prfaas-tier-host-bytes", "--prfaas-tier-storage", "--prfaas-tier-storage-path",
                    "--prfaas-tier-storage-bytes", "--prfaas-tier-mooncake-master", "--prfaas-tier-mooncake-metadata",
                    "--prfaas-tier-key", "--prfaas-tier-publish", "--prfaas-cpu-query-only-attention"}}


def _action(a: argparse.Action, group: str) -> dict:
    typ = a.type if a.type is None else getattr(a.type, "__qualname__", repr(a.type))
    return {"dest": a.dest, "default": repr(a.default), "type": typ, "nargs": a.nargs, "const": repr(a.const),
            "action": type(a).__name__, "choices": None if a.choices is None else list(a.choices),
            "help": a.help, "required": a.required, "metavar": a.metavar, "group": group}


def _describe(p: argparse.ArgumentParser) -> dict:
    out = {}
    for g in p._action_groups:
        for a in g._group_actions:
            if not isinstance(a, argparse._HelpAction):
                out[" ".join(a.option_strings)] = _action(a, g.title or "")
    return out


def parsers() -> dict[str, argparse.ArgumentParser]:
    from prfaas_sgl import config as prfaas_config
    from prfaas_sgl.tools.loadgen.config import add_arguments
    from prfaas_sgl.router.config import build_parser

    plugin, bench = argparse.ArgumentParser(prog="t"), argparse.ArgumentParser(prog="t")
    prfaas_config.add_flags(plugin)
    add_arguments(bench)
    return {"router": build_parser(), "prfaas": plugin, "loadgen": bench}


def snapshot() -> dict:
    return {name: _describe(p) for name, p in parsers().items()}


def test_flags_unchanged():
    want, got = json.loads(SNAPSHOT.read_text()), snapshot()
    for name, flags in want.items():
        assert set(got[name]) - set(flags) == ADDED.get(name, set()), name
        for flag, spec in flags.items():
            assert got[name].get(flag) == spec, (name, flag)


if __name__ == "__main__":
    json.dump(snapshot(), sys.stdout, indent=1, sort_keys=True)
    print()
