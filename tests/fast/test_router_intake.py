"""Admission before a body is read (router/intake.py): a cap on requests in the router (503 + Retry-After past
it), a byte budget for bodies being read and parsed, and a deadline for a body to arrive (408).

Each handler used to read its whole body before anything bounded it: memory grew as concurrency x body limit,
and a client that sent its headers and then one byte now and then held a handler forever.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from prfaas_sgl.router.intake import ByteBudget

from .test_router_http import LONG, SHORT, rig, run

pytestmark = pytest.mark.timeout(60)


async def open_upload(url: str, path: str, length: int, first: bytes) -> tuple[asyncio.StreamReader,
                                                                                asyncio.StreamWriter]:
    """A POST whose headers promise ``length`` body bytes, of which only ``first`` is sent."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {length}\r\n\r\n".encode() + first)
    await writer.drain()
    return reader, writer


async def status_of(reader: asyncio.StreamReader) -> tuple[int, str]:
    head = (await reader.readuntil(b"\r\n\r\n")).decode()
    return int(head.split()[1]), head


def test_requests_past_the_cap_get_503_with_retry_after_and_health_answers(tmp_path):
    async def body():
        async with rig(tmp_path, max_concurrent_requests=2) as r:
            r.decode.delay_s = 1.0
            req = {"model": "tiny", "prompt": SHORT, "max_tokens": 2}
            held = [asyncio.create_task(r.post("/v1/completions", req)) for _ in range(2)]
            while r.router.router.intake.active < 2:
                await asyncio.sleep(0.01)
            async with r.http.post(r.router.url + "/v1/completions", json=req) as resp:
                out = await resp.json()
                assert resp.status == 503 and resp.headers["Retry-After"] == "1"
                assert out["error"]["code"] == "overloaded" and "--max-concurrent-requests" in out["error"]["message"]
            async with r.http.get(r.router.url + "/health") as resp:
                assert resp.status == 200
            assert [s for s, _ in await asyncio.gather(*held)] == [200, 200]
            assert r.router.router.intake.active == 0
            assert (await r.post("/v1/completions", req))[0] == 200
    run(body())


def test_a_body_that_does_not_arrive_gets_408_and_gives_its_budget_back(tmp_path):
    async def body():
        async with rig(tmp_path, body_timeout_s=0.5) as r:
            t0 = time.monotonic()
            reader, writer = await open_upload(r.router.url, "/v1/completions", 5000, b'{"model": "tiny", ')
            status, head = await asyncio.wait_for(status_of(reader), 10)
            took = time.monotonic() - t0
            writer.close()
            assert status == 408 and 0.4 < took < 5.0, (status, took)
            assert "connection: close" in head.lower()
            intake = r.router.router.intake
            assert intake.budget.used == 0 and intake.active == 0
            assert (await r.post("/v1/completions", {"model": "tiny", "prompt": SHORT}))[0] == 200
    run(body())


def test_a_body_waits_for_budget_held_by_bodies_being_read(tmp_path):
    """Budget 30 KB: an upload that declared 51 KB holds all of it while it trickles; a small complete request
    waits (its body unread) until the first one's body is complete and parsed."""
    async def body():
        async with rig(tmp_path, max_body_bytes=65536, max_body_bytes_in_flight=30_000, body_timeout_s=20) as r:
            big = json.dumps({"model": "tiny", "prompt": LONG, "user": "u" * 50_000}).encode()
            reader, writer = await open_upload(r.router.url, "/v1/completions", len(big), big[:100])
            intake = r.router.router.intake
            while intake.budget.used < 30_000:
                await asyncio.sleep(0.01)
            small = asyncio.create_task(r.post("/v1/completions", {"model": "tiny", "prompt": SHORT}))
            await asyncio.sleep(0.5)
            assert not small.done() and len(intake.budget.waiters) == 1
            writer.write(big[100:])
            await writer.drain()
            assert (await asyncio.wait_for(status_of(reader), 10))[0] == 200
            assert (await asyncio.wait_for(small, 10))[0] == 200
            writer.close()
            assert intake.budget.used == 0
    run(body())


def test_budget_serves_in_order_and_a_cancelled_wait_holds_nothing():
    async def body():
        budget = ByteBudget(100)
        assert await budget.take(70) == 70
        big = asyncio.create_task(budget.take(60))
        small = asyncio.create_task(budget.take(10))  # would fit, but waits behind the larger one (no starvation)
        gone = asyncio.create_task(budget.take(500))  # capped at the whole budget
        await asyncio.sleep(0.01)
        assert not big.done() and not small.done() and budget.used == 70
        gone.cancel()
        budget.give(70)
        assert await big == 60 and await small == 10 and budget.used == 70
        with pytest.raises(asyncio.CancelledError):
            await gone
        budget.give(60)
        budget.give(10)
        assert budget.used == 0 and not budget.waiters
        assert await asyncio.wait_for(budget.take(500), 1) == 100
    run(body())
