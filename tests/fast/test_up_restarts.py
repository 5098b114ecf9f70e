"""`prfaas up` restarts a server that dies, on real processes: with a delay that doubles per fast failure up
to a bound, a count reset by a healthy period, a loud give-up, a supervisor's ``GET /restarts``, and the
router taking the restarted server back at its URL. Before: a dead server stayed dead (nothing watched it).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import urllib.request

import pytest

from prfaas_sgl.router.app import start_router
from prfaas_sgl.router.config import InstanceSpec, RouterConfig
from prfaas_sgl.tools.deploy.keeper import Keeper, RestartPolicy
from prfaas_sgl.tools.launch import ManagedProcess, ServerSpec, free_port
from tests.fast.test_up_signals import Up, alive, deployment, wait_gone
from tests.support.router_standin import build_tiny_tokenizer
from tests.support.up_standin import StandinServer

pytestmark = pytest.mark.timeout(120)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def standin(tmp_path, mode: str = "decode") -> StandinServer:
    port = free_port()
    spec = ServerSpec(model_path="standin", port=port, mode=mode, bootstrap_port=free_port() if mode == "prefill"
                      else None, log_path=str(tmp_path / f"{mode}-{port}.log"))
    return StandinServer(spec).start().wait_healthy(30)


async def tick_until(keeper: Keeper, done, timeout_s: float = 30.0) -> None:
    async def loop():
        while not done():
            await keeper.tick()
            await asyncio.sleep(0.05)
    await asyncio.wait_for(loop(), timeout_s)


def test_delays_double_per_fast_failure_up_to_the_bound_then_it_gives_up_loudly(tmp_path, capfd):
    clock, said = Clock(), []
    keeper = Keeper(RestartPolicy(first_delay_s=1, max_delay_s=4, healthy_after_s=60, give_up_after=5),
                    said.append, grace_s=1.0, clock=clock)
    proc = ManagedProcess(["sh", "-c", "echo crashing; exit 3"], {}, str(tmp_path / "x.log"), "http://127.0.0.1:9")
    keeper.keep("x", proc.start())
    clock.t = 100.0  # healthy for 100 s before its first death: not a fast failure
    delays = []

    async def body():
        while not keeper.kept["x"].gave_up:
            k = keeper.kept["x"]
            await tick_until(keeper, lambda: k.restart_at is not None or k.gave_up)
            if k.restart_at is not None:
                delays.append(k.restart_at - clock.t)
                clock.t = k.restart_at
                await keeper.tick()  # the restart
                clock.t += 0.5
    asyncio.run(body())
    k = keeper.kept["x"]
    assert delays == [1, 1, 2, 4, 4] and k.restarts == 5 and k.fast_failures == 5 and k.last_exit == 3
    assert keeper.report()["processes"]["x"]["state"] == "gave_up"
    assert sum("restarted x" in line for line in said) == 5
    assert "GIVING UP on x" in said[-1] and "GIVING UP on x" in capfd.readouterr().err
    assert proc.log_path.read_text().count("crashing") == 6  # each run appends: the crash stays readable


def test_a_healthy_period_resets_the_count_and_a_released_server_is_not_restarted(tmp_path):
    clock = Clock()
    keeper = Keeper(RestartPolicy(first_delay_s=1, healthy_after_s=60), lambda line: None, grace_s=2.0, clock=clock)
    srv = standin(tmp_path)
    keeper.keep("d0", srv)
    k = keeper.kept["d0"]

    async def body():
        clock.t = 10.0
        first = srv.pid
        os.kill(first, signal.SIGKILL)
        await tick_until(keeper, lambda: k.restart_at is not None)
        assert k.fast_failures == 1  # died 10 s into its health
        clock.t = k.restart_at
        await tick_until(keeper, lambda: k.healthy_since is not None)  # restarted, /health answered
        assert k.restarts == 1 and srv.pid != first and srv.alive()
        clock.t += 60.0
        await keeper.tick()
        assert k.fast_failures == 0  # 60 s healthy: the next death is a first one again
        keeper.release("d0")  # what the supervisor does before a deliberate stop
        srv.stop(grace_s=2.0)
        for _ in range(10):
            await keeper.tick()
        assert not srv.alive() and k.restarts == 1
    try:
        asyncio.run(body())
    finally:
        srv.stop(grace_s=1.0)


def test_the_router_takes_a_restarted_server_back_at_its_url(tmp_path):
    keeper = Keeper(RestartPolicy(first_delay_s=0.2), lambda line: None, grace_s=2.0)
    p0, d0 = standin(tmp_path, "prefill"), standin(tmp_path, "decode")
    keeper.keep("p0", p0)
    cfg = RouterConfig(port=0, local_prefill=(InstanceSpec(p0.url, p0.spec.bootstrap_port, None, "p0"),),
                       decode=(InstanceSpec(d0.url, None, None, "d0"),), policy="local_only",
                       tokenizer_path=build_tiny_tokenizer(str(tmp_path / "tok")), served_model_name="tiny",
                       context_length=2048, block_size=4, health_interval_s=0.1, unhealthy_after=1)

    async def body():
        handle = await start_router(cfg, seed=0)
        watch = asyncio.create_task(keeper.run(period_s=0.05))
        inst = handle.router.cluster.instances["p0"]
        try:
            assert inst.healthy
            p0.kill()
            await asyncio.wait_for(_until(lambda: not inst.healthy), 10)  # the router saw it die
            await asyncio.wait_for(_until(lambda: inst.healthy), 30)  # ... and come back
            assert keeper.kept["p0"].restarts == 1 and inst.spec.url == p0.url
        finally:
            watch.cancel()
            await handle.close()
    try:
        asyncio.run(body())
    finally:
        for p in (p0, d0):
            p.stop(grace_s=1.0)


async def _until(cond) -> None:
    while not cond():
        await asyncio.sleep(0.02)


def test_prfaas_up_restarts_a_killed_server_and_its_supervisor_lists_it(tmp_path):
    dep = deployment(tmp_path, supervisor={"port": free_port()}, policy={"first_delay_s": 0.2})
    up = Up(tmp_path, dep)
    try:
        old = up.named["d0"]
        os.kill(old, signal.SIGKILL)
        up.wait_for("[up] d0 exited with -9")
        new = int(up.wait_for("[up] restarted d0 (restart 1").split("pid ")[1].rstrip(")\n"))
        up.wait_for("[up] d0 healthy again after restart 1")
        assert wait_gone([old], 1.0) == [] and alive(new) and new != old
        url = f"http://127.0.0.1:{dep['supervisor']['port']}/restarts"
        with urllib.request.urlopen(url, timeout=5) as r:
            d0 = json.load(r)["processes"]["d0"]
        assert (d0["state"], d0["restarts"], d0["pid"], d0["last_exit"]) == ("healthy", 1, new, -9)
        port = next(s["port"] for s in dep["servers"] if s["name"] == "d0")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            assert r.status == 200  # same URL: the router needs nothing new
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(15) == 0 and wait_gone(up.children + [new], 2.0) == []
    finally:
        up.close()
