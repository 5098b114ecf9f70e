"""A circuit breaker per server: attempts that keep failing through one server take it out of rotation.

A prefill whose KV never reaches its decode can still answer ``/health`` (its HTTP process is fine while its
transfer engine is broken), so health probes alone kept sending it requests that each failed after the
decode's wait, and a failed prefill answer only took it out until the next passing probe (2 s).

    closed ──``failures`` in a row──> open ──``cooldown_s``──> half-open ──trial succeeds──> closed
                                       ^                           │
                                       └──────trial fails──────────┘

Half-open lets one trial request through at a time. A client's 4xx, and an attempt that ends without a
verdict on the server (the client left; for a prefill, its decode was unreachable), count neither way. A decode
that answered 5xx or an error event counts against both servers of the attempt: a broken decode then opens its
own breaker, and its prefills, which succeed with the other decodes, do not reach theirs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

State = Literal["closed", "open", "half_open"]


@dataclass(slots=True)
class Breaker:
    failures_to_open: int = 0  # consecutive failures that open it; 0: never opens
    cooldown_s: float = 30.0
    failures: int = 0  # consecutive, since the last success
    open_until: float = 0.0  # monotonic seconds; 0 while closed
    trial: bool = False  # a half-open trial request is in flight
    opened: int = 0  # times it opened, for the metric

    def state(self, now: float) -> State:
        if self.open_until == 0.0:
            return "closed"
        return "open" if now < self.open_until else "half_open"

    def allows(self, now: float) -> bool:
        """Whether a new request may go to this instance now."""
        state = self.state(now)
        return state == "closed" or (state == "half_open" and not self.trial)

    def start(self, now: float) -> None:
        """A request was sent; in half-open it is the trial, and others wait for its verdict."""
        if self.state(now) == "half_open":
            self.trial = True

    def succeeded(self) -> None:
        self.failures, self.open_until, self.trial = 0, 0.0, False

    def failed(self, now: float) -> bool:
        """Count a failure; True when it opens the breaker (from closed or half-open). A request sent before it
        opened that fails while it is open only restarts the cool-down."""
        self.failures += 1
        self.trial = False
        if not self.failures_to_open or self.failures < self.failures_to_open:
            return False
        was_open = self.state(now) == "open"
        self.open_until = now + self.cooldown_s
        self.opened += not was_open
        return not was_open

    def no_verdict(self) -> None:
        """The request ended without saying anything about this instance: a trial may be sent again."""
        self.trial = False

    def reset(self) -> None:
        """A new server process behind the name (readmitted after a restart or role switch)."""
        self.succeeded()
