"""The processes actuator on stand-in servers: drain, restart in the other role, readmit, no request lost."""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass
from typing import AsyncIterator

import aiohttp
import pytest

from prfaas_sgl.router.actuators.base import Action, Split
from prfaas_sgl.router.actuators.decide import DecideConfig
from prfaas_sgl.router.actuators.processes import ProcessesActuator
from prfaas_sgl.router.app import RouterHandle, start_router
from prfaas_sgl.router.config import InstanceSpec, RouterConfig
from prfaas_sgl.router.controller_glue import close_loop
from tests.support.router_standin import RoomBoard, Standin, build_tiny_tokenizer
from tests.support.scripted_controller import Recommends

pytestmark = pytest.mark.timeout(60)


class StandinControl:
    """ServerControl over stand-ins: a restart is a new stand-in in the other role on the same board."""

    def __init__(self, board: RoomBoard, servers: dict[str, Standin], fail_start: bool = False) -> None:
        self.board, self.servers, self.fail_start = board, servers, fail_start
        self.events: list[str] = []

    def owns(self, name: str) -> bool:
        return name in self.servers

    async def stop(self, name: str) -> None:
        self.events.append(f"stop {name}")
        try:  # a real stop kills the process; aiohttp's cleanup would wait for a hanging handler
            await asyncio.wait_for(self.servers[name].close(), 0.5)
        except asyncio.TimeoutError:
            pass

    async def start(self, name: str, pool: str) -> InstanceSpec:
        role = "prefill" if pool == "local_prefill" else "decode"
        self.events.append(f"start {name} {role}")
        if self.fail_start and role == "decode":
            raise RuntimeError("server exited")
        srv = self.servers[name] = Standin(role, self.board, delay_s=0.05, kv_wait_s=5)
        await srv.start()
        return InstanceSpec(srv.url, 9000 if role == "prefill" else None)


@dataclass
class Rig:
    router: RouterHandle
    servers: dict[str, Standin]
    control: StandinControl
    act: ProcessesActuator
    http: aiohttp.ClientSession

    async def gen(self, i: int) -> int:
        body = {"input_ids": list(range(i % 7 + 3)), "sampling_params": {"max_new_tokens": 2}}
        async with self.http.post(self.router.url + "/generate", data=json.dumps(body)) as r:
            await r.read()
            return r.status


@contextlib.asynccontextmanager
async def rig(tmp_path, fail_start: bool = False, drain_timeout_s: float = 10.0) -> AsyncIterator[Rig]:
    board = RoomBoard()
    servers = {"p0": Standin("prefill", board, delay_s=0.05, kv_wait_s=5),
               "p1": Standin("prefill", board, delay_s=0.05, kv_wait_s=5),
               "d0": Standin("decode", board, kv_wait_s=5)}
    for s in servers.values():
        await s.start()
    cfg = RouterConfig(port=0, local_prefill=(InstanceSpec(servers["p0"].url, 8998, name="p0"),
                                              InstanceSpec(servers["p1"].url, 8999, name="p1")),
                       decode=(InstanceSpec(servers["d0"].url, name="d0"),), policy="local_only",
                       tokenizer_path=build_tiny_tokenizer(str(tmp_path / "tok")), served_model_name="tiny",
                       context_length=2048, block_size=4, prefill_timeout_s=5, request_timeout_s=10)
    handle = await start_router(cfg, seed=0)
    control = StandinControl(board, servers, fail_start)
    act = ProcessesActuator(handle.router.cluster, control, drain_timeout_s=drain_timeout_s, poll_s=0.02)
    http = aiohttp.ClientSession()
    try:
        yield Rig(handle, servers, control, act, http)
    finally:
        await http.close()
        await handle.close()
        for s in servers.values():
            with contextlib.suppress(Exception):
                await s.close()


