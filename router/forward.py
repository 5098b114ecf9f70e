"""SGLang PD forwarding: one attempt = the same body to a prefill and a decode server at once.

The body gets ``bootstrap_host`` (prefill host), ``bootstrap_port`` (prefill's bootstrap server) and a fresh
``bootstrap_room`` (random 63-bit int), as sglang_router's mini_lb does, plus a fresh ``rid`` per attempt:
SGLang aborts by rid prefix and refuses duplicate rids, so ids must be unique and never chosen by a client.
Both come from the OS's CSPRNG: a room id travels in plaintext to both servers, and whoever predicts one
(Mersenne Twister outputs are predictable after 624 of them) can abort or fail that room.
The decode answer is relayed; the prefill answer is awaited so its failure is seen. Nothing reaches the
client before decode produced its first bytes, so an attempt that fails before that can be retried (once,
locally) invisibly. A 4xx from either server is the request's fault: it is relayed as it is, not retried,
and the server stays in rotation. Each attempt's outcome feeds its servers' circuit breakers (router/breaker.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
import uuid
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from .cluster import Cluster, Instance, mark_unhealthy
from .metrics import RouterMetrics
from .names import ROUTE_HEADER
from .policy import Decision
from .requests import ParsedRequest

log = logging.getLogger(__name__)

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


class AttemptFailed(Exception):
    """The attempt failed before any byte reached the client; safe to retry. ``blame``: the roles ("prefill",
    "decode") whose breakers count it: a failed prefill answer is the prefill's; a decode that answered 5xx or
    an error event did not get its KV (the transfer failed), which counts against both."""

    def __init__(self, message: str, blame: frozenset[str] = frozenset()) -> None:
        super().__init__(message)
        self.blame = blame


BOTH = frozenset({"prefill", "decode"})


class Rejected(Exception):
    """A server answered 4xx: the request is at fault, not the server. Relayed to the client unchanged."""

    def __init__(self, status: int, body: bytes, content_type: str) -> None:
        super().__init__(f"HTTP {status}: {body[:200]!r}")
        self.status, self.body, self.content_type = status, body, content_type

    def response(self, extra: dict[str, str]) -> web.Response:
        return web.Response(body=self.body, status=self.status, headers={"Content-Type": self.content_type, **extra})


@dataclass(frozen=True, slots=True)
class LinkShare:
    """KV bytes an attempt puts on the inter-DC link, and when its prefill (and so the stream) should start
    (monotonic seconds)."""

    nbytes: float = 0.0
    start_at: float = 0.0


@dataclass(slots=True)
class DecodeHead:
    resp: aiohttp.ClientResponse
    first: bytes  # whole body (non-stream) or first chunk (stream)


def pd_body(body: dict, prefill: Instance) -> bytes:
    out = dict(body, rid=uuid.uuid4().hex, bootstrap_host=prefill.host, bootstrap_port=prefill.spec.bootstrap_port,
               bootstrap_room=secrets.randbits(63))
    return json.dumps(out, separators=(",", ":")).encode()


def _stream_failed(chunk: bytes) -> bool:
    """Whether a stream's first chunk reports a server-side failure worth a retry.

    SGLang reports an aborted stream as an SSE event ``{"error": {..., "code": STATUS}}``: 5xx for a failed
    KV transfer or a timeout, 4xx for a request it refused once streaming began (relayed like any 4xx).
    """
    head = chunk[:200].lstrip()
    if not (head.startswith(b"data:") and b'"error"' in head and b'"choices"' not in head):
        return False
    try:
        code = json.loads(chunk.lstrip().split(b"\n", 1)[0][5:])["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return True
    return not (isinstance(code, int) and 400 <= code < 500)


class Forwarder:
    def __init__(self, cluster: Cluster, session: aiohttp.ClientSession, metrics: RouterMetrics | None = None) -> None:
        self.cluster, self.session, self.metrics = cluster, session, metrics
        self.cfg = cluster.cfg
        self.background: set[asyncio.Task] = set()

    async def _prefill(self, inst: Instance, path: str, data: bytes) -> str | Rejected | None:
        """POST to prefill and drain its answer: None on success, ``Rejected`` on a 4xx, else an error text."""
        timeout = aiohttp.ClientTimeout(total=self.cfg.prefill_timeout_s, connect=self.cfg.connect_timeout_s)
        try:
            async with self.session.post(inst.spec.url + path, data=data, timeout=timeout,
                                         headers={"Content-Type": "application/json"}) as r:
                text = await r.read()
                if 400 <= r.status < 500:
                    return Rejected(r.status, text, r.headers.get("Content-Type", "application/json"))
                if r.status != 200:
                    return f"prefill {inst.name} HTTP {r.status}: {text[:200]!r}"
                return None
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return f"prefill {inst.name}: {type(e).__name__} {e}"

    async def _decode_head(self, inst: Instance, path: str, data: bytes, stream: bool) -> DecodeHead:
        timeout = aiohttp.ClientTimeout(total=None, connect=self.cfg.connect_timeout_s,
                                        sock_read=self.cfg.request_timeout_s)
        resp = await self.session.post(inst.spec.url + path, data=data, timeout=timeout,
                                       headers={"Content-Type": "application/json"})
        try:
            first = await (resp.content.readany() if stream and resp.status == 200 else resp.read())
        except BaseException:
            resp.release()
            raise
        return DecodeHead(resp, first)

    async def _wait_decode(self, d: Decision, pre: asyncio.Task, dec: asyncio.Task) -> DecodeHead:
        """Wait for decode's first bytes while watching prefill; raises AttemptFailed."""
        pending: set[asyncio.Task] = {pre, dec}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.request_timeout_s
        while not dec.done():
            done, pending = await asyncio.wait(pending, timeout=max(0.0, deadline - loop.time()),
                                               return_when=asyncio.FIRST_COMPLETED)
            if not done:
                raise AttemptFailed(f"no answer from decode {d.decode} within {self.cfg.request_timeout_s}s", BOTH)
            outcome = pre.result() if pre in done else None
            if isinstance(outcome, Rejected):
                raise outcome
            if outcome is not None:
                mark_unhealthy(self.cluster.instances[d.prefill], outcome)
                raise AttemptFailed(outcome, frozenset({"prefill"}))
        try:
            head = dec.result()
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            mark_unhealthy(self.cluster.instances[d.decode], f"{type(e).__name__} {e}")
            raise AttemptFailed(f"decode {d.decode}: {type(e).__name__} {e}", frozenset({"decode"})) from e
        if head.resp.status >= 500 or (head.resp.status == 200 and _stream_failed(head.first)):
            head.resp.release()
            raise AttemptFailed(f"decode {d.decode} HTTP {head.resp.status}: {head.first[:200]!r}", BOTH)
        return head

    def _reap(self, task: asyncio.Task, d: Decision) -> None:
        """Keep a reference to the prefill task until it ends, then log a late failure."""
        def done(t: asyncio.Task) -> None:
            self.background.discard(t)
            if not t.cancelled() and t.result() is not None:
                log.warning("prefill failed after decode started (%s): %s", d.prefill, t.result())
        self.background.add(task)
        task.add_done_callback(done)

    async def attempt(self, req: ParsedRequest, d: Decision, kv: LinkShare,
                      request: web.Request, t0: float | None = None) -> web.StreamResponse:
        """Run one PD attempt and answer the client (a server's 4xx included). Raises AttemptFailed before any
        byte is sent.

        ``kv``: this attempt's KV on the inter-DC link (zero bytes for a local prefill). ``t0``: the request's
        arrival (time.perf_counter()), for the TTFT histogram by route.
        """
        pre_i, dec_i = self.cluster.instances[d.prefill], self.cluster.instances[d.decode]
        data = pd_body(req.body, pre_i)
        link = self.cluster.link
        tid = link.add(kv.nbytes, kv.start_at) if kv.nbytes > 0 else 0
        pre_i.inflight += 1
        pre_i.inflight_tokens += d.incremental_len
        dec_i.inflight += 1
        now = time.monotonic()
        pre_i.breaker.start(now)
        dec_i.breaker.start(now)
        verdict: dict[str, bool] = {}  # role -> whether the attempt went through it; none: no verdict
        pre = asyncio.create_task(self._prefill(pre_i, req.endpoint, data))
        pre.add_done_callback(lambda _t: _release_prefill(pre_i, d.incremental_len))
        dec = asyncio.create_task(self._decode_head(dec_i, req.endpoint, data, req.stream))
        try:
            try:
                head = await self._wait_decode(d, pre, dec)
            except AttemptFailed as e:
                verdict.update(dict.fromkeys(e.blame, False))
                raise
            finally:
                link.done(tid)  # decode has its KV (or the attempt is over)
            if head.resp.status == 200:
                verdict.update(prefill=True, decode=True)
                self._reap(pre, d)
                if self.metrics is not None and t0 is not None:
                    self.metrics.ttft.labels(d.route).observe(time.perf_counter() - t0)
            else:  # decode refused the request (4xx): its prefill would only wait for a decode that never comes
                pre.cancel()
            return await self._relay(head, req, request, {ROUTE_HEADER: d.route})
        except Rejected as e:
            _cancel(pre, dec)
            return e.response({ROUTE_HEADER: d.route})
        except BaseException:
            _cancel(pre, dec)
            raise
        finally:
            dec_i.inflight -= 1
            self._judge(pre_i, verdict.get("prefill"))
            self._judge(dec_i, verdict.get("decode"))

    def _judge(self, inst: Instance, ok: bool | None) -> None:
        """Feed one attempt's outcome at ``inst`` to its breaker (None: the attempt says nothing about it)."""
        b, now = inst.breaker, time.monotonic()
        if ok is None:
            b.no_verdict()
        elif ok:
            if b.state(now) != "closed":
                log.warning("instance %s serves again: a trial request succeeded (breaker closed)", inst.name)
            b.succeeded()
        elif b.failed(now):
            log.warning("instance %s leaves rotation for %.0f s: %d attempts in a row failed through it (breaker "
                        "open)", inst.name, b.cooldown_s, b.failures)
            if self.metrics is not None:
                self.metrics.breaker_opened.labels(inst.name).inc()

    async def _relay(self, head: DecodeHead, req: ParsedRequest, request: web.Request,
                     extra: dict[str, str]) -> web.StreamResponse:
        resp = head.resp
        if not req.stream or resp.status != 200:
            resp.release()
            ctype = resp.headers.get("Content-Type", "application/json")
            return web.Response(body=head.first, status=resp.status, headers={"Content-Type": ctype, **extra})
        out = web.StreamResponse(status=200, headers={**SSE_HEADERS, **extra})
        try:
            await out.prepare(request)
            await out.write(head.first)
            async for chunk in resp.content.iter_any():
                await out.write(chunk)
        except ConnectionResetError:  # before ClientError: aiohttp's ClientConnectionResetError is both
            return out  # the client left; releasing decode's stream makes SGLang abort the request
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            # Bytes already went out: the only honest answer left is an error event in the stream.
            err = {"error": {"message": f"decode stream broke: {e}", "type": "server_error", "code": "upstream"}}
            with contextlib.suppress(ConnectionResetError):
                await out.write(b"data: " + json.dumps(err).encode() + b"\n\ndata: [DONE]\n\n")
        finally:
            resp.release()
        with contextlib.suppress(ConnectionResetError):  # the client may close right after [DONE]
            await out.write_eof()
        return out

    async def close(self) -> None:
        for t in list(self.background):
            t.cancel()
        await asyncio.gather(*self.background, return_exceptions=True)


def _cancel(pre: asyncio.Task, dec: asyncio.Task) -> None:
    """End an attempt's server requests: closing their connections makes SGLang abort them."""
    for t in (pre, dec):
        t.cancel()
    if dec.done() and not dec.cancelled() and dec.exception() is None:
        dec.result().resp.release()


def _release_prefill(inst: Instance, tokens: int) -> None:
    inst.inflight -= 1
    inst.inflight_tokens -= tokens
