"""Test servers fork SGLang's children (prfaas_sgl/tools/sglang_forked.py): the launcher runs a module as
__main__ with its `set_start_method("spawn", force=True)` (what SGLang's engine calls) turned into fork, and
a spec that asks for it is started through the launcher."""
from __future__ import annotations

import os
import subprocess
import sys

from prfaas_sgl.tools.launch import ServerSpec, SGLangServer

ASKS_FOR_SPAWN = """
import multiprocessing as mp
import sys

STATE = []


def child():
    print("child sees", STATE, flush=True)  # a spawned child re-imports this module: it would see []


if __name__ == "__main__":
    STATE.append("set by the parent after its imports")
    mp.set_start_method("spawn", force=True)
    proc = mp.Process(target=child)
    proc.start()
    proc.join()
    print(mp.get_start_method(), sys.argv[1:], flush=True)
"""


def test_the_launcher_forks_where_the_module_asks_for_spawn(tmp_path):
    (tmp_path / "asks_for_spawn.py").write_text(ASKS_FOR_SPAWN)
    assert _run(tmp_path, "asks_for_spawn", "--flag", "1") == ["child sees ['set by the parent after its imports']", "fork ['--flag', '1']"]


EXPORTS_METRICS = """
import multiprocessing as mp
import os
import sys

import prometheus_client  # imported before the multiprocess directory is set, as SGLang's imports do


def child():
    prometheus_client.Counter("child_requests", "requests").inc(3)


if __name__ == "__main__":
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = sys.argv[1]
    mp.set_start_method("spawn", force=True)
    proc = mp.Process(target=child)
    proc.start()
    proc.join()
    from prometheus_client import CollectorRegistry, generate_latest, multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    print([line for line in generate_latest(registry).decode().splitlines() if line.startswith("child_")])
"""


def test_a_forked_child_writes_its_metrics_where_the_parent_reads_them(tmp_path):
    (tmp_path / "exports_metrics.py").write_text(EXPORTS_METRICS)
    (tmp_path / "prom").mkdir()
    out = _run(tmp_path, "exports_metrics", str(tmp_path / "prom"))
    assert out == ["['child_requests_total 3.0']"]


def _run(tmp_path, module: str, *args: str) -> list[str]:
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    code = f"from prfaas_sgl.tools.sglang_forked import run; run({module!r})"
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_a_spec_asking_for_forked_children_starts_through_the_launcher(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    forked = SGLangServer(ServerSpec(model_path=str(tmp_path), port=1, fork_children=True)).cmd
    assert forked[1:3] == ["-m", "prfaas_sgl.tools.sglang_forked"] and forked[3:5] == ["--model-path", str(tmp_path)]
    assert SGLangServer(ServerSpec(model_path=str(tmp_path), port=1)).cmd[1:3] == ["-m", "sglang.launch_server"]
