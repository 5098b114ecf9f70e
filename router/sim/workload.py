"""Simulated requests from the shared workload models (``prfaas_sgl.workload``): Poisson, on-off
(2-state MMPP) or phased arrivals with synthetic prefix sharing, or a Mooncake-style trace, whose
hash_ids are block hashes, so requests sharing leading ids share a prefix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from prfaas_sgl.workload import arrivals, traces
from prfaas_sgl.workload.lengths import LengthDist

from ..planner.curves import ProfileError

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
    fetch_s: float = 0.0  # seconds its prefill spends loading the prefix credited from the shared store
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
        return arrivals.poisson(rng, cfg.rate, until=duration_s)
    return arrivals.onoff(rng, cfg.rate_on, cfg.rate_off, cfg.mean_on_s, cfg.mean_off_s, until=duration_s)


@dataclass(frozen=True, slots=True)
class PrefixConfig:
    """Synthetic prefix sharing: with probability hit_rate a request opens with up to cached_fraction of its
    prompt taken from one of ``groups`` shared documents (chosen uniformly)."""

    hit_rate: float = 0.0
    cached_fraction: float = 0.0
    groups: int = 64


def synthetic(cfg: ArrivalConfig, pfx: PrefixConfig, lengths: LengthDist, output_tokens: int,
              duration_s: float, seed: int, phases: tuple[tuple[float, float, float], ...] = (), *,
              block_tokens: int = 512) -> list[SimRequest]:
    """Requests of ``cfg``'s arrival process; ``phases`` ((start_s, rate req/s, length scale), ...) replace it
    with piecewise Poisson arrivals whose sampled input lengths are multiplied by the phase's scale (a traffic
    shift: short-heavy, then long-heavy hours). One hash per ``block_tokens`` (the simulator's block size)."""
    rng = np.random.default_rng(seed)
    if phases:
        times, scale = arrivals.phased(rng, phases, duration_s)
    else:
        times = arrival_times(cfg, duration_s, rng)
        scale = np.ones(times.size)
    hi = getattr(lengths, "hi", np.inf)
    lens = np.maximum(1, np.rint(np.minimum(lengths.sample(rng, times.size) * scale, hi))).astype(int)
    shared = rng.random(times.size) < pfx.hit_rate
    group = rng.integers(0, max(pfx.groups, 1), times.size)
    reqs, unique = [], 1 << 40  # group g's block i hashes to g * 2^20 + i; unique ids start far above
    for i, (t, n) in enumerate(zip(times, lens)):
        blocks = -(-int(n) // block_tokens)
        k = int(pfx.cached_fraction * n) // block_tokens if shared[i] else 0
        hashes = tuple(int(group[i]) * (1 << 20) + j for j in range(k)) + tuple(range(unique, unique + blocks - k))
        unique += blocks - k
        reqs.append(SimRequest(i, float(t), int(n), int(output_tokens), hashes))
    return reqs


def read_trace(path: Path, limit: int = 10**9, time_scale: float = 1.0) -> list[SimRequest]:
    """A Mooncake-style JSONL trace (``prfaas_sgl.workload.traces``) as requests, timestamps (ms) times
    ``time_scale``; a bad line raises ProfileError with its line number."""
    path = Path(path)
    if not path.is_file():
        raise ProfileError(f"trace file {str(path)!r} not found")
    try:
        records = traces.read_trace(path, limit)
    except traces.TraceError as e:
        raise ProfileError(str(e)) from e
    return [SimRequest(i, r.timestamp_ms / 1000.0 * time_scale, r.input_length, r.output_length, r.hash_ids)
            for i, r in enumerate(records)]
