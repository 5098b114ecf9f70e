"""Summary statistics over request records.

Percentiles use numpy's default definition (linear interpolation between order statistics,
``np.percentile(..., method="linear")``); tests compute expected values the same way.
Throughputs divide by the measured span: first send to last finish over the non-warmup records.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from prfaas_sgl.tools.loadgen.client import RequestRecord

QUANTILES = (50, 90, 99)


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_s: float  # a good request's first token within this
    tpot_s: float  # and mean time per later token within this

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.tpot_s <= 0:
            raise ValueError("--slo-ttft and --slo-tpot must be > 0 seconds")

    def met(self, r: RequestRecord) -> bool:
        tpot = r.tpot_s
        return r.ok and r.ttft_s <= self.ttft_s and (tpot is None or tpot <= self.tpot_s)


def dist_stats(values: Sequence[float]) -> dict[str, float | None]:
    """mean and P50/P90/P99 (seconds); all None for an empty sample."""
    keys = ["mean"] + [f"p{q}" for q in QUANTILES]
    if len(values) == 0:
        return dict.fromkeys(keys)
    arr = np.asarray(values, dtype=float)
    out = {"mean": float(arr.mean())}
    out.update({f"p{q}": float(np.percentile(arr, q)) for q in QUANTILES})
    return out


def span_s(records: Sequence[RequestRecord]) -> float:
    """First send to last finish (seconds); failed requests count up to their send."""
    if not records:
        return 0.0
    start = min(r.send_s for r in records)
    end = max(r.send_s + (r.e2e_s or 0.0) for r in records)
    return end - start


def summarize(records: Sequence[RequestRecord], slo: Slo, duration_s: float | None = None) -> dict:
    """Counts, throughputs (per second of ``duration_s``, default the records' span), latency stats."""
    ok = [r for r in records if r.ok]
    dur = span_s(records) if duration_s is None else duration_s
    per_s = (lambda x: x / dur) if dur > 0 else (lambda x: 0.0)
    good = sum(slo.met(r) for r in records)
    return {
        "requests": len(records),
        "ok": len(ok),
        "errors": len(records) - len(ok),
        "duration_s": dur,
        "request_throughput": per_s(len(ok)),
        "input_token_throughput": per_s(sum(r.prompt_tokens or r.input_len for r in ok)),
        "output_token_throughput": per_s(sum(r.output_tokens for r in ok)),
        "goodput": per_s(good),
        "cached_token_fraction": _cached_fraction(ok),
        "slo_attainment": good / len(records) if records else 0.0,
        "ttft_s": dist_stats([r.ttft_s for r in ok]),
        "tpot_s": dist_stats([t for r in ok if (t := r.tpot_s) is not None]),
        "itl_s": dist_stats([x for r in ok for x in r.itl_s()]),
        "e2e_s": dist_stats([r.e2e_s for r in ok]),
    }


def _cached_fraction(ok: Sequence[RequestRecord]) -> float | None:
    """Prompt tokens served from the prefix cache / prompt tokens, over requests whose server reported
    both (SGLang needs --enable-cache-report); None when none did."""
    rep = [r for r in ok if r.cached_tokens is not None and r.prompt_tokens]
    return sum(r.cached_tokens for r in rep) / sum(r.prompt_tokens for r in rep) if rep else None


def by_route(records: Sequence[RequestRecord], slo: Slo) -> dict[str, dict]:
    """Summaries per route header value; throughputs share the whole run's span so they add up."""
    dur = span_s(records)
    routes = sorted({r.route for r in records})
    return {rt: summarize([r for r in records if r.route == rt], slo, dur) for rt in routes}


def throughput_series(records: Sequence[RequestRecord], bin_s: float = 1.0) -> dict[str, list[float]]:
    """Output tokens/s and completed requests/s in ``bin_s`` bins from the first send.

    A chunk's tokens are spread evenly over its request's chunks (usage count / chunk count).
    """
    ok = [r for r in records if r.ok and r.token_times]
    if not ok:
        return {"bin_s": bin_s, "t_s": [], "output_tokens_per_s": [], "requests_per_s": []}
    t0 = min(r.send_s for r in records)
    times = np.concatenate([np.asarray(r.token_times) + r.send_s - t0 for r in ok])
    weights = np.concatenate([np.full(len(r.token_times), r.output_tokens / len(r.token_times)) for r in ok])
    done = np.asarray([r.send_s + r.e2e_s - t0 for r in ok])
    n_bins = int(np.ceil(max(times.max(), done.max()) / bin_s)) or 1
    edges = np.arange(n_bins + 1) * bin_s
    tok, _ = np.histogram(times, bins=edges, weights=weights)
    req, _ = np.histogram(done, bins=edges)
    return {
        "bin_s": bin_s,
        "t_s": edges[:-1].tolist(),  # left bin edges
        "output_tokens_per_s": (tok / bin_s).tolist(),
        "requests_per_s": (req / bin_s).tolist(),
    }
