"""A local `mooncake_master` (the Mooncake wheel ships it next to the venv's python): what the tests and a
one-machine demo start for the Mooncake storage tier. Every address is 127.0.0.1, over TCP."""
from __future__ import annotations

import shutil
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

    def metric(self, name: str) -> float:
        """One sample of the master's own Prometheus /metrics (e.g. master_exist_key_requests_total: the
        RPCs it answered); 0.0 if it does not report it."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.split(" ", 1)[0] == name:
                    return float(line.rsplit(" ", 1)[1])
        return 0.0
