"""Emulated compute per server: a real cgroup v1 CPU quota and a real core set on real child processes
(root, as this project's machines and CI run), and clear refusals where either cannot be applied."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from prfaas_sgl.tools.cpu_share import CGROUP_CPU, CpuGroup, CpuShare, CpuShareError, problem
from prfaas_sgl.tools.launch import ManagedProcess

needs_cgroup = pytest.mark.skipif(problem(CpuShare(cores=0.5)) is not None,
                                  reason=f"needs root and the cgroup v1 cpu controller: {problem(CpuShare(cores=0.5))}")
# A child that burns CPU for `secs` of wall time, and its children too (a server's scheduler is forked later),
# then prints the CPU time of the process tree and the cores it may run on.
BURN = """
import os, sys, time
secs = float(sys.argv[1])
if os.fork() == 0:
    end = time.monotonic() + secs
    while time.monotonic() < end: pass
    os._exit(0)
end = time.monotonic() + secs
while time.monotonic() < end: pass
os.wait()
t = os.times()
print(t.user + t.system + t.children_user + t.children_system, sorted(os.sched_getaffinity(0)), flush=True)
"""


def _run(tmp_path: Path, share: CpuShare, name: str, secs: float = 2.0):
    group = CpuGroup(name, share)
    proc = ManagedProcess([sys.executable, "-c", BURN, str(secs)], dict(os.environ), str(tmp_path / "log"),
                          "http://127.0.0.1:9", cpu=group)
    proc.start()
    proc.proc.wait(timeout=30)
    proc.stop(grace_s=1)
    cpu_s, cpus = proc.log_path.read_text().split(maxsplit=1)
    return float(cpu_s), cpus.strip(), group


@needs_cgroup
def test_quota_caps_the_whole_process_tree_and_the_group_goes_away(tmp_path):
    """Two busy processes (parent and a child forked after start) under 0.25 cores for 2 s use ~0.5 s of CPU,
    not the ~4 s two unconstrained busy loops take on two cores."""
    cpu_s, _, group = _run(tmp_path, CpuShare(cores=0.25), f"test-quota-{os.getpid()}")
    assert 0.3 < cpu_s < 0.8, cpu_s
    assert not group.path.exists()  # removed once its processes were gone


@needs_cgroup
def test_core_set_pins_the_server(tmp_path):
    _, cpus, _ = _run(tmp_path, CpuShare(cores=1.0, cpus=(0,)), f"test-pin-{os.getpid()}", secs=0.2)
    assert cpus == "[0]"


def test_refusals_say_what_to_change(tmp_path):
    assert "cgroup v1 cpu controller" in problem(CpuShare(cores=1), root=tmp_path)
    have = os.cpu_count()
    assert f"cores [{have}] do not exist here" in problem(CpuShare(cpus=(0, have)))
    with pytest.raises(CpuShareError, match="cgroup v1 cpu controller"):
        CpuGroup("x", CpuShare(cores=1), root=tmp_path).create()
    if os.geteuid() == 0 and CGROUP_CPU.exists():
        ro = tmp_path / "ro"
        ro.mkdir()
        (ro / "cpu.cfs_quota_us").write_text("-1")
        os.chmod(ro, 0o555)
        assert problem(CpuShare(cores=1), root=ro) is None  # root writes anyway: access() says so
    for bad in (dict(cores=0), dict(cores=-1.0), dict(cpus=(1, 1)), dict(cpus=(-1,))):
        with pytest.raises(ValueError):
            CpuShare(**bad)


def test_wrap_joins_outside_the_netns_and_keeps_the_pid():
    group = CpuGroup("s", CpuShare(cores=0.5, cpus=(0, 1)), root=Path("/sys/fs/cgroup/cpu"))
    cmd = group.wrap(["ip", "netns", "exec", "dc2", "python3", "-m", "x"])
    assert cmd[:2] == ["sh", "-c"] and "exec \"$@\"" in cmd[2] and "/prfaas/s/cgroup.procs" in cmd[2]
    assert cmd[4:] == ["taskset", "-c", "0,1", "ip", "netns", "exec", "dc2", "python3", "-m", "x"]
    assert CpuGroup("t", CpuShare()).wrap(["a"]) == ["a"]


def _deployment(**prefill):
    from prfaas_sgl.tools.deploy import config

    return config.parse({"deployment": {"model": "m", "device": "cpu"}, "servers": [
        {"name": "p", "machine": "a", "pool": "prfaas", "host": "127.0.0.1", "port": 1, "bootstrap_port": 2,
         **prefill},
        {"name": "d", "machine": "a", "pool": "decode", "host": "127.0.0.1", "port": 3},
    ]})


def test_the_deployment_file_gives_each_server_its_share(tmp_path):
    from prfaas_sgl.tools.deploy.up import server_spec

    dep = _deployment(cpu_cores=1.5, cpus=[0, 1])
    p, d = dep.servers
    assert p.cpu_share == CpuShare(1.5, (0, 1)) and d.cpu_share is None
    assert server_spec(dep, p, "m", tmp_path).cpu == CpuShare(1.5, (0, 1))
    with pytest.raises(ValueError, match=r"servers\[p\]: cpu cores=0"):
        _deployment(cpu_cores=0)


def test_prfaas_up_refuses_a_share_this_machine_cannot_apply_before_starting_anything(tmp_path, capsys):
    from prfaas_sgl.tools.deploy.up import Launcher, run

    started = []
    launcher = Launcher(server=lambda spec: started.append(spec), model=lambda m: m)
    have = os.cpu_count()
    assert run(_deployment(cpus=[have + 3]), "a", tmp_path, launcher) == 2
    assert started == []
    assert f"servers[p]: cores [{have + 3}] do not exist here" in capsys.readouterr().out


# Answers 200 on every GET: a stand-in for a server's /health, so wait_healthy sees it serve.
HEALTH = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


@needs_cgroup
def test_a_server_loads_uncapped_and_its_quota_applies_once_it_serves(tmp_path):
    """An SGLang server's ~60 s start-up under a 0.12-core quota would take ~8 minutes: the share a server
    emulates applies from its first healthy /health on (wait_healthy, or the keeper after a restart)."""
    from prfaas_sgl.tools.launch import free_port

    port = free_port()
    group = CpuGroup(f"test-defer-{os.getpid()}", CpuShare(cores=0.12), cap_when_healthy=True)
    proc = ManagedProcess([sys.executable, "-c", HEALTH, str(port)], dict(os.environ), str(tmp_path / "log"),
                          f"http://127.0.0.1:{port}", cpu=group)
    try:
        proc.start()
        assert group.cores() is None  # loading: uncapped
        proc.wait_healthy(30)
        assert group.cores() == pytest.approx(0.12)
        group.set_cores(0.5)  # the profiling step's change of share on a running server
        assert group.cores() == pytest.approx(0.5)
    finally:
        proc.stop(grace_s=1)
    assert not group.path.exists()


def test_sglang_servers_defer_their_quota_until_healthy(tmp_path):
    from prfaas_sgl.tools.launch import SGLangServer, ServerSpec

    (tmp_path / "config.json").write_text("{}")
    srv = SGLangServer(ServerSpec(model_path=str(tmp_path), port=1, cpu=CpuShare(cores=0.5)))
    assert srv.cpu.cap_when_healthy
