"""Open-loop arrival processes, shared by the load generator (the first ``n``) and the simulator (a window).

| process | times |
|---|---|
| ``poisson`` | per window [a, b): a Poisson(rate·(b−a)) count of sorted uniform times |
| ``uniform`` | evenly spaced, gap 1/rate (the paper's case study) |
| ``onoff`` | 2-state MMPP: exponential ON periods (mean ``mean_on_s``) at ``rate_on``, exponential OFF |
|           | periods (mean ``mean_off_s``) at ``rate_off``; ON first |
| ``phased`` | piecewise Poisson, ((start_s, rate, length scale), ...) |

Every process yields windows of wall time, drawn whole; ``n=`` takes windows until it has ``n`` times and
cuts, ``until=`` clips the last window at the horizon. ``ArrivalSpec`` is the load generator's CLI form
(``bursty`` = ``onoff`` with no OFF arrivals and the ON rate that keeps the long-run mean at ``rate``).
Closed-loop concurrency has no arrival times; the load generator's runner handles it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

ARRIVAL_KINDS = ("poisson", "uniform", "bursty")


def _window(rng: np.random.Generator, rate: float, start: float, span: float) -> np.ndarray:
    """Poisson arrivals on [start, start + span): the count, then sorted uniform offsets (this order of draws)."""
    return start + np.sort(rng.uniform(0.0, span, rng.poisson(rate * span)))


def _take(windows: Iterator[np.ndarray], n: int | None) -> np.ndarray:
    """All times of a finite window stream, or the first ``n`` of an endless one."""
    out, count = [], 0
    for w in windows:
        out.append(w)
        count += w.size
        if n is not None and count >= n:
            break
    times = np.concatenate(out) if out else np.zeros(0)
    return times[:n] if n is not None else times


def _horizon(n: int | None, until: float | None) -> float:
    if (n is None) == (until is None):
        raise ValueError("give exactly one of n= and until=")
    return math.inf if until is None else until


def poisson(rng: np.random.Generator, rate: float, *, n: int | None = None,
            until: float | None = None) -> np.ndarray:
    """Sorted Poisson arrival times (s): the first ``n``, or all in [0, until) from one window."""
    end = _horizon(n, until)
    span = until if until is not None else max(n, 1) / rate

    def windows() -> Iterator[np.ndarray]:
        t = 0.0
        while t < end:
            step = min(span, end - t)
            yield _window(rng, rate, t, step)
            t += step

    return _take(windows(), n)


def onoff(rng: np.random.Generator, rate_on: float, rate_off: float, mean_on_s: float, mean_off_s: float, *,
          n: int | None = None, until: float | None = None) -> np.ndarray:
    """Sorted on-off (2-state MMPP) arrival times (s); the first period is ON, the last one clipped at ``until``."""
    end = _horizon(n, until)

    def windows() -> Iterator[np.ndarray]:
        t, on = 0.0, True
        while t < end:
            span = min(rng.exponential(mean_on_s if on else mean_off_s), end - t)
            yield _window(rng, rate_on if on else rate_off, t, span)
            t, on = t + span, not on

    return _take(windows(), n)


def uniform(rate: float, *, n: int | None = None, until: float | None = None) -> np.ndarray:
    """Evenly spaced times k / rate (s), starting at 0."""
    end = _horizon(n, until)
    count = n if n is not None else math.ceil(end * rate)
    times = np.arange(count) / rate
    return times[times < end]


def phased(rng: np.random.Generator, phases: tuple[tuple[float, float, float], ...],
           until: float) -> tuple[np.ndarray, np.ndarray]:
    """(sorted times in [0, until), each one's length scale) of piecewise Poisson phases
    ((start_s, rate req/s, length scale), ...); a phase lasts until the next one starts."""
    times, scales = [], []
    for i, (start, rate, scale) in enumerate(phases):
        end = min(phases[i + 1][0] if i + 1 < len(phases) else until, until)
        if end <= start:
            continue
        t = _window(rng, rate, start, end - start)
        times.append(t)
        scales.append(np.full(t.size, scale))
    if not times:
        return np.zeros(0), np.zeros(0)
    return np.concatenate(times), np.concatenate(scales)


@dataclass(frozen=True, slots=True)
class ArrivalSpec:
    """The load generator's arrival flags; ``times`` gives ``n`` session start times."""

    kind: str
    rate: float  # mean sessions per second
    on_s: float = 5.0  # bursty only: mean ON period
    off_s: float = 5.0  # bursty only: mean OFF period

    def __post_init__(self) -> None:
        if self.kind not in ARRIVAL_KINDS:
            raise ValueError(f"arrival kind {self.kind!r} unknown; use one of {ARRIVAL_KINDS}")
        if self.rate <= 0:
            raise ValueError(f"arrival rate must be > 0 req/s, got {self.rate}")
        if self.kind == "bursty" and (self.on_s <= 0 or self.off_s < 0):
            raise ValueError("bursty arrivals need --burst-on > 0 and --burst-off >= 0 seconds")

    def times(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` non-decreasing start times in seconds, shifted so that the first is 0 (a run starts
        with its first session; the processes are memoryless, so the shift keeps their shape)."""
        if n == 0:
            return np.zeros(0)
        if self.kind == "uniform":
            t = uniform(self.rate, n=n)
        elif self.kind == "poisson":
            t = poisson(rng, self.rate, n=n)
        else:
            rate_on = self.rate * (self.on_s + self.off_s) / self.on_s
            t = onoff(rng, rate_on, 0.0, self.on_s, self.off_s, n=n)
        return t - t[0]
