"""The router takes its controller as router/controller_api.py's ``Controller`` on every way in, not as ``Any``:
a type checker then sees a controller that departs from the protocol where it is handed to the router, and
test_controller_seam.py checks each implementation against the same protocol. The controller handed to
``start_router`` is the one its loop drives."""

from __future__ import annotations

import asyncio
import typing

import pytest

from prfaas_sgl.router.app import Router, start_router
from prfaas_sgl.router.config import InstanceSpec, RouterConfig
from prfaas_sgl.router.controller_api import Controller
from prfaas_sgl.router.controller_glue import build_controller
from prfaas_sgl.router.routing import RoutingCore
from prfaas_sgl.tools.demo.live import LiveRouter
from tests.support.router_standin import build_tiny_tokenizer
from tests.support.scripted_controller import Recommends

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("fn", [Router.__init__, start_router, RoutingCore.__init__, LiveRouter.__init__],
                         ids=["Router", "start_router", "RoutingCore", "LiveRouter"])
def test_every_way_into_the_router_takes_the_controller_protocol(fn):
    assert typing.get_type_hints(fn)["controller"] == Controller | None


def test_the_router_builds_a_controller_of_the_protocol():
    assert typing.get_type_hints(build_controller)["return"] == Controller | None


def test_the_controller_given_to_start_router_is_the_one_its_loop_drives(tmp_path):
    # Servers that refuse connections: the router starts with them out of rotation, the loop still ticks.
    cfg = RouterConfig.from_flags(port=0, local_prefill=(InstanceSpec("http://127.0.0.1:1", 8998),),
                                  decode=(InstanceSpec("http://127.0.0.1:1"),), controller_interval_s=0.02,
                                  tokenizer_path=build_tiny_tokenizer(str(tmp_path / "tok")), threshold=32)
    ctl = Recommends((0, 1), threshold=7)

    async def body():
        handle = await start_router(cfg, ctl)
        try:
            core = handle.router.core
            assert core.controller is ctl
            for _ in range(200):
                if core.policy.threshold == 7:
                    break
                await asyncio.sleep(0.01)
            assert core.policy.threshold == 7 and core.recommended_split == {"local_prefill": 0, "decode": 1}
        finally:
            await handle.close()
    asyncio.run(body())
