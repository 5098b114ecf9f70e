"""The supervisor's admin API over real HTTP: signed requests (HMAC-SHA256, timestamp window, nonce spent
once), a token of at least 32 bytes, per-machine tokens, and no browser (JSON only, foreign Origin refused,
loopback Host when it has no token).

Before: the token travelled in clear as ``Authorization: Bearer`` (a captured request replayed forever),
any token length passed, ``stop`` took any Content-Type and any Origin, and a tokenless supervisor
answered any Host (DNS rebinding)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import AsyncIterator

import aiohttp
import pytest

from prfaas_sgl.router.actuators.supervisor import SupervisorClient, sign, supervisor_tokens
from prfaas_sgl.router.config import InstanceSpec
from prfaas_sgl.tools.deploy.supervisor import Supervisor

pytestmark = pytest.mark.timeout(60)
TOKEN, OTHER = "a" * 32, "b" * 48


class Recorder:
    """A ``ServerControl`` that records calls: what reached the servers, and what did not."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def owns(self, name: str) -> bool:
        return True

    async def stop(self, name: str) -> None:
        self.calls.append(f"stop {name}")

    async def start(self, name: str, pool: str) -> InstanceSpec:
        self.calls.append(f"start {name} {pool}")
        return InstanceSpec("http://127.0.0.1:1", None, None, name)


@contextlib.asynccontextmanager
async def supervisor(token: str) -> AsyncIterator[tuple[Supervisor, Recorder, aiohttp.ClientSession]]:
    control = Recorder()
    sup = Supervisor(control, ["p0", "p1"], "127.0.0.1", token)
    await sup.serve(0)
    try:
        async with aiohttp.ClientSession() as http:
            yield sup, control, http
    finally:
        await sup.close()


async def post(http, sup, path: str, body: bytes = b"{}", headers=None, **kw) -> int:
    headers = {"Content-Type": "application/json", **(headers or {})}
    async with http.post(sup.url + path, data=body, headers=headers, **kw) as r:
        return r.status


def test_only_signed_fresh_unreplayed_requests_pass():
    async def body():
        async with supervisor(TOKEN) as (sup, control, http):
            stop = "/servers/p0/stop"
            assert await post(http, sup, stop, headers={"Authorization": f"Bearer {TOKEN}"}) == 401  # never in clear
            assert await post(http, sup, stop) == 401
            assert await post(http, sup, stop, headers=sign(OTHER, "POST", stop, b"{}")) == 401
            assert await post(http, sup, stop, headers=sign(TOKEN, "POST", "/servers/p1/stop", b"{}")) == 401
            assert await post(http, sup, stop, headers=sign(TOKEN, "POST", stop, b'{"x": 1}')) == 401
            assert await post(http, sup, stop, headers=sign(TOKEN, "POST", stop, b"{}", time.time() - 31)) == 401
            assert control.calls == []
            good = sign(TOKEN, "POST", stop, b"{}", time.time() - 25)  # within the 30 s window
            assert await post(http, sup, stop, headers=good) == 200
            assert await post(http, sup, stop, headers=good) == 401  # the same request again: a replay
            assert control.calls == ["stop p0"]
            async with http.get(sup.url + "/servers", headers=sign(TOKEN, "GET", "/servers", b"")) as r:
                assert r.status == 200 and (await r.json())["servers"] == ["p0", "p1"]
    asyncio.run(body())


def test_browsers_are_refused_even_with_a_valid_signature():
    async def body():
        async with supervisor(TOKEN) as (sup, control, http):
            stop = "/servers/p0/stop"
            as_form = {**sign(TOKEN, "POST", stop, b"{}"), "Content-Type": "text/plain"}
            async with http.post(sup.url + stop, data=b"{}", headers=as_form) as r:
                assert r.status == 415
            foreign = {**sign(TOKEN, "POST", stop, b"{}"), "Origin": "http://evil.example"}
            assert await post(http, sup, stop, headers=foreign) == 403
            assert control.calls == []
            own = {**sign(TOKEN, "POST", stop, b"{}"), "Origin": sup.url}
            assert await post(http, sup, stop, headers=own) == 200
    asyncio.run(body())


def test_a_tokenless_loopback_supervisor_answers_loopback_hosts_only():
    async def body():
        async with supervisor("") as (sup, control, http):
            stop = "/servers/p0/stop"
            assert await post(http, sup, stop, headers={"Host": "evil.example"}) == 403  # DNS rebinding
            assert await post(http, sup, stop, headers={"Origin": "http://evil.example"}) == 403
            async with http.post(sup.url + stop, data=b'{}', headers={"Content-Type": "text/plain"}) as r:
                assert r.status == 415  # what a no-cors fetch or a form can send
            assert control.calls == []
            assert await post(http, sup, stop) == 200
            assert await post(http, sup, stop, headers={"Host": "localhost"}) == 200
            assert control.calls == ["stop p0", "stop p0"]
    asyncio.run(body())


def test_a_token_needs_32_bytes_on_both_sides():
    with pytest.raises(ValueError, match="at least 32"):
        Supervisor(Recorder(), ["p0"], "10.0.0.5", token="x" * 31)
    with pytest.raises(ValueError, match="at least 32"):
        SupervisorClient({"p0": "http://10.0.0.5:8101"}, "x" * 31)
    Supervisor(Recorder(), ["p0"], "10.0.0.5", token="x" * 32)


def test_per_machine_tokens():
    a, b = "http://10.0.0.5:8101", "http://10.0.0.6:8101"
    assert supervisor_tokens(TOKEN, [a, b]) == {a: TOKEN, b: TOKEN}
    assert supervisor_tokens(f"{a}={TOKEN}, {b}/={OTHER}", [a, b + "/"]) == {a: TOKEN, b: OTHER}
    assert supervisor_tokens("", [a]) == {a: ""}
    with pytest.raises(ValueError, match="no token for"):
        supervisor_tokens(f"{a}={TOKEN}", [a, b])
    with pytest.raises(ValueError, match="at least 32"):
        supervisor_tokens(f"{a}={TOKEN},{b}=short", [a, b])

    async def body():
        async with supervisor(TOKEN) as (one, calls_one, _), supervisor(OTHER) as (two, calls_two, _):
            client = SupervisorClient({"p0": one.url, "p1": two.url}, f"{one.url}={TOKEN},{two.url}={OTHER}")
            await client.stop("p0")
            await client.stop("p1")
            assert calls_one.calls == ["stop p0"] and calls_two.calls == ["stop p1"]
            with pytest.raises(RuntimeError, match="HTTP 401"):  # machine one's token is no good on machine two
                await SupervisorClient({"p1": two.url}, TOKEN).stop("p1")
            started = await client.start("p0", "decode")
            assert started.url == "http://127.0.0.1:1" and calls_one.calls == ["stop p0", "start p0 decode"]
    asyncio.run(body())
