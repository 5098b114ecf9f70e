"""The Grafana dashboard: committed JSON == its generator's output, well-formed panels, and the
views the issue asks for. Query syntax: test_monitoring_rules.py (promtool); names: test_monitoring_names.py."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

MONITORING = Path(__file__).resolve().parents[2] / "deploy" / "monitoring"


def _generator():
    spec = importlib.util.spec_from_file_location("dashboard", MONITORING / "dashboard.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


DASH = json.loads((MONITORING / "grafana-dashboard.json").read_text())
PANELS = [p for p in DASH["panels"] if p["type"] != "row"]


def test_committed_json_is_the_generators_output():
    assert (MONITORING / "grafana-dashboard.json").read_text() == _generator().text(), \
        "run: python deploy/monitoring/dashboard.py"


def test_every_panel_queries_the_chosen_prometheus():
    assert {"name": "datasource", "type": "datasource", "query": "prometheus"}.items() <= \
        DASH["templating"]["list"][0].items()
    for p in PANELS:
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"] == p["datasource"] and t["expr"].strip() and t["legendFormat"], p["title"]
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"]), p["title"]


def test_panels_have_unique_ids_and_do_not_overlap():
    assert len({p["id"] for p in DASH["panels"]}) == len(DASH["panels"])
    cells = set()
    for p in DASH["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, p["title"]
        cells |= mine


def test_the_issues_views_are_there():
    """Request rate and TTFT by route, offload vs planner, link utilization and goodput, queues per pool,
    transfer failures, current t and split, controller actions."""
    exprs = " ".join(t["expr"] for p in PANELS for t in p["targets"])
    for needle in ("sum by (route) (rate(prfaas_router_decisions_total", "sum by (route, le) (rate("
                   "prfaas_router_ttft_seconds_bucket", "prfaas_router_planner_offload_fraction",
                   "prfaas_router_offload_fraction", "prfaas_router_link_utilization", "prfaas_router_link_goodput_bps",
                   "prfaas_router_pool_queued_tokens", "sum by (pool) (sglang:num_queue_reqs",
                   "prfaas_transfer_failures_total", "prfaas_router_threshold_tokens",
                   "prfaas_router_recommended_instances", "prfaas_router_controller_actions_total"):
        assert needle in exprs, needle
