"""Token-length distributions, shared by the load generator, the simulator and the planner.

Spec strings (the load generator's CLI form), lengths in tokens *before* any scale factor:

| spec | meaning |
|---|---|
| ``fixed:N`` | always N |
| ``uniform:LO:HI`` | integer uniform on [LO, HI] |
| ``lognormal:MU:SIGMA:LO:HI`` | log-normal(MU, SIGMA) truncated to [LO, HI] (the paper: 9.9:1.0:128:131072) |
| ``paper`` | shorthand for ``lognormal:9.9:1.0:128:131072`` |

``sample`` returns raw lengths (float tokens); ``scaled`` multiplies and rounds them, never below 1 token,
so a 1/64 demo keeps the shape of the distribution (bounds become [2, 2048]).

The planner also needs ``split(t)``: p = P(L > t), l_long = E[L | L > t], l_short = E[L | L <= t] (tokens),
and ``grid()``: support points with probabilities, for expectations of nonlinear functions (TTFT) and
quantiles. The truncated log-normal has them in closed form (normal CDF); ``Empirical`` is a weighted
sample (also built from a histogram). Errors are ``ValueError``; the planner adds the scenario field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Protocol

import numpy as np

PAPER_INPUT = "lognormal:9.9:1.0:128:131072"
_N = NormalDist()


class LengthDist(Protocol):
    lo: float
    hi: float

    @property
    def mean(self) -> float:
        """Expected length (tokens, before scaling and rounding)."""
        ...

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` raw lengths in tokens (float, within [lo, hi])."""
        ...


class SplitDist(LengthDist, Protocol):
    """What the planner needs on top of sampling: the split at a threshold and a probability grid."""

    def split(self, t: float) -> Split: ...
    def quantile(self, q: float) -> float: ...
    def grid(self) -> tuple[np.ndarray, np.ndarray]: ...


def scaled(x: np.ndarray, scale: float = 1.0) -> np.ndarray:
    """Lengths times ``scale``, rounded to int64 tokens, at least 1."""
    return np.maximum(1, np.rint(np.asarray(x, dtype=float) * scale)).astype(np.int64)


@dataclass(frozen=True, slots=True)
class Split:
    t: float
    p: float  # P(L > t)
    l_long: float  # E[L | L > t], tokens (0 when p == 0)
    l_short: float  # E[L | L <= t], tokens (0 when p == 1)


@dataclass(frozen=True, slots=True)
class Fixed:
    n: int

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"fixed length must be >= 1 token, got {self.n}")

    @property
    def lo(self) -> int:
        return self.n

    @property
    def hi(self) -> int:
        return self.n

    @property
    def mean(self) -> float:
        return float(self.n)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.full(n, float(self.n))


@dataclass(frozen=True, slots=True)
class Uniform:
    lo: int
    hi: int

    def __post_init__(self) -> None:
        if not 1 <= self.lo <= self.hi:
            raise ValueError(f"uniform needs 1 <= LO <= HI, got {self.lo}:{self.hi}")

    @property
    def mean(self) -> float:
        return (self.lo + self.hi) / 2

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.integers(self.lo, self.hi + 1, size=n).astype(float)


