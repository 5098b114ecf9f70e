"""The router's pooled connections to the servers expire before SGLang's server closes them (router/app.py)."""
from __future__ import annotations

import asyncio

from aiohttp import web

from prfaas_sgl.router.app import UPSTREAM_KEEPALIVE_S, upstream_session

SGLANG_KEEP_ALIVE_S = 5.0  # sglang.srt.environ SGLANG_TIMEOUT_KEEP_ALIVE, uvicorn's timeout_keep_alive


def test_sglangs_keep_alive_default_is_the_one_the_router_stays_under():
    from sglang.srt.environ import envs

    assert envs.SGLANG_TIMEOUT_KEEP_ALIVE.get() == SGLANG_KEEP_ALIVE_S
    assert UPSTREAM_KEEPALIVE_S < SGLANG_KEEP_ALIVE_S


def test_a_request_after_an_idle_gap_opens_a_fresh_connection_instead_of_one_the_server_may_be_closing():
    """A server that, like uvicorn, would close an idle connection at SGLang's 5 s: after an idle gap between
    the router's keep-alive and the server's, the router must not write into the old connection."""
    peers: list = []

    async def handler(request: web.Request) -> web.Response:
        peers.append(request.transport.get_extra_info("peername"))
        return web.Response(text="ok")

    async def run() -> None:
        app = web.Application()
        app.router.add_get("/health", handler)
        runner = web.AppRunner(app, keepalive_timeout=SGLANG_KEEP_ALIVE_S)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        session = upstream_session()
        try:
            for _ in range(2):
                async with session.get(f"http://127.0.0.1:{port}/health") as r:
                    assert await r.text() == "ok"
            await asyncio.sleep(UPSTREAM_KEEPALIVE_S + 0.3)
            async with session.get(f"http://127.0.0.1:{port}/health") as r:
                assert await r.text() == "ok"
        finally:
            await session.close()
            await runner.cleanup()

    asyncio.run(run())
    assert peers[0] == peers[1]  # back-to-back requests reuse the pooled connection
    assert peers[2] != peers[1]  # after the idle gap: a new connection
