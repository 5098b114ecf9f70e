"""The supervisor `prfaas up` keeps: it owns this machine's server processes and restarts one in the other
role when the router's supervisor actuator asks (router/actuators/supervisor.py has the wire API).

Secure by default: without a token it listens on loopback only (the host is the boundary) and refuses to
start on any other address; with a token (env PRFAAS_SUPERVISOR_TOKEN) every call must carry it as
``Authorization: Bearer``. It never drains: the router does that before it calls stop (it alone knows what it
sent where). One action per server at a time; every action is logged.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from typing import Any

from aiohttp import web

from prfaas_sgl.config import is_loopback
from prfaas_sgl.router.actuators.processes import ServerControl
from prfaas_sgl.router.actuators.supervisor import SWITCH_POOLS, Started
from prfaas_sgl.router.config import SUPERVISOR_TOKEN_ENV

log = logging.getLogger(__name__)


class Supervisor:
    def __init__(self, control: ServerControl, names: list[str], host: str, token: str = "") -> None:
        if not token and not is_loopback(host):
            raise ValueError(f"the supervisor would listen on {host} without a token: set {SUPERVISOR_TOKEN_ENV} "
                             "(the router's machine needs the same value) or bind it to a loopback address")
        self.control, self.names, self.host, self.token = control, list(names), host, token
        self.locks = {n: asyncio.Lock() for n in names}
        self.runner: web.AppRunner | None = None
        self.url = ""

    def _refusal(self, request: web.Request) -> web.Response | None:
        if not self.token:
            return None
        scheme, _, sent = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(sent.strip().encode(), self.token.encode()):
            return None
        return _error(401, "needs 'Authorization: Bearer <supervisor token>'")

    def _server(self, request: web.Request) -> str | web.Response:
        name = request.match_info["name"]
        return name if name in self.locks else _error(404, f"no server {name!r} here; this supervisor owns {self.names}")

    async def servers(self, request: web.Request) -> web.Response:
        return self._refusal(request) or web.json_response({"servers": self.names})

    async def stop(self, request: web.Request) -> web.Response:
        name = self._server(request)
        refusal = self._refusal(request) or (name if isinstance(name, web.Response) else None)
        if refusal is not None:
            return refusal
        async with self.locks[name]:
            log.warning("supervisor: stopping %s (asked by %s)", name, request.remote)
            await self.control.stop(name)
        return web.json_response({"stopped": name})

    async def start(self, request: web.Request) -> web.Response:
        name = self._server(request)
        refusal = self._refusal(request) or (name if isinstance(name, web.Response) else None)
        if refusal is not None:
            return refusal
        body = await _json(request)
        pool = body.get("pool") if isinstance(body, dict) else None
        if pool not in SWITCH_POOLS:
            return _error(400, f"body must be {{'pool': one of {list(SWITCH_POOLS)}}}, got {body!r}")
        async with self.locks[name]:
            log.warning("supervisor: starting %s as %s (asked by %s)", name, pool, request.remote)
            try:
                spec = await self.control.start(name, pool)
            except Exception as e:  # noqa: BLE001 - the router restores the old role; it needs the reason
                log.exception("supervisor: %s did not start as %s", name, pool)
                return _error(500, f"{name} did not start as {pool}: {type(e).__name__}: {e}")
        log.warning("supervisor: %s serves as %s at %s", name, pool, spec.url)
        return web.json_response(Started(spec.url, spec.bootstrap_port).to_json())

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/servers", self.servers)
        app.router.add_post("/servers/{name}/stop", self.stop)
        app.router.add_post("/servers/{name}/start", self.start)
        return app

    async def serve(self, port: int) -> str:
        """Listen on ``host:port`` (0 = a free port); returns the URL."""
        # handler_cancellation off (aiohttp's default): a router that gives up waiting must not leave a
        # server half-started, so the start runs to its end and the lock is released after it.
        self.runner = web.AppRunner(self.app(), access_log=None, handle_signals=False)
        await self.runner.setup()
        await web.TCPSite(self.runner, self.host, port, reuse_address=True).start()
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.url = f"http://{host}:{self.runner.addresses[0][1]}"
        log.warning("supervisor of %s listening on %s (%s)", self.names, self.url,
                    "bearer token" if self.token else "loopback, no token")
        return self.url

    async def close(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


async def _json(request: web.Request) -> Any:
    try:
        return await request.json()
    except ValueError:
        return None


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)
