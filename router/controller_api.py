"""The seam between the routing core and its long-timescale controller: what the core calls, what a controller
answers.

``LongTermController`` (router/controller.py, the planner) implements ``Controller``; so do the demo's
``LengthRule`` and the tests' scripted controllers, and ``ActingController`` (router/controller_glue.py) wraps
any of them to reach an actuator (router/actuators/base.py ``Actuator``). Callers use only these names: every
method is required (no "if it has observe_link"), and an update has one shape, ``ControllerUpdate``.
tests/fast/test_controller_seam.py checks each implementation's signatures against these, so a change on
either side fails there instead of silently dropping a field. No clock reads: ``now`` is passed in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class PlannerOptimum:
    """The throughput model's optimum for one window (the planner's; a rule-based controller has none)."""

    target_threshold: int  # tokens: the unrestricted optimum, before the per-update step limit
    lambda_max: float  # model Λ_max at the recommended point, req/s
    bound: str  # the stage that binds at the target
    offload_fraction: float  # P(L > target t): the share the model sends to PrfaaS there

    def detail(self) -> dict[str, int | float | str]:
        """The part of the routing log line that says why (``offload_fraction`` goes to /metrics instead)."""
        return {"target_threshold": self.target_threshold, "lambda_max": self.lambda_max, "bound": self.bound}


@dataclass(frozen=True, slots=True)
class ControllerUpdate:
    """One re-optimisation: the threshold to apply to the policy and the local split to run."""

    threshold: int  # tokens; the routing core applies it through set_routing (validated there)
    recommended_split: tuple[int, int]  # (local prefill, decode) instances; 0 prefills = every prefill remote
    reason: str  # a log word: "converged" | "step_limited" (planner), "length_rule" (the demo)
    optimum: PlannerOptimum | None = None

    def __post_init__(self) -> None:
        if type(self.threshold) is not int:  # a float or numpy scalar would reach the policy and the log as is
            raise ValueError(f"ControllerUpdate.threshold is an int (tokens), got {self.threshold!r}")
        split = self.recommended_split
        if not (isinstance(split, tuple) and len(split) == 2 and all(type(n) is int and n >= 0 for n in split)):
            raise ValueError(f"ControllerUpdate.recommended_split is (local prefill, decode) as two ints >= 0, "
                             f"got {split!r}")

    def by_role(self) -> dict[str, int]:
        """The split keyed by pool name, as /admin/routing and /metrics show it."""
        return {"local_prefill": self.recommended_split[0], "decode": self.recommended_split[1]}


class Controller(Protocol):
    def observe(self, incremental_len: int, now: float) -> None:
        """One routed request's uncached prompt length (tokens); called on every decision, so cheap."""
        ...

    def observe_link(self, link_bps: float, now: float) -> None:
        """The inter-DC link's measured drain rate (bits/s); 0 = unknown. A controller without a link model
        ignores it."""
        ...

    def resize(self, split: tuple[int, int]) -> None:
        """The local (prefill, decode) split now running: an actuator moved a server, or the loop closed."""
        ...

    def maybe_update(self, now: float) -> ControllerUpdate | None:
        """A new threshold and split when one is due, else None; cheap when nothing is due."""
        ...


def checked(update: object) -> ControllerUpdate:
    """``update`` if it has the one shape the routing core reads; raises TypeError naming what came instead."""
    if not isinstance(update, ControllerUpdate):
        raise TypeError(f"a controller's maybe_update returns a ControllerUpdate or None, got "
                        f"{type(update).__module__}.{type(update).__qualname__}")
    return update
