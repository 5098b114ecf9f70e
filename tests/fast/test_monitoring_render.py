"""`prfaas render prometheus`: scrape targets derived from the deployment file, never by hand."""
from __future__ import annotations

from pathlib import Path

import yaml

from prfaas_sgl.cli import main as prfaas
from prfaas_sgl.tools.deploy import config
from prfaas_sgl.tools.deploy.prometheus import RULES, render

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "deploy-two-datacenters.toml"


def _jobs(path: Path) -> dict[str, list[tuple[str, dict]]]:
    cfg = yaml.safe_load(path.read_text())
    return {j["job_name"]: [(t, g.get("labels", {})) for g in j["static_configs"] for t in g["targets"]]
            for j in cfg["scrape_configs"]}


def test_example_deployment_targets_its_router_and_every_server(tmp_path):
    assert prfaas(["render", "prometheus", "--config", str(EXAMPLE), "--out", str(tmp_path)]) == 0
    jobs = _jobs(tmp_path / "prometheus.yml")
    # the router binds 0.0.0.0 on local-a: scraped at local-a's address (local-prefill-0 lives there)
    assert jobs["prfaas-router"] == [("10.10.0.11:8000", {"machine": "local-a"})]
    assert [t for t, _ in jobs["prfaas-sglang"]] == ["10.20.0.11:30000", "10.20.0.12:30000", "10.10.0.11:30000",
                                                    "10.10.0.12:30000", "10.10.0.13:30000"]
    assert jobs["prfaas-sglang"][1][1] == {"machine": "remote-b", "pool": "prfaas", "server": "prfaas-1"}
    # prfaas_zmq stats servers: only on the three prefills (a decode runs none), one per TP rank (tp 8,
    # port 9400 + rank); decode targets would read down forever
    transport = [t for t, _ in jobs["prfaas-transport"]]
    assert transport == [f"{h}:{9400 + r}" for h in ("10.20.0.11", "10.20.0.12", "10.10.0.11") for r in range(8)]
    text = (tmp_path / "prometheus.yml").read_text()
    assert "no --enable-metrics" not in text and "# warning" not in text  # every target answers
    assert (tmp_path / "prfaas-alerts.yml").read_text() == RULES.read_text()
    assert yaml.safe_load(text)["rule_files"] == ["prfaas-alerts.yml"]


def _cpu_deployment() -> config.Deployment:
    stats = ["--prfaas-zmq-stats-port", "9100"]
    return config.parse({
        "deployment": {"model": "tiny:m", "device": "cpu",
                       "server_args": ["--enable-metrics", "--prfaas-zmq-insecure"]},
        "servers": [
            {"name": "p0", "machine": "r0", "pool": "prfaas", "host": "10.0.0.5", "port": 30000,
             "bootstrap_port": 8998, "args": [*stats, "--prfaas-zmq-stats-host", "0.0.0.0"]},
            {"name": "p1", "machine": "r1", "pool": "prfaas", "host": "fd00::6", "port": 30000,
             "bootstrap_port": 8998, "args": [*stats, "--prfaas-zmq-stats-host=fd00::6"]},
            {"name": "p2", "machine": "r2", "pool": "prfaas", "host": "10.0.0.7", "port": 30000,
             "bootstrap_port": 8998, "args": stats},  # stats on loopback (the default): unreachable remotely
            {"name": "d0", "machine": "l0", "pool": "decode", "host": "10.1.0.5", "port": 30000},
        ],
        "router": {"machine": "l0", "host": "10.1.0.9", "port": 8000,
                   "transport_stats_url": "http://10.0.0.5:9100/stats,http://10.0.0.8:9100/stats"},
    })


def test_transport_stats_servers_come_from_server_flags_and_the_routers_stats_urls(tmp_path):
    render(_cpu_deployment(), tmp_path)
    jobs = _jobs(tmp_path / "prometheus.yml")
    assert jobs["prfaas-router"] == [("10.1.0.9:8000", {"machine": "l0"})]
    assert jobs["prfaas-sglang"][1][0] == "[fd00::6]:30000"
    assert [t for t, _ in jobs["prfaas-transport"]] == [
        "10.0.0.5:9100",  # a wildcard bind is scraped at the server's address
        "[fd00::6]:9100", "127.0.0.1:9100",
        "10.0.0.8:9100",  # only in the router's list; 10.0.0.5 appears once
    ]
    assert jobs["prfaas-transport"][0][1] == {"machine": "r0", "pool": "prfaas", "server": "p0"}
    text = (tmp_path / "prometheus.yml").read_text()
    assert "no --enable-metrics" not in text
    assert "# warning: p2: stats server binds 127.0.0.1: only a Prometheus on machine r2 reaches it" in text
