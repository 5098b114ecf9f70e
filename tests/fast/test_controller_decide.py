"""The split decision: hysteresis and dwell time (no flapping), and every action logged and counted."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import generate_latest

from prfaas_sgl.router.actuators.base import Action, Split
from prfaas_sgl.router.actuators.decide import DecideConfig, SplitDecider
from prfaas_sgl.router.controller_glue import ActingController
from prfaas_sgl.router.metrics import RouterMetrics
from tests.support.scripted_controller import Recommends

pytestmark = pytest.mark.timeout(30)


def test_one_recommendation_never_moves_a_server():
    d = SplitDecider(DecideConfig(confirm=2, dwell_s=0))
    assert d.offer(Split(3, 5), Split(4, 4), 0.0) is None and d.held.startswith("hysteresis")
    move = d.offer(Split(3, 5), Split(4, 4), 60.0)
    assert move is not None and move.target == Split(4, 4) and move.reason == "more_prefill"


def test_alternating_recommendations_never_move():
    d = SplitDecider(DecideConfig(confirm=2, dwell_s=0))
    for i in range(20):  # a noisy controller flipping every window
        rec = Split(4, 4) if i % 2 else Split(2, 6)
        assert d.offer(Split(3, 5), rec, 60.0 * i) is None


def test_a_stay_breaks_the_streak():
    d = SplitDecider(DecideConfig(confirm=2, dwell_s=0))
    assert d.offer(Split(3, 5), Split(2, 6), 0.0) is None
    assert d.offer(Split(3, 5), Split(3, 5), 60.0) is None
    assert d.offer(Split(3, 5), Split(2, 6), 120.0) is None
    assert d.offer(Split(3, 5), Split(2, 6), 180.0).target == Split(2, 6)


def test_dwell_time_spaces_moves_and_one_server_per_move():
    d = SplitDecider(DecideConfig(confirm=1, dwell_s=600, max_step=1))
    first = d.offer(Split(3, 5), Split(6, 2), 0.0)
    assert first.target == Split(4, 4)  # one step toward 6/2
    moves = [t for t in range(60, 1200, 60) if d.offer(Split(4, 4), Split(6, 2), float(t))]
    assert moves == [600]  # the next move waits out the dwell time
    assert d.offer(Split(5, 3), Split(6, 2), 700.0) is None and d.held.startswith("dwell")


def test_a_failed_move_restarts_the_streak():
    d = SplitDecider(DecideConfig(confirm=2, dwell_s=0))
    d.offer(Split(3, 5), Split(2, 6), 0.0)
    d.failed()
    assert d.offer(Split(3, 5), Split(2, 6), 60.0) is None


class FakeActuator:
    name = "fake"

    def __init__(self, split: Split, outcome: str = "applied") -> None:
        self.split, self.outcome, self.calls = split, outcome, []

    def current(self) -> Split:
        return self.split

    async def apply(self, target: Split, reason: str) -> Action:
        self.calls.append((target, reason))
        before = self.split
        if self.outcome == "applied":
            self.split = target
        return Action(self.name, before, self.split, reason, self.outcome, "test")


def test_acting_controller_logs_counts_and_resizes(caplog):
    async def body():
        inner, act, metrics = Recommends((3, 5), 100, (3, 5)), FakeActuator(Split(3, 5)), RouterMetrics()
        ctl = ActingController(inner, SplitDecider(DecideConfig(confirm=2, dwell_s=300)), act, metrics)
        inner.rec = (2, 6)
        caplog.set_level("INFO", logger="prfaas_sgl.router.controller_glue")
        for now in (60.0, 120.0, 180.0):
            assert ctl.maybe_update(now).threshold == 100  # the threshold passes through
            await asyncio.gather(*ctl.tasks)
        assert act.calls == [(Split(2, 6), "more_decode")]  # 2nd recommendation moves; the 3rd waits (dwell)
        assert inner.split == (2, 6)
        text = generate_latest(metrics.registry).decode()
        assert ('prfaas_router_controller_actions_total{actuator="fake",outcome="applied",reason="more_decode"} 1.0'
                in text)
        assert any("controller action [fake] applied: 3/5 -> 2/6 (more_decode)" in m for m in caplog.messages)
        assert any("kept" in m and "hysteresis" in m for m in caplog.messages)
    asyncio.run(body())


def test_refused_action_is_counted_and_not_retried_at_once():
    async def body():
        inner, act, metrics = Recommends((3, 5), 100, (3, 5)), FakeActuator(Split(3, 5), "refused"), RouterMetrics()
        ctl = ActingController(inner, SplitDecider(DecideConfig(confirm=1, dwell_s=0)), act, metrics)
        inner.rec = (4, 4)
        ctl.maybe_update(1.0)
        await asyncio.gather(*ctl.tasks)
        assert ctl.actions[-1].outcome == "refused" and inner.split == (3, 5)
        text = generate_latest(metrics.registry).decode()
        assert 'outcome="refused",reason="more_prefill"} 1.0' in text
    asyncio.run(body())


def test_recommendations_are_clipped_to_one_server_per_role():
    from prfaas_sgl.router.actuators.decide import bounded
    assert bounded((0, 8)) == Split(1, 7) and bounded((8, 0)) == Split(7, 1) and bounded((3, 5)) == Split(3, 5)
