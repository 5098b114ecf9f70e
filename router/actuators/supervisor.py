"""The supervisor actuator: the processes actuator for a router that does not own its servers (issue 15).

`prfaas up` starts the servers and the router as separate processes (and, across machines, on separate
hosts), so the router cannot restart a server itself. Each machine's `prfaas up` keeps a supervisor
(prfaas_sgl/tools/deploy/supervisor.py) that owns that machine's server processes and answers a small admin API;
this actuator drives it. The switch is the processes actuator's (drain in the router, then stop and start in
the other role, then readmit when healthy): only the stop and start cross HTTP, so the router's own drain
bookkeeping (its in-flight counts) still decides when a server may stop, and no request is lost.

Wire API (JSON; ``Authorization: Bearer <token>`` whenever the supervisor has a token)::

    GET  /servers                      -> {"servers": ["local-p0", ...]}      names it owns
    POST /servers/{name}/stop          -> {"stopped": name}
    POST /servers/{name}/start  {"pool": "local_prefill" | "decode"}
                                       -> {"url": ..., "bootstrap_port": int | null}  once /health passes
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import aiohttp

from ..cluster import Cluster
from ..config import InstanceSpec, RouterConfig, parse_supervisor_urls
from ..policy import Pool
from .base import Action
from .processes import ProcessesActuator

log = logging.getLogger(__name__)

SWITCH_POOLS = ("local_prefill", "decode")  # the roles a supervisor restarts a server in


@dataclass(frozen=True, slots=True)
class Started:
    """The supervisor's answer to a start: where the restarted server listens (its ports are fresh)."""

    url: str
    bootstrap_port: int | None

    def to_json(self) -> dict[str, Any]:
        return {"url": self.url, "bootstrap_port": self.bootstrap_port}

    @classmethod
    def from_json(cls, body: Any) -> "Started":
        if not isinstance(body, dict) or not isinstance(body.get("url"), str):
            raise ValueError(f"supervisor start: expected {{'url': str, 'bootstrap_port': int|null}}, got {body!r}")
        port = body.get("bootstrap_port")
        if port is not None and (not isinstance(port, int) or isinstance(port, bool)):
            raise ValueError(f"supervisor start: bootstrap_port must be an int or null, got {port!r}")
        return cls(body["url"], port)


class SupervisorClient:
    """``ServerControl`` over the supervisors' HTTP API, by router instance name."""

    def __init__(self, urls: dict[str, str], token: str = "", start_timeout_s: float = 900.0,
                 stop_timeout_s: float = 120.0) -> None:
        self.urls, self.token = urls, token
        self.start_timeout_s, self.stop_timeout_s = start_timeout_s, stop_timeout_s

    def owns(self, name: str) -> bool:
        return name in self.urls

    async def stop(self, name: str) -> None:
        await self._post(name, "stop", {}, self.stop_timeout_s)

    async def start(self, name: str, pool: Pool) -> InstanceSpec:
        started = Started.from_json(await self._post(name, "start", {"pool": pool}, self.start_timeout_s))
        return InstanceSpec(started.url, started.bootstrap_port, None, name)

    async def _post(self, name: str, verb: str, body: dict, timeout_s: float) -> Any:
        """One call; raises RuntimeError naming the supervisor and its answer (the actuator logs and restores)."""
        url = f"{self.urls[name]}/servers/{name}/{verb}"
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        # A session per call: a switch makes two calls minutes apart; a pooled connection would go stale.
        async with aiohttp.ClientSession() as s:
            try:
                async with s.post(url, json=body, headers=headers,
                                  timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                    answer = await r.json(content_type=None)
                    if r.status != 200:
                        raise RuntimeError(f"{url}: HTTP {r.status}: {answer}")
                    return answer
            except (aiohttp.ClientError, TimeoutError, ValueError) as e:
                raise RuntimeError(f"{url}: {type(e).__name__}: {e}") from e


class SupervisorActuator(ProcessesActuator):
    """The processes actuator with ``SupervisorClient`` as its server control: switches only servers a
    supervisor owns, counted in /metrics as ``actuator="supervisor"``."""

    name = "supervisor"

    def __init__(self, cluster: Cluster, urls: dict[str, str], token: str = "",
                 report: Callable[[Action], None] | None = None, drain_timeout_s: float = 120.0,
                 poll_s: float = 0.2, start_timeout_s: float = 900.0) -> None:
        unknown = set(urls) - set(cluster.instances)
        if unknown:
            raise ValueError(f"--supervisor-urls names servers the router does not have: {sorted(unknown)}")
        super().__init__(cluster, SupervisorClient(urls, token, start_timeout_s), report, drain_timeout_s, poll_s)

    @classmethod
    def from_config(cls, cluster: Cluster, cfg: RouterConfig, report: Callable[[Action], None] | None = None
                    ) -> "SupervisorActuator":
        """From ``--supervisor-urls`` and ``--supervisor-token``; a drain waits as long as a request may run."""
        return cls(cluster, parse_supervisor_urls(cfg.supervisor_urls), cfg.supervisor_token, report,
                   drain_timeout_s=cfg.request_timeout_s)
