"""Stopping managed processes (prfaas_sgl/tools/launch.py): a process that exits on SIGTERM is gone at once, and
several stubborn ones share one grace period. Before the fix every stop waited its whole grace period: the
group leader's unreaped zombie kept `killpg(pgid, 0)` succeeding (10 s per server, ~6 min of CI)."""
from __future__ import annotations

import sys
import time

from prfaas_sgl.tools.launch import ManagedProcess, stop_together

SLEEPER = "import time; time.sleep(600)"
STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); " \
           "time.sleep(600)"


def _proc(tmp_path, code: str, name: str) -> ManagedProcess:
    return ManagedProcess([sys.executable, "-c", code], {}, str(tmp_path / f"{name}.log"),
                          "http://127.0.0.1:9").start()


def _wait_ready(p: ManagedProcess) -> None:
    deadline = time.monotonic() + 30
    while "ready" not in p.log_path.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)


def test_a_process_that_exits_on_sigterm_is_stopped_without_waiting_the_grace(tmp_path):
    p = _proc(tmp_path, SLEEPER, "sleeper")
    t0 = time.monotonic()
    p.stop(grace_s=10.0)
    assert time.monotonic() - t0 < 3.0
    assert p.proc.returncode is not None


def test_stubborn_processes_share_one_grace_period_then_are_killed(tmp_path):
    procs = [_proc(tmp_path, STUBBORN, f"stubborn{i}") for i in range(3)]
    for p in procs:
        _wait_ready(p)  # SIGTERM ignored from here on
    t0 = time.monotonic()
    stop_together(procs, grace_s=2.0)
    took = time.monotonic() - t0
    assert 2.0 <= took < 5.0, took  # one grace period for all three, not three
    assert [p.proc.returncode for p in procs] == [-9, -9, -9]


def test_cpu_servers_sleep_when_fully_idle_and_cuda_ones_are_left_alone(tmp_path):
    """SGLang's scheduler spins on its sockets when idle: measured 0.50 of a core per idle CPU server over
    20 s, 0.012 with --sleep-on-idle (same greedy tokens, /tmp probe at load ~8). A farm of 4 servers on 2
    cores lost about a core to idle ones. GPU servers keep SGLang's default (the flag is a CPU setting here)."""
    from prfaas_sgl.tools.launch import ServerSpec, server_args

    (tmp_path / "config.json").write_text('{"layer_types": ["full_attention"]}')
    cpu = server_args(ServerSpec(model_path=str(tmp_path), port=1))
    cuda = server_args(ServerSpec(model_path=str(tmp_path), port=1, device="cuda"))
    assert "--sleep-on-idle" in cpu and "--sleep-on-idle" not in cuda
