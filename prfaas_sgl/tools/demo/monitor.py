"""The demo's Prometheus: a real server scraping the demo's router and SGLang servers; the table and plots
read the link and offload series back from its HTTP API — the series an operator's Grafana shows.

Without the `prometheus` binary (Debian's package; `make demo` installs it when run as root) the demo says
so and reads the router's /metrics directly, as the load generator always does (prfaas_sgl.tools.loadgen.prom).
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

from prfaas_sgl.tools.deploy.config import Deployment
from prfaas_sgl.tools.deploy.prometheus import RULES, scrape_config, to_yaml
from prfaas_sgl.tools.launch import free_port
from prfaas_sgl.router import names

INSTALL = "apt-get install -y prometheus"
SCRAPE_S = 1.0  # the demo's phases last minutes: 1 s samples resolve the link's bursts
SGLANG_SCRAPE_S = 5.0  # ~tens of KB per SGLang scrape: every second would load the demo's 6 Mbit/s link


def binary_problem(name: str) -> str | None:
    """Why ``name`` (prometheus, promtool) cannot run here, or None."""
    if shutil.which(name):
        return None
    who = "as root" if os.geteuid() == 0 else "needs root"
    return f"{name} not found: `{INSTALL}` ({who}; `make setup` and `make demo` install it when run as root)"


class PromServer:
    """One prometheus process on loopback, storing under ``workdir``; queried over its HTTP API."""

    def __init__(self, config: dict, workdir: Path, port: int | None = None) -> None:
        self.config, self.workdir, self.port = config, workdir, port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 60.0) -> "PromServer":
        self.workdir.mkdir(parents=True, exist_ok=True)
        cfg = self.workdir / "prometheus.yml"
        cfg.write_text("\n".join(to_yaml(self.config)) + "\n")
        cmd = [shutil.which("prometheus") or "prometheus", f"--config.file={cfg}",
               f"--storage.tsdb.path={self.workdir / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}",
               "--log.level=warn"]
        with open(self.workdir / "prometheus.log", "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"prometheus did not become ready; see {self.workdir / 'prometheus.log'}")
            time.sleep(0.2)
        return self

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def _api(self, path: str, **params: str | float) -> list:
        url = f"{self.url}/api/v1/{path}?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.loads(r.read())
        if body.get("status") != "success":
            raise RuntimeError(f"prometheus {path} {params}: {body}")
        return body["data"]["result"]

    def query(self, expr: str, at: float | None = None) -> list[tuple[dict, float]]:
        """Instant vector at unix time ``at`` (now if None): [(labels, value)]."""
        params = {"query": expr} | ({"time": at} if at is not None else {})
        return [(r["metric"], float(r["value"][1])) for r in self._api("query", **params)]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[tuple[dict, list]]:
        """[(labels, [(unix time, value), ...])] for ``expr`` every ``step`` s over [start, end]."""
        res = self._api("query_range", query=expr, start=start, end=end, step=step)
        return [(r["metric"], [(float(t), float(v)) for t, v in r["values"]]) for r in res]

    def wait_for_sample(self, expr: str, after_unix: float, timeout_s: float = 30.0) -> None:
        """Until a sample of ``expr`` scraped at or after ``after_unix`` is stored (the run's last one)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(v >= after_unix for _, v in self.query(f"timestamp({expr})")):
                return
            time.sleep(SCRAPE_S / 4)
        raise TimeoutError(f"prometheus stored no sample of {expr} after {after_unix:.1f} within {timeout_s} s")


def _delta(prom: PromServer, expr: str, t0: float, t1: float) -> float | None:
    """Counter growth between the last samples at or before t0 and t1; None if never exported."""
    before, after = prom.query(expr, t0), prom.query(expr, t1)
    if not after:
        return None
    return sum(v for _, v in after) - sum(v for _, v in before)


def _points(prom: PromServer, expr: str, t0: float, t1: float) -> list[tuple[float, float]]:
    res = prom.query_range(expr, t0, t1, SCRAPE_S)
    return res[0][1] if res else []


def router_summary(prom: PromServer, t0: float, t1: float) -> tuple[dict, dict]:
    """(summary, link series) of the router over [t0, t1] (unix s), in the load generator's shapes.

    The offload fraction is the counters' delta, not ``increase()``: a route's series is born at its first
    decision, and ``increase()`` would drop the counts before its first sample."""
    prom.wait_for_sample(names.DECISIONS, t1)
    end = t1 + SCRAPE_S
    remote = _delta(prom, f'sum({names.DECISIONS}{{route="{names.REMOTE_ROUTE}"}})', t0, end) or 0.0
    local = _delta(prom, f'sum({names.DECISIONS}{{route="local"}})', t0, end) or 0.0
    points = _points(prom, f"max({names.LINK_UTILIZATION})", t0, t1)
    bps = dict(_points(prom, f"max({names.LINK_GOODPUT_BPS})", t0, t1))
    utils = [u for _, u in points]
    series = {"t_s": [max(0.0, t - t0) for t, _ in points], "link_bps": [bps.get(t) for t, _ in points],
              "link_utilization": utils}
    summary = {
        "url": prom.url, "source": "prometheus", "scrapes": len(points), "failed_scrapes": None,
        "offload_fraction": remote / (remote + local) if remote + local > 0 else None,
        "link_bytes": _delta(prom, f"sum({names.LINK_BYTES_TOTAL})", t0, end),
        "link_utilization_mean": sum(utils) / len(utils) if utils else None,
        "link_utilization_max": max(utils) if utils else None,
    }
    return summary, series


# -------------------------------------------------------------------- the demo's hooks


def with_metrics(dep: Deployment) -> Deployment:
    """SGLang serves /metrics only with --enable-metrics: on when a Prometheus will scrape it."""
    if binary_problem("prometheus") or "--enable-metrics" in dep.server_args:
        return dep
    return dataclasses.replace(dep, server_args=dep.server_args + ("--enable-metrics",))


def start(dep: Deployment, out: Path, say) -> PromServer | None:
    """A Prometheus scraping ``dep``'s router every second and its servers every 5 s, with the PrfaaS alert
    rules; None (and said why) if it cannot run."""
    problem = binary_problem("prometheus")
    if problem:
        say(f"no Prometheus ({problem}); the table reads the router's /metrics directly")
        return None
    config = scrape_config(dep, SCRAPE_S, rule_files=(str(RULES),))
    for job in config["scrape_configs"]:
        if job["job_name"] == "prfaas-sglang":  # its answers cross the emulated link too: keep them rare
            job["scrape_interval"] = f"{SGLANG_SCRAPE_S:g}s"
    try:
        prom = PromServer(config, out / "prometheus").start()
    except (OSError, RuntimeError) as e:
        say(f"Prometheus did not start ({e}); the table reads the router's /metrics directly")
        return None
    say(f"Prometheus at {prom.url} scrapes the router every {SCRAPE_S:g} s and the servers every "
        f"{SGLANG_SCRAPE_S:g} s (data and config in {prom.workdir})")
    return prom


def read_back(prom: PromServer | None, results: dict) -> None:
    """Replace a run's router summary and link series by what Prometheus stored over the run (no-op without)."""
    if prom is None:
        return
    t0 = results["started_unix"]
    try:
        summary, series = router_summary(prom, t0, t0 + results["run_s"])
    except (OSError, RuntimeError, TimeoutError, ValueError) as e:  # a demo run outlives a broken monitor
        print(f"[demo] Prometheus read-back failed ({e}); keeping the router's /metrics numbers", flush=True)
        return
    results["router"] = summary
    results["timeseries"]["link"] = series
