"""Scenario files (TOML): hardware and model profiles, cluster sizes, link, workload.

Every bad field raises ``ProfileError`` naming the field and what is expected. Layout (see
scenarios/paper_case_study.toml for a commented example):

  [model]            kv_tokens + kv_mib | kv_fixed_mib + kv_bytes_per_token | kv_tokens + phi_gbps + phi_hardware
                     | config (a config.json or model directory) + optional kv_dtype  (model_config.py)
  [hardware.<name>]  prefill_tokens + prefill_s | prefill_poly; decode_max_batch, decode_step_s
  [prfaas]           hardware, instances           (instances = 0: no PrfaaS cluster)
  [local]            hardware, instances, optional prefill + decode (a fixed split)
  [baseline]         hardware, instances           (homogeneous PD of equal cost)
  [link]             gbps
  [workload]         output_tokens; [workload.input] kind = lognormal | samples | histogram | trace;
                     optional [workload.prefix] hit_rate, cached_fraction
  [sim]              simulator settings (read by prfaas_sgl.router.sim.config)
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from prfaas_sgl.workload.lengths import Empirical, SplitDist, TruncLogNormal
from prfaas_sgl.workload.traces import TraceError, TraceRecord, read_trace

from ..kv_accounting import KVAccount
from .curves import Curve, ProfileError
from .model import Hardware, System
from .model_config import kv_curve, read_account

MIB = 1024 * 1024


def num(tbl: dict, key: str, where: str, *, lo: float | None = None, default=None, integer=False) -> float:
    """Read a number; ``lo`` is an exclusive lower bound unless it is 0 for integers (then >= 0)."""
    v = tbl.get(key, default)
    name = f"{where}.{key}" if where else key
    if v is None:
        raise ProfileError(f"{name}: missing; expected a {'whole ' if integer else ''}number")
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and int(v) != v):
        raise ProfileError(f"{name}: expected a {'whole ' if integer else ''}number, got {v!r}")
    if lo is not None and (v < lo if integer else v <= lo):
        raise ProfileError(f"{name}: expected {'>=' if integer else '>'} {lo}, got {v}")
    return int(v) if integer else float(v)


def nums(tbl: dict, key: str, where: str) -> tuple[float, ...]:
    v = tbl.get(key)
    if not isinstance(v, list) or not v or not all(isinstance(x, (int, float)) for x in v):
        raise ProfileError(f"{where}.{key}: expected a non-empty list of numbers, got {v!r}")
    return tuple(float(x) for x in v)


def section(doc: dict, key: str, where: str = "") -> dict:
    v = doc.get(key)
    if not isinstance(v, dict):
        raise ProfileError(f"{where + '.' if where else ''}{key}: missing table [{key}]")
    return v


def _curve(tbl: dict, where: str, xkey: str, ykey: str, polykey: str) -> Curve:
    if polykey in tbl:
        return Curve(poly=nums(tbl, polykey, where), field=f"{where}.{polykey}")
    if xkey not in tbl or ykey not in tbl:
        raise ProfileError(f"{where}: expected {xkey} + {ykey} (a table) or {polykey} (a polynomial)")
    return Curve(nums(tbl, xkey, where), nums(tbl, ykey, where), field=f"{where}.{ykey}")


def load_hardware(name: str, tbl: dict, lo: float, hi: float) -> Hardware:
    where = f"hardware.{name}"
    pre = _curve(tbl, where, "prefill_tokens", "prefill_s", "prefill_poly")
    pre.require_increasing(lo, hi)
    step = None
    if "decode_step_s" in tbl:
        s = tbl["decode_step_s"]
        step = (Curve(nums(tbl, "decode_batch", where), nums(tbl, "decode_step_s", where),
                      field=f"{where}.decode_step_s") if isinstance(s, list)
                else Curve(poly=(num(tbl, "decode_step_s", where, lo=0),), field=f"{where}.decode_step_s"))
    mb = num(tbl, "decode_max_batch", where, lo=0, default=0, integer=True)
    return Hardware(name, pre, mb, step, num(tbl, "gpus_per_instance", where, lo=1, default=8, integer=True))


def load_kv(model: dict, hw: dict[str, Hardware], lo: float, hi: float,
            acct: KVAccount | None = None) -> Curve:
    if acct is not None:
        kv = kv_curve(acct)
    elif "kv_fixed_mib" in model:
        fixed = num(model, "kv_fixed_mib", "model", lo=0, default=0)
        per_tok = num(model, "kv_bytes_per_token", "model", lo=0)
        kv = Curve(poly=(fixed * MIB, per_tok), field="model.kv_bytes_per_token")
    elif "phi_gbps" in model:
        xs = nums(model, "kv_tokens", "model")
        ref = hw.get(model.get("phi_hardware", ""))
        if ref is None:
            raise ProfileError(f"model.phi_hardware: expected one of {sorted(hw)} (S_kv = Φ_kv · T_prefill)")
        phi = nums(model, "phi_gbps", "model")
        if len(phi) != len(xs) or min(phi) <= 0:
            raise ProfileError("model.phi_gbps: expected one value > 0 per kv_tokens entry")
        kv = Curve(xs, tuple(p * 1e9 / 8 * ref.prefill_s.at(x) for p, x in zip(phi, xs)), field="model.phi_gbps")
    else:
        kv = _curve(model, "model", "kv_tokens", "kv_mib", "kv_mib_poly").scaled(MIB, "model.kv_mib")
    kv.require_increasing(lo, hi)
    return kv


def load_lengths(wl: dict, base: Path) -> SplitDist:
    inp = section(wl, "input", "workload")
    kind, where = inp.get("kind"), "workload.input"
    try:
        if kind == "lognormal":
            return TruncLogNormal(num(inp, "mu", where), num(inp, "sigma", where, lo=0),
                                  num(inp, "min", where, lo=0), num(inp, "max", where, lo=0))
        if kind == "samples":
            return Empirical.from_samples(nums(inp, "samples", where))
        if kind == "histogram":
            return Empirical.from_histogram(nums(inp, "edges", where), nums(inp, "counts", where))
        if kind == "trace":
            return Empirical.from_samples([r.input_length for r in _trace(base / str(inp.get("path", "")),
                                                                          int(inp.get("limit", 10**9)))])
    except ProfileError:
        raise
    except ValueError as e:  # the workload models' own checks; name the scenario table
        raise ProfileError(f"{where}.{e}" if kind in ("samples", "histogram") else f"{where}: {e}") from e
    raise ProfileError(f"{where}.kind: expected lognormal | samples | histogram | trace, got {kind!r}")


def _trace(path: Path, limit: int) -> list[TraceRecord]:
    """A trace's records (the simulator reads the same files through the same parser)."""
    if not path.is_file():
        raise ProfileError(f"trace file {str(path)!r} not found")
    try:
        return read_trace(path, limit)
    except TraceError as e:
        raise ProfileError(str(e)) from e


