"""A bounded HTTP/1.1 GET server on one selector thread, for read-only telemetry inside a server process.

It lives in the prefill's scheduler process, which also needs its threads and fds for ZeroMQ, so a
client can hold neither: every connection (idle, trickling, or reading slowly) is closed `timeout_s`
after it was accepted, at most `max_conns` are open (a new one closes the oldest), a request head is at
most 8 KiB, and one answer closes the connection. No thread per connection: 300 idle clients cost 300
fds for at most `timeout_s`, not 300 threads forever.

A bug answering one request closes that connection (500); a failure of the loop itself ends the thread
and `fatal` says why (a health check reads it).
"""

from __future__ import annotations

import ipaddress
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)
_MAX_HEAD = 8192


@dataclass(frozen=True, slots=True)
class Request:
    method: str
    path: str
    headers: dict[str, str]  # names lower-cased
    local: bool  # the client connected from a loopback address (of this machine)


@dataclass(frozen=True, slots=True)
class Response:
    code: int
    ctype: str
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()


_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed",
            431: "Request Header Fields Too Large", 500: "Internal Server Error"}


@dataclass(slots=True)
class _Conn:
    sock: socket.socket
    deadline: float
    local: bool
    inbuf: bytearray = field(default_factory=bytearray)
    outbuf: memoryview | None = None


class HttpServer:
    """Serves `respond(request)` on (`host`, `port`) from a daemon thread named `name`."""

    def __init__(self, host: str, port: int, respond: Callable[[Request], Response], name: str,
                 timeout_s: float = 5.0, max_conns: int = 64) -> None:
        self._respond = respond
        self.timeout_s, self.max_conns = timeout_s, max_conns
        self._lsock = _listen(host, port)
        self._lsock.setblocking(False)
        self.port = self._lsock.getsockname()[1]
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._lsock, selectors.EVENT_READ)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._conns: dict[socket.socket, _Conn] = {}  # insertion order = accept order (oldest first)
        self._stopping = False
        self._fatal: str | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def fatal(self) -> str | None:
        """None while the server thread runs; why it died once it has."""
        return self._fatal

    @property
    def open_connections(self) -> int:
        return len(self._conns)

    def close(self) -> None:
        self._stopping = True
        try:
            self._wake_w.send(b"!")
        except OSError:
            pass
        self._thread.join(5.0)
        if not self._thread.is_alive():
            self._sel.close()
            self._wake_r.close()
            self._wake_w.close()

    # -- server thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping:
                self._iterate()
        except BaseException as e:
            log.exception("%s thread died; the endpoint no longer answers", self._thread.name)
            self._fatal = f"{type(e).__name__}: {e}"
        finally:
            for conn in list(self._conns.values()):
                self._drop(conn)
            self._lsock.close()

    def _iterate(self) -> None:
        now = time.monotonic()
        wait = min((c.deadline for c in self._conns.values()), default=now + 1.0) - now
        for key, events in self._sel.select(max(0.0, min(wait, 1.0))):
            if key.fileobj is self._lsock:
                self._accept()
            elif key.fileobj is self._wake_r:
                self._wake_r.recv(64)
            else:
                self._serve(self._conns[key.fileobj], events)
        now = time.monotonic()
        for conn in [c for c in self._conns.values() if c.deadline <= now]:
            self._drop(conn)

    def _accept(self) -> None:
        for _ in range(64):
            try:
                sock, addr = self._lsock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # e.g. EMFILE: leave the backlog for later, never spin on it
                log.warning("%s: accept failed: %s", self._thread.name, e)
                return
            if len(self._conns) >= self.max_conns:
                self._drop(next(iter(self._conns.values())))  # the oldest: idle holders lose first
            sock.setblocking(False)
            self._conns[sock] = _Conn(sock, time.monotonic() + self.timeout_s, _is_loopback(addr[0]))
            self._sel.register(sock, selectors.EVENT_READ)

    def _serve(self, conn: _Conn, events: int) -> None:
        try:
            if events & selectors.EVENT_READ and conn.outbuf is None:
                self._read(conn)
            if events & selectors.EVENT_WRITE and conn.outbuf is not None:
                self._write(conn)
        except Exception:  # one client's request or a bug answering it: that connection only
            log.exception("%s: error serving a request", self._thread.name)
            self._drop(conn)

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
            return
        conn.inbuf += data
        end = conn.inbuf.find(b"\r\n\r\n")
        if end < 0:
            if len(conn.inbuf) > _MAX_HEAD:
                self._answer(conn, Response(431, "text/plain", b"request head too large\n"))
            return
        self._answer(conn, self._dispatch(bytes(conn.inbuf[:end]), conn.local))

    def _dispatch(self, head: bytes, local: bool) -> Response:
        request = _parse(head, local)
        if request is None:
            return Response(400, "text/plain", b"bad request\n")
        if request.method != "GET":
            return Response(405, "text/plain", b"GET only\n", (("Allow", "GET"),))
        try:
            return self._respond(request)
        except Exception:
            log.exception("%s: error answering %s", self._thread.name, request.path)
            return Response(500, "text/plain", b"internal error\n")

    def _answer(self, conn: _Conn, r: Response) -> None:
        lines = [f"HTTP/1.1 {r.code} {_REASONS.get(r.code, 'Error')}", f"Content-Type: {r.ctype}",
                 f"Content-Length: {len(r.body)}", "Connection: close", *(f"{k}: {v}" for k, v in r.headers)]
        conn.outbuf = memoryview(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + r.body)
        self._sel.modify(conn.sock, selectors.EVENT_WRITE)
        self._write(conn)

    def _write(self, conn: _Conn) -> None:
        try:
            n = conn.sock.send(conn.outbuf)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            n = len(conn.outbuf)  # the client left: nothing more to send
        conn.outbuf = conn.outbuf[n:]
        if not conn.outbuf:
            self._drop(conn)

    def _drop(self, conn: _Conn) -> None:
        if self._conns.pop(conn.sock, None) is None:
            return
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket; "::" also takes IPv4 clients where the system can (as http.server did)."""
    if ":" not in host:
        return socket.create_server((host, port), backlog=128)
    dual = ipaddress.ip_address(host).is_unspecified and socket.has_dualstack_ipv6()
    return socket.create_server((host, port), family=socket.AF_INET6, backlog=128, dualstack_ipv6=dual)


def _is_loopback(addr: str) -> bool:
    """`addr` as the kernel reports a client (not a client's claim): IPv4 clients of a dual-stack
    socket appear as ::ffff:a.b.c.d."""
    ip = ipaddress.ip_address(addr.split("%", 1)[0])
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def _parse(head: bytes, local: bool) -> Request | None:
    try:
        text = head.decode("latin-1")
        first, *rest = text.split("\r\n")
        method, target, version = first.split(" ")
    except ValueError:
        return None
    if not version.startswith("HTTP/1."):
        return None
    headers = {}
    for line in rest:
        name, sep, value = line.partition(":")
        if not sep:
            return None
        headers[name.strip().lower()] = value.strip()
    return Request(method, target.split("?", 1)[0], headers, local)
