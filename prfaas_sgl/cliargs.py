"""Command-line flags generated from a frozen config dataclass: one flag per field, help from the field.

The one generator behind the router's flags (`router/config.py`), the plugin's `--prfaas-*` SGLang flags
(`prfaas_sgl/config.py`) and the load generator's (`prfaas_sgl/tools/loadgen/config.py`). Each field's
``metadata["help"]`` is the help text; ``metadata["choices"]``, when set, the allowed values. No torch, no
sglang: the plugin module imports this in every SGLang process.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, fields, is_dataclass
from typing import Any, get_type_hints

NO_RENAME: Mapping[str, str] = {}


def field_default(f: Field) -> Any:
    return f.default_factory() if f.default is MISSING and f.default_factory is not MISSING else f.default


def add_fields(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type, *, prefix: str = "",
               dest_prefix: str = "", rename: Mapping[str, str] = NO_RENAME, default: Any = MISSING,
               switch: str | type[argparse.Action] = argparse.BooleanOptionalAction, help_suffix: str = "",
               by_type: Callable[[Any], dict[str, Any] | None] = lambda hint: None) -> None:
    """Add ``--<prefix><name>`` (dest ``<dest_prefix><name>``) for every field of the dataclass ``cls``; a
    field holding a dataclass (a nested sub-config) adds its fields' flags instead, with the same options.

    ``rename`` maps a field to another flag/dest name; ``default`` overrides every field's own default
    (``argparse.SUPPRESS``: absent flags stay out of the namespace); ``switch`` is the action of bool
    fields; ``by_type`` returns the argparse keywords for a field type it handles (None: ``type=hint``).
    """
    opts = dict(prefix=prefix, dest_prefix=dest_prefix, rename=rename, default=default, switch=switch,
                help_suffix=help_suffix, by_type=by_type)
    hints = get_type_hints(cls)
    for f in fields(cls):
        name, hint = rename.get(f.name, f.name), hints[f.name]
        if is_dataclass(hint):
            add_fields(parser, hint, **opts)
            continue
        kw: dict[str, Any] = {"help": f.metadata["help"] + help_suffix,
                              "default": field_default(f) if default is MISSING else default}
        if f.metadata.get("choices"):
            kw["choices"] = f.metadata["choices"]
        special = by_type(hint)
        if special is not None:
            kw.update(special)
        elif hint is bool:
            kw["action"] = switch
        else:
            kw["type"] = hint
        parser.add_argument("--" + prefix + name.replace("_", "-"), dest=dest_prefix + name, **kw)


def dest_names(cls: type, *, dest_prefix: str = "", rename: Mapping[str, str] = NO_RENAME) -> list[str]:
    """The dests ``add_fields`` gives ``cls``'s flags, nested sub-configs' included."""
    hints = get_type_hints(cls)
    return [d for f in fields(cls) for d in (dest_names(hints[f.name], dest_prefix=dest_prefix, rename=rename)
            if is_dataclass(hints[f.name]) else [dest_prefix + rename.get(f.name, f.name)])]


def field_values(ns: argparse.Namespace | Mapping[str, Any], cls: type, *, dest_prefix: str = "",
                 rename: Mapping[str, str] = NO_RENAME) -> dict[str, Any]:
    """The fields of ``cls`` found in ``ns`` (as ``add_fields`` named them), keyed by field name."""
    values = ns if isinstance(ns, Mapping) else vars(ns)
    dests = {f.name: dest_prefix + rename.get(f.name, f.name) for f in fields(cls)}
    return {name: values[dest] for name, dest in dests.items() if dest in values}
