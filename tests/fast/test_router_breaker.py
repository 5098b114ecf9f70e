"""A prefill whose transfers keep failing leaves rotation (router/breaker.py), though it answers ``/health``.

The remote stand-in below answers its prefill requests but never hands over the KV, like a prefill whose
transfer engine died under a live HTTP server: each decode waits, then answers 500. The router used to retry
every such request locally and send the next one to the same prefill again, for as long as it passed its
health probes (a decode 5xx never counted against the prefill).
"""

from __future__ import annotations

import asyncio
import itertools

import pytest
from aiohttp import web

from prfaas_sgl.router.breaker import Breaker
from tests.support.router_standin import Standin

from .test_router_hardening import metric
from .test_router_http import LONG, rig, run

pytestmark = pytest.mark.timeout(60)


SERIAL = itertools.count()


def fresh() -> dict:
    """A long prompt no server has cached (the threshold policy sends it to the remote; a cached prefix would
    make it short)."""
    return {"model": "tiny", "prompt": f"request {next(SERIAL)} says: " + LONG, "max_tokens": 2}


class Blackhole(Standin):
    """A prefill that answers 200 and never delivers the KV while ``lost`` (decode times out: HTTP 500), or
    refuses every request with a 400 while ``refuse``."""

    lost = False
    refuse = False

    async def generate(self, request: web.Request) -> web.StreamResponse:
        if self.role == "prefill" and (self.lost or self.refuse):
            self.received.append(await request.json())
            if self.refuse:
                return web.json_response({"error": {"message": "bad request"}}, status=400)
            return web.json_response({"text": "", "meta_info": {}})
        return await super().generate(request)


def test_breaker_states():
    b = Breaker(failures_to_open=2, cooldown_s=10.0)
    assert b.allows(0.0) and not b.failed(1.0) and b.state(1.0) == "closed"
    assert b.failed(2.0) and b.state(2.0) == "open" and not b.allows(11.9)
    assert not b.failed(3.0) and b.opened == 1  # a late failure while open restarts the cool-down only
    assert b.state(13.0) == "half_open" and b.allows(13.0)
    b.start(13.0)
    assert not b.allows(13.0)  # one trial at a time
    b.no_verdict()  # the trial's client left: another may try
    assert b.allows(13.0)
    b.start(13.0)
    assert b.failed(14.0) and b.opened == 2 and b.state(14.0) == "open"  # the trial failed: open again
    b.start(30.0)
    b.succeeded()
    assert b.state(30.0) == "closed" and b.failures == 0
    off = Breaker(failures_to_open=0)
    assert not any(off.failed(t) for t in range(100)) and off.allows(100.0)


def test_prefill_whose_transfers_keep_failing_leaves_rotation_then_returns(tmp_path):
    async def body():
        async with rig(tmp_path, standin=Blackhole, breaker_failures=3, breaker_cooldown_s=1.0) as r:
            r.decode.kv_wait_s = 0.2
            r.remote.lost = True
            for _ in range(6):  # each answered by the local retry
                assert (await r.post("/v1/completions", fresh()))[0] == 200
            assert len(r.remote.received) == 3 and len(r.local.received) == 6
            remote = r.router.router.cluster.instances["prfaas0"]
            assert remote.healthy  # its /health passes all along: only the breaker keeps it out
            assert await metric(r, 'prfaas_router_breaker_opened_total{instance="prfaas0"}') == 1.0
            assert await metric(r, 'prfaas_router_breaker_open{instance="prfaas0"}') == 1.0
            assert await metric(r, 'prfaas_router_breaker_open{instance="decode0"}') == 0.0
            await asyncio.sleep(1.1)  # half-open: the next request is a trial; it fails, so it opens again
            assert (await r.post("/v1/completions", fresh()))[0] == 200
            assert len(r.remote.received) == 4 and remote.breaker.opened == 2
            r.remote.lost = False  # repaired
            await asyncio.sleep(1.1)
            for _ in range(3):  # the trial succeeds, the breaker closes, the remote serves again
                assert (await r.post("/v1/completions", fresh()))[0] == 200
            assert len(r.remote.received) == 7 and remote.breaker.state(0) == "closed"
            assert await metric(r, 'prfaas_router_breaker_open{instance="prfaas0"}') == 0.0
    run(body())


def test_client_4xx_never_opens_a_breaker(tmp_path):
    async def body():
        async with rig(tmp_path, standin=Blackhole, breaker_failures=2) as r:
            r.remote.refuse = True
            for _ in range(5):
                assert (await r.post("/v1/completions", fresh()))[0] == 400
            assert len(r.remote.received) == 5
            assert all(i.breaker.failures == 0 for i in r.router.router.cluster.instances.values())
    run(body())
