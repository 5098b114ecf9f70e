"""The paper's throughput model (paper-notes §2): per-stage throughput and Λ_max at a threshold t.

Units: lengths in tokens, times in seconds, KV sizes in bytes, link rates in bytes/s internally
(Gbit/s only at the edges), throughputs in requests/s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from prfaas_sgl.workload.lengths import Split, SplitDist, weighted_quantile

from .curves import Curve, ProfileError


@dataclass(frozen=True, slots=True)
class Hardware:
    """One instance type (e.g. 8xH200). ``prefill_s``: seconds vs uncached tokens for one instance.

    Decode: ``decode_step_s`` is the step time (seconds) vs batch size; the model uses it at
    ``decode_max_batch`` (the batch the decode SLO allows).
    """

    name: str
    prefill_s: Curve
    decode_max_batch: int = 0
    decode_step_s: Curve | None = None
    gpus_per_instance: int = 8

    def decode_rps(self, output_tokens: float) -> float:
        """Requests/s one decode instance completes: BS_max / (T_decode * L_out)."""
        if self.decode_step_s is None or self.decode_max_batch <= 0:
            raise ProfileError(f"hardware.{self.name}: decode_max_batch and decode_step_s are needed "
                               "on the hardware that decodes")
        return self.decode_max_batch / (self.decode_step_s.at(self.decode_max_batch) * output_tokens)


@dataclass(frozen=True, slots=True)
class System:
    """A deployment the model evaluates: PrfaaS cluster (``remote``, may be absent) + local PD cluster."""

    kv_bytes: Curve  # S_kv(l), bytes per request of l uncached tokens
    local: Hardware
    n_local: int
    remote: Hardware | None
    n_remote: int
    link_Bps: float  # inter-datacenter bytes/s available to KV
    output_tokens: float
    dist: SplitDist


@dataclass(frozen=True, slots=True)
class Stages:
    """Throughputs (req/s) at threshold t with n_p local prefill and n_d decode instances."""

    split: Split
    n_p: int
    n_d: int
    prfaas_compute: float
    prfaas_egress: float
    prfaas: float
    pdp: float
    pdd: float
    lam: float  # Λ_max
    bound: str  # "prfaas" | "pdp" | "pdd": the stage that sets Λ_max

    @property
    def t(self) -> float:
        return self.split.t

    def egress_Bps(self, kv_bytes: Curve) -> float:
        """Link load at Λ_max: Λ · p · S_kv(l_long), bytes/s."""
        return self.lam * self.split.p * kv_bytes.at(self.split.l_long) if self.split.p > 0 else 0.0


def _ratio(num: float, den: float) -> float:
    return num / den if den > 1e-12 else math.inf


def stages(sys: System, t: float, n_p: int, n_d: int) -> Stages:
    """Evaluate every stage at threshold t (requests with uncached length > t go to PrfaaS)."""
    sp = sys.dist.split(t)
    if sys.remote is not None and sys.n_remote > 0 and sp.p > 0:
        compute = sys.n_remote / sys.remote.prefill_s.at(sp.l_long)
        egress = sys.link_Bps / sys.kv_bytes.at(sp.l_long)
    else:
        compute = egress = 0.0
    prfaas = min(compute, egress)
    pdp = n_p / sys.local.prefill_s.at(sp.l_short) if sp.p < 1 else 0.0
    pdd = n_d * sys.local.decode_rps(sys.output_tokens)
    terms = {"prfaas": _ratio(prfaas, sp.p), "pdp": _ratio(pdp, 1.0 - sp.p), "pdd": pdd}
    bound = min(terms, key=terms.get)
    return Stages(sp, n_p, n_d, compute, egress, prfaas, pdp, pdd, terms[bound], bound)


def imbalance(sys: System, t: float, n_p: int) -> float:
    """Θ_prfaas/p − Θ_pdp/(1−p): rises with t (paper §2), so its zero is found by bisection."""
    st = stages(sys, t, n_p, 0)
    return _ratio(st.prfaas, st.split.p) - _ratio(st.pdp, 1.0 - st.split.p)


@dataclass(frozen=True, slots=True)
class Ttft:
    """TTFT without queueing: prefill time of each request on the route it takes (seconds)."""

    mean: float
    p90: float


def ttft_no_queue(sys: System, t: float) -> Ttft:
    """Mean and P90 over the length distribution of T_route(L), route = remote iff L > t.

    This is what reproduces the paper's table (4.44 s mean = E[T_H20(L)], not T_H20(E[L]) = 4.27 s).
    """
    lengths, w = sys.dist.grid()
    times = sys.local.prefill_s.many(lengths)
    if sys.remote is not None and sys.n_remote > 0:
        times = np.where(lengths > t, sys.remote.prefill_s.many(lengths), times)
    return Ttft(float(np.dot(times, w) / w.sum()), weighted_quantile(times, w, 0.9))
