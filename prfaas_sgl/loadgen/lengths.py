"""Token-length distributions for synthetic workloads.

Spec strings (CLI form), lengths in tokens *before* the workload's scale factor:

| spec | meaning |
|---|---|
| ``fixed:N`` | always N |
| ``uniform:LO:HI`` | integer uniform on [LO, HI] |
| ``lognormal:MU:SIGMA:LO:HI`` | log-normal(MU, SIGMA) truncated to [LO, HI] (the paper: 9.9:1.0:128:131072) |
| ``paper`` | shorthand for ``lognormal:9.9:1.0:128:131072`` |

Sampling multiplies by ``scale`` after truncation and rounds, never below 1 token, so a 1/64 demo keeps the
shape of the distribution (bounds become [2, 2048]).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import Protocol

import numpy as np

PAPER_INPUT = "lognormal:9.9:1.0:128:131072"
_STD_NORMAL = NormalDist()


class LengthDist(Protocol):
    def sample(self, rng: np.random.Generator, n: int, scale: float = 1.0) -> np.ndarray:
        """``n`` lengths (int64 tokens, >= 1) scaled by ``scale``."""
        ...

    def mean(self) -> float:
        """Expected length before scaling and rounding (tokens)."""
        ...

    def upper(self) -> int:
        """Largest length the distribution can produce before scaling (tokens)."""
        ...


def _scaled(x: np.ndarray, scale: float) -> np.ndarray:
    return np.maximum(1, np.rint(x * scale)).astype(np.int64)


@dataclass(frozen=True, slots=True)
class Fixed:
    n: int

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"fixed length must be >= 1 token, got {self.n}")

    def sample(self, rng: np.random.Generator, n: int, scale: float = 1.0) -> np.ndarray:
        return _scaled(np.full(n, float(self.n)), scale)

    def mean(self) -> float:
        return float(self.n)

    def upper(self) -> int:
        return self.n


@dataclass(frozen=True, slots=True)
class Uniform:
    lo: int
    hi: int

    def __post_init__(self) -> None:
        if not 1 <= self.lo <= self.hi:
            raise ValueError(f"uniform needs 1 <= LO <= HI, got {self.lo}:{self.hi}")

    def sample(self, rng: np.random.Generator, n: int, scale: float = 1.0) -> np.ndarray:
        return _scaled(rng.integers(self.lo, self.hi + 1, size=n).astype(float), scale)

    def mean(self) -> float:
        return (self.lo + self.hi) / 2

    def upper(self) -> int:
        return self.hi


@dataclass(frozen=True, slots=True)
class TruncLogNormal:
    """exp(N(mu, sigma)) conditioned on [lo, hi]; sampled by inverse CDF, so no rejection loop."""

    mu: float
    sigma: float
    lo: int
    hi: int

    def __post_init__(self) -> None:
        if self.sigma <= 0:
            raise ValueError(f"lognormal sigma must be > 0, got {self.sigma}")
        if not 1 <= self.lo < self.hi:
            raise ValueError(f"lognormal needs 1 <= LO < HI, got {self.lo}:{self.hi}")
        if self._cdf_bounds()[1] - self._cdf_bounds()[0] < 1e-12:
            raise ValueError("lognormal truncation window holds no probability mass; widen LO:HI or move MU")

    def _cdf_bounds(self) -> tuple[float, float]:
        a = (math.log(self.lo) - self.mu) / self.sigma
        b = (math.log(self.hi) - self.mu) / self.sigma
        return _STD_NORMAL.cdf(a), _STD_NORMAL.cdf(b)

    def sample(self, rng: np.random.Generator, n: int, scale: float = 1.0) -> np.ndarray:
        pa, pb = self._cdf_bounds()
        u = rng.uniform(pa, pb, size=n)
        # inv_cdf rejects exactly 0 or 1; the clip only matters for windows reaching float limits.
        u = np.clip(u, 1e-300, 1 - 1e-16)
        z = np.array([_STD_NORMAL.inv_cdf(float(p)) for p in u])
        x = np.clip(np.exp(self.mu + self.sigma * z), self.lo, self.hi)
        return _scaled(x, scale)

    def mean(self) -> float:
        a = (math.log(self.lo) - self.mu) / self.sigma
        b = (math.log(self.hi) - self.mu) / self.sigma
        num = _STD_NORMAL.cdf(b - self.sigma) - _STD_NORMAL.cdf(a - self.sigma)
        den = _STD_NORMAL.cdf(b) - _STD_NORMAL.cdf(a)
        return math.exp(self.mu + self.sigma**2 / 2) * num / den

    def upper(self) -> int:
        return self.hi


def parse_length_dist(spec: str) -> LengthDist:
    """Parse a spec string (see module docstring); errors name the expected form."""
    if spec == "paper":
        spec = PAPER_INPUT
    kind, _, rest = spec.partition(":")
    parts = rest.split(":") if rest else []
    try:
        if kind == "fixed" and len(parts) == 1:
            return Fixed(int(parts[0]))
        if kind == "uniform" and len(parts) == 2:
            return Uniform(int(parts[0]), int(parts[1]))
        if kind == "lognormal" and len(parts) == 4:
            return TruncLogNormal(float(parts[0]), float(parts[1]), int(parts[2]), int(parts[3]))
    except ValueError as e:
        raise ValueError(f"bad length spec {spec!r}: {e}") from e
    raise ValueError(
        f"bad length spec {spec!r}: use fixed:N, uniform:LO:HI, lognormal:MU:SIGMA:LO:HI or paper"
    )
