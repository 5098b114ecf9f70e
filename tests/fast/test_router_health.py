"""Health probes: one slow/failed probe of a busy server does not take it out of rotation; a run does."""
from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from prfaas_sgl.router.cluster import Cluster, check_health
from prfaas_sgl.router.config import InstanceSpec, RouterConfig


async def _scenario(tmp_path):
    status = {"code": 200}

    async def health(_):
        return web.Response(status=status["code"])

    app = web.Application()
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    (tmp_path / "tokenizer.json").write_text("{}")
    cfg = RouterConfig(
        prfaas=(InstanceSpec(url, bootstrap_port=1),), local_prefill=(InstanceSpec(url, bootstrap_port=1),),
        decode=(InstanceSpec(url),), tokenizer_path=str(tmp_path), unhealthy_after=3,
    )
    cluster = Cluster(cfg)
    seen = []
    async with aiohttp.ClientSession() as session:
        for code in (200, 503, 503, 503, 503, 200):
            status["code"] = code
            await check_health(cluster, session)
            seen.append(cluster.instances["prfaas0"].healthy)
    await runner.cleanup()
    return seen


def test_three_failed_probes_take_an_instance_out_and_one_success_brings_it_back(tmp_path):
    assert asyncio.run(_scenario(tmp_path)) == [True, True, True, False, False, True]


# ---------------------------------------------------------------- first probe


def _dead_url() -> str:
    """A loopback port nothing listens on (bound, then closed): connections to it are refused."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


async def _first_requests(tmp_path) -> tuple[list[int], int, int, int]:
    from prfaas_sgl.router.app import start_router
    from tests.support.router_standin import RoomBoard, Standin, build_tiny_tokenizer

    board = RoomBoard()
    down = Standin("prefill", board)  # accepts connections, but its /health fails: never in rotation
    down.healthy = False
    live = [Standin(role, board, kv_wait_s=5) for role in ("prefill", "prefill", "decode")]
    for s in (down, *live):
        await s.start()
    # the down prefill and the dead decode come first by name: least-loaded ties go to them unless health says no
    cfg = RouterConfig.from_flags(
        port=0, prfaas=(InstanceSpec(live[0].url, 8998),),
        local_prefill=(InstanceSpec(down.url, 8997), InstanceSpec(live[1].url, 8999)),
        decode=(InstanceSpec(_dead_url()), InstanceSpec(live[2].url)),
        tokenizer_path=build_tiny_tokenizer(str(tmp_path / "tok")), served_model_name="tiny", context_length=2048,
        policy="threshold", threshold=10_000, block_size=4, prefill_timeout_s=5, request_timeout_s=10,
        health_interval_s=3600)  # only the router's first probe runs during the test
    statuses = []
    handle = await start_router(cfg, seed=0)
    try:
        async with aiohttp.ClientSession() as http:
            for i in range(3):
                body = {"model": "tiny", "prompt": f"hello world {i}", "max_tokens": 4}
                async with http.post(handle.url + "/v1/completions", json=body) as r:
                    statuses.append(r.status)
        retries = sum(s.value for m in handle.router.metrics.retries.collect() for s in m.samples
                      if s.name.endswith("_total"))
    finally:
        await handle.close()
        for s in (down, *live):
            await s.close()
    return statuses, len(down.received), int(retries), len(live[1].received)


def test_a_server_that_never_passed_a_probe_gets_no_request_not_even_the_first(tmp_path):
    """Before: instances started healthy, so the first requests went to the down prefill and the dead decode
    (least loaded, first by name) and failed or were retried. Now only probed servers are routed to, and the
    router probes once before it listens, so the live servers serve at once."""
    statuses, to_down, retries, to_live = asyncio.run(_first_requests(tmp_path))
    assert statuses == [200, 200, 200]
    assert to_down == 0 and retries == 0
    assert to_live == 3
