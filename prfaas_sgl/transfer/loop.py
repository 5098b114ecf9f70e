"""A one-thread event loop that owns ZeroMQ sockets, plus the socket factory.

ZeroMQ sockets are not thread-safe, so every socket lives on one loop thread. Other threads hand work
to it with `call()` (fire and forget) or `call_sync()` (waits for the result); a pipe wakes the poller.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from prfaas_sgl.transfer.config import TransferConfig

log = logging.getLogger(__name__)

# Upper bound on one poll so that deadlines are checked even when nothing arrives.
MAX_POLL_MS = 50


def make_socket(ctx: zmq.Context, kind: int, cfg: TransferConfig) -> zmq.Socket:
    """A socket with the settings every data-plane socket needs.

    LINGER=0: close never blocks on undelivered data (a dead peer must not hang shutdown).
    IMMEDIATE=1: queue only onto completed (and, with CURVE, authenticated) connections, so a message
    for an unreachable peer waits in our window instead of vanishing into a pipe nobody reads.
    """
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, cfg.send_timeout_ms)
    sock.setsockopt(zmq.SNDHWM, cfg.hwm_messages)
    sock.setsockopt(zmq.RCVHWM, cfg.hwm_messages)
    sock.setsockopt(zmq.RECONNECT_IVL, cfg.reconnect_ivl_ms)
    sock.setsockopt(zmq.IMMEDIATE, 1)
    return sock


class SocketLoop:
    """Base class: subclasses implement `poll_items`, `on_event`, `on_tick`, and `next_deadline`."""

    def __init__(self, name: str) -> None:
        self._calls: collections.deque[Callable[[], None]] = collections.deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    # -- called from any thread ------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        self._calls.append(lambda: fn(*args))
        try:
            os.write(self._wake_w, b"!")
        except BlockingIOError:
            pass  # pipe full: the loop is already awake with work pending

    def call_sync(self, fn: Callable[..., Any], *args: Any, timeout: float = 10.0) -> Any:
        if threading.current_thread() is self._thread:
            return fn(*args)
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # handed to the caller's thread
                fut.set_exception(e)

        self.call(run)
        return fut.result(timeout)

    def stop(self) -> None:
        if self._thread.is_alive():
            self.call(self._request_stop)
            self._thread.join(5.0)
        os.close(self._wake_r)
        os.close(self._wake_w)

    # -- subclass interface (loop thread only) ---------------------------------------------------
    def poll_items(self) -> list[tuple[zmq.Socket, int]]:
        raise NotImplementedError

    def on_event(self, sock: zmq.Socket, events: int) -> None:
        raise NotImplementedError

    def on_tick(self, now: float) -> None:
        """Called every iteration: expire deadlines, push queued work."""

    def next_deadline(self) -> float | None:
        return None

    def on_close(self) -> None:
        """Close sockets; runs on the loop thread as it exits."""

    # -- loop ------------------------------------------------------------------------------------
    def _request_stop(self) -> None:
        self._stopping = True

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._iterate()
        except Exception:
            log.exception("%s loop crashed", self._thread.name)
        finally:
            self.on_close()

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
                self.on_event(sock, ev)
        while self._calls:
            self._calls.popleft()()
        self.on_tick(time.monotonic())

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
