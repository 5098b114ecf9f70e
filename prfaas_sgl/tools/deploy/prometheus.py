"""`prfaas render prometheus`: the scrape config of a deployment file, next to the PrfaaS alert rules.

Targets come from the file `prfaas up` reads, so they never drift from the servers:

| job | targets | serves /metrics when |
|---|---|---|
| ``prfaas-router`` | the ``[router]`` section's host:port | always |
| ``prfaas-sglang`` | every server's host:port | the server runs with ``--enable-metrics`` |
| ``prfaas-transport`` | ``--prfaas-zmq-stats-port`` of a server, and the router's ``transport_stats_url`` | always |

Every target carries ``machine`` (and ``pool``, ``server`` for servers), so dashboards group by pool. Alert
rules: deploy/monitoring/alerts.yml (package data of ``prfaas_sgl.monitoring``), copied next to the config
(Prometheus reads rule files relative to it).
"""
from __future__ import annotations

import ipaddress
import json
import re
import shutil
from pathlib import Path
from urllib.parse import urlsplit

from prfaas_sgl.config import is_loopback
from prfaas_sgl.monitoring import alert_rules
from prfaas_sgl.tools.deploy.config import Deployment, ServerEntry

RULES = alert_rules()  # the checkout's file in an editable install, the wheel's copy otherwise
RULES_NAME = "prfaas-alerts.yml"
WILDCARDS = ("", "0.0.0.0", "::")


def _addr(host: str, port: int | str) -> str:
    try:
        v6 = ipaddress.ip_address(host).version == 6
    except ValueError:
        v6 = False
    return f"[{host}]:{port}" if v6 else f"{host}:{port}"


def _flag(args: tuple[str, ...], name: str) -> str | None:
    """Value of ``name`` in an argv tuple (``--f V`` or ``--f=V``); the last one wins, as in argparse."""
    val = None
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            val = args[i + 1]
        elif a.startswith(name + "="):
            val = a.split("=", 1)[1]
    return val


def _router_host(dep: Deployment) -> str:
    """A bind-all router is scraped at an address of its machine: a server's there, else the machine name."""
    host = str(dep.router.get("host", "127.0.0.1"))
    if host not in WILDCARDS:
        return host
    machine = dep.router.get("machine")
    same = [s.host for s in dep.servers if s.machine == machine and not is_loopback(s.host)]
    return same[0] if same else str(machine or "127.0.0.1")


def _transport_targets(dep: Deployment, s: ServerEntry) -> tuple[list[str], str | None]:
    """(addresses, warning) of a server's prfaas_zmq stats servers: none on a decode (only the sending side
    runs one), else one per TP rank, on the flag's port + rank (srt/backend/settings.offset_port)."""
    args = dep.server_args + s.args
    port = _flag(args, "--prfaas-zmq-stats-port")
    if port is None or s.mode == "decode" or not int(port):
        return [], None
    ranks = int(_flag(args, "--tp-size") or _flag(args, "--tp") or 1)
    host = _flag(args, "--prfaas-zmq-stats-host") or "127.0.0.1"
    if host in WILDCARDS:
        host = s.host
    warn = None
    if is_loopback(host) and not is_loopback(s.host):
        warn = (f"{s.name}: stats server binds {host}: only a Prometheus on machine {s.machine} reaches it "
                "(add --prfaas-zmq-stats-host)")
    return [_addr(host, int(port) + rank) for rank in range(ranks)], warn


def _group(address: str, **labels: str) -> dict:
    return {"targets": [address], "labels": labels}


def targets(dep: Deployment) -> tuple[dict[str, list[dict]], list[str]]:
    """{job: [static_config groups]} and warnings about targets that will not answer."""
    jobs: dict[str, list[dict]] = {"prfaas-router": [], "prfaas-sglang": [], "prfaas-transport": []}
    warnings = []
    if dep.router:
        jobs["prfaas-router"].append(_group(_addr(_router_host(dep), dep.router.get("port", 8000)),
                                            machine=str(dep.router.get("machine", ""))))
    for s in dep.servers:
        labels = {"machine": s.machine, "pool": s.pool, "server": s.name}
        jobs["prfaas-sglang"].append(_group(_addr(s.host, s.port), **labels))
        if "--enable-metrics" not in dep.server_args + s.args:
            warnings.append(f"{s.name}: no --enable-metrics, so SGLang serves no /metrics (its target reads down)")
        addresses, warn = _transport_targets(dep, s)
        jobs["prfaas-transport"] += [_group(a, **labels) for a in addresses]
        warnings += [warn] if warn else []
    seen = {g["targets"][0] for g in jobs["prfaas-transport"]}
    for url in str(dep.router.get("transport_stats_url", "")).split(","):
        netloc = urlsplit(url.strip()).netloc
        if netloc and netloc not in seen:
            seen.add(netloc)
            jobs["prfaas-transport"].append(_group(netloc))
    return {job: groups for job, groups in jobs.items() if groups}, warnings


def scrape_config(dep: Deployment, interval_s: float = 15.0, rule_files: tuple[str, ...] = (RULES_NAME,)) -> dict:
    jobs, _ = targets(dep)
    return {
        "global": {"scrape_interval": f"{interval_s:g}s", "evaluation_interval": f"{interval_s:g}s"},
        "rule_files": list(rule_files),
        "scrape_configs": [{"job_name": job, "metrics_path": "/metrics", "static_configs": groups}
                           for job, groups in jobs.items()],
    }


def to_yaml(obj: dict | list, indent: int = 0) -> list[str]:
    """Block-style YAML of plain dicts/lists; scalars as JSON (a JSON string is a YAML string)."""
    pad, lines = "  " * indent, []
    items = obj.items() if isinstance(obj, dict) else ((None, v) for v in obj)
    for key, val in items:
        head = f"{pad}{key}:" if key is not None else f"{pad}-"
        if isinstance(val, (dict, list)) and val:
            sub = to_yaml(val, indent + 1)
            if key is None:  # "- first: x" then the item's other lines
                lines += [f"{head} {sub[0].lstrip()}", *sub[1:]]
            else:
                lines += [head, *sub]
        else:
            lines.append(f"{head} {json.dumps(val)}")
    return lines


def render(dep: Deployment, out: Path) -> list[Path]:
    """Write ``prometheus.yml`` and the alert rules into ``out``; returns their paths."""
    _, warnings = targets(dep)
    header = ["# Generated by `prfaas render prometheus` from a deployment file: edit the file, render again.",
              "# Run: prometheus --config.file=prometheus.yml  (rules: " + RULES_NAME + ", deploy/monitoring/)"]
    header += [f"# warning: {w}" for w in warnings]
    config = out / "prometheus.yml"
    config.write_text("\n".join(header + to_yaml(scrape_config(dep))) + "\n")
    rules = out / RULES_NAME
    shutil.copyfile(RULES, rules)
    return [config, rules]


# label names never start with these prefixes; a quoted label value is skipped by the look-behind
_NAME = re.compile(r'(?<![\w:"])(prfaas_\w+|sglang:[\w:]+|up(?=\{))')


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression reads (ours, SGLang's and `up`); label names and values aside."""
    return set(_NAME.findall(expr))
