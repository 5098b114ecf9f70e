"""Fault schedule: which fault hits which target when, drawn from a seed.

Times are seconds after the load starts. Kill events SIGKILL a server's whole process group and start it
again `restart_after_s` later on the same ports; a link event sets the emulated link's rate to ~0 for
`duration_s` and then back. The runner may start an event late (a target still restarting from its
previous kill is not killed again before it is healthy); it records when each event really ran.

    0        lead_s                                    span_s - tail_s   span_s
    |--------|==== events, >= gap_s apart ===============|----------------|
              ^ load already flowing                       load still flowing: recovery is exercised
"""
from __future__ import annotations

import random
from dataclasses import dataclass

TARGETS = ("remote_prefill", "local_prefill", "decode_b")  # decode_a is never killed: one decode always lives
LINK = "link"
KINDS = ("kill", "link_down")


@dataclass(frozen=True, slots=True)
class FaultEvent:
    at_s: float
    kind: str  # "kill" | "link_down"
    target: str  # one of TARGETS, or LINK
    duration_s: float = 0.0  # link_down: seconds at rate ~0
    restart_after_s: float = 0.0  # kill: seconds between SIGKILL and the new start

    def to_json(self) -> dict:
        return {"at_s": round(self.at_s, 3), "kind": self.kind, "target": self.target,
                "duration_s": round(self.duration_s, 3), "restart_after_s": round(self.restart_after_s, 3)}


@dataclass(frozen=True, slots=True)
class ScheduleSpec:
    span_s: float  # the load's planned duration
    kills_per_target: int = 1
    link_drops: int = 1
    link_down_s: tuple[float, float] = (3.0, 6.0)
    restart_after_s: tuple[float, float] = (0.0, 3.0)
    lead_s: float = 10.0
    tail_s: float = 20.0
    gap_s: float = 8.0  # minimum spacing between two events, so each fault's effect is visible alone

    def __post_init__(self) -> None:
        if self.kills_per_target < 0 or self.link_drops < 0:
            raise ValueError("kills_per_target and link_drops must be >= 0")
        for name in ("link_down_s", "restart_after_s"):
            lo, hi = getattr(self, name)
            if not 0 <= lo <= hi:
                raise ValueError(f"{name}: need 0 <= low <= high, got {(lo, hi)}")
        if self.window_s < self.gap_s * max(0, self.n_events - 1):
            raise ValueError(f"span_s {self.span_s}: {self.n_events} events {self.gap_s}s apart do not fit "
                             f"between lead_s {self.lead_s} and span_s - tail_s; raise span_s")

    @property
    def n_events(self) -> int:
        return self.kills_per_target * len(TARGETS) + self.link_drops

    @property
    def window_s(self) -> float:
        return self.span_s - self.lead_s - self.tail_s


def make_schedule(spec: ScheduleSpec, seed: int) -> tuple[FaultEvent, ...]:
    """Events sorted by time; the same (spec, seed) always gives the same schedule."""
    rng = random.Random(seed)
    jobs = [("kill", t) for t in TARGETS for _ in range(spec.kills_per_target)]
    jobs += [("link_down", LINK)] * spec.link_drops
    rng.shuffle(jobs)
    times = _spaced_times(rng, len(jobs), spec)
    events = []
    for (kind, target), at in zip(jobs, times):
        if kind == "kill":
            events.append(FaultEvent(at, kind, target, restart_after_s=rng.uniform(*spec.restart_after_s)))
        else:
            events.append(FaultEvent(at, kind, target, duration_s=rng.uniform(*spec.link_down_s)))
    return tuple(events)


def _spaced_times(rng: random.Random, n: int, spec: ScheduleSpec) -> list[float]:
    """n sorted times in [lead_s, span_s - tail_s], consecutive ones >= gap_s apart: draw n points in the
    window shrunk by the mandatory gaps, sort, then add k * gap_s to the k-th (uniform over valid sets)."""
    if n == 0:
        return []
    slack = spec.window_s - spec.gap_s * (n - 1)
    points = sorted(rng.uniform(0.0, slack) for _ in range(n))
    return [spec.lead_s + p + k * spec.gap_s for k, p in enumerate(points)]
