"""Whether a class implements a ``typing.Protocol`` with the protocol's signatures, not only its names.

``runtime_checkable`` isinstance checks only that the members exist; a renamed parameter, a dropped
argument, a sync ``apply`` where the caller awaits, or another return type pass it and fail in production.
``mismatches`` compares each member with ``inspect`` and the resolved type hints instead.
"""

from __future__ import annotations

import inspect
import typing


def _methods(proto: type) -> dict[str, typing.Callable]:
    return {k: v for k, v in vars(proto).items() if inspect.isfunction(v) and not k.startswith("_")}


def _attributes(proto: type) -> dict[str, object]:
    return {k: v for k, v in typing.get_type_hints(proto).items() if not k.startswith("_")}


def _params(fn: typing.Callable) -> list[inspect.Parameter]:
    return list(inspect.signature(fn).parameters.values())[1:]  # without self


def _method_mismatches(name: str, want: typing.Callable, got: object) -> list[str]:
    if not inspect.isfunction(got):
        return [f"{name}: not a method"]
    out = []
    if inspect.iscoroutinefunction(want) != inspect.iscoroutinefunction(got):
        out.append(f"{name}: {'async' if inspect.iscoroutinefunction(want) else 'sync'} in the protocol")
    want_hints, got_hints = typing.get_type_hints(want), typing.get_type_hints(got)
    wp, gp = _params(want), _params(got)
    for w, g in zip(wp, gp):
        if (w.name, w.kind) != (g.name, g.kind):
            out.append(f"{name}: parameter {g.name} ({g.kind.description}) where the protocol has {w.name} "
                       f"({w.kind.description})")
        elif (w.default is inspect.Parameter.empty) != (g.default is inspect.Parameter.empty):
            out.append(f"{name}: parameter {w.name} {'has' if g.default is not g.empty else 'lacks'} a default")
        elif want_hints.get(w.name) != got_hints.get(g.name):
            out.append(f"{name}: parameter {w.name} is {got_hints.get(g.name)}, not {want_hints.get(w.name)}")
    out += [f"{name}: missing parameter {w.name}" for w in wp[len(gp):]]
    out += [f"{name}: extra parameter {g.name} without a default" for g in gp[len(wp):]
            if g.default is inspect.Parameter.empty and g.kind not in (g.VAR_POSITIONAL, g.VAR_KEYWORD)]
    if want_hints.get("return") != got_hints.get("return"):
        out.append(f"{name}: returns {got_hints.get('return')}, not {want_hints.get('return')}")
    return out


def mismatches(impl: type, proto: type) -> list[str]:
    """How ``impl`` departs from ``proto``, one line each; empty when it conforms. An attribute must be set on
    the class (so it is there before ``__init__`` runs) with a value of the annotated type."""
    out = []
    for name, hint in _attributes(proto).items():
        if not hasattr(impl, name):
            out.append(f"{name}: missing attribute")
        elif isinstance(hint, type) and not isinstance(getattr(impl, name), hint):
            out.append(f"{name}: {getattr(impl, name)!r} is not a {hint.__name__}")
    for name, want in _methods(proto).items():
        out += _method_mismatches(name, want, inspect.getattr_static(impl, name, None))
    return out
