"""A supervisor's ``start`` of a running server is refused (409) and never orphans it, on real processes:
`prfaas up`'s LaunchedServers over stand-in servers, its keeper, and the router's signed client.

Before: a second start replaced the dict entry without stopping the first server, so two servers ran, the
first one orphaned (``Stack.stop`` never reached it)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import aiohttp
import pytest

from prfaas_sgl.router.actuators.supervisor import AlreadyRunning, SupervisorClient, sign
from prfaas_sgl.tools.deploy.keeper import Keeper
from prfaas_sgl.tools.deploy.supervisor import Supervisor
from prfaas_sgl.tools.server_control import LaunchedServers
from tests.fast.test_up_restarts import standin

pytestmark = pytest.mark.timeout(120)
TOKEN = "t" * 40


def standin_children() -> list[int]:
    """Pids of this process's live stand-in servers."""
    out = []
    for d in Path("/proc").iterdir():
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            cmd = (d / "cmdline").read_bytes()
        except (OSError, IndexError):
            continue
        if fields[1] == str(os.getpid()) and fields[0] != "Z" and b"standin_process" in cmd:
            out.append(int(d.name))
    return out


def test_start_of_a_running_server_is_409_and_leaves_one_process(tmp_path):
    keeper = Keeper(say=lambda line: None, grace_s=2.0)
    servers = {"p0": standin(tmp_path, "prefill")}
    keeper.keep("p0", servers["p0"])
    control = LaunchedServers(servers, health_timeout_s=30, make=type(servers["p0"]), keeper=keeper)
    sup = Supervisor(control, ["p0"], "127.0.0.1", TOKEN, keeper.report)

    async def body():
        await sup.serve(0)
        client = SupervisorClient({"p0": sup.url}, TOKEN, start_timeout_s=30)
        try:
            first = servers["p0"].pid
            for _ in range(2):
                with pytest.raises(RuntimeError, match="HTTP 409.*stop it first"):
                    await client.start("p0", "decode")
            with pytest.raises(AlreadyRunning):  # the control refuses too, not only the supervisor
                await control.start("p0", "decode")
            assert standin_children() == [first] and servers["p0"].pid == first

            await client.stop("p0")
            assert standin_children() == [] and not keeper.watches("p0")
            spec = await client.start("p0", "decode")
            second = servers["p0"].pid
            assert spec.url == servers["p0"].url and keeper.watches("p0")
            with pytest.raises(RuntimeError, match="HTTP 409"):
                await client.start("p0", "local_prefill")
            assert standin_children() == [second]
            async with aiohttp.ClientSession() as s:
                path = "/restarts"
                async with s.get(sup.url + path, headers=sign(TOKEN, "GET", path, b"")) as r:
                    assert (await r.json())["processes"]["p0"]["pid"] == second
        finally:
            await sup.close()
    try:
        asyncio.run(body())
    finally:
        servers["p0"].stop(grace_s=1.0)
    assert standin_children() == []
