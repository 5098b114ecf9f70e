"""The processes actuator on simulated time: move local servers between prefill and decode, at a cost.

The same ``SplitDecider`` as the router (hysteresis, dwell time) turns the controller's recommended split into
moves. A move drains a server (the policy sees it unhealthy, so no new work; its queue or batch finishes, and
every request already routed to it arrives and is served), then the server is out for ``switch_s``
(restart in the other role), then it joins the other pool empty (cold prefix cache)::

    offer ── drain (until idle; checked every sample_s) ── restart (switch_s) ── serves in the new pool
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..actuators.base import Split
from ..actuators.decide import DecideConfig, SplitDecider, bounded


@dataclass(slots=True)
class Switch:
    name: str  # the server leaving its pool
    to: str  # "local_prefill" | "decode"
    start: float  # simulated seconds: drain began
    drained: float = float("nan")  # idle, restart began
    ready: float = float("nan")  # serving in the new pool
    new_name: str = ""


class SplitMover:
    """Owns the switches of one simulation; the engine calls ``offer``, ``check`` and ``ready``."""

    def __init__(self, sim, cfg: DecideConfig, switch_s: float) -> None:
        self.sim, self.decider, self.switch_s = sim, SplitDecider(cfg), switch_s
        self.active: dict[str, Switch] = {}  # draining or restarting, by the leaving server's name
        self.done: list[Switch] = []
        self.seq = 0

    def current(self) -> Split:
        """Servers per role, a moving server counted in the pool it moves to."""
        n_p = sum(s.pool == "local_prefill" for s in self.sim.prefill.values())
        n_d = len(self.sim.decode)
        for sw in self.active.values():
            step = 1 if sw.to == "local_prefill" else -1
            if math.isnan(sw.drained):  # still draining: counted in its old pool's dict
                n_p, n_d = n_p + step, n_d - step
            else:  # restarting: in neither dict
                n_p, n_d = n_p + (step > 0), n_d + (step < 0)
        return Split(max(n_p, 1), max(n_d, 1))

    def offer(self, recommended: tuple[int, int], now: float) -> None:
        if self.active:  # one move at a time, as the processes actuator
            return
        move = self.decider.offer(self.current(), bounded(recommended), now)
        if move is None:
            return
        cur = self.current()
        src = "decode" if move.target.prefill > cur.prefill else "local_prefill"
        servers = (self.sim.decode if src == "decode" else
                   {k: s for k, s in self.sim.prefill.items() if s.pool == "local_prefill"})
        for _ in range(abs(move.target.prefill - cur.prefill)):
            name = min((k for k in servers if k not in self.active), key=lambda k: (self.sim.load_of(k), k))
            self.active[name] = Switch(name, "local_prefill" if src == "decode" else "decode", now)
            self.sim.draining.add(name)

    def check(self, now: float) -> None:
        """Servers that drained leave their pool; each is back after ``switch_s`` (a SWITCH event)."""
        for sw in self.active.values():
            if math.isnan(sw.drained) and self.sim.idle(sw.name):
                sw.drained = now
                self.sim.retire(sw.name)
                self.sim.push_switch(now + self.switch_s, sw)

    def ready(self, sw: Switch, now: float) -> None:
        self.seq += 1
        sw.ready, sw.new_name = now, f"{'pd-p' if sw.to == 'local_prefill' else 'pd-d'}-m{self.seq}"
        self.sim.add_server(sw.new_name, sw.to)
        del self.active[sw.name]
        self.done.append(sw)
        if self.sim.ctl is not None:
            cur = self.current()
            self.sim.ctl.resize((cur.prefill, cur.decode))
