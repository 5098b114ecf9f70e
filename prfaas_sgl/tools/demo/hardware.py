"""The demo's emulated hardware: the paper's two GPU kinds as CPU shares (tools/cpu_share.py).

A CPU core runs prefill and decode at one speed, a GPU does not: an H20 prefills ~6.7x slower than an H200
(dense BF16: 148 vs 989 TFLOPS; prefill is compute-bound) but decodes only ~1.2x slower (HBM: 4.0 vs
4.8 TB/s; decode is bandwidth-bound). So each server's share follows the resource its role is bound by:

    kind                          role     share of REFERENCE_CORES      cores   core
    compute-dense prefill (H200)  prefill  989 / 989 TFLOPS = 1           0.70    1   ("remote datacenter")
    bandwidth-optimised (H20)     prefill  148 / 989 TFLOPS = 0.150       0.105   0   ("local datacenter")
    bandwidth-optimised (H20)     decode   4.0 / 4.8 TB/s   = 0.833       0.583   0

REFERENCE_CORES (the H200's share) is 0.7, not 1: the local core then carries 2 x 0.105 + 0.583 = 0.79 cores
at most, and the router, load generator and tokenizer, which run unshared, keep ~0.5 of the machine's 2 cores.
"""
from __future__ import annotations

from dataclasses import dataclass

from prfaas_sgl.tools import cpu_share
from prfaas_sgl.tools.cpu_share import CpuShare

REFERENCE_CORES = 0.7  # one compute-dense prefill server (an H200's share)
REMOTE_CORE, LOCAL_CORE = 1, 0


@dataclass(frozen=True)
class Kind:
    """A GPU kind by the two numbers the paper's argument rests on."""

    name: str
    tflops: float  # dense BF16
    hbm_tbps: float  # memory bandwidth, TB/s


H200 = Kind("compute-dense prefill (H200-like)", 989.0, 4.8)
H20 = Kind("bandwidth-optimised decode (H20-like)", 148.0, 4.0)


def cores(kind: Kind, role: str) -> float:
    """CPU cores that emulate `kind` in `role` ("prefill": compute-bound, "decode": bandwidth-bound)."""
    ratio = kind.tflops / H200.tflops if role == "prefill" else kind.hbm_tbps / H200.hbm_tbps
    return round(REFERENCE_CORES * ratio, 3)


def share(kind: Kind, role: str) -> CpuShare:
    return CpuShare(cores(kind, role), (REMOTE_CORE if kind is H200 else LOCAL_CORE,))


# (kind, role) per demo pool: the PrfaaS cluster is H200s that only prefill; the local PD cluster is H20s.
POOL_HARDWARE = {"prfaas": (H200, "prefill"), "local_prefill": (H20, "prefill"), "decode": (H20, "decode")}


def pool_share(pool: str) -> CpuShare:
    return share(*POOL_HARDWARE[pool])


def shares_problem() -> str | None:
    """Why the demo cannot apply its shares here (then every server runs unshared), or None."""
    return next((why for p in POOL_HARDWARE if (why := cpu_share.problem(pool_share(p)))), None)


def describe() -> list[str]:
    """One line per emulated kind and role, for the demo's log."""
    return [f"{kind.name} {role}: {cores(kind, role):g} cores on core {share(kind, role).cpus[0]} "
            f"({kind.tflops:g} TFLOPS, {kind.hbm_tbps:g} TB/s)"
            for kind, role in ((H200, "prefill"), (H20, "prefill"), (H20, "decode"))]