def with_prefix_hits(dist: SplitDist, hit_rate: float, cached_fraction: float) -> SplitDist:
    """Distribution of the *uncached* length when a fraction ``hit_rate`` of requests find
    ``cached_fraction`` of their prompt cached (the planner models hits where the request is computed)."""
    if hit_rate <= 0 or cached_fraction <= 0:
        return dist
    v, w = dist.grid()
    return Empirical.from_samples(np.concatenate([v, v * (1 - cached_fraction)]),
                                  np.concatenate([w * (1 - hit_rate), w * hit_rate]))


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    system: System  # the PrfaaS-PD deployment
    baseline: System  # homogeneous PD of (about) equal cost
    fixed_split: tuple[int, int] | None
    raw_lengths: SplitDist  # before prefix hits (the simulator samples prompts from this)
    hit_rate: float
    cached_fraction: float
    sim: dict = field(default_factory=dict)  # raw [sim] table
    base_dir: Path = Path(".")
    account: KVAccount | None = None  # the bytes derived from [model] config, when it names one


def _cluster(doc: dict, key: str, hw: dict[str, Hardware], allow_zero: bool) -> tuple[Hardware | None, int, dict]:
    tbl = section(doc, key)
    n = num(tbl, "instances", key, lo=0 if allow_zero else 1, integer=True)
    name = tbl.get("hardware")
    if name not in hw:
        raise ProfileError(f"{key}.hardware: expected one of {sorted(hw)}, got {name!r}")
    return hw[name], n, tbl


