"""A scripted, in-process OpenAI-compatible server with known latencies, for the load generator's tests.

Per request, with ``w`` = whitespace-separated words in the prompt (= target tokens in the load
generator's approximate mode):

    TTFT  = ttft_base_s + ttft_per_token_s * w        (first chunk at arrival + TTFT)
    chunk = one token per chunk, token i at arrival + TTFT + i * itl_s   (so TPOT = ITL = itl_s)
    route = "prfaas" if w > route_threshold else "local"  (header only when route_threshold > 0)

``/metrics`` uses the router's Prometheus names (router/names.py): the per-route decision counter, and the
link byte counter (``link_bytes_per_token`` per prompt word of each remote request) and capacity.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

from aiohttp import web

from prfaas_sgl.router import names
from prfaas_sgl.router.names import ROUTE_HEADER


@dataclass(frozen=True, slots=True)
class StandInScript:
    ttft_base_s: float = 0.0
    ttft_per_token_s: float = 1e-4
    itl_s: float = 0.005
    route_threshold: int = 0  # 0: send no route header
    honour_usage: bool = True  # False: behave like a server without stream_options support
    fail_every: int = 0  # every n-th request (1-based) answers HTTP 500; 0: never
    link_bytes_per_token: int = 1000
    link_capacity_bps: float = 1e8
    model: str = "standin"


@dataclass(slots=True)
class StandInServer:
    script: StandInScript = field(default_factory=StandInScript)
    bodies: list[dict] = field(default_factory=list)  # every request body received, in arrival order
    routes: dict[str, int] = field(default_factory=dict)
    link_bytes: int = 0
    inflight: int = 0  # generate calls in progress now, and the most seen at once
    max_inflight: int = 0
    _runner: web.AppRunner | None = None
    url: str = ""

    async def start(self) -> str:
        """Bind 127.0.0.1 on a free port; returns the base URL."""
        app = web.Application()
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # aiohttp exposes the bound port only here
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def expected_ttft_s(self, words: int) -> float:
        return self.script.ttft_base_s + self.script.ttft_per_token_s * words

    def route_for(self, words: int) -> str | None:
        if self.script.route_threshold <= 0:
            return None
        return "prfaas" if words > self.script.route_threshold else "local"

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.script.model, "object": "model"}]})

    async def _metrics(self, request: web.Request) -> web.Response:
        decisions, link_bytes = names.DECISIONS.removesuffix("_total"), names.LINK_BYTES_TOTAL.removesuffix("_total")
        lines = [f"# TYPE {decisions} counter"]
        lines += [f'{names.DECISIONS}{{route="{r}",reason="standin"}} {n}' for r, n in sorted(self.routes.items())]
        lines += [f"# TYPE {link_bytes} counter", f"{names.LINK_BYTES_TOTAL} {self.link_bytes}",
                  f"# TYPE {names.LINK_CAPACITY_BPS} gauge",
                  f"{names.LINK_CAPACITY_BPS} {self.script.link_capacity_bps}"]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            return await self._answer(request)
        finally:
            self.inflight -= 1

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if self.script.fail_every and len(self.bodies) % self.script.fail_every == 0:
            return web.json_response({"error": {"message": "scripted failure"}}, status=500)
        chat = "messages" in body
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        words = len(prompt.split())
        headers = {"Content-Type": "text/event-stream"}
        route = self.route_for(words)
        if route:
            headers[ROUTE_HEADER] = route
            self.routes[route] = self.routes.get(route, 0) + 1
            if route == "prfaas":
                self.link_bytes += words * self.script.link_bytes_per_token
        resp = web.StreamResponse(headers=headers)
        await resp.prepare(request)
        await self._stream(resp, body, chat, words)
        return resp

    async def _stream(self, resp: web.StreamResponse, body: dict, chat: bool, words: int) -> None:
        # Absolute deadlines (arrival + TTFT + i * ITL), not chained sleeps: a late wake-up on a busy
        # event loop then delays one chunk instead of shifting every later one.
        loop = asyncio.get_running_loop()
        first = loop.time() + self.expected_ttft_s(words)
        n = int(body["max_tokens"])
        if chat:  # real servers open a chat stream with a role-only chunk; it carries no token
            await _send(resp, {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        for i in range(n):
            await asyncio.sleep(max(0.0, first + i * self.script.itl_s - loop.time()))
            choice = {"index": 0, "delta": {"content": " tok"}} if chat else {"index": 0, "text": " tok"}
            await _send(resp, {"choices": [choice]})
        usage = (body.get("stream_options") or {}).get("include_usage") and self.script.honour_usage
        if usage:
            await _send(resp, {"choices": [], "usage": {"prompt_tokens": words, "completion_tokens": n,
                                                        "prompt_tokens_details": {"cached_tokens": 0}}})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()


async def _send(resp: web.StreamResponse, obj: dict) -> None:
    await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
