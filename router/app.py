"""The router process: aiohttp server + client in one asyncio loop (uvloop when run as a program).

Start from code (tests, benchmarks)::

    handle = await start_router(RouterConfig(...))   # port=0 picks a free port
    ... handle.url ...
    await handle.close()
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

import aiohttp
import zmq.asyncio
from aiohttp import web

from prfaas_sgl.cachepool.hashing import block_hashes

from .admin import admin_refusal
from .cluster import Cluster, check_health, health_loop, poll_loads
from .config import RouterConfig
from .controller_api import Controller
from .controller_glue import build_controller
from .forward import AttemptFailed, Forwarder
from .intake import Intake
from .kv_events import KVEventSubscriber
from .metrics import RouterMetrics
from .policy import NoInstanceError
from .prefix_index import ExactIndex
from .requests import ApiError, Limits, ParsedRequest, decode_json, parse_raw, read_body
from .routing import Routed, RoutingCore
from .tokenize import PromptTokenizer, id_limit

log = logging.getLogger(__name__)

BIG_BODY = 16 * 1024  # bytes; larger bodies are parsed and tokenized off the event loop (~10 ms of work)
# Big parses at once. Tokenizing releases the GIL but json.loads and template rendering keep it: the cap bounds
# how long the loop can wait for the GIL, and the memory of decoded bodies and encodings.
BIG_PARSES = 2
ADMIN_BODY_LIMIT = 64 * 1024  # bytes; a routing change is a few keys
# SGLang's HTTP server (uvicorn) closes a connection idle for SGLANG_TIMEOUT_KEEP_ALIVE = 5 s. A pooled connection
# kept longer races that close: the next request after an idle gap is written into a socket the server is closing
# (ServerDisconnectedError / "Can not write request body"), which takes the decode out of rotation. In the demo,
# after the few idle seconds between phases, that failed 63 of a run's 64 requests with one decode server.
UPSTREAM_KEEPALIVE_S = 4.0


def upstream_session() -> aiohttp.ClientSession:
    """The one pooled client session to the servers: idle connections are dropped before SGLang drops them."""
    conn = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=UPSTREAM_KEEPALIVE_S)
    return aiohttp.ClientSession(connector=conn, auto_decompress=False)


def error_response(e: ApiError) -> web.Response:
    resp = web.json_response(e.body(), status=e.status, headers=e.headers)
    if e.headers.get("Connection") == "close":  # a body that never arrived: its connection cannot be reused
        resp.force_close()
    return resp


class Router:
    """All state of one router; its handlers are bound methods."""

    def __init__(self, cfg: RouterConfig, controller: Controller | None = None) -> None:
        self.cfg = cfg
        self.tokenizer = PromptTokenizer(cfg.tokenizer_path)
        self.cluster = Cluster(cfg)
        self.metrics = RouterMetrics()
        self.core = RoutingCore(cfg, self.cluster, self.metrics, controller)
        vocab = id_limit(self.tokenizer, cfg.model_path, cfg.tokenizer_path)
        self.limits = Limits(cfg.context_length, cfg.context_length * cfg.max_chars_per_token, vocab)
        self.intake = Intake(cfg.max_concurrent_requests, cfg.body_budget, cfg.body_timeout_s)
        self.big_parses = asyncio.Semaphore(BIG_PARSES)
        self.tasks: list[asyncio.Task] = []
        self.subscribers: list[KVEventSubscriber] = []

    async def start(self) -> None:
        # One pooled client session for the process lifetime (no per-request sessions).
        self.session = upstream_session()
        self.forwarder = Forwarder(self.cluster, self.session, self.metrics)
        self.zmq_ctx = zmq.asyncio.Context()
        for inst in self.cluster.instances.values():
            if inst.spec.kv_events and isinstance(inst.index, ExactIndex):
                sub = KVEventSubscriber(self.zmq_ctx, inst.spec.kv_events, inst.index)
                sub.start()
                self.subscribers.append(sub)
        # Instances start unknown (out of rotation): probe them before anything routes, so servers that are up
        # serve the first request and one that is down never sees it.
        await check_health(self.cluster, self.session)
        self.tasks += [asyncio.create_task(poll_loads(self.cluster, self.session), name="loads"),
                       asyncio.create_task(health_loop(self.cluster, self.session), name="health"),
                       asyncio.create_task(self._controller_loop(), name="controller")]

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for sub in self.subscribers:
            await sub.close()
        await self.forwarder.close()
        await self.session.close()
        self.zmq_ctx.term()

    async def _controller_loop(self) -> None:
        if self.core.controller is None:
            return
        while True:
            await asyncio.sleep(self.cfg.controller_params.interval_s)
            try:
                self.core.controller_tick(time.monotonic())
            except Exception:  # a planner bug must not take routing down
                log.exception("long-term controller update failed; keeping current routing")

    # ------------------------------------------------------------ generation endpoints

    async def _parse(self, request: web.Request, endpoint: str) -> ParsedRequest:
        async with self.intake.body(request, self.cfg.body_limit) as raw:  # its bytes count until parsed
            return await self._parse_raw(endpoint, raw)

    async def _parse_raw(self, endpoint: str, raw: bytes) -> ParsedRequest:
        args = (endpoint, raw, self.tokenizer, self.cfg.model_name, self.limits)
        if len(raw) <= BIG_BODY:
            return parse_raw(*args)
        async with self.big_parses:
            work = asyncio.get_running_loop().run_in_executor(None, parse_raw, *args)
            try:
                return await asyncio.shield(work)
            except asyncio.CancelledError:  # the client left; its thread runs on, so it keeps its slot until done
                with contextlib.suppress(Exception):
                    await work
                raise

    async def generate(self, request: web.Request) -> web.StreamResponse:
        t0 = time.perf_counter()
        endpoint = request.match_info.route.resource.canonical
        try:
            with self.intake.admit():
                return await self._generate(request, endpoint, t0)
        except ApiError as e:
            self.metrics.errors.labels(e.code).inc()
            return error_response(e)
        except Exception:  # a router bug: still an OpenAI-style answer, and counted
            log.exception("request to %s failed inside the router", endpoint)
            self.metrics.errors.labels("internal_error").inc()
            return error_response(ApiError(500, "internal router error", "server_error", "internal_error"))

    async def _generate(self, request: web.Request, endpoint: str, t0: float) -> web.StreamResponse:
        req = await self._parse(request, endpoint)
        hashes = block_hashes(req.tokens, self.cfg.block_size)
        try:
            routed = await self.core.route_paced(len(req.tokens), hashes)  # the paced policy may hold it
        except NoInstanceError as e:
            raise ApiError(503, str(e), "server_error", "no_healthy_instance") from e
        self.metrics.overhead.observe(time.perf_counter() - t0)
        return await self._serve(request, req, hashes, routed, t0)

    async def _serve(self, request: web.Request, req: ParsedRequest, hashes: list[int],
                     routed: Routed, t0: float) -> web.StreamResponse:
        d = routed.decision
        try:
            return await self.forwarder.attempt(req, d, routed.link, request, t0)
        except AttemptFailed as e:
            log.warning("attempt via %s/%s failed (%s); retrying locally once", d.prefill, d.decode, e)
            self.metrics.retries.labels(d.reason).inc()
            first_error = str(e)
        try:
            retry = self.core.retry_route(len(req.tokens), hashes, frozenset({d.prefill}), time.monotonic())
            return await self.forwarder.attempt(req, retry.decision, retry.link, request, t0)
        except (AttemptFailed, NoInstanceError) as e:
            raise ApiError(502, f"prefill/decode failed: {first_error}; local retry: {e}", "server_error",
                           "upstream_failed") from e

    # ------------------------------------------------------------ info, metrics, admin

    async def models(self, request: web.Request) -> web.Response:
        card = {"id": self.cfg.model_name, "object": "model", "created": 0, "owned_by": "prfaas-sgl"}
        return web.json_response({"object": "list", "data": [card]})

    async def health(self, request: web.Request) -> web.Response:
        insts = self.cluster.instances.values()
        ok = any(i.healthy and i.pool == "decode" for i in insts) and any(
            i.healthy and i.pool != "decode" for i in insts)
        return web.json_response({"status": "ok" if ok else "no healthy prefill/decode"}, status=200 if ok else 503)

    async def metrics_page(self, request: web.Request) -> web.Response:
        body = self.metrics.render(self.cluster, self.core.policy.threshold, self.core.params.budget_s)
        return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def admin_get(self, request: web.Request) -> web.Response:
        refusal = admin_refusal(self.cfg, request)
        return web.json_response(self.core.routing_state()) if refusal is None else error_response(refusal)

    async def admin_post(self, request: web.Request) -> web.Response:
        refusal = admin_refusal(self.cfg, request)
        if refusal is not None:
            return error_response(refusal)
        try:
            changes = decode_json(await read_body(request, ADMIN_BODY_LIMIT))
            if not isinstance(changes, dict):
                raise ValueError("body must be a JSON object")
            return web.json_response(self.core.set_routing(changes, why=f"admin {request.remote}"))
        except ApiError as e:
            return error_response(e)
        except (ValueError, TypeError) as e:
            return error_response(ApiError(400, str(e), code="invalid_routing"))

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.body_limit)
        for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
            app.router.add_post(path, self.generate)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_page)
        app.router.add_get("/admin/routing", self.admin_get)
        app.router.add_post("/admin/routing", self.admin_post)
        return app


@dataclass
class RouterHandle:
    url: str
    router: Router
    runner: web.AppRunner

    async def close(self) -> None:
        await self.runner.cleanup()
        await self.router.close()


async def start_router(cfg: RouterConfig, controller: Controller | None = None,
                       seed: int | None = None) -> RouterHandle:
    """Start a router on the running loop; returns once it accepts connections, its servers probed once (those
    that answered /health are in rotation, the others join at their first passing probe).

    ``seed`` seeds nothing any more (room ids come from the OS's CSPRNG); it stays for existing callers."""
    router = Router(cfg, controller if controller is not None else build_controller(cfg))
    await router.start()
    # handler_cancellation: a client that leaves cancels its handler, and so its attempt; the servers see the
    # connection close and abort the request (aiohttp >= 3.9 otherwise runs the handler to completion).
    runner = web.AppRunner(router.app(), access_log=None, handle_signals=False, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port, reuse_address=True)
    await site.start()
    port = runner.addresses[0][1]
    return RouterHandle(f"http://{cfg.host}:{port}", router, runner)
