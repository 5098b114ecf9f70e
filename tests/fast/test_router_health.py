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
