"""Statistics on hand-made records (exact), results JSON, plots, the CLI, import hygiene."""

import argparse
import asyncio
import json
import subprocess
import sys
import threading

import numpy as np
import pytest

from prfaas_sgl.tools.loadgen import cli
from prfaas_sgl.tools.loadgen.client import RequestRecord
from prfaas_sgl.tools.loadgen.plots import write_plots
from prfaas_sgl.tools.loadgen.report import SCHEMA, build_results, format_table
from prfaas_sgl.tools.loadgen.runner import RunResult
from prfaas_sgl.tools.loadgen.stats import Slo, throughput_series
from tests.support.loadgen_standin import StandInScript, StandInServer

TTFTS = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 3.0]


def _records() -> list[RequestRecord]:
    """Request i: sent at i*0.5 s, TTFT TTFTS[i], 5 tokens 10 ms (even i) or 40 ms (odd i) apart."""
    out = []
    for i, ttft in enumerate(TTFTS):
        itl = 0.01 if i % 2 == 0 else 0.04
        times = [ttft + k * itl for k in range(5)]
        out.append(RequestRecord(i, i, 0, 100, 5, send_s=i * 0.5, ttft_s=ttft, e2e_s=times[-1], output_tokens=5,
                                 token_times=times, route="prfaas" if i < 4 else "local", status=200))
    out.append(RequestRecord(10, 10, 0, 100, 5, send_s=5.0, route="local", status=500, error="HTTP 500: x"))
    return out


def _results() -> dict:
    run = RunResult(_records(), [], 0.0, 6.0, "workload")
    return build_results(run, Slo(ttft_s=0.75, tpot_s=0.02), {"note": "unit"})


def test_summary_is_exact():
    res = _results()
    s = res["summary"]
    assert res["schema"] == SCHEMA
    assert (s["requests"], s["ok"], s["errors"]) == (11, 10, 1)
    span = 9 * 0.5 + 3.0 + 4 * 0.04  # last request (odd, slow tokens) ends last
    assert s["duration_s"] == pytest.approx(span)
    for q in (50, 90, 99):
        assert s["ttft_s"][f"p{q}"] == pytest.approx(np.percentile(TTFTS, q))
    assert s["tpot_s"]["p50"] == pytest.approx(np.percentile([0.01, 0.04] * 5, 50))
    # good: TTFT <= 0.75 and TPOT <= 20 ms -> even i among 0..6 -> 0, 2, 4, 6
    assert s["goodput"] == pytest.approx(4 / span)
    assert s["slo_attainment"] == pytest.approx(4 / 11)
    assert s["output_token_throughput"] == pytest.approx(50 / span)
    assert res["routes"]["prfaas"]["ok"] == 4 and res["routes"]["local"]["errors"] == 1
    assert res["routes"]["prfaas"]["request_throughput"] == pytest.approx(4 / span)
    assert res["requests"][1]["tpot_s"] == pytest.approx(0.04)
    assert s["cached_token_fraction"] is None  # no request reported cached tokens


def test_throughput_series_bins_tokens_and_completions():
    recs = _records()
    ts = throughput_series(recs, bin_s=1.0)
    assert sum(ts["output_tokens_per_s"]) == pytest.approx(50)
    assert sum(ts["requests_per_s"]) == 10
    assert ts["t_s"][:3] == [0.0, 1.0, 2.0]
    # [0, 1) holds request 0 (tokens at 0.10..0.14 s) and request 1 (sent 0.5, tokens at 0.70..0.86 s)
    assert ts["output_tokens_per_s"][0] == 10


def test_table_and_plots(tmp_path):
    res = _results()
    table = format_table(res)
    assert table.splitlines()[0].split() == ["all", "local", "prfaas"]
    assert "stopped by workload" in table
    paths = write_plots(res, tmp_path, prefix="x_")
    assert [p.name for p in paths] == ["x_ttft_cdf.png", "x_timeseries.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
    json.dumps(res)  # the whole document is plain JSON


def _serve_in_thread(script):
    """Stand-in server on its own event loop thread (the CLI runs asyncio.run itself)."""
    loop = asyncio.new_event_loop()
    srv = StandInServer(script)
    threading.Thread(target=loop.run_forever, daemon=True).start()
    url = asyncio.run_coroutine_threadsafe(srv.start(), loop).result(10)
    return srv, url, loop


def test_cli_end_to_end(tmp_path, capsys):
    srv, url, loop = _serve_in_thread(StandInScript(ttft_per_token_s=1e-5, itl_s=0.001, route_threshold=50))
    try:
        rc = cli.main(["--url", url, "--num-sessions", "6", "--input-len", "uniform:10:100", "--output-len",
                       "fixed:3", "--concurrency", "2", "--no-progress", "--out-dir", str(tmp_path),
                       "--router-metrics", url + "/metrics", "--metrics-interval", "0.1"])
    finally:
        asyncio.run_coroutine_threadsafe(srv.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
    assert rc == 0
    out = capsys.readouterr().out
    assert "throughput (req/s)" in out and "offload fraction" in out
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["summary"]["ok"] == 6 and res["config"]["num_sessions"] == 6
    assert (tmp_path / "ttft_cdf.png").exists() and (tmp_path / "timeseries.png").exists()


def test_cli_config_errors_exit_2(capsys):
    assert cli.main(["--input-len", "zipf:2", "--no-progress"]) == 2
    assert "bad length spec" in capsys.readouterr().err
    assert cli.main(["--trace", "/nonexistent/trace.jsonl", "--no-progress"]) == 2
    assert "/nonexistent/trace.jsonl" in capsys.readouterr().err


def test_bench_subcommand_hooks_into_a_parent_parser():
    parser = argparse.ArgumentParser(prog="prfaas")
    sub = parser.add_subparsers(dest="command", required=True)
    cli.add_parser(sub)
    args = parser.parse_args(["bench", "--rate", "3", "--no-include-usage"])
    assert args.func is cli.run and args.rate == 3.0 and args.include_usage is False


def test_library_imports_no_torch_sglang_or_matplotlib():
    code = ("import sys, prfaas_sgl.tools.loadgen.cli, prfaas_sgl.tools.loadgen.report;"
            "print(sorted(m for m in ('torch', 'sglang', 'matplotlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_sampler_reads_the_real_router_metrics():
    """Pins the default metric names to what router/metrics.py exports (fails if either side renames)."""
    from prometheus_client import generate_latest

    from prfaas_sgl.tools.loadgen.prom import MetricsSampler, Scrape, parse_metrics
    from prfaas_sgl.router.metrics import RouterMetrics
    from prfaas_sgl.router.policy import Decision

    m = RouterMetrics()
    m.record(Decision("local", "p0", "d0", 10, "short"))
    sampler = MetricsSampler("unused")
    sampler.scrapes.append(Scrape(0.0, parse_metrics(generate_latest(m.registry).decode())))
    for route in ("prfaas", "prfaas", "prfaas", "local"):
        m.record(Decision(route, "p", "d", 100, "long" if route == "prfaas" else "short"))
    m.link_util.set(0.4)
    m.link_goodput.set(1e9)  # the sampled gauge; the byte counter's exact rate wins
    m.link_bytes_total.inc(250_000_000)  # 2e9 bits over the 1 s between the scrapes
    sampler.scrapes.append(Scrape(1.0, parse_metrics(generate_latest(m.registry).decode())))
    assert sampler.offload_fraction() == pytest.approx(3 / 4)  # the decision before the run is excluded
    assert sampler.link_series() == {"t_s": [1.0], "link_bps": [2e9], "link_utilization": [0.4]}
