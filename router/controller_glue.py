"""Builds the long-term controller named by ``--controller`` (router/controller.py, planner helper), and
closes its loop: ``ActingController`` turns recommended splits into actuator actions.

Both sides are typed: the controller is router/controller_api.py's ``Controller``, the actuator
router/actuators/base.py's ``Actuator``; nothing here asks an object what it has.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Protocol

from .actuators.base import Action, Actuator, Report, Split
from .actuators.decide import DecideConfig, SplitDecider, bounded
from .cluster import Cluster
from .config import RouterConfig
from .controller import LongTermController
from .controller_api import Controller, ControllerUpdate
from .metrics import RouterMetrics
from .planner.scenario import load_scenario

log = logging.getLogger(__name__)

# Builds the actuator for a router's cluster; ``Report`` is the callback for the end of a background action.
ActuatorFactory = Callable[[Cluster, Report], Actuator]


def build_controller(cfg: RouterConfig) -> Controller | None:
    """The controller ``--controller`` names, or None.

    The planner's throughput model comes from ``--controller-scenario``; the current split is what this
    router was started with (local prefill instances, decode instances) and t starts at ``--threshold``.
    """
    if cfg.controller == "none":
        return None
    system = load_scenario(cfg.controller_scenario).system
    split = (len(cfg.local_prefill), len(cfg.decode))
    return LongTermController(cfg.controller_params, system, split, cfg.policy_params.threshold)


class ActingController:
    """A ``Controller`` wrapping another, whose recommended splits reach an actuator.

    Threshold updates pass through unchanged to the routing core. A recommended split goes through the
    decider (hysteresis, dwell time); a move runs as a task on the router's loop (``apply`` of the
    processes actuator drains and restarts a server in the background). Every action — the actuator's
    answer and, for a switch, its end — is logged with its reason and counted in
    ``prfaas_router_controller_actions_total{actuator,outcome,reason}``.
    """

    def __init__(self, inner: Controller, decider: SplitDecider, actuator: Actuator | None = None,
                 metrics: RouterMetrics | None = None) -> None:
        self.inner, self.decider, self.actuator, self.metrics = inner, decider, actuator, metrics
        self.actions: list[Action] = []  # every action, in order (tests, the demo's table)
        self.action_times: list[float] = []  # unix seconds of each
        self.tasks: set[asyncio.Task] = set()

    def observe(self, incremental_len: int, now: float) -> None:
        self.inner.observe(incremental_len, now)

    def observe_link(self, link_bps: float, now: float) -> None:
        self.inner.observe_link(link_bps, now)

    def resize(self, split: tuple[int, int]) -> None:
        self.inner.resize(split)

    def maybe_update(self, now: float) -> ControllerUpdate | None:
        upd = self.inner.maybe_update(now)
        if upd is None or self.actuator is None:
            return upd
        rec = upd.recommended_split
        current = self.actuator.current()
        move = self.decider.offer(current, bounded(rec), now)
        if move is None:
            if self.decider.held:
                log.info("split %s/%s kept (recommended %s): %s", current.prefill, current.decode, rec,
                         self.decider.held)
            return upd
        log.info("split move %s -> %s (%s): %s", current, move.target, move.reason, move.detail)
        task = asyncio.get_running_loop().create_task(self._apply(self.actuator, move.target, move.reason))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return upd

    async def _apply(self, actuator: Actuator, target: Split, reason: str) -> None:
        try:
            action = await actuator.apply(target, reason)
        except Exception as e:  # noqa: BLE001 - an actuator bug must not take the controller loop down
            log.exception("actuator %s failed", actuator.name)
            current = actuator.current()
            action = Action(actuator.name, current, current, reason, "failed", repr(e))
        self.record(action)

    def record(self, action: Action) -> None:
        """Log and count one action; an actuator's report callback for the end of a background switch."""
        self.actions.append(action)
        self.action_times.append(time.time())
        if action.outcome in ("refused", "failed"):
            self.decider.failed()
        if action.outcome in ("applied", "failed"):
            current = self.actuator.current() if self.actuator is not None else action.after
            self.inner.resize((current.prefill, current.decode))
        level = logging.WARNING if action.outcome == "failed" else logging.INFO
        log.log(level, "controller action [%s] %s: %s/%s -> %s/%s (%s) %s", action.actuator, action.outcome,
                action.before.prefill, action.before.decode, action.after.prefill, action.after.decode,
                action.reason, action.detail)
        if self.metrics is not None:
            self.metrics.controller_actions.labels(action.actuator, action.outcome, action.reason).inc()


class _Core(Protocol):
    controller: Controller | None


class LoopRouter(Protocol):
    """What ``close_loop`` uses of a router (router/app.py ``Router``)."""

    core: _Core
    cluster: Cluster
    metrics: RouterMetrics


def close_loop(router: LoopRouter, actuator_factory: ActuatorFactory,
               decide: DecideConfig = DecideConfig()) -> ActingController:
    """Wrap ``router``'s controller (it must have one: the controller loop only runs then) in an
    ``ActingController``; ``actuator_factory(cluster, report)`` builds the actuator, ``report`` being the
    callback for the end of a background action."""
    if router.core.controller is None:
        raise ValueError("close_loop: start the router with a controller (--controller planner or controller=...)")
    acting = ActingController(router.core.controller, SplitDecider(decide), None, router.metrics)
    actuator = acting.actuator = actuator_factory(router.cluster, acting.record)
    # The planner was sized from the router's server lists at start-up; the actuator knows what really runs
    # (k8s: the StatefulSets' replicas may differ from the lists), so the first threshold fits that split.
    current = actuator.current()
    acting.inner.resize((current.prefill, current.decode))
    router.core.controller = acting
    return acting
