"""Async streaming client for OpenAI-compatible endpoints (/v1/completions, /v1/chat/completions).

One ``aiohttp.ClientSession`` per client, created in ``start()`` and shared by all requests. Times are
``time.perf_counter()`` seconds; records store them relative to the caller's ``t0``.

A "token time" is the arrival of an SSE chunk carrying generated output (see ``is_token_chunk``).
Servers may pack several tokens into one chunk (SGLang's ``--stream-interval``, or a busy server), so
the token *count* comes from the final usage chunk (``stream_options.include_usage``) when the server
sends one, and from the chunk count otherwise.

Route header: the response header ``x-prfaas-route`` (value e.g. ``prfaas`` or ``local``) is copied into
each record and drives the per-route breakdown; servers that do not send it are reported as route "-".
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace

import aiohttp

from prfaas_sgl.router.names import ROUTE_HEADER  # one definition, shared with the router

APIS = ("completions", "chat")


@dataclass(frozen=True, slots=True)
class ClientSpec:
    base_url: str  # e.g. http://127.0.0.1:30000 (no /v1)
    api: str = "completions"
    model: str = ""  # empty: ask /v1/models at start
    timeout_s: float = 600.0  # per request, whole stream
    include_usage: bool = True
    ignore_eos: bool = True  # SGLang/vLLM extension: generate exactly max_tokens
    route_header: str = ROUTE_HEADER

    def __post_init__(self) -> None:
        if self.api not in APIS:
            raise ValueError(f"--api must be one of {APIS}, got {self.api!r}")
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"--url must start with http:// or https://, got {self.base_url!r}")
        if self.timeout_s <= 0:
            raise ValueError("--request-timeout must be > 0 seconds")


@dataclass(slots=True)
class RequestRecord:
    """One request's measurements; times in seconds, ``send_s`` relative to the run's t0."""

    index: int
    session: int
    turn: int
    input_len: int  # target prompt tokens
    output_len: int  # max_tokens asked for
    send_s: float = 0.0
    ttft_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None  # from usage, when the server reports it
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens (SGLang --enable-cache-report)
    token_times: list[float] = field(default_factory=list)  # seconds after send, one per text chunk
    route: str = "-"
    status: int | None = None
    error: str | None = None
    warmup: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttft_s is not None

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None for fewer than two tokens."""
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def itl_s(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


class OpenAIClient:
    def __init__(self, spec: ClientSpec) -> None:
        self.spec = spec
        self._session: aiohttp.ClientSession | None = None

    async def start(self, max_connections: int = 0) -> None:
        """Open the pooled session; ``max_connections`` 0 = unlimited. Resolves the model name."""
        conn = aiohttp.TCPConnector(limit=max_connections, force_close=False)
        self._session = aiohttp.ClientSession(
            connector=conn, timeout=aiohttp.ClientTimeout(total=self.spec.timeout_s)
        )
        if not self.spec.model:
            self.spec = replace(self.spec, model=await self._discover_model())

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _discover_model(self) -> str:
        try:
            async with self._session.get(f"{self.spec.base_url}/v1/models") as resp:
                data = await resp.json()
            return data["data"][0]["id"]
        except (aiohttp.ClientError, KeyError, IndexError, ValueError) as e:
            raise RuntimeError(f"could not read the model name from {self.spec.base_url}/v1/models; "
                               "pass --model") from e

    def _body(self, prompt: str, max_tokens: int) -> tuple[str, dict]:
        body: dict = {"model": self.spec.model, "max_tokens": max_tokens, "stream": True, "temperature": 0.0}
        if self.spec.include_usage:
            body["stream_options"] = {"include_usage": True}
        if self.spec.ignore_eos:
            body["ignore_eos"] = True
        if self.spec.api == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
            return f"{self.spec.base_url}/v1/chat/completions", body
        body["prompt"] = prompt
        return f"{self.spec.base_url}/v1/completions", body

    async def send(self, rec: RequestRecord, prompt: str, t0: float) -> RequestRecord:
        """Stream one request, filling ``rec`` in place (errors are recorded, never raised)."""
        url, body = self._body(prompt, rec.output_len)
        start = time.perf_counter()
        rec.send_s = start - t0
        try:
            async with self._session.post(url, json=body) as resp:
                rec.status = resp.status
                rec.route = resp.headers.get(self.spec.route_header, "-")
                if resp.status != 200:
                    rec.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                    return rec
                await self._read_stream(resp, rec, start)
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:  # ValueError: a chunk was not JSON
            rec.error = f"{type(e).__name__}: {e}"
        if rec.error is None and rec.ttft_s is None:
            rec.error = "stream ended without any output text"
        return rec

    async def _read_stream(self, resp: aiohttp.ClientResponse, rec: RequestRecord, start: float) -> None:
        chunks = 0
        usage_tokens = None
        async for raw in resp.content:
            now = time.perf_counter()
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue  # blank separators and SSE comments
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            msg = json.loads(data)
            if "error" in msg:
                rec.error = f"stream error: {str(msg['error'])[:300]}"
                return
            if usage := msg.get("usage"):
                usage_tokens = usage.get("completion_tokens")
                rec.prompt_tokens = usage.get("prompt_tokens")
                rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            if is_token_chunk(msg):
                chunks += 1
                rec.token_times.append(now - start)
        end = time.perf_counter()
        rec.e2e_s = end - start
        rec.ttft_s = rec.token_times[0] if rec.token_times else None
        rec.output_tokens = usage_tokens if usage_tokens is not None else chunks


def is_token_chunk(msg: dict) -> bool:
    """Does this SSE message carry generated tokens?

    Yes for non-empty text. Also yes for an *empty* text increment that is neither a chat role header nor
    a closing ``finish_reason`` chunk: SGLang emits one chunk per decode step and leaves the text empty
    while a token's UTF-8 bytes are incomplete — dropping those would skew TTFT and ITL.
    """
    choices = msg.get("choices") or []
    if not choices:
        return False  # usage-only or extension chunk
    c = choices[0]
    if "text" in c:
        text = c["text"]
    else:
        delta = c.get("delta") or {}
        if "role" in delta:
            return bool(delta.get("content") or delta.get("reasoning_content"))
        text = (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return bool(text) or c.get("finish_reason") is None
