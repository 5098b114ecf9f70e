"""The processes actuator's ``ServerControl`` over servers this process launched (``prfaas up``'s Stack, the
demo): tooling, so it lives here and the router's actuator (router/actuators/processes.py) knows only the
protocol.
"""

from __future__ import annotations

import asyncio
import dataclasses

from prfaas_sgl.router.config import InstanceSpec
from prfaas_sgl.router.policy import Pool
from prfaas_sgl.tools.launch import SGLangServer, free_port


class LaunchedServers:
    """``ServerControl`` over ``SGLangServer`` objects (what ``prfaas up``'s Stack and the demo hold), by router
    instance name.

    A restart keeps every flag of the server's ``ServerSpec`` except its mode, ports and log file; a new
    decode binds ``decode_host`` when given (the demo's decode listens on the link's address, so the remote
    prefill can reach it).
    """

    def __init__(self, servers: dict, health_timeout_s: float = 600.0, decode_host: str | None = None) -> None:
        self.servers, self.health_timeout_s, self.decode_host = servers, health_timeout_s, decode_host
        self.restarts = 0

    def owns(self, name: str) -> bool:
        return name in self.servers

    async def stop(self, name: str) -> None:
        await asyncio.to_thread(self.servers[name].stop)

    async def start(self, name: str, pool: Pool) -> InstanceSpec:
        old = self.servers[name].spec
        mode = "prefill" if pool == "local_prefill" else "decode"
        host = self.decode_host if mode == "decode" and self.decode_host else old.host
        self.restarts += 1
        log_path = f"{old.log_path or f'/tmp/prfaas-{name}.log'}.{self.restarts}-{mode}.log"
        # fresh ports: the stopped server's may still be held (TIME_WAIT, a child not yet reaped)
        spec = dataclasses.replace(old, mode=mode, host=host, port=free_port(host), log_path=log_path,
                                   bootstrap_port=free_port() if mode == "prefill" else None)
        srv = SGLangServer(spec)
        self.servers[name] = srv
        await asyncio.to_thread(lambda: srv.start().wait_healthy(self.health_timeout_s))
        return InstanceSpec(spec.url, spec.bootstrap_port, None, name)
