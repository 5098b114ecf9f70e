"""Start real SGLang servers as subprocesses (tests, demo, scripts) and always clean them up.

Each server runs in its own session (process group), so `stop()` reaches SGLang's scheduler and
detokenizer children too. Servers are stopped on `stop()`, on context exit, at interpreter exit, and on
SIGTERM/SIGINT of the launching process. One started from the main thread also dies with its launcher
(PR_SET_PDEATHSIG): a launcher killed by SIGKILL or the OOM killer runs no cleanup at all.

    with SGLangServer(ServerSpec(model_path=..., port=free_port())) as srv:
        requests.post(srv.url + "/generate", ...)
"""
from __future__ import annotations

import atexit
import ctypes
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from prfaas_sgl.tools.cpu_share import CpuGroup, CpuShare

MODES = ("colocated", "prefill", "decode")
_LIVE: set["ManagedProcess"] = set()
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# Loaded before any fork: the child between fork and exec must not dlopen (a lock another thread held at
# fork time stays held there forever).
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


_HANDED_OUT: set[int] = set()
_PORT_RANGE = (20000, 32000)  # below Linux's ephemeral range (32768-60999)


def free_port(host: str = "127.0.0.1") -> int:
    """A port that binds now, below the ephemeral range: a port the kernel picked (bind to 0) can be
    handed to another socket's outgoing connection before our server binds it (seen in CI: a server
    died with 'address already in use')."""
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(*_PORT_RANGE)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free port in {_PORT_RANGE} on {host}")


def is_hybrid(model_path: str | Path) -> bool:
    conf = json.loads((Path(model_path) / "config.json").read_text())
    return "linear_attention" in conf.get("layer_types", [])


@dataclass(frozen=True)
class ServerSpec:
    model_path: str
    port: int
    host: str = "127.0.0.1"
    mode: str = "colocated"
    transfer_backend: str = "mooncake"
    bootstrap_port: int | None = None  # prefill only
    max_total_tokens: int = 65536
    max_running_requests: int = 128
    max_mamba_slots: int = 512  # hybrid only; SGLang's default sizes ~145K slots (~4 GB) for a tiny model
    chunked_prefill_size: int | None = None
    page_size: int | None = None
    extra_args: tuple[str, ...] = ()
    env: dict = field(default_factory=dict)
    log_path: str | None = None
    netns: str | None = None  # run inside `ip netns exec NAME` (emulated remote datacenter)
    device: str = "cpu"  # "cuda": none of the CPU flags / environment below
    cpu: CpuShare | None = None  # emulated compute: CPU-time quota and core set (tools/cpu_share.py)
    fork_children: bool = False  # test servers: SGLang's children forked, not spawned (tools/sglang_forked.py)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.mode == "prefill" and self.bootstrap_port is None:
            raise ValueError("a prefill server needs bootstrap_port")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def server_args(spec: ServerSpec) -> list[str]:
    """SGLang flags for `spec`: on CPU those SGLang 0.5.23 needs there (see sglang-notes.md), then PD
    flags, then the spec's own."""
    args = ["--model-path", spec.model_path, "--host", spec.host, "--port", str(spec.port)]
    if spec.device == "cpu":
        args += _cpu_args(spec)
    if spec.chunked_prefill_size:
        args += ["--chunked-prefill-size", str(spec.chunked_prefill_size)]
    if spec.page_size:
        args += ["--page-size", str(spec.page_size)]
    if spec.mode != "colocated":
        args += ["--disaggregation-mode", spec.mode, "--disaggregation-transfer-backend", spec.transfer_backend]
        if spec.mode == "prefill":
            args += ["--disaggregation-bootstrap-port", str(spec.bootstrap_port)]
    return args + list(spec.extra_args)


def _cpu_args(spec: ServerSpec) -> list[str]:
    args = [
        "--device", "cpu", "--attention-backend", "torch_native", "--disable-overlap-schedule",
        "--dtype", "float32", "--max-total-tokens", str(spec.max_total_tokens),
        "--max-running-requests", str(spec.max_running_requests), "--skip-server-warmup",
        # An idle scheduler otherwise spins on its sockets (measured: ~22% of a core per idle server); on a few
        # cores shared by a farm of servers that is CPU taken from the one doing work. SGLang sleeps only when
        # fully idle (no running, waiting, bootstrap, prealloc or transfer queue) and wakes on its sockets.
        "--sleep-on-idle",
    ]
    if spec.mode != "colocated":
        args += ["--disaggregation-decode-retraction-backup", "none"]  # the default calls cudaHostRegister
    if is_hybrid(spec.model_path):
        args += ["--mamba-radix-cache-strategy", "no_buffer", "--max-mamba-cache-size", str(spec.max_mamba_slots)]
    return args


