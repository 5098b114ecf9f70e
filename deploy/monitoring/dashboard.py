"""Writes grafana-dashboard.json (the PrfaaS operator's dashboard): `python deploy/monitoring/dashboard.py`.

The JSON is committed; tests/fast/test_monitoring_dashboard.py checks it equals this script's output, that
every query parses (promtool), and tests/fast/test_monitoring_names.py that every metric it names is exported.
Jobs and labels are those of `prfaas render prometheus` (pool, server, machine on SGLang targets).
"""
from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).with_name("grafana-dashboard.json")
DS = {"type": "prometheus", "uid": "${datasource}"}
RATE = "[$__rate_interval]"
WIDTH, HEIGHT = 8, 8

# rows of panels: (row title, [(panel title, unit, [(PromQL, legend), ...]), ...])
ROWS: list[tuple[str, list[tuple[str, str, list[tuple[str, str]]]]]] = [
    ("Routing", [
        ("Requests by route", "reqps", [
            (f"sum by (route) (rate(prfaas_router_decisions_total{RATE}))", "{{route}}")]),
        ("TTFT by route (router: arrival to decode's first bytes)", "s", [
            (f"histogram_quantile(0.5, sum by (route, le) (rate(prfaas_router_ttft_seconds_bucket{RATE})))",
             "p50 {{route}}"),
            (f"histogram_quantile(0.9, sum by (route, le) (rate(prfaas_router_ttft_seconds_bucket{RATE})))",
             "p90 {{route}}")]),
        ("Offload fraction vs planner optimum", "percentunit", [
            ("prfaas_router_offload_fraction", "routed to PrfaaS (last 1000 decisions)"),
            ("prfaas_router_planner_offload_fraction", "planner optimum")]),
        ("Decisions by reason", "reqps", [
            (f"sum by (reason) (rate(prfaas_router_decisions_total{RATE}))", "{{reason}}")]),
        ("Threshold t (incremental tokens)", "none", [("prfaas_router_threshold_tokens", "t")]),
        ("Instances: recommended split and healthy per pool", "none", [
            ("prfaas_router_recommended_instances", "recommended {{role}}"),
            ("prfaas_router_pool_healthy_instances", "healthy {{pool}}")]),
    ]),
    ("Inter-DC link", [
        ("Link utilization (pressure / budget; 1 = at budget)", "percentunit", [
            ("prfaas_router_link_utilization", "utilization")]),
        ("Link goodput", "bps", [
            ("prfaas_router_link_goodput_bps", "router: measured goodput"),
            (f"rate(prfaas_router_link_bytes_total{RATE}) * 8", "router: acknowledged bytes"),
            ("prfaas_router_link_capacity_bps", "capacity"),
            (f"sum by (instance) (rate(prfaas_transfer_acked_bytes_total{RATE})) * 8", "sender {{instance}}")]),
        ("KV on the link", "bytes", [
            ("prfaas_router_link_bytes_in_flight", "in flight"),
            ("prfaas_router_link_bytes_queued", "queued behind PrfaaS prefill"),
            ("sum by (instance) (prfaas_transfer_bytes_in_flight)", "unacknowledged at {{instance}}")]),
    ]),
    ("Pools", [
        ("Router: queued uncached tokens per pool", "none", [("prfaas_router_pool_queued_tokens", "{{pool}}")]),
        ("Router: requests in flight per pool", "none", [("prfaas_router_pool_inflight", "{{pool}}")]),
        ("SGLang: waiting and running requests per pool", "none", [
            ('sum by (pool) (sglang:num_queue_reqs{priority=""})', "waiting {{pool}}"),
            ('sum by (pool) (sglang:num_running_reqs{priority=""})', "running {{pool}}")]),
        ("SGLang: requests waiting on KV transfer", "none", [
            ('sum by (pool) (sglang:num_prefill_inflight_queue_reqs{priority=""})', "prefill sending {{pool}}"),
            ('sum by (pool) (sglang:num_decode_transfer_queue_reqs{priority=""})', "decode receiving {{pool}}")]),
    ]),
    ("KV transport and control", [
        ("Transfer failures and retries", "ops", [
            (f"sum by (instance, kind) (rate(prfaas_transfer_failures_total{RATE}))", "{{kind}} at {{instance}}"),
            (f"sum by (pool) (rate(sglang:num_transfer_failed_reqs_total{RATE}))", "SGLang {{pool}}"),
            (f"sum by (reason) (rate(prfaas_router_retries_total{RATE}))", "router retry after {{reason}}"),
            (f"sum by (code) (rate(prfaas_router_errors_total{RATE}))", "router error {{code}}")]),
        ("KV transfer latency (first chunk to Done)", "s", [
            (f"histogram_quantile(0.5, sum by (instance, le) (rate(prfaas_transfer_transfer_seconds_bucket{RATE})))",
             "p50 {{instance}}"),
            (f"histogram_quantile(0.9, sum by (instance, le) (rate(prfaas_transfer_transfer_seconds_bucket{RATE})))",
             "p90 {{instance}}")]),
        ("Controller actions", "none", [
            (f"sum by (actuator, outcome, reason) (increase(prfaas_router_controller_actions_total{RATE}))",
             "{{actuator}} {{outcome}} ({{reason}})")]),
        ("Health of the telemetry", "none", [
            ("prfaas_transfer_loop_alive", "sender loop alive {{instance}}"),
            ("prfaas_router_link_stats_ok", "router has link stats"),
            ('up{job=~"prfaas-.*"}', "up {{job}} {{instance}}")]),
    ]),
]


def _panel(pid: int, x: int, y: int, title: str, unit: str, queries: list[tuple[str, str]]) -> dict:
    return {
        "id": pid, "type": "timeseries", "title": title, "datasource": DS,
        "gridPos": {"h": HEIGHT, "w": WIDTH, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
        "targets": [{"refId": chr(ord("A") + i), "datasource": DS, "expr": expr, "legendFormat": legend}
                    for i, (expr, legend) in enumerate(queries)],
    }


def panels() -> list[dict]:
    out, pid, y = [], 1, 0
    for row, items in ROWS:
        out.append({"id": pid, "type": "row", "title": row, "collapsed": False, "panels": [],
                    "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}})
        pid, y = pid + 1, y + 1
        for i, item in enumerate(items):
            x = (i % (24 // WIDTH)) * WIDTH
            if i and x == 0:
                y += HEIGHT
            out.append(_panel(pid, x, y, *item))
            pid += 1
        y += HEIGHT
    return out


def dashboard() -> dict:
    return {
        "uid": "prfaas-sgl", "title": "PrfaaS (prfaas-sgl)", "tags": ["prfaas", "sglang"], "editable": True,
        "schemaVersion": 39, "version": 1, "refresh": "30s", "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": [{"name": "datasource", "type": "datasource", "query": "prometheus",
                                 "label": "Prometheus", "current": {}, "hide": 0}]},
        "panels": panels(),
    }


def text() -> str:
    return json.dumps(dashboard(), indent=1) + "\n"


if __name__ == "__main__":
    OUT.write_text(text())
    print(OUT)
