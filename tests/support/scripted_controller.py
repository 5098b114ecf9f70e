"""A scripted ``Controller`` (prfaas_sgl/router/controller_api.py) for the tests that are about acting on a
recommendation, not about computing one: the planner's controller needs a throughput model and minutes of
traffic before it says anything."""

from __future__ import annotations

from prfaas_sgl.router.controller_api import ControllerUpdate


class Recommends:
    """Recommends ``rec`` at ``threshold`` on every tick; ``split`` is what it was last sized for (``resize``),
    ``seen`` the lengths it observed."""

    def __init__(self, rec: tuple[int, int], threshold: int = 32, split: tuple[int, int] | None = None) -> None:
        self.rec, self.threshold, self.split = rec, threshold, split
        self.seen: list[int] = []

    def observe(self, incremental_len: int, now: float) -> None:
        self.seen.append(incremental_len)

    def observe_link(self, link_bps: float, now: float) -> None: ...

    def resize(self, split: tuple[int, int]) -> None:
        self.split = split

    def maybe_update(self, now: float) -> ControllerUpdate | None:
        return ControllerUpdate(self.threshold, self.rec, "converged")
