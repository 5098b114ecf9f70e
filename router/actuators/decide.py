"""Whether to move the local prefill/decode split: hysteresis and a minimum dwell time.

The long-term controller recommends a split every interval from one window of traffic; acting on every
recommendation would flap servers between roles, and each switch costs a drain plus a restart (minutes of
a server doing nothing). So a move needs the same direction recommended ``confirm`` times in a row
(hysteresis: one noisy window never moves a server) and ``dwell_s`` since the last move (a switch's cost is
paid back before the next one). Pure: time comes in as ``now``; used by the router and the simulator.
"""

from __future__ import annotations

from dataclasses import dataclass

from prfaas_sgl.cliargs import FieldError, knob

from .base import Split


@dataclass(frozen=True, slots=True)
class DecideConfig:
    confirm: int = knob(2, "recommendations in the same direction before a server switches role")
    dwell_s: float = knob(600.0, "seconds after a role switch before the next one may start")
    max_step: int = knob(1, "servers moved per decision (each one is drained and restarted)")

    def __post_init__(self) -> None:
        for name in ("confirm", "max_step"):
            if getattr(self, name) < 1:
                raise FieldError(name, f"{name} must be >= 1")
        if self.dwell_s < 0:
            raise FieldError("dwell_s", "dwell_s must be >= 0 seconds")


@dataclass(frozen=True, slots=True)
class Move:
    target: Split
    reason: str  # "more_prefill" | "more_decode": a metrics label, low cardinality
    detail: str  # for the log: what was recommended, how long it was held


def bounded(recommended: tuple[int, int]) -> Split:
    """The planner may recommend 0 local prefills (every prefill remote); an actuator keeps >= 1 of each role
    (a server per pool to fall back on), so the recommendation is clipped to that."""
    n_p, n_d = recommended
    p = min(max(int(n_p), 1), max(int(n_p + n_d) - 1, 1))
    return Split(p, max(int(n_p + n_d) - p, 1))


def direction(current: Split, recommended: Split) -> int:
    """+1: more local prefill recommended, -1: more decode, 0: stay."""
    return (recommended.prefill > current.prefill) - (recommended.prefill < current.prefill)


class SplitDecider:
    """Feed it every recommendation with ``offer``; it answers the move to make now, or None."""

    def __init__(self, cfg: DecideConfig = DecideConfig()) -> None:
        self.cfg = cfg
        self.streak = 0  # consecutive recommendations in ``streak_dir``
        self.streak_dir = 0
        self.last_move_at = float("-inf")
        self.held = ""  # why the last non-zero recommendation did not move (for the log / tests)

    def offer(self, current: Split, recommended: Split, now: float) -> Move | None:
        d = direction(current, recommended)
        self.streak = self.streak + 1 if d != 0 and d == self.streak_dir else (1 if d else 0)
        self.streak_dir = d
        if d == 0:
            self.held = ""
            return None
        if self.streak < self.cfg.confirm:
            self.held = f"hysteresis: {self.streak}/{self.cfg.confirm} recommendations"
            return None
        if now - self.last_move_at < self.cfg.dwell_s:
            self.held = f"dwell: {now - self.last_move_at:.0f}/{self.cfg.dwell_s:.0f} s since the last move"
            return None
        step = min(abs(recommended.prefill - current.prefill), self.cfg.max_step) * d
        if min(current.prefill + step, current.decode - step) < 1:
            self.held = f"a move to {recommended.prefill}/{recommended.decode} would empty a pool"
            return None
        target = Split(current.prefill + step, current.decode - step)
        self.last_move_at, self.streak, self.held = now, 0, ""
        reason = "more_prefill" if d > 0 else "more_decode"
        return Move(target, reason, f"recommended {recommended.prefill}/{recommended.decode}, "
                                    f"now {current.prefill}/{current.decode}")

    def failed(self) -> None:
        """The move was refused or failed: allow a retry after the dwell time, not at once."""
        self.streak = 0