@dataclass(frozen=True, slots=True)
class TruncLogNormal:
    """ln L ~ N(mu, sigma^2) truncated to [lo, hi] tokens."""

    mu: float
    sigma: float
    lo: float
    hi: float

    def __post_init__(self) -> None:
        if self.sigma <= 0:
            raise ValueError(f"lognormal sigma must be > 0, got {self.sigma}")
        if not 0 < self.lo < self.hi:
            raise ValueError(f"lognormal needs 0 < LO < HI, got {self.lo}:{self.hi}")
        if self._mass(self.lo, self.hi) < 1e-12:
            raise ValueError("lognormal truncation window holds no probability mass; widen LO:HI or move MU")

    def _z(self, x: float, shift: float = 0.0) -> float:
        return (math.log(x) - self.mu - shift) / self.sigma

    def _mass(self, a: float, b: float) -> float:
        return _N.cdf(self._z(b)) - _N.cdf(self._z(a))

    def _partial_mean(self, a: float, b: float) -> float:
        """E[L ; a < L <= b] for the untruncated log-normal."""
        s2 = self.sigma**2
        return math.exp(self.mu + s2 / 2) * (_N.cdf(self._z(b, s2)) - _N.cdf(self._z(a, s2)))

    @property
    def mean(self) -> float:
        return self._partial_mean(self.lo, self.hi) / self._mass(self.lo, self.hi)

    def split(self, t: float) -> Split:
        t = min(max(t, self.lo), self.hi)
        z = self._mass(self.lo, self.hi)
        m_long, m_short = self._mass(t, self.hi), self._mass(self.lo, t)
        l_long = self._partial_mean(t, self.hi) / m_long if m_long > 0 else 0.0
        l_short = self._partial_mean(self.lo, t) / m_short if m_short > 0 else 0.0
        return Split(t, m_long / z, l_long, l_short)

    def quantile(self, q: float) -> float:
        a, b = _N.cdf(self._z(self.lo)), _N.cdf(self._z(self.hi))
        return math.exp(self.mu + self.sigma * _N.inv_cdf(a + q * (b - a)))

    def grid(self, n: int = 4000) -> tuple[np.ndarray, np.ndarray]:
        """n equal-probability points (quantiles at bin midpoints)."""
        qs = (np.arange(n) + 0.5) / n
        return np.array([self.quantile(q) for q in qs]), np.full(n, 1.0 / n)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        # Rejection keeps the simulator's seeded draws (docs/simulation.md); a window holding little
        # mass would loop long, but the acceptance is >= 97% at the paper's parameters.
        out = np.empty(0)
        while out.size < n:
            x = np.exp(rng.normal(self.mu, self.sigma, 2 * n + 16))
            out = np.concatenate([out, x[(x >= self.lo) & (x <= self.hi)]])
        return out[:n]


@dataclass(frozen=True, slots=True)
class Empirical:
    """Weighted samples of L; ``values`` sorted ascending (use ``from_samples`` / ``from_histogram``)."""

    values: np.ndarray
    weights: np.ndarray
    _cw: np.ndarray = field(repr=False, default=None)  # cumulative weight, normalised
    _cwv: np.ndarray = field(repr=False, default=None)  # cumulative weight * value

    @staticmethod
    def from_samples(samples, weights=None) -> Empirical:
        v = np.asarray(samples, dtype=float)
        w = np.ones_like(v) if weights is None else np.asarray(weights, dtype=float)
        if v.size == 0 or v.shape != w.shape or np.any(w < 0) or w.sum() <= 0 or np.any(v < 0):
            raise ValueError("samples: expected a non-empty list of lengths >= 0 "
                             "(and, if given, as many weights >= 0 with a positive sum)")
        order = np.argsort(v, kind="stable")
        v, w = v[order], w[order] / w.sum()
        return Empirical(v, w, np.cumsum(w), np.cumsum(w * v))

    @staticmethod
    def from_histogram(edges, counts, per_bin: int = 16) -> Empirical:
        e, c = np.asarray(edges, dtype=float), np.asarray(counts, dtype=float)
        if e.size != c.size + 1 or np.any(np.diff(e) <= 0):
            raise ValueError("edges/counts: expected strictly increasing edges, one more edge than counts")
        frac = (np.arange(per_bin) + 0.5) / per_bin
        pts = (e[:-1, None] + np.diff(e)[:, None] * frac[None, :]).ravel()
        return Empirical.from_samples(pts, np.repeat(c / per_bin, per_bin))

    @property
    def lo(self) -> float:
        return float(self.values[0])

    @property
    def hi(self) -> float:
        return float(self.values[-1])

    @property
    def mean(self) -> float:
        return float(self._cwv[-1])

    def split(self, t: float) -> Split:
        k = int(np.searchsorted(self.values, t, side="right"))  # values[:k] <= t
        short_w = float(self._cw[k - 1]) if k else 0.0
        short_wv = float(self._cwv[k - 1]) if k else 0.0
        p = max(0.0, 1.0 - short_w)
        l_long = (self.mean - short_wv) / p if p > 1e-12 else 0.0
        l_short = short_wv / short_w if short_w > 1e-12 else 0.0
        return Split(t, p if p > 1e-12 else 0.0, l_long, l_short)

    def quantile(self, q: float) -> float:
        return float(self.values[min(int(np.searchsorted(self._cw, q)), self.values.size - 1)])

    def grid(self) -> tuple[np.ndarray, np.ndarray]:
        return self.values, self.weights

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.choice(self.values, size=n, p=self.weights)


def weighted_quantile(values: np.ndarray, weights: np.ndarray, q: float) -> float:
    """Smallest v with P(V <= v) >= q."""
    order = np.argsort(values, kind="stable")
    cw = np.cumsum(weights[order]) / weights.sum()
    return float(values[order][min(int(np.searchsorted(cw, q - 1e-12)), values.size - 1)])


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