def test_switch_under_load_loses_no_request_and_readmits_in_the_new_pool(tmp_path):
    async def body():
        async with rig(tmp_path) as r:
            cluster = r.router.router.cluster
            load = [asyncio.create_task(r.gen(i)) for i in range(30)]
            while min(cluster.instances[n].inflight for n in ("p0", "p1")) == 0:  # both prefills busy
                await asyncio.sleep(0.005)
            action = await r.act.apply(Split(1, 2), "more_decode")
            assert action.outcome == "in_progress" and action.after == Split(1, 2)
            name = action.detail.split(":")[0]
            old, inst = r.servers[name], cluster.instances[name]
            assert inst.draining and inst.inflight > 0  # it had work when its drain began
            assert r.act.current() == Split(1, 2)  # the switching server counts in its new pool
            at_drain = inst.inflight  # requests the router had sent there (some not yet read by the server)
            assert (await r.act.apply(Split(1, 2), "more_decode")).outcome == "refused"  # one switch at a time
            await r.act.task
            assert all(s == 200 for s in await asyncio.gather(*load))
            assert len(old.received) == at_drain  # those finished, nothing new reached the draining server
            assert inst.pool == "decode" and inst.healthy and not inst.draining
            assert inst.spec.url == r.servers[name].url and inst.inflight == 0
            assert r.control.events[0] == f"stop {name}"  # stopped only after its requests finished
            after = await asyncio.gather(*(r.gen(i) for i in range(12)))
            assert all(s == 200 for s in after)
            assert r.servers[name].received, "the new decode server got no work"
    asyncio.run(body())


def test_drain_is_bounded_by_its_timeout(tmp_path):
    async def body():
        async with rig(tmp_path, drain_timeout_s=0.3) as r:
            cluster = r.router.router.cluster
            r.servers["p0"].fail = r.servers["p1"].fail = "hang"
            stuck = [asyncio.create_task(r.gen(i)) for i in range(2)]  # one on each prefill (least loaded)
            while min(cluster.instances[n].inflight for n in ("p0", "p1")) == 0:
                await asyncio.sleep(0.01)
            reported = []
            r.act.report = reported.append
            t0 = asyncio.get_running_loop().time()
            await r.act.apply(Split(1, 2), "more_decode")
            await asyncio.wait_for(r.act.task, 5)
            assert reported[0].outcome == "applied" and "1 request(s) cut at the 0 s drain bound" in reported[0].detail
            assert asyncio.get_running_loop().time() - t0 < 3
            for t in stuck:
                t.cancel()
    asyncio.run(body())


def test_failed_restart_puts_the_server_back_in_its_old_role(tmp_path):
    async def body():
        async with rig(tmp_path, fail_start=True) as r:
            reported = []
            r.act.report = reported.append
            await r.act.apply(Split(1, 2), "more_decode")
            await r.act.task
            assert reported[0].outcome == "failed" and reported[0].after == Split(2, 1)
            inst = r.router.router.cluster.instances[reported[0].detail.split(":")[0]]
            assert inst.pool == "local_prefill" and inst.healthy and not inst.draining
            assert r.act.current() == Split(2, 1)
            assert all(s == 200 for s in await asyncio.gather(*(r.gen(i) for i in range(6))))
    asyncio.run(body())


def test_never_empties_a_pool(tmp_path):
    async def body():
        async with rig(tmp_path) as r:
            action = await r.act.apply(Split(3, 1), "more_prefill")  # the only decode cannot leave
            assert action.outcome == "refused" and "decode" in action.detail
    asyncio.run(body())


def test_closed_loop_from_controller_tick_to_metrics(tmp_path):
    async def body():
        async with rig(tmp_path) as r:
            router = r.router.router
            router.core.controller = Recommends((1, 2))
            acting = close_loop(router, lambda cluster, report: ProcessesActuator(cluster, r.control, report,
                                                                                  poll_s=0.02),
                                DecideConfig(confirm=2, dwell_s=0))
            router.core.controller_tick(1.0)
            assert not acting.tasks  # hysteresis: one recommendation is not enough
            router.core.controller_tick(2.0)
            await asyncio.gather(*acting.tasks)
            await acting.actuator.task
            assert [a.outcome for a in acting.actions] == ["in_progress", "applied"]
            async with r.http.get(r.router.url + "/metrics") as resp:
                text = await resp.text()
            assert ('prfaas_router_controller_actions_total{actuator="processes",outcome="applied",'
                    'reason="more_decode"} 1.0') in text
            assert acting.actuator.current() == Split(1, 2)
    asyncio.run(body())


class FixedActuator:
    """Runs a split it never moves."""

    name = "fixed"

    def __init__(self, split: Split) -> None:
        self.split = split

    def current(self) -> Split:
        return self.split

    async def apply(self, target: Split, reason: str) -> Action:
        return Action(self.name, self.split, self.split, reason, "refused", "fixed")


def test_close_loop_sizes_the_planner_from_what_the_actuator_runs(tmp_path):
    async def body():
        async with rig(tmp_path) as r:
            router = r.router.router
            inner = router.core.controller = Recommends((1, 2))
            close_loop(router, lambda cluster, report: FixedActuator(Split(3, 4)))
            assert inner.split == (3, 4)  # not the router's lists: what the actuator says runs
    asyncio.run(body())
