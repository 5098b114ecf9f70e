"""Profiles as data: a 1-D curve y(x) given by a table or a polynomial.

Tables interpolate linearly between points and extrapolate the end segments linearly (the paper gives
H200 prefill time at 1K/8K/32K/128K only; requests of 128 tokens fall below the first point).
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

import numpy as np


class ProfileError(ValueError):
    """A scenario field is missing or inconsistent; the message names the field and what is expected."""


@dataclass(frozen=True, slots=True)
class Curve:
    """y(x) from a table (``xs``, ``ys``) or a polynomial ``poly`` = (c0, c1, c2, ...): c0 + c1 x + ...

    ``field`` names the scenario field it came from, for error messages.
    """

    xs: tuple[float, ...] = ()
    ys: tuple[float, ...] = ()
    poly: tuple[float, ...] = ()
    field: str = "curve"

    def __post_init__(self) -> None:
        if bool(self.poly) == bool(self.xs):
            raise ProfileError(f"{self.field}: give either a table (x and y lists) or a polynomial, not both/none")
        if self.poly:
            return
        if len(self.xs) != len(self.ys) or len(self.xs) < 2:
            raise ProfileError(f"{self.field}: table needs >= 2 points and equally long x/y lists "
                               f"(got {len(self.xs)} x, {len(self.ys)} y)")
        if any(b <= a for a, b in zip(self.xs, self.xs[1:])):
            raise ProfileError(f"{self.field}: x values must be strictly increasing, got {list(self.xs)}")

    def require_increasing(self, lo: float, hi: float) -> None:
        """Raise unless y strictly increases on [lo, hi] (prefill time, KV bytes must grow with length)."""
        if not self.poly:
            if any(b <= a for a, b in zip(self.ys, self.ys[1:])):
                raise ProfileError(f"{self.field}: values must be strictly increasing with length, "
                                   f"got {list(self.ys)}")
            return
        grid = np.linspace(lo, hi, 257)
        if np.any(np.diff(self.many(grid)) <= 0):
            raise ProfileError(f"{self.field}: polynomial {list(self.poly)} must increase on [{lo:g}, {hi:g}]")

    def at(self, x: float) -> float:
        """Scalar evaluation (the simulator's hot path)."""
        if self.poly:
            y = 0.0
            for c in reversed(self.poly):
                y = y * x + c
            return y
        xs, ys = self.xs, self.ys
        i = min(max(bisect_right(xs, x) - 1, 0), len(xs) - 2)
        return ys[i] + (ys[i + 1] - ys[i]) * (x - xs[i]) / (xs[i + 1] - xs[i])

    def many(self, x: np.ndarray) -> np.ndarray:
        """Vectorised evaluation; same numbers as ``at``."""
        x = np.asarray(x, dtype=float)
        if self.poly:
            return np.polynomial.polynomial.polyval(x, self.poly)
        xs, ys = np.asarray(self.xs), np.asarray(self.ys)
        i = np.clip(np.searchsorted(xs, x, side="right") - 1, 0, len(xs) - 2)
        return ys[i] + (ys[i + 1] - ys[i]) * (x - xs[i]) / (xs[i + 1] - xs[i])

    def fit_poly(self, degree: int, lo: float, hi: float) -> tuple[float, ...]:
        """Least-squares polynomial (c0, c1, ...) over [lo, hi]; for ModelCost's quadratic estimate."""
        x = np.linspace(lo, hi, 512)
        return tuple(float(c) for c in np.polynomial.polynomial.polyfit(x, self.many(x), degree))

    def scaled(self, factor: float, field: str) -> Curve:
        if self.poly:
            return Curve(poly=tuple(c * factor for c in self.poly), field=field)
        return Curve(self.xs, tuple(y * factor for y in self.ys), field=field)
