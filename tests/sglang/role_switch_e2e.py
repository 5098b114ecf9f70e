"""Outside `make test` (no test_ prefix) to keep CI under its time limit (~500 s under load); run it with
`.venv/bin/python -m pytest -q tests/sglang/role_switch_e2e.py`.

A role switch under load with real SGLang servers (issue 15): two local prefills and one decode behind the
router; the controller recommends one more decode; the actuator drains a prefill, restarts it as a decode
with the same flags and the router admits it. Every request of the load must answer HF greedy's tokens
(0 lost), and the switched server must then serve its new role on its own. Twice on the same servers: first
the processes actuator (the router owns the servers, as in the demo), then the supervisor actuator (the
router calls a supervisor over HTTP with a bearer token, as on `prfaas up`), which switches back one server
toward the recommended split. ~20 small requests per switch: three server starts, two restarts.
"""
from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from prfaas_sgl.router.actuators.base import Split
from prfaas_sgl.router.actuators.decide import DecideConfig
from prfaas_sgl.router.actuators.processes import ProcessesActuator
from prfaas_sgl.router.actuators.supervisor import SupervisorActuator
from prfaas_sgl.router.config import InstanceSpec, RouterConfig
from prfaas_sgl.router.controller_glue import close_loop
from prfaas_sgl.tools.deploy.supervisor import Supervisor
from prfaas_sgl.tools.launch import free_port
from prfaas_sgl.tools.server_control import LaunchedServers
from tests.support.scripted_controller import Recommends

from .conftest import HYBRID, farm_for, spec
from .live_router import running_router
from .pd import post
from .prompts import prompt_ids
from .reference import hf_greedy

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(1200)]
NEW = 8
PD = dict(transfer_backend="prfaas_zmq", extra_args=("--prfaas-zmq-timeout-s", "120"))


def _specs(log_dir):
    return {"p0": spec(log_dir, "p0", HYBRID, mode="prefill", bootstrap_port=free_port(), **PD),
            "p1": spec(log_dir, "p1", HYBRID, mode="prefill", bootstrap_port=free_port(), **PD),
            "d0": spec(log_dir, "d0", HYBRID, mode="decode", **PD)}


farm = farm_for(_specs)


TOKEN = "role-switch-e2e-token-of-32-bytes-at-least"


@pytest.fixture(scope="module")
def supervisor_url(farm):
    """The farm's servers under a supervisor on its own loop and thread (as `prfaas up` runs it, apart from
    the router), with a token (the actuator signs its requests)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    sup = Supervisor(LaunchedServers(farm.servers), list(farm.servers), "127.0.0.1", TOKEN)
    url = asyncio.run_coroutine_threadsafe(sup.serve(0), loop).result(30)
    try:
        yield url
    finally:
        asyncio.run_coroutine_threadsafe(sup.close(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)


def _actuator(kind: str, farm, supervisor_url: str):
    if kind == "processes":
        return lambda cluster, report: ProcessesActuator(cluster, LaunchedServers(farm.servers), report,
                                                         drain_timeout_s=120)
    urls = {name: supervisor_url for name in farm.servers}
    return lambda cluster, report: SupervisorActuator(cluster, urls, TOKEN, report, drain_timeout_s=120)


def on_loop(loop: asyncio.AbstractEventLoop, fn):
    async def call():
        return fn()
    return asyncio.run_coroutine_threadsafe(call(), loop).result(30)


@pytest.mark.parametrize("kind", ["processes", "supervisor"])
def test_switch_under_load_loses_no_request(farm, model_paths, supervisor_url, kind):
    path = model_paths["hybrid"]
    prompts = [prompt_ids(path, 120 + 40 * i, seed=10 + i) for i in range(4)]
    want = [hf_greedy(path, p, NEW) for p in prompts]
    modes = {name: srv.spec.mode for name, srv in farm.servers.items()}  # the previous case switched one
    prefills = tuple(n for n, m in modes.items() if m == "prefill")
    decodes = tuple(n for n, m in modes.items() if m == "decode")
    # one server toward the other role: 2P/1D -> 1P/2D first, then back
    target = (len(prefills) - 1, len(decodes) + 1) if len(prefills) > 1 else (len(prefills) + 1, len(decodes) - 1)

    def inst(name: str) -> InstanceSpec:
        s = farm[name].spec
        return InstanceSpec(s.url, bootstrap_port=s.bootstrap_port, name=name)

    cfg = RouterConfig(port=0, local_prefill=tuple(map(inst, prefills)), decode=tuple(map(inst, decodes)),
                       policy="local_only", tokenizer_path=path, served_model_name="tiny", context_length=8192,
                       block_size=1, health_interval_s=2.0, prefill_timeout_s=300, request_timeout_s=300)
    with running_router(cfg) as (handle, loop):
        router = handle.router

        def wire():
            router.core.controller = Recommends(target, 8192)  # the test is about acting
            return close_loop(router, _actuator(kind, farm, supervisor_url), DecideConfig(confirm=1))

        acting = on_loop(loop, wire)

        def one(i: int) -> list[int]:
            k = i % len(prompts)
            body = {"input_ids": prompts[k], "sampling_params": {"max_new_tokens": NEW, "temperature": 0.0,
                                                                "ignore_eos": True}}
            out = post(handle.url + "/generate", body)
            assert out.get("output_ids") == want[k], (i, out)
            return out["output_ids"]

        stop = threading.Event()
        sent = []

        def load():
            i = 0
            while (not stop.is_set() or i < 8) and i < 60:  # ~1.5 s apart: a small load through the switch
                sent.append(pool.submit(one, i))
                i += 1
                time.sleep(1.5)

        with ThreadPoolExecutor(8) as pool:
            feeder = threading.Thread(target=load)
            feeder.start()
            while len(sent) < 3:
                time.sleep(0.1)
            on_loop(loop, lambda: router.core.controller_tick(time.monotonic()))
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline and not any(a.outcome != "in_progress" for a in acting.actions):
                time.sleep(1)
            stop.set()
            feeder.join()
            results = [f.result() for f in sent]  # raises on a lost or wrong request

        assert [a.outcome for a in acting.actions] == ["in_progress", "applied"], acting.actions
        assert acting.actuator.name == kind
        switched = acting.actions[0].detail.split(":")[0]
        assert on_loop(loop, lambda: acting.actuator.current()) == Split(*target)
        new_pool = "decode" if target[1] > len(decodes) else "local_prefill"
        assert router.cluster.instances[switched].pool == new_pool
        assert len(results) >= 8
        for other in (decodes if new_pool == "decode" else prefills):
            on_loop(loop, lambda other=other: router.cluster.drain(other))  # only the switched one serves its role
        for i in range(2):
            one(i)
        assert farm.servers[switched].spec.mode == ("decode" if new_pool == "decode" else "prefill")
