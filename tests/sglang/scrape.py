"""Reading counters in real-server tests: a server's or the router's Prometheus /metrics, and the bytes a
prfaas_zmq prefill's transport acknowledged (its stats server's /stats)."""
from __future__ import annotations

import json
import re
import time
import urllib.request


def metric(url: str, name: str, **labels) -> float:
    """Sum of the samples of ``name`` at ``url``/metrics whose labels include ``labels`` (0 when absent)."""
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    total = 0.0
    for lab, value in re.findall(rf"^{name}(?:\{{([^}}]*)\}})? (\S+)$", text, re.M):
        if all(f'{k}="{v}"' in lab for k, v in labels.items()):
            total += float(value)
    return total


def wait_metric(url: str, name: str, at_least: float, timeout_s: float = 60, **labels) -> float:
    """Counters a worker thread bumps (the tier publisher) reach /metrics ~1 s late: poll until `at_least`."""
    deadline = time.monotonic() + timeout_s
    while (value := metric(url, name, **labels)) < at_least and time.monotonic() < deadline:
        time.sleep(0.5)
    return value


def stats_url_of(server) -> str:
    """/stats of the stats server a prfaas_zmq sender was started with (`--prfaas-zmq-stats-port`)."""
    args = server.spec.extra_args
    return f"http://127.0.0.1:{args[args.index('--prfaas-zmq-stats-port') + 1]}/stats"


def acked_bytes(stats_url: str) -> int:
    """Bytes the sender's peers acknowledged so far, summed over its links."""
    with urllib.request.urlopen(stats_url, timeout=10) as r:
        return sum(link["bytes_total"] for link in json.loads(r.read())["links"].values())


def settled_bytes(stats_url: str, before: int, timeout_s: float = 10.0) -> int:
    """Acknowledged bytes once they grew past `before` and then held for one poll: the last ack can land just
    after the decode answers. After `timeout_s`, the last value read."""
    last, deadline = acked_bytes(stats_url), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = acked_bytes(stats_url)
        if now == last and now > before:
            return now
        last = now
    return last
