"""Open-loop arrival processes: start times (seconds from the run's start) for ``n`` sessions.

| spec | process |
|---|---|
| ``poisson`` | exponential gaps with mean 1/rate |
| ``uniform`` | evenly spaced, gap 1/rate (the paper's case study) |
| ``bursty`` | on-off: exponential ON periods (mean ``on_s``) with Poisson arrivals at rate·(on+off)/on, |
|            | exponential OFF periods (mean ``off_s``) with none, so the long-run mean rate is ``rate`` |

Closed-loop concurrency has no arrival times; the runner handles it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ARRIVAL_KINDS = ("poisson", "uniform", "bursty")


@dataclass(frozen=True, slots=True)
class ArrivalSpec:
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
        """``n`` non-decreasing start times in seconds; the first is 0 for poisson/uniform."""
        if n == 0:
            return np.zeros(0)
        if self.kind == "uniform":
            return np.arange(n) / self.rate
        if self.kind == "poisson":
            gaps = rng.exponential(1.0 / self.rate, size=n)
            gaps[0] = 0.0
            return np.cumsum(gaps)
        return self._bursty(rng, n)

    def _bursty(self, rng: np.random.Generator, n: int) -> np.ndarray:
        # Walk ON/OFF periods; a Poisson process restricted to ON time is a Poisson process in
        # "ON-clock" time, so draw gaps in ON-time and map them onto wall time period by period.
        rate_on = self.rate * (self.on_s + self.off_s) / self.on_s
        out: list[float] = []
        wall = 0.0
        carry = rng.exponential(1.0 / rate_on)  # ON-time until the next arrival
        max_periods = 100 * n + 1000  # bounds the loop even for pathological periods
        for _ in range(max_periods):
            on = rng.exponential(self.on_s)
            t = 0.0
            while len(out) < n and t + carry <= on:
                t += carry
                out.append(wall + t)
                carry = rng.exponential(1.0 / rate_on)
            if len(out) >= n:
                break
            carry -= on - t
            wall += on + (rng.exponential(self.off_s) if self.off_s > 0 else 0.0)
        if len(out) < n:
            raise RuntimeError("bursty arrival generation did not converge; check --burst-on/--burst-off")
        return np.asarray(out)
