"""The operator's monitoring checked by promtool: alert rules, their unit tests (every alert firing
and quiet), the scrape config `prfaas render prometheus` writes, and every dashboard query's PromQL.

`make setup` installs Debian's `prometheus` (promtool) when run as root, as CI does: there a missing promtool
fails; a user who cannot install it gets a skip that says so."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from prfaas_sgl.cli import main as prfaas
from prfaas_sgl.tools.demo.monitor import binary_problem

MONITORING = Path(__file__).resolve().parents[2] / "deploy" / "monitoring"
EXAMPLE = MONITORING.parents[1] / "docs" / "deploy-two-datacenters.toml"


def promtool(*args: str, cwd: Path = MONITORING) -> str:
    problem = binary_problem("promtool")
    if problem and os.geteuid() == 0:
        pytest.fail(problem)
    if problem:
        pytest.skip(f"{problem}; this user cannot install it")
    r = subprocess.run(["promtool", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout + r.stderr


def alert_names() -> list[str]:
    rules = yaml.safe_load((MONITORING / "alerts.yml").read_text())
    return [r["alert"] for g in rules["groups"] for r in g["rules"]]


def test_alert_rules_pass_promtool():
    assert f"SUCCESS: {len(alert_names())} rules found" in promtool("check", "rules", "alerts.yml")


def test_alert_unit_tests_pass():
    assert "SUCCESS" in promtool("test", "rules", "alerts_test.yml")


def test_every_alert_has_a_firing_and_a_quiet_unit_test():
    cases = [c for t in yaml.safe_load((MONITORING / "alerts_test.yml").read_text())["tests"]
             for c in t["alert_rule_test"]]
    for name in alert_names():
        mine = [c for c in cases if c["alertname"] == name]
        assert any(c["exp_alerts"] for c in mine), f"{name}: no test where it fires"
        assert any(not c["exp_alerts"] for c in mine), f"{name}: no test where it stays quiet"


def test_rendered_scrape_config_and_its_rules_pass_promtool(tmp_path):
    assert prfaas(["render", "prometheus", "--config", str(EXAMPLE), "--out", str(tmp_path)]) == 0
    out = promtool("check", "config", "prometheus.yml", cwd=tmp_path)
    assert "SUCCESS: 1 rule files found" in out and f"SUCCESS: {len(alert_names())} rules found" in out


def _dashboard_exprs() -> list[str]:
    spec = importlib.util.spec_from_file_location("dashboard", MONITORING / "dashboard.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return [t["expr"] for p in mod.dashboard()["panels"] for t in p.get("targets", [])]


def test_every_dashboard_query_is_valid_promql(tmp_path):
    """promtool has no offline query parser; a recording rule's expression is parsed by `check rules`."""
    rules = [{"record": f"dashboard:q{i}", "expr": e.replace("$__rate_interval", "1m")}
             for i, e in enumerate(_dashboard_exprs())]
    (tmp_path / "q.yml").write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}))
    assert f"SUCCESS: {len(rules)} rules found" in promtool("check", "rules", "q.yml", cwd=tmp_path)
