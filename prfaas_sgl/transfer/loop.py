"""A one-thread event loop that owns ZeroMQ sockets, plus the socket and context factories.

ZeroMQ sockets are not thread-safe, so every socket lives on one loop thread. Other threads hand work
to it with `call()` (fire and forget) or `call_sync()` (waits for the result); a pipe wakes the poller.

Failure containment: an exception in one event handler or queued call is logged with its traceback and
the loop goes on (subclasses catch earlier where they can name the transfer to fail). Only a failure
of the loop machinery itself (poller, `poll_items`) ends the thread; then `fatal` holds the reason,
`on_fatal` fails every pending transfer, and `call()` raises `LoopDead` instead of queueing forever.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import os
import resource
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from prfaas_sgl.transfer.config import TransferConfig

log = logging.getLogger(__name__)

# Upper bound on one poll so that deadlines are checked even when nothing arrives.
MAX_POLL_MS = 50
# fds kept free of ZeroMQ for the rest of the process (HTTP, logs, the scheduler's own sockets)
_FD_RESERVE = 256


class LoopDead(RuntimeError):
    """The loop thread has stopped (`fatal` says why, or it was closed): work handed to it would never run."""


def make_context(cfg: TransferConfig) -> zmq.Context:
    """A context whose socket limit is `cfg.max_sockets`, bounded by this process's fd limit.

    libzmq's default is 1023 sockets; every sender link costs 3 sockets per connection (DEALER plus
    a monitor pair), so a long-lived prefill that met many decode endpoints used to hit EMFILE.
    """
    ctx = zmq.Context(io_threads=cfg.io_threads)
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    fd_cap = soft - _FD_RESERVE if soft != resource.RLIM_INFINITY else cfg.max_sockets
    ctx.set(zmq.MAX_SOCKETS, max(64, min(cfg.max_sockets, fd_cap)))
    return ctx


def make_socket(ctx: zmq.Context, kind: int, cfg: TransferConfig) -> zmq.Socket:
    """A socket with the settings every data-plane socket needs.

    LINGER=0: close never blocks on undelivered data (a dead peer must not hang shutdown).
    IMMEDIATE=1: queue only onto completed (and, with CURVE, authenticated) connections, so a message
    for an unreachable peer waits in our window instead of vanishing into a pipe nobody reads.
    RECONNECT_IVL_MAX: back off exponentially towards it, so a dead peer is not redialled every 100 ms.
    """
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, cfg.send_timeout_ms)
    sock.setsockopt(zmq.SNDHWM, cfg.hwm_messages)
    sock.setsockopt(zmq.RCVHWM, cfg.hwm_messages)
    sock.setsockopt(zmq.RECONNECT_IVL, cfg.reconnect_ivl_ms)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, cfg.reconnect_ivl_max_ms)
    sock.setsockopt(zmq.IMMEDIATE, 1)
    return sock


_Call = tuple[Callable[[], None], "concurrent.futures.Future | None"]


class SocketLoop:
    """Base class: subclasses implement `poll_items`, `on_event`, `on_tick`, `next_deadline`, `on_fatal`."""

    def __init__(self, name: str) -> None:
        self._calls: collections.deque[_Call] = collections.deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._stopping = False
        self._exited = False  # set by the loop thread as it ends, before it drains the call queue
        self._fatal: str | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    # -- called from any thread ------------------------------------------------------------------
    @property
    def fatal(self) -> str | None:
        """None while the loop thread is healthy; why it died once it has (a health check reads this)."""
        return self._fatal

    def start(self) -> None:
        self._thread.start()

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn(*args)` on the loop thread; raises LoopDead if it will never run."""
        self._enqueue(lambda: fn(*args), None)

    def call_sync(self, fn: Callable[..., Any], *args: Any, timeout: float = 10.0) -> Any:
        if threading.current_thread() is self._thread:
            return fn(*args)
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # handed to the caller's thread
                fut.set_exception(e)

        self._enqueue(run, fut)
        return fut.result(timeout)

    def stop(self) -> None:
        if self._wake_w < 0:
            return
        if self._thread.is_alive():
            try:
                self.call(self._request_stop)
            except LoopDead:
                pass  # exiting already
            self._thread.join(5.0)
        os.close(self._wake_r)
        os.close(self._wake_w)
        self._wake_r = self._wake_w = -1

    def _enqueue(self, run: Callable[[], None], fut: concurrent.futures.Future | None) -> None:
        self._check_alive()
        self._calls.append((run, fut))
        # The loop may have ended between the check and the append; it sets `_exited` before it
        # drains the queue, so either the drain fails this call or this second check sees the end.
        self._check_alive()
        try:
            os.write(self._wake_w, b"!")
        except BlockingIOError:
            pass  # pipe full: the loop is already awake with work pending

    def _check_alive(self) -> None:
        if self._fatal is not None:
            raise LoopDead(f"{self._thread.name} loop died: {self._fatal}")
        if self._exited or self._wake_w < 0:
            raise LoopDead(f"{self._thread.name} is closed")

    # -- subclass interface (loop thread only) ---------------------------------------------------
    def poll_items(self) -> list[tuple[zmq.Socket, int]]:
        raise NotImplementedError

    def on_event(self, sock: zmq.Socket, events: int) -> None:
        raise NotImplementedError

    def on_tick(self, now: float) -> None:
        """Called every iteration: expire deadlines, push queued work."""

    def next_deadline(self) -> float | None:
        return None

    def on_fatal(self, reason: str) -> None:
        """The loop is dying: move every pending transfer to a terminal state naming `reason`."""

    def on_close(self) -> None:
        """Close sockets; runs on the loop thread as it exits."""

    # -- loop ------------------------------------------------------------------------------------
    def _request_stop(self) -> None:
        self._stopping = True

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._iterate()
        except BaseException as e:
            log.exception("%s loop crashed; its transfers fail and new work is refused", self._thread.name)
            self._fatal = f"{type(e).__name__}: {e}"
            self._guard("on_fatal", self.on_fatal, self._fatal)
        finally:
            self._exited = True
            self._refuse_queued()
            self._guard("on_close", self.on_close)

    def _refuse_queued(self) -> None:
        why = f"loop died: {self._fatal}" if self._fatal else "is closed"
        while self._calls:
            _, fut = self._calls.popleft()
            if fut is not None:
                fut.set_exception(LoopDead(f"{self._thread.name} {why}"))

    def _iterate(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        for sock, flags in self.poll_items():
            if flags:
                poller.register(sock, flags)
        events = poller.poll(self._poll_timeout_ms())
        for sock, ev in events:
            if sock == self._wake_r:
                self._drain_wake()
            else:
                self._guard("on_event", self.on_event, sock, ev)
        while self._calls:
            run, _ = self._calls.popleft()
            self._guard("queued call", run)
        self._guard("on_tick", self.on_tick, time.monotonic())

    def _guard(self, what: str, fn: Callable[..., Any], *args: Any) -> None:
        """Last line of containment: a bug in one handler must not end the thread every transfer needs."""
        try:
            fn(*args)
        except Exception:
            log.exception("%s: unexpected error in %s (loop continues)", self._thread.name, what)

    def _poll_timeout_ms(self) -> int:
        if self._calls:
            return 0
        deadline = self.next_deadline()
        if deadline is None:
            return MAX_POLL_MS
        return max(0, min(MAX_POLL_MS, int((deadline - time.monotonic()) * 1000) + 1))

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
