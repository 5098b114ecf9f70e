"""A local `mooncake_master` (the Mooncake wheel ships it next to the venv's python): what the tests and a
one-machine demo start for the Mooncake storage tier. Every address is 127.0.0.1, over TCP."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Optional


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MooncakeMaster:
    def __init__(self, port: int = 0, log_path: Optional[str] = None) -> None:
        self.binary = shutil.which("mooncake_master", path=str(Path(sys.executable).parent)) or \
            shutil.which("mooncake_master")
        if self.binary is None:
            raise FileNotFoundError("mooncake_master not found next to python or on PATH; install the mooncake "
                                    "wheel (pip install mooncake-transfer-engine-non-cuda)")
        self.port, self.metrics_port = port or free_port(), free_port()
        self.log_path = log_path
        self.proc: Optional[subprocess.Popen] = None

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 20.0) -> "MooncakeMaster":
        """Start and wait until it accepts TCP connections; raises RuntimeError if it does not in time."""
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen([self.binary, f"--rpc_port={self.port}", "--rpc_address=127.0.0.1",
                                      f"--metrics_port={self.metrics_port}"], stdout=out, stderr=out)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with {self.proc.returncode}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return self
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"mooncake_master did not listen on {self.addr} within {timeout_s} s")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def hang(self, timeout_s: float = 5.0) -> None:
        """SIGSTOP: the master keeps accepting connections and answers nothing (the fault tests' hung store).
        Returns once every thread is stopped. kill() only queues the signal: the kernel stops the other
        threads when the one it woke gets a CPU, and until then (milliseconds on a loaded machine) an RPC
        thread woken by a request still answers it."""
        os.kill(self.proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + timeout_s
        while not self._all_threads_stopped():
            if time.monotonic() > deadline:
                raise RuntimeError(f"mooncake_master {self.proc.pid} not stopped {timeout_s} s after SIGSTOP")
            time.sleep(0.005)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def _all_threads_stopped(self) -> bool:
        tasks = Path(f"/proc/{self.proc.pid}/task")
        states = []
        for t in tasks.iterdir():
            try:  # state is the field after "(comm)"; comm may hold spaces or parentheses
                states.append((t / "stat").read_text().rsplit(")", 1)[1].split()[0])
            except (FileNotFoundError, IndexError):
                continue  # a thread that exited meanwhile
        return bool(states) and all(s == "T" for s in states)

    def metric(self, name: str) -> float:
        """One sample of the master's own Prometheus /metrics (e.g. master_exist_key_requests_total: the
        RPCs it answered); 0.0 if it does not report it."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.split(" ", 1)[0] == name:
                    return float(line.rsplit(" ", 1)[1])
        return 0.0
