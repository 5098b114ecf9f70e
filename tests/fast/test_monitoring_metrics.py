"""Router metrics added for the operator's dashboard and alerts: TTFT by route, and the planner's
optimal offload fraction next to the routed one."""
from __future__ import annotations

import asyncio
import math
from pathlib import Path

import numpy as np
from prometheus_client import generate_latest

from prfaas_sgl.tools.loadgen.prom import parse_metrics, total
from prfaas_sgl.router.cluster import Cluster
from prfaas_sgl.router.config import RouterConfig
from prfaas_sgl.router.controller_glue import build_controller
from prfaas_sgl.router.metrics import RouterMetrics
from prfaas_sgl.router.routing import RoutingCore
from tests.fast.test_router_http import LONG, SHORT, rig
from tests.support.router_standin import build_tiny_tokenizer

SCENARIO = Path(__file__).resolve().parents[2] / "scenarios" / "paper_case_study.toml"
REMOTE_DELAY_S = 0.3


def test_ttft_is_observed_by_the_route_that_served(tmp_path):
    """Decode's first bytes wait for the prefill (the stand-in decode waits for its room), so a remote prefill
    that takes 0.3 s shows in the prfaas route's TTFT and not in the local one's."""
    async def body() -> dict:
        async with rig(tmp_path) as r:
            r.remote.delay_s = REMOTE_DELAY_S
            for prompt, stream in ((LONG, True), (SHORT, True), (SHORT, False)):
                req = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "stream": stream}
                async with r.http.post(r.router.url + "/v1/completions", json=req) as resp:
                    assert resp.status == 200
                    await resp.read()
            async with r.http.get(r.router.url + "/metrics") as resp:
                return parse_metrics(await resp.text())
    m = asyncio.run(body())
    count = {route: total(m, "prfaas_router_ttft_seconds_count", route=route) for route in ("prfaas", "local")}
    assert count == {"prfaas": 1, "local": 2}
    assert total(m, "prfaas_router_ttft_seconds_sum", route="prfaas") >= REMOTE_DELAY_S
    assert total(m, "prfaas_router_ttft_seconds_sum", route="local") < REMOTE_DELAY_S


def _planner_gauge(metrics: RouterMetrics) -> float:
    return total(parse_metrics(generate_latest(metrics.registry).decode()), "prfaas_router_planner_offload_fraction")


def test_planner_offload_fraction_is_nan_until_the_controller_updates_then_its_optimum(tmp_path):
    cfg = RouterConfig.from_flags(local_prefill=("http://h:1;bootstrap=8998",), decode=("http://h:2",),
                       tokenizer_path=build_tiny_tokenizer(str(tmp_path / "tok")), controller="planner",
                       controller_scenario=str(SCENARIO), threshold=19_000)
    metrics = RouterMetrics()
    core = RoutingCore(cfg, Cluster(cfg), metrics, build_controller(cfg))
    assert math.isnan(_planner_gauge(metrics))  # no optimum yet: the alert comparing with it stays quiet
    lengths = np.array([1000 + 300 * i for i in range(200)])
    for i, n in enumerate(lengths):
        core.controller.observe(int(n), float(i))
    core.controller_tick(1e6)
    target = core.last_update_reason
    p = _planner_gauge(metrics)
    assert 0 < p < 1, target
    t_star = int(target.split("'target_threshold': ")[1].split(",")[0])
    # P(L > t*) of the observed lengths; t* sits on a jump of this step function, and the log shows it rounded
    # to whole tokens, which may move it across the one sample there
    assert abs(p - float(np.mean(lengths > t_star))) <= 1 / len(lengths)