def _fixed_split(local: dict, n_local: int) -> tuple[int, int] | None:
    if "prefill" not in local and "decode" not in local:
        return None
    n_p = num(local, "prefill", "local", lo=0, integer=True)
    n_d = num(local, "decode", "local", lo=1, integer=True)
    if n_p + n_d != n_local:
        raise ProfileError(f"local.prefill + local.decode: expected to sum to local.instances = {n_local}, "
                           f"got {n_p} + {n_d} = {n_p + n_d}")
    return n_p, n_d


def parse_scenario(doc: dict, name: str = "scenario", base_dir: Path = Path(".")) -> Scenario:
    """Build a Scenario from a parsed TOML/JSON document."""
    wl = section(doc, "workload")
    raw = load_lengths(wl, base_dir)
    lo, hi = max(raw.lo, 1.0), raw.hi
    hw_tbl = section(doc, "hardware")
    hw = {k: load_hardware(k, v, lo, hi) for k, v in hw_tbl.items() if isinstance(v, dict)}
    if not hw:
        raise ProfileError("hardware: expected at least one [hardware.<name>] table")
    model = section(doc, "model")
    acct = read_account(model, base_dir) if "config" in model else None
    kv = load_kv(model, hw, lo, hi, acct)
    remote, n_remote, _ = _cluster(doc, "prfaas", hw, allow_zero=True)
    local, n_local, local_tbl = _cluster(doc, "local", hw, allow_zero=False)
    base_hw, n_base, _ = _cluster(doc, "baseline", hw, allow_zero=False) if "baseline" in doc else (local, n_local, {})
    gbps = num(section(doc, "link"), "gbps", "link", lo=0)
    out = num(wl, "output_tokens", "workload", lo=0)
    prefix = wl.get("prefix", {})
    hit = num(prefix, "hit_rate", "workload.prefix", default=0.0)
    frac = num(prefix, "cached_fraction", "workload.prefix", default=0.0)
    if not (0 <= hit <= 1 and 0 <= frac < 1):
        raise ProfileError("workload.prefix: expected 0 <= hit_rate <= 1 and 0 <= cached_fraction < 1")
    dist = with_prefix_hits(raw, hit, frac)
    local.decode_rps(out)  # raises when the local hardware cannot decode
    base_hw.decode_rps(out)
    sys = System(kv, local, n_local, remote, n_remote, gbps * 1e9 / 8, out, dist)
    base = System(kv, base_hw, n_base, None, 0, gbps * 1e9 / 8, out, dist)
    sim = doc.get("sim", {})
    return Scenario(str(doc.get("name", name)), sys, base, _fixed_split(local_tbl, n_local), raw, hit, frac,
                    sim if isinstance(sim, dict) else {}, base_dir, acct)


def load_scenario(path: str | Path, model_config: str | Path | None = None, kv_dtype: str | None = None) -> Scenario:
    """Read a .toml (or .json) scenario file. `model_config` (a config.json or model directory) replaces
    its [model] table: S_kv then comes from the model's layers (model_config.py); `kv_dtype` sets its
    [model] kv_dtype (the KV element type of a config-derived S_kv)."""
    p = Path(path)
    if not p.is_file():
        raise ProfileError(f"scenario file {str(p)!r} not found")
    text = p.read_text()
    try:
        doc = json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise ProfileError(f"{p}: not valid {'JSON' if p.suffix == '.json' else 'TOML'}: {e}") from e
    if model_config is not None:
        doc["model"] = {"config": str(Path(model_config).resolve())}
    if kv_dtype is not None and isinstance(doc.get("model"), dict):
        doc["model"]["kv_dtype"] = kv_dtype
    return parse_scenario(doc, p.stem, p.parent)
