"""The controller seam is typed: every controller and every actuator has the protocol's signatures
(router/controller_api.py ``Controller``, router/actuators/base.py ``Actuator``), each actuator answers when
called through the protocol, and an update has one shape, ``ControllerUpdate``: another one is refused where
the routing core reads it, instead of being read field by field with getattr."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from prfaas_sgl.router.actuators.base import Action, Actuator, Split
from prfaas_sgl.router.actuators.k8s import K8sActuator
from prfaas_sgl.router.actuators.processes import ProcessesActuator
from prfaas_sgl.router.actuators.supervisor import SupervisorActuator
from prfaas_sgl.router.cluster import Cluster
from prfaas_sgl.router.config import InstanceSpec, RouterConfig
from prfaas_sgl.router.controller import LongTermController
from prfaas_sgl.router.controller_api import Controller, ControllerUpdate, PlannerOptimum
from prfaas_sgl.router.controller_glue import ActingController
from prfaas_sgl.router.metrics import RouterMetrics
from prfaas_sgl.router.policy import Pool
from prfaas_sgl.router.routing import RoutingCore
from prfaas_sgl.tools.demo.shift import LengthRule
from tests.support.protocols import mismatches
from tests.support.router_standin import build_tiny_tokenizer
from tests.support.scripted_controller import Recommends

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("impl", [ProcessesActuator, SupervisorActuator, K8sActuator])
def test_every_actuator_has_the_protocols_signatures(impl):
    assert mismatches(impl, Actuator) == []


@pytest.mark.parametrize("impl", [LongTermController, ActingController, LengthRule, Recommends])
def test_every_controller_has_the_protocols_signatures(impl):
    assert mismatches(impl, Controller) == []


class SyncApply:
    name = "sync"

    def current(self) -> Split: ...

    def apply(self, target: Split, reason: str) -> Action: ...


class NoReason:
    name = "no_reason"

    def current(self) -> Split: ...

    async def apply(self, target: Split) -> Action: ...


class DictAnswer:
    name = "dict"

    def current(self) -> Split: ...

    async def apply(self, target: Split, reason: str) -> dict: ...


class Nameless:
    def current(self) -> Split: ...

    async def apply(self, target: Split, reason: str) -> Action: ...


class OldLinkName(Recommends):
    def observe_link(self, goodput_bps: float, now: float) -> None: ...


class NoResize:
    def observe(self, incremental_len: int, now: float) -> None: ...

    def observe_link(self, link_bps: float, now: float) -> None: ...

    def maybe_update(self, now: float) -> ControllerUpdate | None: ...


@pytest.mark.parametrize("impl, proto, why", [
    (SyncApply, Actuator, "apply: async in the protocol"),
    (NoReason, Actuator, "apply: missing parameter reason"),
    (DictAnswer, Actuator, "apply: returns <class 'dict'>"),
    (Nameless, Actuator, "name: missing attribute"),
    (OldLinkName, Controller, "observe_link: parameter goodput_bps"),
    (NoResize, Controller, "resize: not a method"),
])
def test_the_check_sees_what_runtime_checkable_does_not(impl, proto, why):
    assert any(m.startswith(why) for m in mismatches(impl, proto)), mismatches(impl, proto)


# ------------------------------------------------------------ each actuator, called through the protocol

def two_by_two(tmp_path) -> Cluster:
    cfg = RouterConfig.from_flags(local_prefill=("http://h:1;bootstrap=8998", "http://h:3;bootstrap=8999"),
                                  decode=("http://h:2", "http://h:4"),
                                  tokenizer_path=build_tiny_tokenizer(str(tmp_path / "tok")))
    return Cluster(cfg)


class OwnsNothing:
    def owns(self, name: str) -> bool:
        return False

    async def stop(self, name: str) -> None:
        raise AssertionError("no server may be stopped")

    async def start(self, name: str, pool: Pool) -> InstanceSpec:
        raise AssertionError("no server may be started")


class Scales:
    """Two StatefulSets' ``scale`` subresources, as much of ``AppsV1Api`` as the k8s actuator calls."""

    def __init__(self, replicas: dict[str, int]) -> None:
        self.replicas = replicas

    def read_namespaced_stateful_set_scale(self, name: str, namespace: str, _request_timeout: float):
        return SimpleNamespace(spec=SimpleNamespace(replicas=self.replicas[name]),
                               metadata=SimpleNamespace(resource_version="7"))

    def patch_namespaced_stateful_set_scale(self, name: str, namespace: str, body: dict, _content_type: str,
                                            _request_timeout: float) -> None:
        assert body["metadata"]["resourceVersion"] == "7"
        self.replicas[name] = body["spec"]["replicas"]


