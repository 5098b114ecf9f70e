"""The processes actuator: switch one local server between prefill and decode.

A switch, one server at a time::

    drain ──────────────── stop ── start in the other role ── /health ── readmit
    │ router sends it no   │                                           │ router routes to it in
    │ new work; requests   │ after inflight == 0, or drain_timeout_s   │ the new pool
    │ there finish         │ (then the stragglers fail and are retried by their clients)

The server is restarted with the same flags (``ServerSpec`` minus mode, ports); only its role changes.
``apply`` returns at once ("in_progress"); the end of the switch ("applied", or "failed" after putting the
server back in its old role) goes to the ``report`` callback. Runs on the router's event loop, in the process
that owns both the router and the server processes (tests, the demo); starting and stopping servers block,
so they run in threads.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from ..cluster import Cluster, Instance
from ..config import InstanceSpec
from ..policy import Pool
from .base import Action, Report, Split
from .decide import direction

log = logging.getLogger(__name__)


class ServerControl(Protocol):
    """Stops and starts the process behind a router instance."""

    def owns(self, name: str) -> bool:
        """Whether this control can restart ``name`` (a supervisor owns one machine's servers only)."""
        ...

    async def stop(self, name: str) -> None: ...

    async def start(self, name: str, pool: Pool) -> InstanceSpec:
        """Start ``name`` in ``pool``'s role; return its spec once it answers /health (raises if it does not)."""
        ...


class ProcessesActuator:
    name = "processes"

    def __init__(self, cluster: Cluster, control: ServerControl, report: Report | None = None,
                 drain_timeout_s: float = 120.0, poll_s: float = 0.2) -> None:
        self.cluster, self.control, self.report = cluster, control, report
        self.drain_timeout_s, self.poll_s = drain_timeout_s, poll_s
        self.switching: tuple[str, Pool] | None = None  # (server, pool it moves to)
        self.task: asyncio.Task | None = None

    def current(self) -> Split:
        """Servers per role, a switching server counted in the pool it moves to."""
        n = {"local_prefill": 0, "decode": 0}
        for inst in self.cluster.instances.values():
            pool = self.switching[1] if self.switching and inst.name == self.switching[0] else inst.pool
            if pool in n:
                n[pool] += 1
        return Split(max(n["local_prefill"], 1), max(n["decode"], 1))

    async def apply(self, target: Split, reason: str) -> Action:
        before = self.current()
        d = direction(before, target)
        refuse = (f"{self.switching[0]} is still switching" if self.switching else
                  "already at the target split" if d == 0 else "")
        src: Pool = "decode" if d > 0 else "local_prefill"
        dst: Pool = "local_prefill" if d > 0 else "decode"
        cands = [i for i in self.cluster.pool(src) if i.healthy and not i.draining and self.control.owns(i.name)]
        if not refuse and (len(self.cluster.pool(src)) <= 1 or not cands):
            refuse = f"no {src} server can leave its pool"
        if refuse:
            return Action(self.name, before, before, reason, "refused", refuse)
        inst = min(cands, key=lambda i: (i.inflight, i.name))
        after = Split(before.prefill + d, before.decode - d)
        self.switching = (inst.name, dst)
        self.cluster.drain(inst.name)
        self.task = asyncio.get_running_loop().create_task(self._switch(inst, src, dst, before, after, reason))
        return Action(self.name, before, after, reason, "in_progress", f"{inst.name}: {src} -> {dst}")

    async def _drain(self, inst: Instance) -> int:
        """Wait until nothing this router sent to ``inst`` is open; returns how many were left at the timeout."""
        deadline = time.monotonic() + self.drain_timeout_s
        while inst.inflight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(self.poll_s)
        return inst.inflight

    async def _switch(self, inst: Instance, src: Pool, dst: Pool, before: Split, after: Split, reason: str) -> None:
        t0 = time.monotonic()
        try:
            left = await self._drain(inst)
            drained_s = time.monotonic() - t0
            await self.control.stop(inst.name)
            spec = await self.control.start(inst.name, dst)
            self.cluster.readmit(inst.name, dst, spec)
            cut = f", {left} request(s) cut at the {self.drain_timeout_s:.0f} s drain bound" if left else ""
            action = Action(self.name, before, after, reason, "applied",
                            f"{inst.name}: {src} -> {dst} in {time.monotonic() - t0:.1f} s "
                            f"(drain {drained_s:.1f} s{cut}), now {spec.url}")
        except Exception as e:  # noqa: BLE001 - the server must not stay out of rotation
            log.exception("switching %s to %s failed; restarting it as %s", inst.name, dst, src)
            action = Action(self.name, before, before, reason, "failed", f"{inst.name}: {type(e).__name__}: {e}")
            await self._restore(inst, src)
        finally:
            self.switching = None
        if self.report is not None:
            self.report(action)

    async def _restore(self, inst: Instance, src: Pool) -> None:
        try:
            await self.control.stop(inst.name)
            self.cluster.readmit(inst.name, src, await self.control.start(inst.name, src))
        except Exception:  # noqa: BLE001 - logged; the instance stays drained and out of rotation
            log.exception("%s did not come back as %s either; it stays out of rotation", inst.name, src)

