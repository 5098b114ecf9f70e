"""The supervisor actuator on real processes: a supervisor (what `prfaas up` keeps) owns stand-in server
processes; the router drains one, the supervisor restarts it in the other role, the router readmits it —
under load, no request lost, every action logged and counted. And the supervisor's admin API is closed by
default: signed requests only (tests/fast/test_up_supervisor_auth.py has the details)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass
from typing import AsyncIterator

import aiohttp
import pytest

from prfaas_sgl.tools.deploy.supervisor import Supervisor
from prfaas_sgl.router.actuators.base import Split
from prfaas_sgl.router.actuators.decide import DecideConfig
from prfaas_sgl.router.actuators.supervisor import SupervisorActuator, sign
from prfaas_sgl.router.app import RouterHandle, start_router
from prfaas_sgl.router.config import RouterConfig, parse_supervisor_urls
from prfaas_sgl.router.controller_glue import close_loop
from tests.support.router_standin import build_tiny_tokenizer
from tests.support.scripted_controller import Recommends
from tests.support.standin_process import StandinProcesses

pytestmark = pytest.mark.timeout(120)
TOKEN = "s3cret-token-of-at-least-32-bytes"


@dataclass
class Rig:
    router: RouterHandle
    servers: StandinProcesses
    supervisor: Supervisor
    http: aiohttp.ClientSession

    async def gen(self, i: int) -> int:
        body = {"input_ids": list(range(i % 7 + 3)), "sampling_params": {"max_new_tokens": 2}}
        async with self.http.post(self.router.url + "/generate", data=json.dumps(body)) as r:
            await r.read()
            return r.status


@contextlib.asynccontextmanager
async def rig(tmp_path) -> AsyncIterator[Rig]:
    servers = StandinProcesses(delay_s=0.2)
    sup = None
    try:
        specs = {n: await servers.start(n, pool) for n, pool in
                 (("p0", "local_prefill"), ("p1", "local_prefill"), ("d0", "decode"))}
        sup = Supervisor(servers, list(specs), "127.0.0.1", token=TOKEN)
        await sup.serve(0)
        cfg = RouterConfig(port=0, local_prefill=(specs["p0"], specs["p1"]), decode=(specs["d0"],),
                           policy="local_only", tokenizer_path=build_tiny_tokenizer(str(tmp_path / "tok")),
                           served_model_name="tiny", context_length=2048, block_size=4, prefill_timeout_s=10,
                           request_timeout_s=20)
        handle = await start_router(cfg, seed=0)
        http = aiohttp.ClientSession()
        try:
            yield Rig(handle, servers, sup, http)
        finally:
            await http.close()
            await handle.close()
    finally:
        if sup is not None:
            await sup.close()
        servers.close()


def test_switch_through_the_supervisor_under_load_loses_nothing_and_is_counted(tmp_path, caplog):
    caplog.set_level("INFO")

    async def body():
        async with rig(tmp_path) as r:
            router = r.router.router
            router.core.controller = Recommends((1, 2))
            urls = {n: r.supervisor.url for n in ("p0", "p1", "d0")}
            acting = close_loop(router, lambda cluster, report: SupervisorActuator(
                cluster, urls, TOKEN, report, poll_s=0.02), DecideConfig(confirm=2, dwell_s=3600))
            load = [asyncio.create_task(r.gen(i)) for i in range(40)]
            while min(router.cluster.instances[n].inflight for n in ("p0", "p1")) == 0:
                await asyncio.sleep(0.005)
            router.core.controller_tick(1.0)
            assert not acting.tasks  # hysteresis: one recommendation does not move a server
            router.core.controller_tick(2.0)
            await asyncio.gather(*acting.tasks)
            name = acting.actions[0].detail.split(":")[0]
            inst = router.cluster.instances[name]
            assert acting.actions[0].outcome == "in_progress" and inst.draining and inst.inflight > 0
            old_url = inst.spec.url
            acting.inner.rec = (2, 1)  # the traffic swings back at once: the dwell time keeps the server put
            router.core.controller_tick(3.0)
            router.core.controller_tick(4.0)
            assert len(acting.actions) == 1 and acting.decider.held.startswith("dwell")  # no flap back
            await acting.actuator.task
            assert all(s == 200 for s in await asyncio.gather(*load))  # none lost across the switch
            assert [a.outcome for a in acting.actions] == ["in_progress", "applied"]
            assert r.servers.events[-2:] == [f"stop {name}", f"start {name} decode"]  # drained, then stopped
            assert inst.pool == "decode" and inst.healthy and not inst.draining and inst.spec.url != old_url
            assert acting.actuator.current() == Split(1, 2)
            assert all(s == 200 for s in await asyncio.gather(*(r.gen(i) for i in range(12))))
            async with r.http.get(r.router.url + "/metrics") as resp:
                text = await resp.text()
            for outcome in ("in_progress", "applied"):
                assert (f'prfaas_router_controller_actions_total{{actuator="supervisor",outcome="{outcome}",'
                        f'reason="more_decode"}} 1.0') in text
    asyncio.run(body())
    logged = [m for m in caplog.messages if m.startswith("controller action [supervisor]")]
    assert len(logged) == 2 and all("more_decode" in m for m in logged)


def test_a_failed_start_is_reported_and_the_server_returns_to_its_role(tmp_path):
    async def body():
        async with rig(tmp_path) as r:
            reported = []
            act = SupervisorActuator(r.router.router.cluster, {"p0": r.supervisor.url}, TOKEN, reported.append,
                                     poll_s=0.02)
            real_start = r.servers.start

            async def start_fails_as_decode(name: str, pool: str):
                if pool == "decode":
                    raise RuntimeError("server exited")
                return await real_start(name, pool)
            r.servers.start = start_fails_as_decode
            assert (await act.apply(Split(1, 2), "more_decode")).detail.startswith("p0:")  # the only one it owns
            await act.task
            assert reported[0].outcome == "failed" and "server exited" in reported[0].detail
            inst = r.router.router.cluster.instances["p0"]
            assert inst.pool == "local_prefill" and inst.healthy and not inst.draining
            assert all(s == 200 for s in await asyncio.gather(*(r.gen(i) for i in range(6))))
    asyncio.run(body())


def test_the_admin_api_needs_signed_requests_and_a_tokenless_supervisor_stays_on_loopback(tmp_path):
    def signed(path: str, body: bytes = b"{}") -> dict:
        return {**sign(TOKEN, "POST", path, body), "Content-Type": "application/json"}

    async def body():
        async with rig(tmp_path) as r:
            async with aiohttp.ClientSession() as s:
                for headers in ({}, {"Authorization": f"Bearer {TOKEN}"}, sign("w" * 32, "POST", "/servers/p0/stop", b"")):
                    async with s.post(f"{r.supervisor.url}/servers/p0/stop", headers=headers, json={}) as resp:
                        assert resp.status == 401
                async with s.get(f"{r.supervisor.url}/servers", headers=sign(TOKEN, "GET", "/servers", b"")) as resp:
                    assert (await resp.json())["servers"] == ["p0", "p1", "d0"]
                bad_pool = json.dumps({"pool": "prfaas"}).encode()
                async with s.post(f"{r.supervisor.url}/servers/p0/start", data=bad_pool,
                                  headers=signed("/servers/p0/start", bad_pool)) as resp:
                    assert resp.status == 400  # only the local roles
                async with s.post(f"{r.supervisor.url}/servers/zz/stop", data=b"{}",
                                  headers=signed("/servers/zz/stop")) as resp:
                    assert resp.status == 404
            assert r.servers.events == ["start p0 prefill", "start p1 prefill", "start d0 decode"]  # nothing moved
    asyncio.run(body())
    with pytest.raises(ValueError, match="PRFAAS_SUPERVISOR_TOKEN"):
        Supervisor(StandinProcesses(), ["p0"], "0.0.0.0")
    Supervisor(StandinProcesses(), ["p0"], "10.0.0.5", token=TOKEN)  # elsewhere with a token: fine


def test_supervisor_urls_flag():
    assert parse_supervisor_urls("p0=http://10.0.0.5:8101/, d0 = http://h:1") == {
        "p0": "http://10.0.0.5:8101", "d0": "http://h:1"}
    assert parse_supervisor_urls("") == {}
    for bad in ("p0", "p0=10.0.0.5:8101", "=http://h:1"):
        with pytest.raises(ValueError, match="supervisor-urls"):
            parse_supervisor_urls(bad)
