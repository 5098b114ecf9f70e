"""Keeps `prfaas up`'s processes running: a server (or the router) that dies is restarted with the same
command on the same ports, so the router, which probes every server's /health, takes it back by itself.

One process, from its death on::

    died ── its group stopped ── wait delay ── restart ── /health passes ── healthy for healthy_after_s
                                                                            └─ fast failures back to 0
    a death before healthy_after_s of health is a fast failure;
    delay = first_delay_s * 2 ** (fast failures - 1), at most max_delay_s (1, 1, 2, 4, ... 60 s);
    give_up_after fast failures in a row: no more restarts, said loudly; the rest keeps serving

Everything runs on the event loop of `prfaas up`'s main thread: a restart forks from there, so the
parent-death signal (prfaas_sgl/tools/launch.py) follows `prfaas up`'s lifetime, not a worker thread's.
A process the supervisor stops on purpose (a role switch) is released first and never restarted.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

from prfaas_sgl.tools.launch import ManagedProcess, http_ok


@dataclass(frozen=True)
class RestartPolicy:
    first_delay_s: float = 1.0
    max_delay_s: float = 60.0
    healthy_after_s: float = 60.0  # this long healthy and a death counts as a first one again
    give_up_after: int = 5  # fast failures in a row

    def __post_init__(self) -> None:
        if not 0 < self.first_delay_s <= self.max_delay_s:
            raise ValueError(f"restart delays: need 0 < first ({self.first_delay_s}) <= max ({self.max_delay_s})")
        if self.healthy_after_s <= 0 or self.give_up_after < 1:
            raise ValueError("restart policy: healthy_after_s must be > 0 and give_up_after >= 1")

    def delay_s(self, fast_failures: int) -> float:
        return min(self.max_delay_s, self.first_delay_s * 2 ** max(0, fast_failures - 1))


@dataclass
class Kept:
    """One watched process and its restart bookkeeping (monotonic seconds)."""

    name: str
    proc: ManagedProcess
    started_at: float
    healthy_since: float | None = None
    restarts: int = 0
    fast_failures: int = 0
    restart_at: float | None = None  # set while a restart waits out its delay
    gave_up: bool = False
    last_exit: int | None = None

    @property
    def state(self) -> str:
        if self.gave_up:
            return "gave_up"
        if self.restart_at is not None:
            return "restarting"
        return "healthy" if self.healthy_since is not None else "starting"

    def to_json(self) -> dict[str, Any]:
        return {"state": self.state, "pid": self.proc.pid, "restarts": self.restarts,
                "fast_failures": self.fast_failures, "last_exit": self.last_exit, "log": str(self.proc.log_path)}


class Keeper:
    """Watches named ``ManagedProcess``es and restarts the ones that die (see the module docstring)."""

    def __init__(self, policy: RestartPolicy = RestartPolicy(), say: Callable[[str], None] = print,
                 grace_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.policy, self.say, self.grace_s, self.clock = policy, say, grace_s, clock
        self.kept: dict[str, Kept] = {}

    def keep(self, name: str, proc: ManagedProcess) -> None:
        """Watch ``proc`` (started, healthy) as ``name`` from now on, replacing whatever was watched."""
        self.kept[name] = Kept(name, proc, self.clock(), healthy_since=self.clock())

    def release(self, name: str) -> None:
        """Stop watching ``name`` (it is about to be stopped on purpose); a pending restart is dropped."""
        self.kept.pop(name, None)

    def watches(self, name: str) -> bool:
        return name in self.kept

    def report(self) -> dict[str, Any]:
        """What ``GET /restarts`` of the supervisor answers."""
        return {"policy": vars(self.policy).copy(), "processes": {n: k.to_json() for n, k in self.kept.items()}}

    async def run(self, period_s: float = 0.5) -> None:
        while True:
            await self.tick()
            await asyncio.sleep(period_s)

    async def tick(self) -> None:
        """One round: notice deaths, restart the processes whose delay is over, probe the unconfirmed."""
        for k in list(self.kept.values()):
            if k.gave_up:
                continue
            if k.restart_at is None and not k.proc.alive():
                await self._died(k)
            elif k.restart_at is not None and self.clock() >= k.restart_at:
                self._restart(k)
        await self._probe()

    async def _died(self, k: Kept) -> None:
        now = self.clock()
        k.last_exit = k.proc.proc.returncode if k.proc.proc else None
        healthy_for = now - k.healthy_since if k.healthy_since is not None else 0.0
        k.fast_failures = 0 if healthy_for >= self.policy.healthy_after_s else k.fast_failures + 1
        k.healthy_since = None
        # SGLang's scheduler and detokenizer may outlive its main process for a moment, holding the GPU
        # and the ports the restart needs: stop the whole group first.
        await asyncio.to_thread(k.proc.stop, self.grace_s)
        if self.kept.get(k.name) is not k:  # released meanwhile (the supervisor stopped it on purpose)
            return
        ran = now - k.started_at
        if k.fast_failures >= self.policy.give_up_after:
            self._give_up(k, ran)
            return
        delay = self.policy.delay_s(k.fast_failures)
        k.restart_at = self.clock() + delay
        fast = f" (fast failure {k.fast_failures} of {self.policy.give_up_after})" if k.fast_failures else ""
        self.say(f"[up] {k.name} exited with {k.last_exit} after {ran:.1f} s{fast}: restart {k.restarts + 1} "
                 f"in {delay:g} s; log {k.proc.log_path}")

    def _restart(self, k: Kept) -> None:
        k.restart_at, k.restarts, k.started_at = None, k.restarts + 1, self.clock()
        try:
            k.proc.start(append=True)
        except OSError as e:  # the command itself is gone: a failure like any other
            k.fast_failures += 1
            k.restart_at = self.clock() + self.policy.delay_s(k.fast_failures)
            self.say(f"[up] {k.name} could not be restarted: {e}")
            return
        self.say(f"[up] restarted {k.name} (restart {k.restarts}, pid {k.proc.pid})")

    def _give_up(self, k: Kept, ran: float) -> None:
        k.gave_up = True
        message = (f"[up] GIVING UP on {k.name}: it died {k.fast_failures} times in a row (last: exit "
                   f"{k.last_exit} after {ran:.1f} s), each before {self.policy.healthy_after_s:.0f} s of health. "
                   f"It stays down; the router keeps it out of rotation. Log {k.proc.log_path}:\n"
                   f"{k.proc.log_tail(20)}")
        self.say(message)
        print(message, file=sys.stderr, flush=True)

    async def _probe(self) -> None:
        now = self.clock()
        for k in self.kept.values():  # a long healthy run forgives the earlier failures
            if k.healthy_since is not None and now - k.healthy_since >= self.policy.healthy_after_s:
                k.fast_failures = 0
        waiting = [k for k in self.kept.values() if k.healthy_since is None and k.restart_at is None
                   and not k.gave_up and k.proc.alive()]
        oks = await asyncio.gather(*(asyncio.to_thread(http_ok, k.proc.url + "/health") for k in waiting))
        for k, ok in zip(waiting, oks):
            if ok and self.kept.get(k.name) is k and k.healthy_since is None:
                k.healthy_since = self.clock()
                k.proc.became_healthy()
                self.say(f"[up] {k.name} healthy again after restart {k.restarts}")
