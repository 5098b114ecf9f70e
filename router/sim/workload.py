"""Simulated requests and their arrival processes: Poisson, on-off (2-state MMPP), Mooncake-style trace.

Trace format (JSONL, one request per line): ``{"timestamp": ms, "input_length": int, "output_length": int,
"hash_ids": [int, ...]}``; hash_ids are block hashes, so requests sharing leading ids share a prefix.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..planner.curves import ProfileError
from ..planner.lengths import LengthDist

NAN = math.nan


@dataclass(slots=True)
class SimRequest:
    """One request and, once simulated, its timeline (seconds of simulated time)."""

    rid: int
    arrival: float
    input_len: int
    output_len: int
    hashes: tuple[int, ...]  # block hashes of the prompt, leading ones shared between requests
    route: str = ""
    reason: str = ""
    prefill: str = ""
    decode: str = ""
    incremental: int = 0
    kv_bytes: float = 0.0  # bytes crossing the inter-DC link (0 for local prefill)
    held_s: float = 0.0  # seconds pacing held it at the router before its route was decided
    prefill_start: float = NAN
    prefill_end: float = NAN
    link_done: float = NAN
    kv_ready: float = NAN
    decode_start: float = NAN
    decode_end: float = NAN


@dataclass(frozen=True, slots=True)
class ArrivalConfig:
    """kind: poisson (rate) | onoff (rate_on/rate_off, exponential mean_on_s/mean_off_s) | trace (path)."""

    kind: str = "poisson"
    rate: float = 1.0  # req/s
    rate_on: float = 0.0
    rate_off: float = 0.0
    mean_on_s: float = 60.0
    mean_off_s: float = 60.0
    path: str = ""
    time_scale: float = 1.0  # trace timestamps are multiplied by this (0.5 = twice the load)

    def __post_init__(self) -> None:
        if self.kind not in ("poisson", "onoff", "trace"):
            raise ProfileError(f"sim.arrival.kind: expected poisson | onoff | trace, got {self.kind!r}")
        if self.kind == "poisson" and self.rate <= 0:
            raise ProfileError(f"sim.arrival.rate: expected > 0 req/s, got {self.rate}")
        if self.kind == "onoff" and (min(self.rate_on, self.rate_off) < 0 or self.rate_on <= 0
                                     or min(self.mean_on_s, self.mean_off_s) <= 0):
            raise ProfileError("sim.arrival: onoff needs rate_on > 0, rate_off >= 0, mean_on_s/mean_off_s > 0")
        if self.kind == "trace" and (not self.path or self.time_scale <= 0):
            raise ProfileError("sim.arrival.path: a trace needs a JSONL path and time_scale > 0")


def arrival_times(cfg: ArrivalConfig, duration_s: float, rng: np.random.Generator) -> np.ndarray:
    """Sorted arrival times in [0, duration_s) for the synthetic kinds."""
    if cfg.kind == "poisson":
        n = rng.poisson(cfg.rate * duration_s)
        return np.sort(rng.uniform(0.0, duration_s, n))
    out, t, on = [], 0.0, True
    while t < duration_s:  # alternate exponential on/off periods; Poisson within each
        span = min(rng.exponential(cfg.mean_on_s if on else cfg.mean_off_s), duration_s - t)
        rate = cfg.rate_on if on else cfg.rate_off
        out.append(t + np.sort(rng.uniform(0.0, span, rng.poisson(rate * span))))
        t, on = t + span, not on
    return np.concatenate(out) if out else np.zeros(0)


@dataclass(frozen=True, slots=True)
class PrefixConfig:
    """Synthetic prefix sharing: with probability hit_rate a request opens with up to cached_fraction of its
    prompt taken from one of ``groups`` shared documents (chosen uniformly)."""

    hit_rate: float = 0.0
    cached_fraction: float = 0.0
    groups: int = 64
    block_tokens: int = 512


def synthetic(cfg: ArrivalConfig, pfx: PrefixConfig, lengths: LengthDist, output_tokens: int,
              duration_s: float, seed: int, phases: tuple[tuple[float, float, float], ...] = ()) -> list[SimRequest]:
    """Requests of ``cfg``'s arrival process; ``phases`` ((start_s, rate req/s, length scale), ...) replace it
    with piecewise Poisson arrivals whose sampled input lengths are multiplied by the phase's scale (a traffic
    shift: short-heavy, then long-heavy hours)."""
    rng = np.random.default_rng(seed)
    if phases:
        times, scale = phased_times(phases, duration_s, rng)
    else:
        times = arrival_times(cfg, duration_s, rng)
        scale = np.ones(times.size)
    hi = getattr(lengths, "hi", np.inf)
    lens = np.maximum(1, np.rint(np.minimum(lengths.sample(rng, times.size) * scale, hi))).astype(int)
    shared = rng.random(times.size) < pfx.hit_rate
    group = rng.integers(0, max(pfx.groups, 1), times.size)
    reqs, unique = [], 1 << 40  # group g's block i hashes to g * 2^20 + i; unique ids start far above
    for i, (t, n) in enumerate(zip(times, lens)):
        blocks = -(-int(n) // pfx.block_tokens)
        k = int(pfx.cached_fraction * n) // pfx.block_tokens if shared[i] else 0
        hashes = tuple(int(group[i]) * (1 << 20) + j for j in range(k)) + tuple(range(unique, unique + blocks - k))
        unique += blocks - k
        reqs.append(SimRequest(i, float(t), int(n), int(output_tokens), hashes))
    return reqs


def phased_times(phases: tuple[tuple[float, float, float], ...], duration_s: float,
                 rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(sorted arrival times in [0, duration_s), each one's length scale) of piecewise Poisson phases."""
    times, scales = [], []
    for i, (start, rate, scale) in enumerate(phases):
        end = min(phases[i + 1][0] if i + 1 < len(phases) else duration_s, duration_s)
        if end <= start:
            continue
        t = np.sort(rng.uniform(start, end, rng.poisson(rate * (end - start))))
        times.append(t)
        scales.append(np.full(t.size, scale))
    if not times:
        return np.zeros(0), np.zeros(0)
    return np.concatenate(times), np.concatenate(scales)


def _field(obj: dict, key: str, lineno: int, path: Path) -> int:
    v = obj.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
        raise ProfileError(f"{path}:{lineno}: field {key!r} must be a number >= 0, got {v!r}")
    return int(v)


def read_trace(path: Path, limit: int = 10**9, time_scale: float = 1.0) -> list[SimRequest]:
    """Parse a Mooncake-style JSONL trace; a bad line raises ProfileError with its line number."""
    path = Path(path)
    if not path.is_file():
        raise ProfileError(f"trace file {str(path)!r} not found")
    reqs: list[SimRequest] = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if len(reqs) >= limit:
                break
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ProfileError(f"{path}:{lineno}: not valid JSON ({e.msg})") from e
            if not isinstance(obj, dict):
                raise ProfileError(f"{path}:{lineno}: expected a JSON object")
            hashes = obj.get("hash_ids", [])
            if not isinstance(hashes, list) or not all(isinstance(h, int) for h in hashes):
                raise ProfileError(f"{path}:{lineno}: field 'hash_ids' must be a list of integers")
            ts = _field(obj, "timestamp", lineno, path) / 1000.0 * time_scale
            reqs.append(SimRequest(len(reqs), ts, max(1, _field(obj, "input_length", lineno, path)),
                                   max(1, _field(obj, "output_length", lineno, path)), tuple(hashes)))
    reqs.sort(key=lambda r: r.arrival)
    for i, r in enumerate(reqs):
        r.rid = i
    return reqs
