"""The processes actuator's ``ServerControl`` over servers this process launched (``prfaas up``'s Stack, the
demo): tooling, so it lives here and the router's actuator (router/actuators/processes.py) knows only the
protocol.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Callable

from prfaas_sgl.router.actuators.supervisor import AlreadyRunning
from prfaas_sgl.router.config import InstanceSpec
from prfaas_sgl.router.policy import Pool
from prfaas_sgl.tools.cpu_share import CpuShare
from prfaas_sgl.tools.deploy.keeper import Keeper
from prfaas_sgl.tools.launch import ManagedProcess, ServerSpec, SGLangServer, free_port


class LaunchedServers:
    """``ServerControl`` over ``SGLangServer`` objects (what ``prfaas up``'s Stack and the demo hold), by router
    instance name.

    A restart keeps every flag of the server's ``ServerSpec`` except its mode, ports and log file; a new
    decode binds ``decode_host`` when given (the demo's decode listens on the link's address, so the remote
    prefill can reach it). With a ``keeper`` a stopped server leaves its watch and a started one joins it, so
    a deliberate stop is never undone by a crash restart. A start of a server that runs, or that the keeper
    will restart, raises ``AlreadyRunning``: replacing it would orphan the old process. ``share_for`` gives a
    server that had a CPU share the share of its new pool (the demo's emulated hardware: an H20-like server
    that decodes now is bound by memory bandwidth, not compute).
    """

    def __init__(self, servers: dict, health_timeout_s: float = 600.0, decode_host: str | None = None,
                 make: Callable[[ServerSpec], ManagedProcess] = SGLangServer, keeper: Keeper | None = None,
                 share_for: Callable[[Pool], CpuShare] | None = None) -> None:
        self.servers, self.health_timeout_s, self.decode_host = servers, health_timeout_s, decode_host
        self.make, self.keeper, self.share_for = make, keeper, share_for
        self.restarts = 0

    def owns(self, name: str) -> bool:
        return name in self.servers

    async def stop(self, name: str) -> None:
        if self.keeper is not None:
            self.keeper.release(name)
        await asyncio.to_thread(self.servers[name].stop)

    async def start(self, name: str, pool: Pool) -> InstanceSpec:
        old = self.servers[name]
        if old.alive() or (self.keeper is not None and self.keeper.watches(name)):
            raise AlreadyRunning(f"{name} is running (pid {old.pid}): stop it first")
        await asyncio.to_thread(old.stop)  # what is left of its process group (SGLang's scheduler)
        srv = self.make(self._respec(name, old.spec, pool))
        self.servers[name] = srv
        # Forked here, on the event loop's thread (prfaas up's main thread): see launch._die_with_parent.
        srv.start()
        try:
            await asyncio.to_thread(srv.wait_healthy, self.health_timeout_s)
        except BaseException:
            await asyncio.to_thread(srv.stop)
            raise
        if self.keeper is not None:
            self.keeper.keep(name, srv)
        return InstanceSpec(srv.spec.url, srv.spec.bootstrap_port, None, name)

    def _respec(self, name: str, old: ServerSpec, pool: Pool) -> ServerSpec:
        mode = "prefill" if pool == "local_prefill" else "decode"
        host = self.decode_host if mode == "decode" and self.decode_host else old.host
        self.restarts += 1
        log_path = f"{old.log_path or f'/tmp/prfaas-{name}.log'}.{self.restarts}-{mode}.log"
        # fresh ports: the stopped server's may still be held (TIME_WAIT, a child not yet reaped)
        cpu = self.share_for(pool) if self.share_for is not None and old.cpu is not None else old.cpu
        return dataclasses.replace(old, mode=mode, host=host, port=free_port(host), log_path=log_path,
                                   bootstrap_port=free_port() if mode == "prefill" else None, cpu=cpu)
