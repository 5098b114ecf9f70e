"""Every metric name the alert rules and the Grafana dashboard use is exported, live.

A real router process (stand-in prefill/decode servers) and a real prfaas_zmq sender process (its stats
server, one completed transfer, one refused peer) are scraped over HTTP; each prfaas_* name in
deploy/monitoring/alerts.yml and grafana-dashboard.json must be a sample name there (histograms by their
_bucket/_sum/_count samples). SGLang's own names (sglang:*) are checked on real servers by
tests/sglang/test_prfaas_zmq.py (test_monitoring_names_...).
"""
from __future__ import annotations

import asyncio
import json
import re
import sys
import urllib.request
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from prfaas_sgl.tools.deploy.prometheus import metric_names
from prfaas_sgl.tools.launch import free_port
from prfaas_sgl.transfer.config import PeerInfo, TransferConfig
from prfaas_sgl.transfer.receiver import ZmqReceiver
from tests.support.router_standin import RoomBoard, Standin, build_tiny_tokenizer
from tests.support.transport import Remote, batch, small_layout

pytestmark = pytest.mark.timeout(90)
MONITORING = Path(__file__).resolve().parents[2] / "deploy" / "monitoring"
# Labelled families whose samples need what this scenario does not do (a controller update, a split
# action): they must be declared (# TYPE) by the live process; the test prints them.
DECLARED_ONLY = {"prfaas_router_recommended_instances", "prfaas_router_controller_actions_total"}


def used_names() -> set[str]:
    """Metric names in the rules' and the dashboard's expressions (Prometheus's own `up` aside)."""
    rules = yaml.safe_load((MONITORING / "alerts.yml").read_text())
    exprs = [r["expr"] for g in rules["groups"] for r in g["rules"]]
    dash = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    exprs += [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    return set().union(*(metric_names(e) for e in exprs))


def exported(text: str) -> tuple[set[str], set[str]]:
    """(sample names, declared family names with their _total for counters) of one exposition."""
    samples, declared = set(), set()
    for fam in text_string_to_metric_families(text):
        declared.add(fam.name + ("_total" if fam.type == "counter" else ""))
        samples |= {s.name for s in fam.samples}
    return samples, declared


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def transport_metrics() -> str:
    """/metrics of a sender process after one completed transfer and one refused peer."""
    layout, cfg, port = small_layout(), TransferConfig(timeout_s=20), free_port()
    rx = ZmqReceiver(layout, [np.zeros(b.nbytes, np.uint8) for b in layout.buffers], cfg)
    try:
        with Remote("sender", layout, cfg, stats_port=port) as tx:
            items = batch(layout, range(4))
            rx.expect(1, items)
            tx.call("send", 1, rx.address, items, True)
            assert tx.call("wait", 1, 20).state.value == "done"
            tx.call("send", 2, PeerInfo("not-an-ip", 1), items, True)  # counted as a bad_peer failure
            assert tx.call("wait", 2, 20).state.value == "failed"
            return _get(f"http://127.0.0.1:{port}/metrics")
    finally:
        rx.close()


async def _router_url(proc: asyncio.subprocess.Process) -> str:
    while True:
        line = (await asyncio.wait_for(proc.stderr.readline(), 60)).decode()
        assert line, "router exited before listening"
        m = re.search(r"listening on (http://\S+)", line)
        if m:
            return m.group(1)


async def _drive(url: str, remote: Standin) -> None:
    """One request served via PrfaaS, one whose remote attempt fails (local retry), one bad body."""
    body = json.dumps({"model": "tiny", "prompt": "hello world, a long enough prompt", "max_tokens": 2})
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/completions", data=body) as r:
            assert r.status == 200 and r.headers["x-prfaas-route"] == "prfaas"
        remote.fail = "http500"
        async with s.post(url + "/v1/completions", data=body) as r:
            assert r.status == 200 and r.headers["x-prfaas-route"] == "local"
        async with s.post(url + "/v1/completions", data=b"{not json") as r:
            assert r.status == 400


async def router_metrics(tok: str, stats_url: str) -> str:
    board = RoomBoard()
    remote, local, dec = Standin("prefill", board), Standin("prefill", board), Standin("decode", board)
    for s in (remote, local, dec):
        await s.start()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "prfaas_sgl.launch_router", "--port", "0", "--policy", "threshold",
        "--threshold", "1", "--prfaas", f"{remote.url};bootstrap=8998", "--local-prefill",
        f"{local.url};bootstrap=8998", "--decode", dec.url, "--served-model-name", "tiny", "--tokenizer-path", tok,
        "--transport-stats-url", stats_url, stderr=asyncio.subprocess.PIPE)
    try:
        url = await _router_url(proc)
        await _drive(url, remote)
        async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
            return await r.text()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        for s in (remote, local, dec):
            await s.close()


async def _both(tok: str) -> tuple[str, str]:
    """(router, transport) expositions; the two processes start side by side (each takes seconds to boot)."""
    transport = asyncio.create_task(asyncio.to_thread(transport_metrics))
    stats = f"http://127.0.0.1:{free_port()}/stats"  # polled and failing: the poll-error series is exported
    return await router_metrics(tok, stats), await transport


def test_every_name_in_the_rules_and_the_dashboard_is_exported_live(tmp_path):
    router, transport = asyncio.run(_both(build_tiny_tokenizer(str(tmp_path / "tok"))))
    samples, declared = exported(transport)
    router_samples, router_declared = exported(router)
    samples |= router_samples
    declared |= router_declared
    wanted = used_names() - {"up"}
    ours = {n for n in wanted if not n.startswith("sglang:")}
    print("declared, no samples in this scenario:", sorted(DECLARED_ONLY))
    assert not (ours - DECLARED_ONLY) - samples, "used but not exported"
    assert DECLARED_ONLY <= declared
    assert {"prfaas_router_ttft_seconds_bucket", "prfaas_transfer_transfer_seconds_bucket"} <= wanted
    assert 'prfaas_transfer_loop_alive 1.0' in transport
    assert re.search(r'prfaas_transfer_failures_total\{kind="bad_peer",peer="not-an-ip"\} 1.0', transport)
