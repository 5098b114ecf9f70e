"""Every knob is declared once: in the dataclass that uses it (`PolicyParams`, `ModelCost`, `ControllerConfig`,
`DecideConfig`, `TransferConfig`), which a process's config (`RouterConfig`, `SimConfig`, `PrfaasConfig`) nests
instead of re-declaring its fields flat under other names. Each command-line flag (and each flat [sim] key)
sets exactly one dataclass field, and no field is set by two flags."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import fields, is_dataclass

import pytest

from prfaas_sgl import config as prfaas_config
from prfaas_sgl.cliargs import build, flag_fields
from prfaas_sgl.router.actuators.decide import DecideConfig
from prfaas_sgl.router.config import RouterConfig, build_parser
from prfaas_sgl.router.controller import ControllerConfig
from prfaas_sgl.router.cost import ModelCost
from prfaas_sgl.router.policy import PolicyParams
from prfaas_sgl.router.sim.config import SimConfig
from prfaas_sgl.tools.loadgen.config import BenchConfig, add_arguments
from prfaas_sgl.transfer.config import TransferConfig

OWNERS = (PolicyParams, ModelCost, ControllerConfig, DecideConfig, TransferConfig)
PROCESSES = (RouterConfig, SimConfig, prfaas_config.PrfaasConfig, BenchConfig)
# Same-named fields that are deliberately different knobs.
DISTINCT = {
    # the simulator's starting threshold, -1 = the planner's optimum; policy_params.threshold is no [sim] key
    ("SimConfig", "threshold"),
}


def _parsers() -> dict[str, tuple[argparse.ArgumentParser, type, str]]:
    plugin, bench = argparse.ArgumentParser(prog="t"), argparse.ArgumentParser(prog="t")
    prfaas_config.add_flags(plugin)
    add_arguments(bench)
    return {"router": (build_parser(), RouterConfig, ""), "prfaas": (plugin, prfaas_config.PrfaasConfig, "prfaas_"),
            "loadgen": (bench, BenchConfig, "")}


@pytest.mark.parametrize("name", ["router", "prfaas", "loadgen"])
def test_each_flag_sets_exactly_one_field(name):
    parser, cls, prefix = _parsers()[name]
    dests = [a.dest for a in parser._actions if not isinstance(a, argparse._HelpAction) and a.dest != "config"]
    by_dest = {prefix + ff.key: (ff.cls.__name__, ff.name) for ff in flag_fields(cls)}
    assert sorted(dests) == sorted(by_dest)  # no flag without its field, no field flag missing
    assert len(set(by_dest.values())) == len(by_dest)  # no field set by two flags


def test_each_sim_key_sets_exactly_one_field():
    owned = [(ff.cls.__name__, ff.name) for ff in flag_fields(SimConfig)]
    assert len(set(owned)) == len(owned)
    assert {"controller_interval_s", "controller_window", "dwell_s", "confirm", "max_step", "budget_s"} <= {
        ff.key for ff in flag_fields(SimConfig)}


def _nested_classes(cls: type) -> set[type]:
    return {type(ff.default) for ff in flag_fields(cls) if is_dataclass(ff.default)} | {
        type(f.default_factory()) for f in fields(cls) if f.default_factory is not dataclasses.MISSING}


def _default(f: dataclasses.Field):
    return f.default if f.default is not dataclasses.MISSING else dataclasses.MISSING


@pytest.mark.parametrize("cls", PROCESSES, ids=lambda c: c.__name__)
def test_no_knob_declared_twice(cls):
    """A process config's own field that repeats a knob's name (``dwell_s``), or ends with it and has its
    default (``switch_dwell_s = 600.0``), re-declares that knob: nest its owner instead."""
    repeats = []
    for owner in set(OWNERS) | _nested_classes(cls):
        for g in fields(owner):
            for f in fields(cls):
                if is_dataclass(f.type) or (cls.__name__, f.name) in DISTINCT:
                    continue
                same_default = _default(g) is dataclasses.MISSING or _default(f) == _default(g)
                if f.name == g.name or (f.name.endswith("_" + g.name) and same_default):
                    repeats.append(f"{cls.__name__}.{f.name} ~ {owner.__name__}.{g.name}")
    assert repeats == []


def _values(cfg, nests: set[str]) -> dict[tuple[str, str], object]:
    """The config's knobs: its own fields and its nested sub-configs' fields, by (nested field, name)."""
    out = {}
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if f.name in nests:
            out.update({(f.name, g.name): getattr(value, g.name) for g in fields(value)})
        else:
            out["", f.name] = value
    return out


def _other(value):
    """A valid value other than a numeric or tuple default."""
    if isinstance(value, tuple):
        return tuple(x * 1.5 + 1e-6 for x in value)
    return value + 1 if isinstance(value, int) else value * 1.5 if value > 0 else 0.5


@pytest.mark.parametrize("name", ["router", "prfaas"])
def test_a_flag_changes_exactly_its_field(name, tmp_path):
    parser, cls, prefix = _parsers()[name]
    base = {}
    if cls is RouterConfig:
        (tmp_path / "tokenizer.json").write_text("{}")
        base = dict(local_prefill=("http://h:1;bootstrap=8998",), decode=("http://h:2",),
                    tokenizer_path=str(tmp_path))
    flags = flag_fields(cls)
    nests = {ff.path for ff in flags if ff.path}
    default = _values(build(cls, {prefix + k: v for k, v in base.items()}, dest_prefix=prefix), nests)
    numeric = [ff for ff in flags if ff.key not in base and (type(ff.default) in (int, float) or (
        isinstance(ff.default, tuple) and ff.default and all(type(x) is float for x in ff.default)))]
    assert len(numeric) >= {RouterConfig: 30, prfaas_config.PrfaasConfig: 6}[cls]
    for ff in numeric:
        values = {prefix + k: v for k, v in {**base, ff.key: _other(ff.default)}.items()}
        got = _values(build(cls, values, dest_prefix=prefix), nests)
        assert {k for k, v in got.items() if default[k] != v} == {(ff.path, ff.name)}, ff.key
