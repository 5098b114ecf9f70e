"""A stand-in server as its own process (``python -m tests.support.standin_process ROLE PORT``), and a
``ServerControl`` that starts and kills such processes: the supervisor's mechanics on real processes, no SGLang.

Prefill and decode run in different processes here, so there is no shared room board: a decode takes the
KV as arrived when the request reaches it (after ``delay_s``, which stands for the transfer).
"""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import aiohttp
from aiohttp import web

from prfaas_sgl.router.config import InstanceSpec
from tests.support.router_standin import RoomBoard, Standin


class LoneStandin(Standin):
    async def _decode(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        self.board.event(body["bootstrap_room"]).set()  # no prefill process shares this board
        return await super()._decode(request, body)


async def _serve(role: str, port: int, delay_s: float) -> None:
    srv = LoneStandin(role, RoomBoard(), delay_s=delay_s, keep_bodies=False)
    await srv.start(port=port)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await srv.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class StandinProcesses:
    """``ServerControl`` over stand-in processes by name; a start is a new process on a fresh port."""

    def __init__(self, delay_s: float = 0.2) -> None:
        self.delay_s = delay_s
        self.procs: dict[str, subprocess.Popen] = {}
        self.specs: dict[str, InstanceSpec] = {}
        self.events: list[str] = []

    def owns(self, name: str) -> bool:
        return name in self.procs

    async def start(self, name: str, pool: str) -> InstanceSpec:
        role = "decode" if pool == "decode" else "prefill"
        port = free_port()
        self.events.append(f"start {name} {role}")
        self.procs[name] = subprocess.Popen([sys.executable, "-m", "tests.support.standin_process", role, str(port),
                                             str(self.delay_s)])
        url = f"http://127.0.0.1:{port}"
        await _wait_healthy(url, self.procs[name])
        self.specs[name] = InstanceSpec(url, free_port() if role == "prefill" else None, None, name)
        return self.specs[name]

    async def stop(self, name: str) -> None:
        self.events.append(f"stop {name}")
        proc = self.procs[name]
        proc.terminate()
        await asyncio.to_thread(proc.wait, 10)

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


async def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"stand-in at {url} exited with {proc.returncode}")
            try:
                async with s.get(url + "/health", timeout=aiohttp.ClientTimeout(total=1)) as r:
                    if r.status == 200:
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(0.05)
    raise RuntimeError(f"stand-in at {url} not healthy after {timeout_s} s")


if __name__ == "__main__":
    asyncio.run(_serve(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]) if len(sys.argv) > 3 else 0.0))
