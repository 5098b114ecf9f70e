"""Reading counters from a server's or the router's Prometheus /metrics in real-server tests."""
from __future__ import annotations

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
