"""The unified-pool benchmark's own bookkeeping: the work each server did in a phase (prefill passes and
the prompt tokens they computed, read from SGLang's log lines), the CPU seconds of a real process tree,
the server order per round, and the per-round ratios the summary reports."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

LOG = """\
[2026-11-27 16:33:44] Prefill batch, #new-seq: 1, #new-token: 384, #cached-token: 512, full token usage: 0.24, mamba usage: 0.06, #running-req: 0, #queue-req: 0, #pending-token: 600, cpu graph: False, input throughput (token/s): 1177.20
[2026-11-27 16:33:44] Prefill batch, #new-seq: 2, #new-token: 504, #cached-token: 896, full token usage: 0.61, mamba usage: 0.17, #running-req: 1, #queue-req: 3, #pending-token: 4672, cpu graph: False, input throughput (token/s): 5125.97
[2026-11-27 16:33:45] Decode batch, #running-req: 5, #full token: 4345, full token usage: 0.97, mamba num: 7, mamba usage: 0.50, cpu graph: False, gen throughput (token/s): 50.28, #queue-req: 0
"""


def _bench():
    spec = importlib.util.spec_from_file_location("bench_unified_pool", ROOT / "scripts" / "bench_unified_pool.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_a_phase_counts_its_prefill_passes_and_the_prompt_tokens_they_computed():
    stats = _bench().batch_stats(LOG)
    assert stats == {"max_running": 3, "max_queued": 3, "prefill_passes": 2, "prefill_tokens": 888}


def test_cpu_seconds_include_the_children_of_the_server_process():
    b = _bench()
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\ntime.sleep(30)"
    parent = subprocess.Popen([sys.executable, "-c",
                               f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', {burn!r}])\n"
                               "time.sleep(30)"])
    try:
        deadline = time.monotonic() + 20
        while b.cpu_seconds(parent.pid) < 0.3 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert b.cpu_seconds(parent.pid) >= 0.3  # the parent itself only sleeps
    finally:
        for child in b.psutil.Process(parent.pid).children(recursive=True):
            child.kill()
        parent.kill()
        parent.wait()


def test_odd_rounds_take_the_servers_in_reverse_order():
    b = _bench()
    names = ["sglang", "hybrid", "unified"]
    assert b.server_order(names, 0) == names
    assert b.server_order(names, 1) == ["unified", "hybrid", "sglang"]
    assert b.server_order(names, 2) == names


def test_the_summary_lists_each_round_ratio_and_the_cpu_ratio():
    b = _bench()

    def row(rnd, rps, cpu, passes):
        return {"round": rnd, "phase": "long", "requests": 6, "ok": 6, "requests_per_s": rps, "cpu_s": cpu,
                "prefill_passes": passes, "prefill_tokens": passes * 500, "max_running": 5, "max_queued": 4,
                "prefix_hit_rate": 0.4, "same_outputs_as_sglang": 6}

    ref = [row(0, 3.0, 2.0, 12), row(1, 4.0, 2.2, 12), row(2, 3.0, 2.0, 12)]
    mine = [row(0, 3.3, 1.6, 10), row(1, 3.6, 2.0, 10), row(2, 3.6, 1.6, 10)]
    s = b.summarize(mine, ref)["long"]
    assert s["x_rounds"] == [1.1, 0.9, 1.2] and s["x_sglang"] == 1.1
    assert s["cpu_x_rounds"] == [1.25, 1.1, 1.25] and s["cpu_x_sglang"] == 1.25
    assert (s["prefill_passes"], s["prefill_tokens"]) == (10, 5000)


def test_omp_threads_reach_every_server_only_when_asked():
    b = _bench()
    assert b.server_env(None) == {}
    assert b.server_env(1) == {"OMP_NUM_THREADS": "1"}


def test_the_report_prints_each_round_and_records_how_the_servers_ran(tmp_path, capsys):
    b = _bench()

    def rows(rps, cpu):
        return [{"round": 0, "phase": "long", "requests": 1, "ok": 1, "requests_per_s": rps, "cpu_s": cpu,
                 "prefill_passes": 3, "prefill_tokens": 1496, "max_running": 1, "max_queued": 0,
                 "prefix_hit_rate": 0.0, "outputs": [[1, 2]]}]

    args = type("A", (), dict(out=str(tmp_path / "r.json"), profile="memory-bound", profile_used={"rounds": 1},
                              seed=17, fork=True, omp_threads=1, attention="query-only"))()
    b.report({"sglang": rows(2.0, 1.0), "unified": rows(2.2, 0.8)}, args)
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("| long | unified"))
    assert "| 1.1 (1.10) | 1.25 (1.25) | 3 / 1496 |" in line and line.endswith("| 1/1 |")
    saved = json.loads((tmp_path / "r.json").read_text())
    assert (saved["fork"], saved["omp_threads"], saved["attention"]) == (True, 1, "query-only")
