"""Results document (JSON, comparable across runs) and the printed summary table.

Schema ``prfaas-loadgen/1``: ``config`` (the CLI config), ``summary`` (all measured requests), ``routes``
(the same per ``x-prfaas-route`` value), ``router`` (scraped metrics or null), ``timeseries``,
``warmup`` (counts only) and ``requests`` (one object per request, times in seconds).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from prfaas_sgl.tools.loadgen.client import RequestRecord
from prfaas_sgl.tools.loadgen.runner import RunResult
from prfaas_sgl.tools.loadgen.stats import Slo, by_route, summarize, throughput_series

SCHEMA = "prfaas-loadgen/1"


def record_json(r: RequestRecord) -> dict:
    d = asdict(r)
    d["ok"] = r.ok
    d["tpot_s"] = r.tpot_s
    return d


def build_results(result: RunResult, slo: Slo, config: dict, bin_s: float = 1.0) -> dict:
    recs = result.records
    sampler = result.sampler
    return {
        "schema": SCHEMA,
        "config": config,
        "started_unix": result.started_unix,
        "run_s": result.duration_s,
        "stopped_by": result.stopped_by,
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
        "summary": summarize(recs, slo),
        "routes": by_route(recs, slo),
        "router": sampler.summary() if sampler else None,
        "timeseries": {
            "throughput": throughput_series(recs, bin_s),
            "link": sampler.link_series() if sampler else None,
        },
        "warmup": {"requests": len(result.warmup), "errors": sum(not r.ok for r in result.warmup)},
        "requests": [record_json(r) for r in recs],
    }


def write_json(path: str | Path, results: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")


def _fmt(x: float | None, mult: float = 1.0, digits: int = 3) -> str:
    return "-" if x is None else f"{x * mult:.{digits}f}"


def _pcts(d: dict, mult: float) -> str:
    return "/".join(_fmt(d[k], mult, 1 if mult > 1 else 3) for k in ("p50", "p90", "p99"))


_ROWS = (
    ("requests ok/err", lambda s: f"{s['ok']}/{s['errors']}"),
    ("throughput (req/s)", lambda s: _fmt(s["request_throughput"])),
    ("goodput (req/s)", lambda s: _fmt(s["goodput"])),
    ("SLO attainment", lambda s: _fmt(s["slo_attainment"])),
    ("prefix-cached tokens", lambda s: _fmt(s["cached_token_fraction"])),
    ("input tok/s", lambda s: _fmt(s["input_token_throughput"], digits=1)),
    ("output tok/s", lambda s: _fmt(s["output_token_throughput"], digits=1)),
    ("TTFT mean (s)", lambda s: _fmt(s["ttft_s"]["mean"])),
    ("TTFT P50/P90/P99 (s)", lambda s: _pcts(s["ttft_s"], 1.0)),
    ("TPOT P50/P90/P99 (ms)", lambda s: _pcts(s["tpot_s"], 1000.0)),
    ("E2E P50/P90/P99 (s)", lambda s: _pcts(s["e2e_s"], 1.0)),
)


def format_table(results: dict) -> str:
    """Fixed-width table: one column for all requests, one per route when routes are reported."""
    cols = [("all", results["summary"])]
    routes = results["routes"]
    if set(routes) - {"-"}:
        cols += sorted(routes.items())
    cells = [[fn(s) for _, s in cols] for _, fn in _ROWS]
    width = 2 + max(len(c) for c in [name for name, _ in cols] + [c for row in cells for c in row])
    lines = [f"{'':24}" + "".join(f"{name:>{width}}" for name, _ in cols)]
    for (label, _), row in zip(_ROWS, cells):
        lines.append(f"{label:24}" + "".join(f"{c:>{width}}" for c in row))
    slo = results["slo"]
    lines.append(f"SLO: TTFT <= {slo['ttft_s']} s, TPOT <= {slo['tpot_s'] * 1000:.1f} ms; "
                 f"span {results['summary']['duration_s']:.2f} s; stopped by {results['stopped_by']}")
    router = results.get("router")
    if router:
        lines.append(f"router: offload fraction {_fmt(router['offload_fraction'])}, link pressure "
                     f"mean {_fmt(router['link_utilization_mean'])} max {_fmt(router['link_utilization_max'])}"
                     f" ({router['scrapes']} scrapes, {router['failed_scrapes']} failed)")
    return "\n".join(lines)
