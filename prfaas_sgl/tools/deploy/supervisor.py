"""The supervisor `prfaas up` keeps: it owns this machine's server processes and restarts one in the other
role when the router's supervisor actuator asks (router/actuators/supervisor.py has the wire API).

Secure by default:
- With a token (env PRFAAS_SUPERVISOR_TOKEN, at least 32 bytes) every request must be signed with it
  (HMAC-SHA256 over method, target, body hash, timestamp and nonce; a replay is refused), loopback included:
  the token itself never crosses the network.
- Without a token it listens on loopback only (the host is the boundary) and refuses to start on any other
  address; a request must then name a loopback ``Host`` (a DNS-rebound page names its own).
- Browsers are kept out: a POST must be ``application/json`` (a form or ``no-cors`` fetch cannot send that
  without a preflight, which this server never grants) and an ``Origin`` other than its own is refused.

It never drains: the router does that before it calls stop (it alone knows what it sent where). One action
per server at a time; a start of a server it has not stopped is refused (409): the old process would be
orphaned. Every action is logged.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

from aiohttp import web
from yarl import URL

from prfaas_sgl.config import is_loopback
from prfaas_sgl.router.actuators.processes import ServerControl
from prfaas_sgl.router.actuators.supervisor import SWITCH_POOLS, AlreadyRunning, Started, Verifier
from prfaas_sgl.router.config import SUPERVISOR_TOKEN_ENV

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 64 * 1024  # a start's body is one small JSON object


class Supervisor:
    def __init__(self, control: ServerControl, names: list[str], host: str, token: str = "",
                 restarts: Callable[[], dict[str, Any]] | None = None) -> None:
        if not token and not is_loopback(host):
            raise ValueError(f"the supervisor would listen on {host} without a token: set {SUPERVISOR_TOKEN_ENV} "
                             "(the router's machine needs the same value) or bind it to a loopback address")
        self.control, self.names, self.host = control, list(names), host
        self.verifier = Verifier(token) if token else None
        self.restarts = restarts
        self.locks = {n: asyncio.Lock() for n in names}
        self.stopped: set[str] = set()  # stopped through this API: the only servers a start may bring up
        self.runner: web.AppRunner | None = None
        self.url = ""

    @web.middleware
    async def guard(self, request: web.Request, handler) -> web.StreamResponse:
        body = await request.read()
        return self._refusal(request, body) or await handler(request)

    def _refusal(self, request: web.Request, body: bytes) -> web.Response | None:
        origin = request.headers.get("Origin")
        if origin is not None and origin.rstrip("/").lower() != self.url.lower():
            return _error(403, f"cross-origin request from {origin!r} refused")
        if request.method == "POST" and request.content_type != "application/json":
            return _error(415, "a POST needs 'Content-Type: application/json' (send {} for an empty body)")
        if self.verifier is not None:
            why = self.verifier.refusal(request.method, request.raw_path, body, request.headers)
            return _error(401, why) if why else None
        host = URL(f"http://{request.host}").host or ""
        if not is_loopback(host.strip("[]")):
            return _error(403, f"Host {request.host!r} refused: without a token this supervisor answers loopback "
                               "names only")
        return None

    def _server(self, request: web.Request) -> str | web.Response:
        name = request.match_info["name"]
        return name if name in self.locks else _error(404, f"no server {name!r} here; this supervisor owns {self.names}")

    async def servers(self, request: web.Request) -> web.Response:
        return web.json_response({"servers": self.names})

    async def restart_report(self, request: web.Request) -> web.Response:
        if self.restarts is None:
            return _error(404, "this supervisor's servers are not kept by a restart monitor")
        return web.json_response(self.restarts())

    async def stop(self, request: web.Request) -> web.Response:
        name = self._server(request)
        if isinstance(name, web.Response):
            return name
        async with self.locks[name]:
            log.warning("supervisor: stopping %s (asked by %s)", name, request.remote)
            await self.control.stop(name)
            self.stopped.add(name)
        return web.json_response({"stopped": name})

    async def start(self, request: web.Request) -> web.Response:
        name = self._server(request)
        if isinstance(name, web.Response):
            return name
        body = await _json(request)
        pool = body.get("pool") if isinstance(body, dict) else None
        if pool not in SWITCH_POOLS:
            return _error(400, f"body must be {{'pool': one of {list(SWITCH_POOLS)}}}, got {body!r}")
        async with self.locks[name]:
            return await self._start_locked(request, name, pool)

    async def _start_locked(self, request: web.Request, name: str, pool: str) -> web.Response:
        if name not in self.stopped:
            return _error(409, f"{name} is running: stop it first (a second start would orphan the first server)")
        log.warning("supervisor: starting %s as %s (asked by %s)", name, pool, request.remote)
        try:
            spec = await self.control.start(name, pool)
        except AlreadyRunning as e:
            return _error(409, str(e))
        except Exception as e:  # noqa: BLE001 - the router restores the old role; it needs the reason
            log.exception("supervisor: %s did not start as %s", name, pool)
            return _error(500, f"{name} did not start as {pool}: {type(e).__name__}: {e}")
        self.stopped.discard(name)
        log.warning("supervisor: %s serves as %s at %s", name, pool, spec.url)
        return web.json_response(Started(spec.url, spec.bootstrap_port).to_json())

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.guard], client_max_size=MAX_BODY_BYTES)
        app.router.add_get("/servers", self.servers)
        app.router.add_get("/restarts", self.restart_report)
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
                    "signed requests" if self.verifier else "loopback, no token")
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
