"""Totals and time series of a finished simulation, as a JSON-ready dict."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict

import numpy as np

from .config import SimConfig
from .engine import Sample
from .workload import SimRequest


def _pct(x: np.ndarray) -> dict:
    if x.size == 0:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    p50, p90, p99 = np.percentile(x, [50, 90, 99])
    return {"mean": float(x.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def request_arrays(reqs: list[SimRequest]) -> dict[str, np.ndarray]:
    arr = {k: np.array([getattr(r, k) for r in reqs], dtype=float)
           for k in ("arrival", "decode_start", "decode_end", "kv_bytes", "input_len", "incremental", "output_len",
                     "held_s")}
    arr["remote"] = np.array([r.route == "prfaas" for r in reqs], dtype=bool)
    arr["ttft"] = arr["decode_start"] - arr["arrival"]
    arr["tpot"] = (arr["decode_end"] - arr["decode_start"]) / arr["output_len"]
    return arr


def good_mask(arr: dict, cfg: SimConfig) -> np.ndarray:
    done = ~np.isnan(arr["decode_end"])
    with np.errstate(invalid="ignore"):
        return done & (arr["ttft"] <= cfg.slo_ttft_s) & (arr["tpot"] <= cfg.slo_tpot_s)


def summarize(reqs: list[SimRequest], samples: list[Sample], cfg: SimConfig, window_s: float,
              wall_s: float, threshold0: float, split: tuple[int, int]) -> dict:
    """window_s: the arrival window rates are computed over (seconds)."""
    arr = request_arrays(reqs)
    done = ~np.isnan(arr["decode_end"])
    good = good_mask(arr, cfg)
    n = max(len(reqs), 1)
    lens = arr["input_len"].sum()
    link = np.array([s.link_util for s in samples]) if samples else np.zeros(1)
    util = {k: float(np.mean([getattr(s, k) for s in samples])) if samples else 0.0
            for k in ("prfaas_util", "local_prefill_util", "decode_util")}
    return {
        "config": {"policy": cfg.policy, "threshold_start": threshold0, "split": list(split),
                   "controller": cfg.controller, "seed": cfg.seed, "arrival": asdict(cfg.arrival),
                   "slo_ttft_s": cfg.slo_ttft_s, "slo_tpot_s": cfg.slo_tpot_s},
        "totals": {
            "requests": len(reqs), "completed": int(done.sum()), "window_s": window_s,
            "offered_rps": len(reqs) / window_s, "throughput_rps": float(done.sum()) / window_s,
            "goodput_rps": float(good.sum()) / window_s, "slo_attainment": float(good.sum()) / n,
            "ttft_s": _pct(arr["ttft"][done]), "tpot_s": _pct(arr["tpot"][done]),
            "offload_fraction": float(arr["remote"].mean()) if reqs else 0.0,
            "paced_fraction": float((arr["held_s"] > 0).mean()) if reqs else 0.0,
            "cache_hit_token_fraction": float(1 - arr["incremental"].sum() / lens) if lens else 0.0,
            "link_util_mean": float(link.mean()), "link_util_max": float(link.max()),
            "link_gbytes": float(arr["kv_bytes"].sum() / 1e9), **util,
            "reasons": dict(Counter(r.reason for r in reqs)), "wall_s": wall_s,
        },
        "timeseries": timeseries(arr, samples, cfg),
    }


def timeseries(arr: dict, samples: list[Sample], cfg: SimConfig) -> dict:
    """Per sampling interval: resources from the samples; per-arrival-bin request metrics."""
    t = np.array([s.t for s in samples])
    out = {k: [getattr(s, k) for s in samples] for k in Sample.__slots__}
    edges = np.concatenate([[0.0], t]) if t.size else np.zeros(1)
    good = good_mask(arr, cfg)
    idx = np.searchsorted(edges, arr["arrival"], side="right") - 1
    p90, goodput, offload = [], [], []
    for b in range(max(t.size, 0)):
        m = idx == b
        ttft = arr["ttft"][m]
        ttft = ttft[~np.isnan(ttft)]
        dt = edges[b + 1] - edges[b]
        p90.append(float(np.percentile(ttft, 90)) if ttft.size else None)
        goodput.append(float(good[m].sum() / dt))
        offload.append(float(arr["remote"][m].mean()) if m.any() else None)
    out.update({"ttft_p90_s": p90, "goodput_rps": goodput, "offload_fraction": offload})
    return out
