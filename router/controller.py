"""Long-timescale controller (paper §4): refit the incremental-length distribution, re-optimise t.

Every ``interval_s`` it fits an empirical distribution to the most recent incremental lengths, re-runs the
throughput model with the measured link bandwidth, moves the threshold toward the new optimum by at most
``max_step_frac`` (so one noisy window cannot swing routing), and recommends a local prefill/decode split.
The caller applies the threshold to its policy (``policy.threshold = update.threshold``). The methods
callers use and the update's shape are router/controller_api.py's. No clock reads: time is passed in. Used
by the router process and, on simulated time, by the simulator.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from prfaas_sgl.cliargs import FieldError, knob
from prfaas_sgl.workload.lengths import Empirical
from .controller_api import ControllerUpdate, PlannerOptimum
from .planner.model import System
from .planner.optimize import best_split, best_threshold


@dataclass(frozen=True, slots=True)
class ControllerConfig:
    interval_s: float = knob(60.0, "seconds between controller updates")
    window: int = knob(4096, "most recent incremental lengths kept (and fitted)")
    min_samples: int = knob(100, "no update before this many observations")
    max_step_frac: float = knob(0.25, "|t change| <= this fraction of the current t per update")
    split_gain: float = knob(0.05, "recommend another split only if it raises the throughput bound by this fraction")

    def __post_init__(self) -> None:
        if self.interval_s <= 0:
            raise FieldError("interval_s", "interval_s must be > 0 seconds")
        for name in ("window", "min_samples"):
            if getattr(self, name) < 1:
                raise FieldError(name, f"{name} must be >= 1")
        if not 0 < self.max_step_frac <= 1:
            raise FieldError("max_step_frac", "max_step_frac must be in (0, 1]")
        if self.split_gain < 0:
            raise FieldError("split_gain", "split_gain must be >= 0")


class LongTermController:
    """The planner's ``Controller`` (router/controller_api.py). Owns a ring buffer of observations;
    ``maybe_update`` is cheap when nothing is due."""

    def __init__(self, cfg: ControllerConfig, system: System, split: tuple[int, int], threshold: float) -> None:
        self.cfg, self.system = cfg, system
        self.split = split
        self.threshold = float(threshold)
        self.buf = np.zeros(cfg.window)
        self.count = 0
        self.link_Bps = system.link_Bps
        self.next_at = cfg.interval_s

    def observe(self, incremental_len: int, now: float) -> None:
        self.buf[self.count % self.cfg.window] = incremental_len
        self.count += 1

    def observe_link(self, link_bps: float, now: float) -> None:
        """Measured link drain rate (bits/s); 0 = unknown, keep the last value."""
        if link_bps > 0:
            self.link_Bps = link_bps / 8

    def resize(self, split: tuple[int, int]) -> None:
        """The local split changed (an actuator moved a server): the next threshold is optimised for it."""
        self.split = split

    def maybe_update(self, now: float) -> ControllerUpdate | None:
        if now < self.next_at:
            return None
        self.next_at = now + self.cfg.interval_s
        if self.count < self.cfg.min_samples:
            return None
        dist = Empirical.from_samples(self.buf[: min(self.count, self.cfg.window)])
        sys = replace(self.system, dist=dist, link_Bps=self.link_Bps)
        target = best_threshold(sys, *self.split)
        best = best_split(sys)
        if best.lam > target.lam * (1 + self.cfg.split_gain):
            rec = (best.n_p, best.n_d)
        else:
            rec = self.split
        lo, hi = self.threshold * (1 - self.cfg.max_step_frac), self.threshold * (1 + self.cfg.max_step_frac)
        t_target = min(target.t, dist.hi + 1)  # p = 0 at any t above the largest sample
        new = min(max(t_target, lo), hi)
        self.threshold = max(new, 1.0)
        reason = "converged" if new == t_target else "step_limited"
        optimum = PlannerOptimum(int(round(t_target)), target.lam, target.bound, target.split.p)
        return ControllerUpdate(int(round(self.threshold)), rec, reason, optimum)
