"""Command-line flags generated from a frozen config dataclass: one flag per field, help from the field.

The one generator behind the router's flags (`router/config.py`), the plugin's `--prfaas-*` SGLang flags
(`prfaas_sgl/config.py`), the load generator's (`prfaas_sgl/tools/loadgen/config.py`) and the simulator's
flat [sim] keys (`router/sim/config.py`). Each field's ``metadata["help"]`` is the help text;
``metadata["choices"]``, when set, the allowed values. No torch, no sglang: the plugin module imports this in
every SGLang process.

A knob is declared once, in the dataclass that uses it (`PolicyParams`, `ModelCost`, `ControllerConfig`,
`DecideConfig`, `TransferConfig`). A process's config holds that dataclass as one field made by `nested`,
which names the sub-config's fields that get a flag and each flag's name: ``--switch-dwell-s`` sets
``DecideConfig.dwell_s``. A sub-config refuses a value with `FieldError`, naming its own field; `build`
re-raises it naming the flag.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields, replace
from types import MappingProxyType
from typing import Any, get_type_hints

NESTED = "flags"  # metadata key of a `nested` field: sub-config field -> its flag's name (snake_case)


def knob(default: Any, help: str, *, choices: tuple | None = None, secret: bool = False) -> Any:
    """A config field whose flag says ``help``; ``secret`` keeps its value out of repr."""
    return field(default=default, metadata={"help": help, "choices": choices}, repr=not secret)


def nested(default: Any, flags: Mapping[str, str]) -> Any:
    """A field holding the sub-config ``default`` (a frozen dataclass instance, also the flags' defaults):
    ``flags`` maps each of its fields that a flag sets to that flag's name; the others keep ``default``'s
    values."""
    return field(default_factory=lambda: default, metadata={NESTED: MappingProxyType(dict(flags))})


def same_names(cls: type, *, but: tuple[str, ...] = (), **renames: str) -> dict[str, str]:
    """For `nested`: every field of ``cls`` except ``but``, each under its own name or ``renames[field]``."""
    return {f.name: renames.get(f.name, f.name) for f in fields(cls) if f.name not in but}


class FieldError(ValueError):
    """A config dataclass refuses the value of its field ``field``; the message is in the class's own
    words (its field names). `build` re-raises it naming the flag that sets the field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def field_default(f: Field) -> Any:
    return f.default_factory() if f.default is MISSING and f.default_factory is not MISSING else f.default


@dataclass(frozen=True, slots=True)
class FlagField:
    """One flag and the one field it sets: ``cls``'s field ``name``, held by the owner's nested field
    ``path`` ("" for the owner's own field). ``key`` is the flag's snake_case name (its dest without a
    prefix, a --config key); ``default`` the value it has when the flag is absent."""

    key: str
    path: str
    cls: type
    name: str
    field: Field
    hint: Any
    default: Any


def flag_fields(cls: type) -> list[FlagField]:
    """Every flag of ``cls`` in declaration order, a `nested` sub-config's flags in its ``flags`` order."""
    out: list[FlagField] = []
    hints = get_type_hints(cls)
    for f in fields(cls):
        if NESTED not in f.metadata:
            out.append(FlagField(f.name, "", cls, f.name, f, hints[f.name], field_default(f)))
            continue
        sub = field_default(f)
        sub_fields, sub_hints = {g.name: g for g in fields(sub)}, get_type_hints(type(sub))
        out += [FlagField(key, f.name, type(sub), name, sub_fields[name], sub_hints[name], getattr(sub, name))
                for name, key in f.metadata[NESTED].items()]
    return out


def add_fields(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type, *, prefix: str = "",
               dest_prefix: str = "", default: Any = MISSING,
               switch: str | type[argparse.Action] = argparse.BooleanOptionalAction, help_suffix: str = "",
               by_type: Callable[[Any], dict[str, Any] | None] = lambda hint: None) -> None:
    """Add ``--<prefix><key>`` (dest ``<dest_prefix><key>``) for every flag of the dataclass ``cls``.

    ``default`` overrides every flag's default (``argparse.SUPPRESS``: absent flags stay out of the
    namespace); ``switch`` is the action of bool fields; ``by_type`` returns the argparse keywords for a
    field type it handles (None: ``type=hint``).
    """
    for ff in flag_fields(cls):
        kw: dict[str, Any] = {"help": ff.field.metadata["help"] + help_suffix,
                              "default": ff.default if default is MISSING else default}
        if ff.field.metadata.get("choices"):
            kw["choices"] = ff.field.metadata["choices"]
        special = by_type(ff.hint)
        if special is not None:
            kw.update(special)
        elif ff.hint is bool:
            kw["action"] = switch
        else:
            kw["type"] = ff.hint
        parser.add_argument("--" + prefix + ff.key.replace("_", "-"), dest=dest_prefix + ff.key, **kw)


def dest_names(cls: type, *, dest_prefix: str = "") -> list[str]:
    """The dests ``add_fields`` gives ``cls``'s flags."""
    return [dest_prefix + ff.key for ff in flag_fields(cls)]


def flag_name(key: str, prefix: str = "") -> str:
    return "--" + prefix + key.replace("_", "-")


def build(cls: type, values: argparse.Namespace | Mapping[str, Any], *, dest_prefix: str = "",
          prefix: str = "") -> Any:
    """``cls`` from flat flag values (dests as ``add_fields`` named them; other keys are ignored, absent
    flags keep their defaults). A sub-config's `FieldError` becomes a ValueError naming the flag."""
    values = values if isinstance(values, Mapping) else vars(values)
    given: dict[str, dict[str, Any]] = {}
    keys: dict[tuple[str, str], str] = {}
    for ff in flag_fields(cls):
        keys[ff.path, ff.name] = ff.key
        if dest_prefix + ff.key in values:
            given.setdefault(ff.path, {})[ff.name] = values[dest_prefix + ff.key]
    kw = given.pop("", {})
    for f in fields(cls):
        if f.name not in given:
            continue
        try:
            kw[f.name] = replace(field_default(f), **given[f.name])
        except FieldError as e:
            raise ValueError(f"{flag_name(keys[f.name, e.field], prefix)}: {e}") from e
    return cls(**kw)