async def drive(act: Actuator, target: Split) -> tuple[Split, Action, Split]:
    return act.current(), await act.apply(target, "more_decode"), act.current()


def test_each_actuator_answers_through_the_protocol(tmp_path):
    cluster = two_by_two(tmp_path)
    processes = ProcessesActuator(cluster, OwnsNothing())
    supervisor = SupervisorActuator(cluster, {})
    k8s = K8sActuator(Scales({"prefill": 2, "decode": 2}), "ns", Split(2, 2))

    async def body():
        before, action, after = await drive(processes, Split(1, 3))
        assert before == after == Split(2, 2) and action.outcome == "refused"
        assert action.detail == "no local_prefill server can leave its pool"  # it owns none of them
        before, action, after = await drive(supervisor, Split(2, 2))
        assert (action.actuator, action.outcome, action.detail) == ("supervisor", "refused",
                                                                    "already at the target split")
        before, action, after = await drive(k8s, Split(1, 3))
        assert (before, action.outcome, after) == (Split(2, 2), "applied", Split(1, 3))
        assert action.detail == "prefill 2->1, decode 2->3"  # shrink first
    asyncio.run(body())


# ------------------------------------------------------------ one shape of update

@dataclass
class LooseUpdate:
    """What a controller could return before the seam was typed: the routing core read it with getattr."""

    threshold: int
    recommended_split: tuple[int, int]
    reason: str


class Loose(Recommends):
    def maybe_update(self, now: float) -> LooseUpdate:  # type: ignore[override]
        return LooseUpdate(7, (2, 5), "converged")


def core_with(tmp_path, ctl: Controller) -> RoutingCore:
    cfg = RouterConfig.from_flags(local_prefill=("http://h:1;bootstrap=8998",), decode=("http://h:2",),
                                  tokenizer_path=build_tiny_tokenizer(str(tmp_path / "tok")))
    return RoutingCore(cfg, Cluster(cfg), RouterMetrics(), ctl)


def test_an_update_of_another_shape_is_refused_not_read_field_by_field(tmp_path):
    core = core_with(tmp_path, Loose((2, 5)))
    threshold = core.policy.threshold
    with pytest.raises(TypeError, match="returns a ControllerUpdate or None, got .*LooseUpdate"):
        core.controller_tick(1.0)
    assert core.policy.threshold == threshold != 7 and core.recommended_split == {}  # nothing applied


@pytest.mark.parametrize("threshold, split", [
    (7, {"local_prefill": 2, "decode": 5}), (7, Split(2, 5)), (7, [2, 5]), (7, (2, 5, 1)), (7, (2, -1)),
    (7.0, (2, 5)), (True, (2, 5)),
])
def test_an_update_has_one_shape(threshold, split):
    with pytest.raises(ValueError, match="ControllerUpdate"):
        ControllerUpdate(threshold, split, "converged")


def _sample(core: RoutingCore, name: str, **labels: str) -> float | None:
    return core.metrics.registry.get_sample_value(name, labels)


def test_a_planner_update_reaches_policy_metrics_and_log(tmp_path):
    optimum = PlannerOptimum(target_threshold=9, lambda_max=1.5, bound="egress", offload_fraction=0.25)
    ctl = Recommends((0, 2), threshold=7)
    ctl.maybe_update = lambda now: ControllerUpdate(7, (0, 2), "step_limited", optimum)  # type: ignore[method-assign]
    core = core_with(tmp_path, ctl)
    core.controller_tick(1.0)
    assert core.policy.threshold == 7 and core.recommended_split == {"local_prefill": 0, "decode": 2}
    assert core.last_update_reason == ("step_limited {'target_threshold': 9, 'lambda_max': 1.5, 'bound': 'egress'} "
                                       "split={'local_prefill': 0, 'decode': 2}")
    assert _sample(core, "prfaas_router_planner_offload_fraction") == 0.25
    assert _sample(core, "prfaas_router_recommended_instances", role="decode") == 2


def test_a_rule_update_without_an_optimum_leaves_the_planner_gauge_alone(tmp_path):
    core = core_with(tmp_path, Recommends((1, 1), threshold=11))
    core.controller_tick(1.0)
    assert core.policy.threshold == 11
    assert core.last_update_reason == "converged {} split={'local_prefill': 1, 'decode': 1}"
    assert math.isnan(_sample(core, "prfaas_router_planner_offload_fraction"))
