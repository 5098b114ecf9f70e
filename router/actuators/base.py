"""The one interface the long-timescale controller acts through.

An actuator moves the local PD cluster toward a target prefill/decode split. Three implementations share it:
``processes`` (drain a local server, restart it in the other role, re-admit it when healthy — what the demo
runs), ``supervisor`` (the same switch, with the stop and start done by the supervisor `prfaas up` keeps on
each machine) and ``k8s`` (patch the prefill/decode replica counts through the Kubernetes API). The
controller decides *whether* to act (hysteresis, dwell time); the actuator only decides *how*. Every action
is returned as an :class:`Action` so the router can log it with its reason and count it; an action that ends
later (a restarted server turning healthy) goes to the ``Report`` callback the actuator was built with.
tests/fast/test_controller_seam.py checks each implementation's signatures against ``Actuator``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol


@dataclass(frozen=True, slots=True)
class Split:
    """Instances of the local PD cluster by role."""

    prefill: int
    decode: int

    def __post_init__(self) -> None:
        if self.prefill < 1 or self.decode < 1:
            raise ValueError(f"Split needs >= 1 prefill and >= 1 decode, got {self.prefill}/{self.decode}")


@dataclass(frozen=True, slots=True)
class Action:
    """One thing an actuator did (or refused to do), for the log and ``/metrics``."""

    actuator: str  # the actuator's name: "processes" | "supervisor" | "k8s"
    before: Split
    after: Split  # what it moved to (== before when refused or failed)
    reason: str  # the decider's reason: "more_prefill" | "more_decode"
    outcome: str  # "applied" | "in_progress" | "refused" | "failed"
    detail: str = ""  # e.g. which server moved, or the API error


Report = Callable[[Action], None]


class Actuator(Protocol):
    name: str  # the ``actuator`` label of its actions in the log and /metrics

    def current(self) -> Split:
        """The split as it stands now (servers in each pool / replicas requested)."""
        ...

    async def apply(self, target: Split, reason: str) -> Action:
        """Move toward ``target``. May move one step at a time (the processes actuator switches one server
        per call); returns without waiting for a restarted server to become healthy ("in_progress")."""
        ...