def server_env(spec: ServerSpec) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", SGLANG_HOST_IP=spec.host)  # host advertised to the PD peer
    if spec.device == "cpu":
        env.update(SGLANG_USE_CPU_ENGINE="1", MC_FORCE_TCP="1")  # Mooncake: TCP, no RDMA device lookup
        # /health otherwise generates a token through the scheduler; on 2 CPU cores that probe queues
        # behind long prefills for 10+ s and routers take a busy server for a dead one. Liveness only;
        # the router removes an instance at once when a real request to it fails.
        env.setdefault("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "0")
    env.update(spec.env)
    return env


class ManagedProcess:
    """A subprocess in its own session with a log file and an HTTP health URL; see module docstring."""

    def __init__(self, cmd: list[str], env: dict, log_path: str, url: str, netns: str | None = None,
                 cpu: CpuGroup | None = None):
        self.cmd = ["ip", "netns", "exec", netns, *cmd] if netns else cmd
        self.cpu = cpu  # joined outside the netns: `ip netns exec` mounts a sysfs without this cgroup tree
        if cpu is not None:
            self.cmd = cpu.wrap(self.cmd)
        self.env, self.log_path, self.url = env, Path(log_path), url
        self.proc: subprocess.Popen | None = None
        self._log = None

    def start(self, append: bool = False):
        """Starts the process; ``append`` keeps the log of an earlier run (a restart after a crash: its end
        says why). From the main thread the process also dies with this one (see ``_die_with_parent``)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._close_log()
        self._log = open(self.log_path, "ab" if append else "wb")
        if self.cpu is not None:
            self.cpu.create()
        self.proc = subprocess.Popen(
            self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True,
            preexec_fn=_die_with_parent(os.getpid()) if _LIBC and _on_main_thread() else None,
        )
        _LIVE.add(self)
        _install_cleanup()
        return self

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        """Whether the process runs (started and not exited)."""
        return self.proc is not None and self.proc.poll() is None

    def wait_healthy(self, timeout_s: float = 300.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.url} exited ({self.proc.returncode}); "
                                   f"log tail:\n{self.log_tail()}")
            if http_ok(self.url + "/health"):
                self.became_healthy()
                return self
            time.sleep(0.5)
        raise TimeoutError(f"{self.url} not healthy after {timeout_s}s; "
                           f"log tail:\n{self.log_tail()}")

    def became_healthy(self) -> None:
        """Called by whoever saw /health answer (wait_healthy, the keeper after a restart): a CPU share
        deferred until the server serves applies now."""
        if self.cpu is not None:
            self.cpu.cap()

    def log_tail(self, n: int = 40) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self, grace_s: float = 10.0) -> None:
        """Kills the whole process group: SIGTERM, then SIGKILL after `grace_s`."""
        stop_together([self], grace_s)

    def _terminate(self) -> bool:
        """SIGTERM to the group; False when there is nothing left to stop."""
        _LIVE.discard(self)
        if self.proc is None or self.proc.poll() is not None and not _group_alive(self.proc.pid):
            self._release()
            return False
        _signal_group(self.proc.pid, signal.SIGTERM)
        return True

    def _reap(self, deadline: float) -> None:
        """Waits until the group is gone or `deadline`, then SIGKILLs what is left. Polls the leader on each
        turn: its zombie stays in the group until reaped, so without the poll every stop waited the whole
        grace period (10 s per server)."""
        while time.monotonic() < deadline and (self.proc.poll() is None or _group_alive(self.proc.pid)):
            time.sleep(0.1)
        _signal_group(self.proc.pid, signal.SIGKILL)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        self._release()

    def _release(self) -> None:
        """What a stopped process leaves: its log file and its CPU group."""
        if self.cpu is not None:
            self.cpu.remove()
        self._close_log()

    def kill(self) -> None:
        """Hard kill (fault injection): SIGKILL to the whole group, no grace."""
        _signal_group(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def _close_log(self):
        if self._log:
            self._log.close()
            self._log = None

    def __enter__(self):
        return self.start().wait_healthy()

    def __exit__(self, *exc):
        self.stop()


class SGLangServer(ManagedProcess):
    def __init__(self, spec: ServerSpec):
        self.spec = spec
        entry = "prfaas_sgl.tools.sglang_forked" if spec.fork_children else "sglang.launch_server"
        cmd = [sys.executable, "-m", entry, *server_args(spec)]
        log = spec.log_path or f"/tmp/prfaas-sglang-{spec.port}.log"
        cpu = (CpuGroup(f"{spec.mode}-{spec.port}", spec.cpu, cap_when_healthy=True) if spec.cpu is not None
               else None)
        super().__init__(cmd, server_env(spec), log, spec.url, spec.netns, cpu)


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _die_with_parent(parent: int):
    """A preexec function: the child gets SIGKILL when its parent dies.

    The kernel sends it when the *thread* that forked exits, not the process: from a worker thread (an
    executor's ends at its shutdown, a thread of its own when its function returns) it would kill a healthy
    server, so ``start`` asks for it only on the main thread. It survives the ``exec`` of ``ip netns exec``
    (which execs the command in place, no fork) and of the Python interpreter; SGLang's scheduler and
    detokenizer carry the same signal towards SGLang's main process."""
    def preexec() -> None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died between fork and prctl: no signal will ever come
            os._exit(1)
    return preexec


def http_ok(url: str) -> bool:
    """Whether a GET of ``url`` answers 200 within 2 s."""
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except Exception:
        return False


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def stop_together(procs, grace_s: float = 10.0) -> None:
    """Stops several processes under one grace period (SIGTERM to all, then wait), not one period each."""
    live = [p for p in procs if p._terminate()]
    deadline = time.monotonic() + grace_s
    for p in live:
        p._reap(deadline)


def stop_all() -> None:
    stop_together(list(_LIVE), grace_s=3.0)


def _on_signal(signum, frame):
    stop_all()
    raise SystemExit(128 + signum)


def _install_cleanup() -> None:
    """Once per process, on the first start(): atexit covers normal exit and Ctrl-C; SIGTERM is mapped
    to SystemExit so atexit runs then too."""
    if getattr(_install_cleanup, "done", False):
        return
    _install_cleanup.done = True
    atexit.register(stop_all)
    try:
        if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            signal.signal(signal.SIGTERM, _on_signal)
    except ValueError:  # not the main thread
        pass
