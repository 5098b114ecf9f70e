"""A slow link on loopback without root: a TCP proxy that forwards client→server bytes at a fixed rate
(one token bucket for all its connections, like one shared link) and server→client bytes freely, and
that can freeze (stop forwarding both ways while keeping every connection open: a dead link that sends
no RST, as a cut cable or a blackholing firewall looks)."""

from __future__ import annotations

import socket
import threading
import time

_PIECE = 1024  # bytes forwarded per step: pacing is smooth at tens of KiB/s


class _Bucket:
    """Debt-based pacing: `take(n)` returns once n more bytes fit `rate` bytes/s since the first."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._lock = threading.Lock()
        self._next = 0.0

    def take(self, n: int) -> None:
        with self._lock:
            now = time.monotonic()
            self._next = max(self._next, now) + n / self.rate
            wait = self._next - now - n / self.rate
        if wait > 0:
            time.sleep(wait)


class ThrottledProxy:
    """Listens on 127.0.0.1:`port`; each connection is forwarded to `target` (host, port)."""

    def __init__(self, target: tuple[str, int], rate_bytes_s: float) -> None:
        self._target = target
        self._bucket = _Bucket(rate_bytes_s)
        self._frozen = threading.Event()
        self._closed = threading.Event()
        self._socks: list[socket.socket] = []
        self._lsock = socket.create_server(("127.0.0.1", 0))
        self._lsock.settimeout(0.1)  # accept() wakes to see close()
        self.port = self._lsock.getsockname()[1]
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def freeze(self) -> None:
        self._frozen.set()

    def close(self) -> None:
        self._closed.set()
        self._lsock.close()
        for s in list(self._socks):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        for t in self._threads:
            t.join(5)

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._lsock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            server = socket.create_connection(self._target)
            self._socks += [client, server]
            for src, dst, paced in ((client, server, True), (server, client, False)):
                t = threading.Thread(target=self._pump, args=(src, dst, paced), daemon=True)
                self._threads.append(t)
                t.start()

    def _pump(self, src: socket.socket, dst: socket.socket, paced: bool) -> None:
        try:
            while not self._closed.is_set():
                if self._frozen.is_set():
                    time.sleep(0.05)
                    continue
                data = src.recv(_PIECE)
                if not data:
                    return
                if paced:
                    self._bucket.take(len(data))
                while self._frozen.is_set() and not self._closed.is_set():
                    time.sleep(0.05)
                dst.sendall(data)
        except OSError:
            return
