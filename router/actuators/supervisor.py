"""The supervisor actuator: the processes actuator for a router that does not own its servers.

`prfaas up` starts the servers and the router as separate processes (and, across machines, on separate
hosts), so the router cannot restart a server itself. Each machine's `prfaas up` keeps a supervisor
(prfaas_sgl/tools/deploy/supervisor.py) that owns that machine's server processes and answers a small admin API;
this actuator drives it. The switch is the processes actuator's (drain in the router, then stop and start in
the other role, then readmit when healthy): only the stop and start cross HTTP, so the router's own drain
bookkeeping (its in-flight counts) still decides when a server may stop, and no request is lost.

Wire API (JSON bodies, ``Content-Type: application/json`` on every POST)::

    GET  /servers                      -> {"servers": ["local-p0", ...]}      names it owns
    GET  /restarts                     -> {"policy": {...}, "processes": {name: {"state", "restarts", ...}}}
    POST /servers/{name}/stop   {}     -> {"stopped": name}
    POST /servers/{name}/start  {"pool": "local_prefill" | "decode"}
                                       -> {"url": ..., "bootstrap_port": int | null}  once /health passes
                                          409 while the server runs: stop it first

Whenever the supervisor has a token (at least 32 bytes) every request is signed, and the token itself never
travels: ``X-Prfaas-Signature`` is the hex HMAC-SHA256 under the token of five lines joined by newlines
(method, request target with query, hex SHA-256 of the body, timestamp, nonce); ``X-Prfaas-Timestamp`` is
Unix seconds, accepted within 30 s of the supervisor's clock (keep machines on NTP); ``X-Prfaas-Nonce``
(32 hex digits) is accepted once. Each machine may have its own
token: the router then holds ``URL=TOKEN`` pairs (see ``supervisor_tokens``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import aiohttp
from yarl import URL

from ..cluster import Cluster
from ..config import InstanceSpec, RouterConfig, parse_supervisor_urls
from ..policy import Pool
from .base import Action
from .processes import ProcessesActuator

log = logging.getLogger(__name__)

SWITCH_POOLS = ("local_prefill", "decode")  # the roles a supervisor restarts a server in
MIN_TOKEN_BYTES = 32  # 256 bits: an HMAC key no one guesses offline from a captured signature
SIGNATURE_WINDOW_S = 30.0
SIGNATURE, TIMESTAMP, NONCE = "X-Prfaas-Signature", "X-Prfaas-Timestamp", "X-Prfaas-Nonce"


class AlreadyRunning(RuntimeError):
    """A start of a server that runs: starting another would orphan it (two servers on one GPU)."""


def check_token(token: str) -> str:
    """``token`` if it is long enough to sign with; raises ValueError saying how to make one."""
    if len(token.encode()) < MIN_TOKEN_BYTES:
        raise ValueError(f"the supervisor token has {len(token.encode())} bytes, at least {MIN_TOKEN_BYTES} are "
                         "needed: make one with `python -c 'import secrets; print(secrets.token_hex(32))'`")
    return token


def supervisor_tokens(value: str, urls: Iterable[str]) -> dict[str, str]:
    """Supervisor URL -> token, for each of ``urls``, from ``--supervisor-token`` (or its environment variable).

    ``value`` is empty (no token: loopback supervisors), one token for every machine, or per-machine tokens as
    comma-separated ``http://HOST:PORT=TOKEN`` pairs (every URL needs one)."""
    urls = {u.rstrip("/") for u in urls}
    if not value:
        return dict.fromkeys(urls, "")
    if "://" not in value:
        return dict.fromkeys(urls, check_token(value))
    pairs: dict[str, str] = {}
    for item in filter(None, (x.strip() for x in value.split(","))):
        url, sep, token = item.partition("=")
        if not sep or not url.startswith(("http://", "https://")):
            raise ValueError(f"supervisor token: expected http://HOST:PORT=TOKEN pairs, got an item {url!r}")
        pairs[url.rstrip("/")] = check_token(token)
    missing = sorted(urls - set(pairs))
    if missing:
        raise ValueError(f"supervisor token: no token for {missing} (pairs given for {sorted(pairs)})")
    return {u: pairs[u] for u in urls}


def _canonical(method: str, path_qs: str, body: bytes, timestamp: str, nonce: str) -> bytes:
    return "\n".join((method.upper(), path_qs, hashlib.sha256(body).hexdigest(), timestamp, nonce)).encode()


def sign(token: str, method: str, path_qs: str, body: bytes, now: float | None = None) -> dict[str, str]:
    """The headers that authenticate one request (``path_qs``: the request target, path and query)."""
    timestamp, nonce = str(int(time.time() if now is None else now)), secrets.token_hex(16)
    mac = hmac.new(token.encode(), _canonical(method, path_qs, body, timestamp, nonce), hashlib.sha256)
    return {SIGNATURE: mac.hexdigest(), TIMESTAMP: timestamp, NONCE: nonce}


class Verifier:
    """Checks signed requests: a valid MAC, a timestamp within the window, a nonce not seen in it."""

    def __init__(self, token: str, window_s: float = SIGNATURE_WINDOW_S,
                 clock: Callable[[], float] = time.time) -> None:
        self.key, self.window_s, self.clock = check_token(token).encode(), window_s, clock
        self.seen: OrderedDict[str, float] = OrderedDict()  # nonce -> when it may be forgotten

    def refusal(self, method: str, path_qs: str, body: bytes, headers: Mapping[str, str]) -> str | None:
        """None for a good request (its nonce is then spent), else why it is refused."""
        sig, timestamp, nonce = (headers.get(h, "") for h in (SIGNATURE, TIMESTAMP, NONCE))
        if not (sig and timestamp.isdigit() and len(nonce) == 32):
            return f"needs {SIGNATURE}, {TIMESTAMP} and {NONCE} headers (a request signed with the supervisor token)"
        want = hmac.new(self.key, _canonical(method, path_qs, body, timestamp, nonce), hashlib.sha256).hexdigest()
        if not hmac.compare_digest(sig.encode(), want.encode()):
            return "bad signature (a different token, or the request was altered)"
        now = self.clock()
        if abs(now - int(timestamp)) > self.window_s:
            return f"timestamp {timestamp} is {now - int(timestamp):+.0f} s off this machine's clock (window " \
                   f"{self.window_s:.0f} s): replayed, or a clock not synchronised"
        self._forget(now)
        if nonce in self.seen:
            return "nonce already used (a replayed request)"
        self.seen[nonce] = int(timestamp) + self.window_s
        return None

    def _forget(self, now: float) -> None:
        """Drops nonces whose timestamps left the window: a replay of those fails the timestamp check."""
        while self.seen and next(iter(self.seen.values())) < now - self.window_s:
            self.seen.popitem(last=False)


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
        self.urls, self.tokens = urls, supervisor_tokens(token, urls.values())
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
        data = json.dumps(body).encode()
        token = self.tokens[self.urls[name].rstrip("/")]
        headers = {"Content-Type": "application/json",
                   **(sign(token, "POST", URL(url).raw_path_qs, data) if token else {})}
        # A session per call: a switch makes two calls minutes apart; a pooled connection would go stale.
        async with aiohttp.ClientSession() as s:
            try:
                async with s.post(url, data=data, headers=headers,
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
        """From ``--supervisor-urls`` and ``--supervisor-token`` (one token, or ``URL=TOKEN`` pairs); a drain
        waits as long as a request may run."""
        return cls(cluster, parse_supervisor_urls(cfg.supervisor_urls), cfg.supervisor_token, report,
                   drain_timeout_s=cfg.request_timeout_s)
