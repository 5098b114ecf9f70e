"""The planner in the demo's loop: the measured profile (profile.py), the emulated link and the demo's scaled
workload as a planner `System`, and the planner's prediction for each configuration the demo can run.

The demo's servers have fixed roles (a PD server changes role only by a restart), so each policy is
evaluated on the servers its phase uses (topology.PHASES), the threshold t searched by the planner:

    PrfaaS          1 compute-dense prefill + 1 local prefill / 1 decode   t = the planner's optimum
    homogeneous PD  2 local prefill / 1 decode (the remote slot as a local prefill)
    naive           1 compute-dense prefill, 0 local prefill / 1 decode (local-prefill-0 stays idle)
    equal cost      3 local prefill / 1 decode (an H200 costs ~2 H20s: what PrfaaS's servers cost)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from prfaas_sgl.router.planner import Curve, Hardware, System, best_threshold, stages, ttft_no_queue
from prfaas_sgl.router.planner.optimize import ALL_REMOTE_T
from prfaas_sgl.tools.demo.topology import KV_BYTES_PER_TOKEN, STATE_BYTES
from prfaas_sgl.workload.lengths import TruncLogNormal

PAPER_MU, PAPER_SIGMA, PAPER_LO, PAPER_HI = 9.9, 1.0, 128.0, 131072.0  # the loadgen's "paper" lengths


@dataclass(frozen=True)
class Prediction:
    label: str
    servers: str  # remote + local P/D
    threshold: int | None  # tokens; None: every request on one route
    lam: float  # Λ_max, req/s
    bound: str  # the stage that sets it
    offload: float  # fraction of requests prefilled remotely
    ttft_p90_s: float  # prefill time alone, no queueing


def hardware_of(entry: dict, name: str, decode: dict | None = None, handoff: tuple[float, float] = (0.0, 0.0),
                output_tokens: float = 16.0) -> Hardware:
    """`handoff` = (receive s/request, share lost waiting): the decode's time per request receiving its KV and
    the fraction of its share its scheduler spends polling pending transfers, folded into the step the model
    reads at the decode batch: Θ_pdd = BS / (step · L_out) becomes (1 - lost) / (step · L_out / BS + receive)."""
    pre = Curve(tuple(map(float, entry["tokens"])), tuple(sustained_s(entry)), field=f"{name}.prefill")
    if decode is None:
        return Hardware(name, pre, gpus_per_instance=1)
    per_request = decode["step_s"] * output_tokens / decode["batch"] + handoff[0]
    step = per_request / (1.0 - handoff[1]) * decode["batch"] / output_tokens
    return Hardware(name, pre, decode["batch"], Curve(poly=(step,), field=f"{name}.decode"), 1)


def sustained_s(entry: dict) -> list[float]:
    """Prefill seconds per request a saturated share sustains: the pair's wall time per request, or its CPU
    seconds over the share where less. Four requests at a time leave the 0.7-core prefill waiting on the
    handoff's latency (it used 60-77 % of its share), which a queue of requests would fill; the 0.105-core one
    used all of its share, so there the two agree."""
    walls = entry["s_per_request"]
    if "prefill_cpu_s" not in entry or not entry.get("cores"):
        return list(walls)
    return [min(w, c / entry["cores"]) if c > 0 else w for w, c in zip(walls, entry["prefill_cpu_s"])]


def handoff_measured(profile: dict) -> bool:
    """Whether the profile came from the PD pair (it has the handoff's receive CPU and wire bytes)."""
    return all("decode_recv_cpu_s" in profile[p] for p in ("prfaas", "local_prefill"))


def _pooled(profile: dict, *fields: str) -> list[np.ndarray]:
    """Per field, both prefill kinds' batches in one array (`tokens` included as a field)."""
    return [np.asarray([y for p in ("prfaas", "local_prefill") for y in profile[p][f]], float) for f in fields]


def kv_curve(profile: dict) -> Curve:
    """S_kv(l): the wire bytes the pair measured (a line over length), else the model's accounting."""
    if not handoff_measured(profile):
        return Curve(poly=(float(STATE_BYTES), float(KV_BYTES_PER_TOKEN)), field="tiny model KV")
    b, a = np.polyfit(*_pooled(profile, "tokens", "wire_bytes"), 1)
    return Curve(poly=(max(float(a), 0.0), max(float(b), 1.0)), field="tiny model KV, measured on the wire")


def receive_fit(profile: dict) -> tuple[float, float, float]:
    """(c0, c1, waiting cores): the decode's CPU per request = c0 + c1 · l + waiting · the prefill's seconds
    per request. The pair measured it behind a fast and a slow prefill: the slower one costs the decode more
    CPU at the same length, since its scheduler polls a pending transfer the whole while (~0.06 cores, idle
    rate subtracted); c0 + c1 · l is what taking the request over costs whatever the sender."""
    tokens, secs, recv = _pooled(profile, "tokens", "s_per_request", "decode_recv_cpu_s")
    coef, *_ = np.linalg.lstsq(np.column_stack([np.ones_like(tokens), tokens, secs]), recv, rcond=None)
    return max(float(coef[0]), 0.0), float(coef[1]), max(float(coef[2]), 0.0)


def decode_handoff(profile: dict, dist) -> tuple[float, float]:
    """(receive s/request, share lost waiting) of the decode (hardware_of): the receive CPU at the workload's
    mean over the decode's cores (every request's KV lands there, whichever prefill sent it); at Λ_max some
    request always waits for its KV, so the polling costs its rate throughout."""
    if not handoff_measured(profile):
        return 0.0, 0.0
    c0, c1, waiting = receive_fit(profile)
    lengths, w = dist.grid()
    cpu = float(np.dot(np.maximum(c0 + c1 * lengths, 0.0), w) / w.sum())
    cores = profile["decode"].get("cores") or 1.0
    return cpu / cores, min(waiting / cores, 0.5)


def system(profile: dict, link_mbit: float, scale: float, output_tokens: float) -> System:
    """The demo's PrfaaS deployment (1 remote, 2 local) as the planner sees it; lengths scaled like the
    loadgen's `paper` spec. A PD-pair profile brings the KV handoff: its prefill curves include sending,
    its wire bytes are S_kv, and receiving takes decode time (decode_handoff)."""
    dist = TruncLogNormal(PAPER_MU + math.log(scale), PAPER_SIGMA, PAPER_LO * scale, PAPER_HI * scale)
    local = hardware_of(profile["local_prefill"], "H20-like", profile["decode"], decode_handoff(profile, dist),
                        output_tokens)
    remote = hardware_of(profile["prfaas"], "H200-like")
    return System(kv_curve(profile), local, 2, remote, 1, link_mbit * 1e6 / 8, output_tokens, dist)


def _prediction(label: str, servers: str, sys: System, st) -> Prediction:
    t = None if st.split.p in (0.0, 1.0) or math.isinf(st.t) else int(round(st.t))
    return Prediction(label, servers, t, st.lam, st.bound, st.split.p, ttft_no_queue(sys, st.t).p90)


def predict(sys: System) -> dict[str, Prediction]:
    """Keyed by the demo's phase policy names."""
    prfaas = best_threshold(sys, 1, 1)
    homo_sys = replace(sys, remote=None, n_remote=0, n_local=3)
    homo = stages(homo_sys, math.inf, 2, 1)
    naive = stages(sys, ALL_REMOTE_T, 0, 1)
    equal_sys = replace(homo_sys, n_local=4)
    return {
        "bandwidth_aware": _prediction("PrfaaS", "1 + 1/1", sys, prfaas),
        "local_only": _prediction("homogeneous PD", "0 + 2/1", homo_sys, homo),
        "all_remote": _prediction("naive", "1 + 0/1", sys, naive),
        "local_only_equal_cost": _prediction("homogeneous PD, equal cost", "0 + 3/1", equal_sys,
                                             stages(equal_sys, math.inf, 3, 1)),
    }


def router_cost(profile: dict) -> dict[str, list[float]]:
    """The router's prefill-time model (`--local-prefill-coef`, `--remote-prefill-coef`: s = a + b*l + c*l^2)
    from the profile: a line fitted over the measured lengths. The bandwidth-aware policy compares the pools'
    ready times with it; its defaults are paper-scale (0.1 ms a token locally, remote 2x faster), which here
    would take a 0.105-core local prefill (~2 ms a token) for 20x faster than it is."""
    def line(entry: dict) -> list[float]:
        b, a = np.polyfit(entry["tokens"], entry["s_per_request"], 1)
        return [max(float(a), 0.0), max(float(b), 1e-9), 0.0]
    return {"local_prefill_coef": line(profile["local_prefill"]), "remote_prefill_coef": line(profile["prfaas"])}


def format_predictions(preds: dict[str, Prediction]) -> str:
    base = preds["local_only"].lam
    lines = ["| planner (measured profile) | servers (remote + P/D) | t (tokens) | Λ_max (req/s) | vs homogeneous "
             "| bound | offloaded | P90 prefill (s) |", "|---|---|---|---|---|---|---|---|"]
    for p in preds.values():
        t = "-" if p.threshold is None else str(p.threshold)
        lines.append(f"| {p.label} | {p.servers} | {t} | {p.lam:.2f} | {p.lam / base:.2f}x | {p.bound} "
                     f"| {100 * p.offload:.0f}% | {p.ttft_p90_s:.2f} |")
    return "\n".join(lines)
