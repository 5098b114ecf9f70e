"""Search for the throughput-optimal threshold t and local prefill/decode split, plus the baselines.

t: bisection on the zero of Θ_prfaas/p − Θ_pdp/(1−p), which rises monotonically with t (paper §2), in
log-length space. Split: every integer n_p in [0, n_local − 1] (n_local is small; each point costs one
bisection), keeping the best min(prefill crossing, Θ_pdd).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from .model import Stages, System, Ttft, imbalance, stages, ttft_no_queue

ALL_REMOTE_T = 0.0  # every request has L > 0: p = 1
ALL_LOCAL_T = math.inf  # p = 0


def best_threshold(sys: System, n_p: int, n_d: int, iters: int = 64) -> Stages:
    """Throughput-optimal t for a fixed split. Falls back to an end when one pool is empty."""
    if sys.remote is None or sys.n_remote == 0:
        return stages(sys, ALL_LOCAL_T, n_p, n_d)
    if n_p == 0:
        return stages(sys, ALL_REMOTE_T, n_p, n_d)
    lo, hi = math.log(max(sys.dist.lo, 1.0)) - 1e-6, math.log(sys.dist.hi) + 1e-6
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        if imbalance(sys, math.exp(mid), n_p) < 0:
            lo = mid
        else:
            hi = mid
    # An empirical distribution makes the ratio a step function: the best point is on either side of the
    # jump the bisection isolated; both ends are evaluated.
    cands = [stages(sys, math.exp(x), n_p, n_d) for x in (lo, hi)]
    return max(cands, key=lambda s: s.lam)


def best_split(sys: System, fixed: tuple[int, int] | None = None) -> Stages:
    """Best (t, n_p, n_d) with n_p + n_d = n_local and n_d >= 1; or best t for a ``fixed`` split."""
    if fixed is not None:
        return best_threshold(sys, *fixed)
    cands = [best_threshold(sys, n_p, sys.n_local - n_p) for n_p in range(sys.n_local)]
    return max(cands, key=lambda s: (round(s.lam, 9), s.n_d))


@dataclass(frozen=True, slots=True)
class PlanRow:
    """One column of the paper's results table."""

    name: str
    n_remote: int
    stages: Stages
    egress_gbps: float
    ttft: Ttft

    def to_dict(self) -> dict:
        st, sp = self.stages, self.stages.split
        return {
            "name": self.name, "threshold": None if math.isinf(sp.t) else sp.t,
            "instances": {"prfaas": self.n_remote, "local_prefill": st.n_p, "decode": st.n_d},
            "throughput_rps": {"prfaas": st.prfaas, "prfaas_compute": st.prfaas_compute,
                               "prfaas_egress": st.prfaas_egress, "local_prefill": st.pdp, "decode": st.pdd},
            "lambda_max_rps": st.lam, "bound": st.bound, "offload_fraction": sp.p,
            "l_long": sp.l_long, "l_short": sp.l_short, "egress_gbps": self.egress_gbps,
            "ttft_mean_s": self.ttft.mean, "ttft_p90_s": self.ttft.p90,
        }


def _row(name: str, sys: System, st: Stages) -> PlanRow:
    egress = st.egress_Bps(sys.kv_bytes) * 8 / 1e9
    n_remote = sys.n_remote if sys.remote is not None and st.split.p > 0 else 0
    return PlanRow(name, n_remote, st, egress, ttft_no_queue(sys, st.t))


def plan_prfaas(sys: System, fixed: tuple[int, int] | None = None) -> PlanRow:
    return _row("prfaas_pd", sys, best_split(sys, fixed))


def plan_homogeneous(base: System) -> PlanRow:
    """All instances local (the baseline cluster), best prefill/decode split."""
    return _row("homogeneous_pd", base, best_split(replace(base, remote=None, n_remote=0)))


def plan_naive(sys: System) -> PlanRow:
    """Every prefill remote; every local instance decodes."""
    return _row("naive_heterogeneous", sys, stages(sys, ALL_REMOTE_T, 0, sys.n_local))


@dataclass(frozen=True, slots=True)
class Surface:
    """Λ_max over thresholds (tokens) x local prefill counts, for plots."""

    thresholds: np.ndarray  # [T]
    n_prefill: np.ndarray  # [S]
    lam: np.ndarray  # [S, T], req/s
    prfaas_term: np.ndarray  # [S, T] Θ_prfaas/p
    pdp_term: np.ndarray  # [S, T] Θ_pdp/(1-p)


def surface(sys: System, points: int = 200) -> Surface:
    ts = np.geomspace(max(sys.dist.lo, 1.0), sys.dist.hi, points)
    nps = np.arange(1, max(sys.n_local, 2))
    lam, pr, pd = (np.zeros((nps.size, ts.size)) for _ in range(3))
    for i, n_p in enumerate(nps):
        for j, t in enumerate(ts):
            st = stages(sys, float(t), int(n_p), int(sys.n_local - n_p))
            lam[i, j] = st.lam
            pr[i, j] = st.prfaas / st.split.p if st.split.p > 0 else np.nan
            pd[i, j] = st.pdp / (1 - st.split.p) if st.split.p < 1 else np.nan
    return Surface(ts, nps, lam, pr, pd)
