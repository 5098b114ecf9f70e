"""Not collected by `make test` (no test_ prefix): it failed in the clean-clone run at 3d0e429 and was not
re-run in time. Run: `.venv/bin/python -m pytest -q tests/sglang/link_telemetry_e2e.py` (root).

Link telemetry with real servers (issue 12 M8): a prfaas_zmq remote prefill in a network namespace sends
KV over a `tc tbf` link to a decode on the host; the router, on the host, polls the prefill's transport
stats across the link (`--prfaas-zmq-stats-host` = the prefill's routable address).

Checked: during the transfers the router's link goodput is measured (stats_ok, > 0, never above the link
rate) and, integrated over the run, it accounts for the bytes the transport itself counted within 10%.
The tiny model's KV is ~0.5 KB/token, so the link is slow (4 Mbit/s) to make a few long prompts a long
transfer. The same property at 200 Mbit/s with the real transport and no model is
tests/fast/test_router_telemetry.py::test_router_measures_the_goodput_the_transport_measured_over_a_tbf_link.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import urllib.request

import aiohttp
import pytest

from prfaas_sgl.config import PrfaasConfig
from prfaas_sgl.tools.launch import free_port
from prfaas_sgl.tools.netns import emulated_link, root_problem
from prfaas_sgl.router.app import start_router
from prfaas_sgl.router.config import InstanceSpec, RouterConfig
from prfaas_sgl.transfer.security import generate_keys

from .conftest import HYBRID, Farm, spec
from .prompts import prompt_ids

pytestmark = [pytest.mark.sglang, pytest.mark.netns, pytest.mark.timeout(900)]
RATE_MBIT = 4
PROMPT_TOKENS = 6000
CONCURRENT = 3  # ~3 x 3 MB of KV: ~20 s on the link
ZMQ = ("--prfaas-zmq-timeout-s", "120")


@pytest.fixture(scope="module")
def link():
    if root_problem():
        pytest.skip(f"link telemetry: {root_problem()}")
    if "zmq_stats_host" not in {f.name for f in dataclasses.fields(PrfaasConfig)}:
        pytest.skip("needs --prfaas-zmq-stats-host (issue 12 M8: the stats bind address)")
    with emulated_link(rate=f"{RATE_MBIT}mbit") as lk:
        yield lk


@pytest.fixture(scope="module")
def farm(link, log_dir):
    stats_port, keys = free_port(), str(log_dir / "telemetry_keys")
    generate_keys(keys)  # routable addresses: the data plane requires CURVE
    zmq = ZMQ + ("--prfaas-zmq-curve-keys", keys)
    farm = Farm({
        "prefill": spec(log_dir, "telemetry_prefill", HYBRID, mode="prefill", transfer_backend="prfaas_zmq",
                        host=link.remote_ip, netns=link.netns, bootstrap_port=free_port(),
                        extra_args=zmq + ("--prfaas-role", "remote", "--prfaas-zmq-stats-port", str(stats_port),
                                          "--prfaas-zmq-stats-host", link.remote_ip)),
        "decode": spec(log_dir, "telemetry_decode", HYBRID, mode="decode", transfer_backend="prfaas_zmq",
                       host=link.local_ip, extra_args=zmq + ("--prfaas-role", "local")),
    }).start()
    farm.stats_url = f"http://{link.remote_ip}:{stats_port}/stats"
    try:
        yield farm
    finally:
        farm.stop()


def _transport_bytes(url: str) -> int:
    doc = json.loads(urllib.request.urlopen(url, timeout=10).read())
    return sum(peer["bytes_total"] for peer in doc["links"].values())


async def _run(farm, tmp_path) -> tuple[list[tuple[float, float, bool]], int]:
    """Router goodput samples (t, bits/s, stats_ok) while CONCURRENT long prompts go remote; bytes the
    transport acknowledged meanwhile."""
    p, d = farm["prefill"], farm["decode"]
    cfg = RouterConfig(port=0, prfaas=(InstanceSpec(p.spec.url, p.spec.bootstrap_port),),
                       decode=(InstanceSpec(d.spec.url),), tokenizer_path=p.spec.model_path, policy="all_remote",
                       block_size=1, link_gbps=RATE_MBIT / 1000, loads_interval_s=0.25,
                       transport_stats_url=farm.stats_url, prefill_timeout_s=300, request_timeout_s=300)
    before = _transport_bytes(farm.stats_url)
    handle = await start_router(cfg)
    samples: list[tuple[float, float, bool]] = []
    try:
        async with aiohttp.ClientSession() as http:
            async def one(i: int) -> int:
                ids = prompt_ids(p.spec.model_path, PROMPT_TOKENS, seed=i)
                body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}}
                async with http.post(handle.url + "/generate", json=body) as r:
                    return r.status

            reqs = asyncio.gather(*(one(i) for i in range(CONCURRENT)))
            link, t0, done_at, fresh = handle.router.cluster.link, time.monotonic(), None, set()
            # After the last request, wait for two newer readings: the last bytes are in their counter delta.
            while done_at is None or (len(fresh) < 2 and time.monotonic() - done_at < 15):
                samples.append((time.monotonic() - t0, link.goodput_bps, link.stats_ok))
                if done_at is None and reqs.done():
                    done_at = time.monotonic()
                if done_at is not None and link.good_at > done_at:
                    fresh.add(link.good_at)
                await asyncio.sleep(0.05)
            assert await reqs == [200] * CONCURRENT
    finally:
        await handle.close()
    return samples, _transport_bytes(farm.stats_url) - before


def test_router_goodput_accounts_for_the_transports_bytes(farm, tmp_path):
    samples, acked = asyncio.run(_run(farm, tmp_path))
    assert acked > 4 << 20, f"too little KV crossed the link to judge: {acked} B"
    assert all(ok for _, _, ok in samples[4:]), "the router lost the transport stats during the run"
    router_bits = sum(g * (t1 - t0) for (t0, g, _), (t1, _, _) in zip(samples, samples[1:]))
    assert router_bits == pytest.approx(8 * acked, rel=0.10)
    busy = [g for _, g, _ in samples if g > 0]
    assert busy and max(busy) <= 1.05 * RATE_MBIT * 1e6, max(busy, default=0)
