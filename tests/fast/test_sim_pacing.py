"""Pacing: a remote-bound request is held briefly while the link binds, in the policy, the
router's routing core and the simulator."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from prfaas_sgl.router.cluster import Cluster
from prfaas_sgl.router.config import InstanceSpec, RouterConfig
from prfaas_sgl.router.metrics import RouterMetrics
from prfaas_sgl.router.planner import load_scenario
from prfaas_sgl.router.policy import InstanceView, LinkView, ModelCost, PolicyParams, RouteInput, make_policy
from prfaas_sgl.router.routing import RoutingCore
from prfaas_sgl.router.sim.config import sim_config
from prfaas_sgl.router.sim.run import build
from tests.support.router_standin import build_tiny_tokenizer

ROOT = Path(__file__).resolve().parents[2]
GBIT = 1e9
COST = ModelCost(kv_bytes_per_token=1e5, local_coef=(0.0, 1e-4, 0.0), remote_coef=(0.0, 5e-5, 0.0))


def views(local_queued: int = 0, remote_busy: bool = True) -> tuple[InstanceView, ...]:
    r_inflight, r_queued = (1, 2_000) if remote_busy else (0, 0)  # busy: 0.1 s of PrfaaS work ahead
    return (InstanceView("r0", "prfaas", True, r_queued, r_inflight, 0),
            InstanceView("l0", "local_prefill", True, local_queued, 4, 0), InstanceView("d0", "decode", True, 0, 0, 0))


def decide(in_flight_bytes: float, waited_s: float = 0.0, local_queued: int = 400_000, remote_busy: bool = True):
    pol = make_policy("paced", PolicyParams(threshold=1000, pace_max_s=1.0, pace_step_s=0.25), COST)
    return pol.decide(RouteInput(20_000, views(local_queued, remote_busy), LinkView(GBIT, 0.0, in_flight_bytes), 0.0,
                                 waited_s=waited_s))


def test_holds_a_long_request_while_the_link_binds():
    d = decide(in_flight_bytes=2e9)  # 16 s of KV ahead on 1 Gbit/s vs 1 s of remote prefill
    assert d.pace_s == pytest.approx(0.25) and d.reason == "paced" and d.route == "prfaas"


def test_sends_it_when_the_link_has_room_or_its_hold_is_spent():
    assert decide(in_flight_bytes=0.0).pace_s == 0.0  # 16 s for its own 2 GB, but nothing ahead: no gain
    assert decide(in_flight_bytes=2e9, waited_s=1.0).pace_s == 0.0
    assert decide(in_flight_bytes=2e9, waited_s=0.9).pace_s == pytest.approx(0.1)


def test_an_idle_prfaas_instance_is_never_held_back():
    # the link binds (16 s of KV ahead), but holding would leave PrfaaS idle: its compute is lost for good and the
    # held backlog meets a PrfaaS queue when the link recovers; it goes now, its transfer shares the link
    d = decide(in_flight_bytes=2e9, remote_busy=False)
    assert d.pace_s == 0.0 and d.route == "prfaas" and d.reason == "long"


def test_a_caller_that_cannot_wait_gets_no_hold():
    pol = make_policy("paced", PolicyParams(threshold=1000), COST)
    d = pol.decide(RouteInput(20_000, views(400_000), LinkView(GBIT, 0.0, 2e9), 0.0))  # waited_s = inf
    assert d.pace_s == 0.0 and d.route == "prfaas"


def test_routing_core_holds_then_routes(tmp_path):
    cfg = RouterConfig.from_flags(prfaas=(InstanceSpec("http://h:1", 1, name="r0"),),
                       local_prefill=(InstanceSpec("http://h:2", 2, name="l0"),), decode=(InstanceSpec("http://h:3"),),
                       tokenizer_path=build_tiny_tokenizer(str(tmp_path / "tok")), policy="paced", threshold=10,
                       kv_bytes_per_token=1e6, state_bytes=0.0, link_gbps=1.0)
    core = RoutingCore(cfg, Cluster(cfg), RouterMetrics())
    for name in core.cluster.instances:  # instances start out of rotation until a /health probe passes
        core.cluster.probed(name, True)
    core.set_routing({"pace_max_s": 0.3, "pace_step_s": 0.1}, why="test")
    core.cluster.link.add(1e9, time.monotonic() - 1)  # 8 s of KV on the wire
    core.cluster.instances["l0"].server_queued_tokens = 10**6  # local pool busy: bandwidth-aware keeps it remote
    core.cluster.instances["r0"].server_queued_tokens = 10  # PrfaaS busy too (an idle one is never held back)

    async def body():
        t0 = time.monotonic()
        d = (await core.route_paced(100, [])).decision
        return d, time.monotonic() - t0
    d, took = asyncio.run(body())
    assert d.pace_s == 0.0 and 0.25 <= took < 2.0
    assert core.metrics.decisions.labels("held", "paced")._value.get() == 3
    assert core.route(100, [], time.monotonic()).decision.pace_s == 0.0  # route(): never holds


def test_simulator_holds_and_loses_nothing():
    scn = load_scenario(ROOT / "scenarios" / "burst_link_drop.toml")
    c = sim_config(scn.sim, policy="paced", duration_s=240.0, bandwidth_trace=((0.0, 0.1),))
    sim = build(scn, c)
    sim.run()
    held = [r for r in sim.reqs if r.held_s > 0]
    assert held and all(0 < r.held_s <= 1.0 + 1e-9 for r in held)
    assert all(r.prefill_start >= r.arrival + r.held_s - 1e-9 for r in held)
    assert all(r.route for r in sim.reqs)  # every request was routed in the end
