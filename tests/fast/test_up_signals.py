"""`prfaas up` behaves like a daemon towards its children, on real processes (tests/support/up_standin.py:
the real up.run, stand-in servers and router). SIGTERM, SIGINT and SIGHUP stop every child and exit 0; a
SIGKILL of `prfaas up` takes every child with it (parent-death signal), also one started through
`ip netns exec` (a stand-in `ip` that execs the command in place, as `ip netns exec` does).

Before: SIGTERM, SIGHUP and SIGKILL left all three servers running, orphaned, every time (SIGTERM ended
`prfaas up` at once: its cleanup handler was never installed, the servers being forked from a worker thread).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prfaas_sgl.tools.launch import free_port

pytestmark = pytest.mark.timeout(120)
REPO = Path(__file__).resolve().parents[2]
# `ip netns exec NAME CMD...` enters NAME, then execs CMD in place (no fork); this one notes NAME and execs
FAKE_IP = '#!/bin/sh\necho "$3" >> "$(dirname "$0")/netns.log"\nshift 3\nexec "$@"\n'


def deployment(tmp_path: Path, **extra) -> dict:
    def server(name: str, pool: str, **kw) -> dict:
        return {"name": name, "machine": "m", "pool": pool, "host": "127.0.0.1", "port": free_port(), **kw}
    return {
        "deployment": {"model": "standin", "device": "cpu", "transfer_backend": "fake"},
        "servers": [server("p0", "local_prefill", bootstrap_port=free_port()),
                    server("r0", "prfaas", bootstrap_port=free_port(), netns="remote-dc"),
                    server("d0", "decode")],
        "router": {"machine": "m", "port": free_port()},
        "machine": "m", "grace_s": 5.0, **extra,
    }


class Up:
    """A stand-in `prfaas up` process and the pids it reports once all is up."""

    def __init__(self, tmp_path: Path, dep: dict, ready: str = "[up] all up", **popen) -> None:
        (tmp_path / "bin").mkdir(exist_ok=True)
        (tmp_path / "bin" / "ip").write_text(FAKE_IP)
        (tmp_path / "bin" / "ip").chmod(0o755)
        (tmp_path / "dep.json").write_text(json.dumps(dep))
        env = dict(os.environ, PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.support.up_standin", str(tmp_path / "dep.json"),
                                      str(tmp_path / "logs")], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, **popen)
        self.lines: list[str] = []
        ready_line = self.wait_for(ready)
        self.named = {line.split()[2]: int(line.split(", pid ")[1]) for line in self.lines
                      if line.startswith("[up] started ") and ", pid " in line}
        self.children = self._pids(ready_line) if "(pids " in ready_line else list(self.named.values())

    def wait_for(self, text: str, timeout_s: float = 60.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.lines.append(line)
            if text in line:
                return line
        raise AssertionError(f"no {text!r} from prfaas up; it said:\n{''.join(self.lines)}")

    @staticmethod
    def _pids(line: str) -> list[int]:
        return [int(p) for p in line.split("(pids ")[1].split(")")[0].split()]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        for pid in self.children:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not: an orphan's is reaped by init, maybe late in a container)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def default_stop_signals() -> None:
    """`prfaas up` as a shell's foreground command starts it: the stop signals at their defaults. A test run
    under nohup (or as a shell's background job) passes SIGHUP (or SIGINT) down ignored, and `prfaas up`
    keeps an ignored signal ignored (test_a_signal_ignored_at_start_stays_ignored)."""
    for sig in STOP:
        signal.signal(sig, signal.SIG_DFL)


STOP = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


@pytest.mark.parametrize("sig", STOP)
def test_a_stop_signal_stops_every_server_and_the_router_then_exits_0(tmp_path, sig):
    up = Up(tmp_path, deployment(tmp_path), preexec_fn=default_stop_signals)
    try:
        assert len(up.children) == 4 and all(alive(p) for p in up.children)  # three servers and the router
        t0 = time.monotonic()
        up.proc.send_signal(sig)
        assert up.proc.wait(15) == 0
        assert wait_gone(up.children, 2.0) == [], "children outlived prfaas up"
        assert time.monotonic() - t0 < 10.0
        out = "".join(up.lines) + up.proc.stdout.read()
        assert f"[up] {sig.name}: stopping every server and the router" in out and "[up] stopped" in out
    finally:
        up.close()


def test_sigkill_of_prfaas_up_takes_every_child_with_it(tmp_path):
    up = Up(tmp_path, deployment(tmp_path))
    try:
        assert (tmp_path / "bin" / "netns.log").read_text() == "remote-dc\n"  # r0 went through `ip netns exec`
        assert "tests.support.standin_process prefill" in cmdline(up.named["r0"])  # ip exec'd it in place
        up.proc.kill()
        up.proc.wait(10)
        assert wait_gone(up.children, 5.0) == [], "children outlived a SIGKILLed prfaas up"
    finally:
        up.close()


def test_a_server_forked_from_a_worker_thread_survives_the_thread(tmp_path):
    """The parent-death signal fires when the forking *thread* ends: a server started from a thread (the
    demo's router thread, an executor) must not be killed when that thread returns."""
    import threading

    from prfaas_sgl.tools.launch import ManagedProcess

    proc = ManagedProcess([sys.executable, "-c", "import time; time.sleep(60)"], {}, str(tmp_path / "t.log"),
                          "http://127.0.0.1:9")
    t = threading.Thread(target=proc.start)
    t.start()
    t.join()
    try:
        time.sleep(0.5)
        assert proc.alive()
    finally:
        proc.stop(grace_s=1.0)


def test_a_stop_signal_during_start_up_stops_the_servers_still_loading(tmp_path):
    dep = deployment(tmp_path)
    dep["servers"][2]["args"] = ["never-healthy"]  # d0 loads forever, as a big model seems to
    up = Up(tmp_path, dep, ready="[up] started d0")
    try:
        assert len(up.children) == 3 and all(alive(p) for p in up.children)
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(15) == 0
        assert wait_gone(up.children, 2.0) == []
    finally:
        up.close()


def test_a_signal_ignored_at_start_stays_ignored(tmp_path):
    """`nohup prfaas up &`: the hangup of the terminal must not stop it."""
    up = Up(tmp_path, deployment(tmp_path), preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    try:
        up.proc.send_signal(signal.SIGHUP)
        time.sleep(1.0)
        assert up.proc.poll() is None and all(alive(p) for p in up.children)
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(15) == 0 and wait_gone(up.children, 2.0) == []
    finally:
        up.close()
