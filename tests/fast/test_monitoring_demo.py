"""The demo's monitored run: a real Prometheus scrapes a router's /metrics and the demo reads the
offload and link series back from its HTTP API (prfaas_sgl/tools/demo/monitor.py)."""
from __future__ import annotations

import os
import time

import pytest
from prometheus_client import start_http_server

from prfaas_sgl.tools.demo import monitor
from prfaas_sgl.tools.deploy import config
from prfaas_sgl.tools.launch import free_port
from prfaas_sgl.router.metrics import RouterMetrics
from prfaas_sgl.router.policy import Decision

pytestmark = pytest.mark.timeout(90)


def require(binary: str) -> None:
    """Setup installs Debian's prometheus as root (CI): missing there is a failure; elsewhere a skip."""
    problem = monitor.binary_problem(binary)
    if problem and os.geteuid() == 0:
        pytest.fail(problem)
    if problem:
        pytest.skip(f"{problem}; this user cannot install it")


def _deployment(router_port: int) -> config.Deployment:
    """The router is the stand-in below; the SGLang servers are ports nothing listens on (targets down)."""
    return config.parse({
        "deployment": {"model": "tiny:tiny-qwen35-hybrid", "device": "cpu"},
        "servers": [
            {"name": "p0", "machine": "m", "pool": "prfaas", "host": "127.0.0.1", "port": free_port(),
             "bootstrap_port": free_port()},
            {"name": "d0", "machine": "m", "pool": "decode", "host": "127.0.0.1", "port": free_port()},
        ],
        "router": {"machine": "m", "host": "127.0.0.1", "port": router_port},
    })


def _decide(m: RouterMetrics, route: str, n: int) -> None:
    for _ in range(n):
        m.record(Decision(route, "p0", "d0", 100, "long" if route == "prfaas" else "short"))


def test_demo_reads_offload_and_link_series_back_from_a_real_prometheus(tmp_path):
    require("prometheus")
    m = RouterMetrics()
    server, thread = start_http_server(0, "127.0.0.1", registry=m.registry)
    prom = None
    try:
        _decide(m, "local", 2)  # before the run: must not count
        m.link_util.set(0.2)
        said = []
        prom = monitor.start(_deployment(server.server_port), tmp_path, said.append)
        assert said[0].startswith(f"Prometheus at {prom.url} scrapes the router every 1 s")
        prom.wait_for_sample("prfaas_router_decisions_total", time.time())
        t0 = time.time()
        _decide(m, "prfaas", 3)
        _decide(m, "local", 1)
        m.link_util.set(0.5)
        time.sleep(1.5)
        m.link_util.set(0.9)
        time.sleep(1.5)
        results = {"started_unix": t0, "run_s": time.time() - t0, "router": None, "timeseries": {"link": None}}
        monitor.read_back(prom, results)

        up = {labels["job"]: v for labels, v in prom.query("max by (job) (up)")}
        assert up == {"prfaas-router": 1.0, "prfaas-sglang": 0.0}
    finally:
        if prom is not None:
            prom.stop()
        server.shutdown()
    router, link = results["router"], results["timeseries"]["link"]
    assert router["source"] == "prometheus"
    assert router["offload_fraction"] == pytest.approx(0.75)  # 3 remote of the run's 4, not the 2 before
    assert router["link_utilization_max"] == pytest.approx(0.9)
    assert set(link["link_utilization"]) <= {0.2, 0.5, 0.9} and len(link["t_s"]) >= 3
    assert link["t_s"] == sorted(link["t_s"]) and 0 <= link["t_s"][0] < 1.0


def test_without_a_working_prometheus_the_demo_says_so_and_keeps_the_direct_numbers(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no prometheus binary on it
    said = []
    dep = _deployment(free_port())
    assert monitor.start(dep, tmp_path, said.append) is None
    assert "no Prometheus" in said[0] and "apt-get install -y prometheus" in said[0]
    assert monitor.with_metrics(dep) is dep  # servers keep their flags: nothing will scrape them
    results = {"router": {"source": "direct"}, "started_unix": time.time(), "run_s": 1.0}
    monitor.read_back(None, results)
    gone = monitor.PromServer({}, tmp_path, port=free_port())  # started, then died: nothing answers
    monitor.read_back(gone, results)
    assert results["router"] == {"source": "direct"}


def test_with_prometheus_sglang_servers_export_metrics(tmp_path):
    require("prometheus")
    dep = monitor.with_metrics(_deployment(free_port()))
    assert dep.server_args.count("--enable-metrics") == 1
    assert monitor.with_metrics(dep) is dep
