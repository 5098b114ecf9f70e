"""Simulator settings: the scenario's [sim] table (plus command-line overrides) as one frozen dataclass."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from prfaas_sgl.cliargs import FieldError, field_default, flag_fields, nested, same_names

from ..actuators.decide import DecideConfig
from ..controller import ControllerConfig
from ..cost import STREAMING_FLAGS, Streaming
from ..planner.curves import ProfileError
from ..policy import PolicyParams
from .workload import ArrivalConfig, PrefixConfig


@dataclass(frozen=True, slots=True)
class SimConfig:
    duration_s: float = 3600.0  # arrivals stop here (synthetic kinds)
    drain_s: float = 900.0  # then at most this long to finish in-flight work
    seed: int = 1
    policy: str = "threshold"  # a name in prfaas_sgl.router.policy.POLICIES
    threshold: float = -1.0  # tokens, replaces policy_params.threshold; < 0 = the planner's optimum
    # the policy's other tunables, the router's defaults; flat [sim] keys of the same names
    policy_params: PolicyParams = nested(PolicyParams(), same_names(PolicyParams, but=("threshold",)))
    controller: bool = False  # run the long-term controller on simulated time
    controller_params: ControllerConfig = nested(ControllerConfig(), {
        "interval_s": "controller_interval_s", "max_step_frac": "controller_max_step_frac",
        "window": "controller_window"})
    actuate: bool = False  # the controller also moves local servers between prefill and decode
    switch_s: float = 180.0  # a moved server's restart time after its drain (model load, warm-up)
    switch_params: DecideConfig = nested(DecideConfig(), same_names(DecideConfig))  # [sim] dwell_s, confirm, max_step
    prefill: int = -1  # local prefill instances; < 0 = the planner's split
    slo_ttft_s: float = 15.0
    slo_tpot_s: float = 0.05
    sample_s: float = 10.0  # time-series resolution
    cache_blocks: int = 0  # prefix-cache capacity per instance in blocks (0 = no prefix cache)
    block_tokens: int = 512
    # how the PrfaaS prefills stream KV (cost.Streaming, the servers' settings): only its tail follows prefill
    kv_stream: Streaming = nested(Streaming(), STREAMING_FLAGS)
    bandwidth_trace: tuple[tuple[float, float], ...] = ()  # (time_s, fraction of link.gbps), step function
    phases: tuple[tuple[float, float, float], ...] = ()  # (start_s, Poisson rate, length scale): replaces arrival
    arrival: ArrivalConfig = field(default_factory=ArrivalConfig)
    prefix: PrefixConfig = field(default_factory=PrefixConfig)

    def __post_init__(self) -> None:
        if self.duration_s <= 0 or self.drain_s < 0 or self.sample_s <= 0:
            raise ProfileError("sim.duration_s and sim.sample_s must be > 0, sim.drain_s >= 0")
        if self.slo_ttft_s <= 0 or self.slo_tpot_s <= 0:
            raise ProfileError("sim.slo_ttft_s and sim.slo_tpot_s must be > 0 seconds")
        if self.cache_blocks < 0 or self.block_tokens < 1:
            raise ProfileError("sim.cache_blocks must be >= 0, sim.block_tokens >= 1")
        times = [t for t, _ in self.bandwidth_trace]
        if any(f <= 0 for _, f in self.bandwidth_trace) or times != sorted(times):
            raise ProfileError("sim.bandwidth_trace: expected [[time_s, fraction > 0], ...] sorted by time")
        starts = [p[0] for p in self.phases]
        if any(len(p) != 3 or p[1] <= 0 or p[2] <= 0 for p in self.phases) or starts != sorted(starts):
            raise ProfileError("sim.phases: expected [[start_s, rate > 0, length scale > 0], ...] sorted by time")
        if self.switch_s < 0:
            raise ProfileError("sim.switch_s must be >= 0 seconds")


TABLES = {"arrival": ArrivalConfig, "prefix": PrefixConfig}  # [sim.arrival], [sim.prefix]


def _coerce(name: str, value, default):
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ProfileError(f"sim.{name}: expected true/false, got {value!r}")
        return value
    if isinstance(default, (int, float)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ProfileError(f"sim.{name}: expected a number, got {value!r}")
        return type(default)(value)
    if isinstance(default, str):
        return str(value)
    return value


def _sub(cls, tbl: dict, where: str):
    known = {f.name: f for f in fields(cls)}
    for k in tbl:
        if k not in known:
            raise ProfileError(f"{where}.{k}: unknown setting; expected one of {sorted(known)}")
    kw = {k: _coerce(f"{where[4:]}.{k}" if where != "sim" else k, v, known[k].default) for k, v in tbl.items()}
    return cls(**kw)


def sim_config(tbl: dict, **overrides) -> SimConfig:
    """Build from a scenario's [sim] table; ``overrides`` (not None) win. threshold = "auto" -> -1. A nested
    sub-config's settings are flat keys ([sim] dwell_s sets ``switch_params.dwell_s``)."""
    tbl = dict(tbl)
    if tbl.get("threshold") == "auto":
        tbl["threshold"] = -1.0
    top = {name: _sub(cls, tbl.pop(name, {}), f"sim.{name}") for name, cls in TABLES.items()}
    top["bandwidth_trace"] = tuple((float(t), float(f)) for t, f in tbl.pop("bandwidth_trace", ()))
    top["phases"] = tuple(tuple(float(x) for x in p) for p in tbl.pop("phases", ()))
    keys = {ff.key: ff for ff in flag_fields(SimConfig)}
    for k in tbl:
        if k not in keys:
            raise ProfileError(f"sim.{k}: unknown setting; expected one of {sorted(set(keys) - set(top))}")
    given = [(k, _coerce(k, v, keys[k].default)) for k, v in tbl.items()]  # the file's values, type-checked
    given += [(k, v) for k, v in overrides.items() if v is not None]  # the caller's, as given
    sub: dict[str, dict] = {}
    for k, v in given:
        ff = keys.get(k)  # None: an unknown override, refused by SimConfig below
        if ff is not None and ff.path:
            sub.setdefault(ff.path, {})[ff.name] = v
        else:
            top[k] = v
    top.update({path: _nested(path, values, keys) for path, values in sub.items()})
    return SimConfig(**top)


def _nested(path: str, values: dict, keys: dict):
    """``SimConfig.<path>``'s default sub-config with ``values``; a refusal names the [sim] key."""
    default = next(field_default(f) for f in fields(SimConfig) if f.name == path)
    try:
        return replace(default, **values)
    except FieldError as e:
        key = next((k for k, ff in keys.items() if (ff.path, ff.name) == (path, e.field)), e.field)
        raise ProfileError(f"sim.{key}: {e}") from e
