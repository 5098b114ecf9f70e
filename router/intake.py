"""Admission of generation requests before their bodies are read: a cap on requests in the router, a byte
budget for bodies being read and parsed, and a deadline for a body to arrive.

Without them the router's memory grew as concurrency x body limit (every handler read its whole body before
the big-parse semaphore), and a client that uploads one byte a minute held its handler forever. The budget
is taken for the body's declared length (the body limit for a chunked one) *before* a byte is read, and
released once the body is parsed; what a parsed request holds afterwards is bounded by the request cap.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from typing import AsyncIterator

from aiohttp import web

from .errors import ApiError
from .requests import read_body, too_large

RETRY_AFTER_S = 1  # what a refused client is told to wait: requests end and bodies parse within about that


def busy(what: str) -> ApiError:
    return ApiError(503, f"the router is busy: {what}; retry shortly", "server_error", "overloaded",
                    {"Retry-After": str(RETRY_AFTER_S)})


class ByteBudget:
    """Bytes that may be held at once; ``take`` waits in arrival order (a large body is not starved by small
    ones overtaking it). Used from one event loop only."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used = limit, 0
        self.waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    async def take(self, n: int) -> int:
        """Hold ``n`` bytes (at most the whole budget, so one body can always pass alone); returns what was
        taken, to ``give`` back. Cancellable: a cancelled wait holds nothing."""
        n = min(n, self.limit)
        if not self.waiters and self.used + n <= self.limit:
            self.used += n
            return n
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (n, fut)
        self.waiters.append(entry)
        try:
            await fut
        except BaseException:
            if fut.done() and not fut.cancelled():  # granted as the wait ended: hand it on
                self.give(n)
            else:
                with contextlib.suppress(ValueError):
                    self.waiters.remove(entry)
                self._wake()  # the head left: those behind it may fit now
            raise
        return n

    def give(self, n: int) -> None:
        self.used -= n
        self._wake()

    def _wake(self) -> None:
        while self.waiters and self.used + self.waiters[0][0] <= self.limit:
            n, fut = self.waiters.popleft()
            if not fut.done():
                self.used += n
                fut.set_result(None)


class Intake:
    """The router's admission state: requests in the handler, body bytes in flight, the body deadline."""

    def __init__(self, max_requests: int, body_bytes: int, body_timeout_s: float) -> None:
        self.max_requests, self.body_timeout_s = max_requests, body_timeout_s
        self.active = 0
        self.budget = ByteBudget(body_bytes)

    @contextlib.contextmanager
    def admit(self):
        """Count one request for its whole life in the handler; a request past the cap gets a 503 at once."""
        if self.active >= self.max_requests:
            raise busy(f"{self.active} requests in flight (--max-concurrent-requests)")
        self.active += 1
        try:
            yield
        finally:
            self.active -= 1

    @contextlib.asynccontextmanager
    async def body(self, request: web.Request, limit: int) -> AsyncIterator[bytes]:
        """The raw body, read within ``body_timeout_s`` (waiting for budget included), its bytes held in the
        budget until the ``async with`` ends. 413 unread past ``limit``; 503 when the budget stays full; 408
        when the body does not arrive in time."""
        declared = request.content_length
        if declared is not None and declared > limit:
            raise too_large(limit)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout_s
        try:
            held = await asyncio.wait_for(self.budget.take(limit if declared is None else declared),
                                          self.body_timeout_s)
        except asyncio.TimeoutError:
            raise busy("other request bodies fill --max-body-bytes-in-flight") from None
        try:
            try:
                raw = await asyncio.wait_for(read_body(request, limit), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise ApiError(408, f"the request body did not arrive within {self.body_timeout_s:g} s "
                               "(--body-timeout-s)", "invalid_request_error", "request_timeout",
                               {"Connection": "close"}) from None
            yield raw
        finally:
            self.budget.give(held)
