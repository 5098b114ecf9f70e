"""The KV handoff in the demo's planner: the profiling step's PD pair (prfaas_sgl/tools/demo/{pair,profile}.py)
measures what sending and receiving the KV cost, and the planner's model (plan.py) charges it: the prefill
curves include sending, the wire bytes are S_kv, and receiving takes decode time per request. The pair's real
run is the demo's profiling step (`python -m prfaas_sgl.tools.demo`, cached in out/demo-profile.json)."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from prfaas_sgl.router.planner import stages
from prfaas_sgl.tools.demo import hardware, pair, plan, profile

TOKENS = [32, 256, 1024]


LOCAL = [0.13, 0.33, 1.0]


def _profile(recv_cpu_s: list[float] | None = None, wire: list[float] | None = None,
             waiting_cores: float = 0.0) -> dict:
    local = LOCAL
    doc = {"prfaas": {"tokens": TOKENS, "s_per_request": [s / 6.7 for s in local]},
           "local_prefill": {"tokens": TOKENS, "s_per_request": local},
           "decode": {"batch": 8, "step_s": 0.03, "cores": 0.5}}
    if recv_cpu_s is not None:
        for p in ("prfaas", "local_prefill"):
            polled = [r + waiting_cores * s for r, s in zip(recv_cpu_s, doc[p]["s_per_request"])]
            doc[p] |= {"decode_recv_cpu_s": polled, "wire_bytes": wire, "prefill_cpu_s": [0.0] * 3}
    return doc


def test_receiving_the_kv_takes_decode_capacity_by_its_cpu_over_the_decode_share():
    """0.01 s of CPU per request on a 0.5-core decode is 0.02 s of its time: at batch 8 and 16 output tokens
    (0.06 s of step time per request) Θ_pdd falls from 16.7 to 1 / (0.06 + 0.02) = 12.5 req/s."""
    wire = [float(33792 + 512 * n) for n in TOKENS]
    old = plan.system(_profile(), 20.0, 1 / 64, 16)
    new = plan.system(_profile([0.01] * 3, wire), 20.0, 1 / 64, 16)
    assert stages(old, 0.0, 0, 1).pdd == pytest.approx(8 / (0.03 * 16))
    assert stages(new, 0.0, 0, 1).pdd == pytest.approx(1 / (0.03 * 16 / 8 + 0.01 / 0.5), rel=1e-6)


def test_the_receive_cost_is_averaged_over_the_workloads_lengths():
    """A cost that grows with length is charged at the workload's mean, not at one profiled length."""
    wire = [float(33792 + 512 * n) for n in TOKENS]
    sys_ = plan.system(_profile([0.002 + 1e-5 * n for n in TOKENS], wire), 20.0, 1 / 64, 16)
    lengths, w = sys_.dist.grid()
    mean_len = float((lengths * w).sum() / w.sum())
    expect = (0.002 + 1e-5 * mean_len) / 0.5
    assert plan.decode_handoff(_profile([0.002 + 1e-5 * n for n in TOKENS], wire), sys_.dist) == pytest.approx(
        (expect, 0.0), rel=1e-3, abs=1e-9)


def test_a_decode_polling_a_pending_transfer_loses_that_share_and_not_per_request_time():
    """Behind the slow prefill the decode burns more CPU per request (it polls the transfer the whole while):
    the fit separates that rate from the per-request cost and charges it as share the decode loses."""
    wire = [float(33792 + 512 * n) for n in TOKENS]
    prof = _profile([0.01] * 3, wire, waiting_cores=0.05)
    assert plan.receive_fit(prof) == pytest.approx((0.01, 0.0, 0.05), abs=1e-9)
    sys_ = plan.system(prof, 20.0, 1 / 64, 16)
    assert stages(sys_, 0.0, 0, 1).pdd == pytest.approx((1 - 0.05 / 0.5) / (0.03 * 16 / 8 + 0.01 / 0.5), rel=1e-6)


def test_the_wire_bytes_the_pair_measured_are_the_planners_kv_size():
    wire = [40_000 + 600 * n for n in TOKENS]  # e.g. framing on top of the 512 B/token the model accounts
    sys_ = plan.system(_profile([0.0] * 3, wire), 20.0, 1 / 64, 16)
    assert sys_.kv_bytes.at(500) == pytest.approx(40_000 + 600 * 500)
    naive = stages(sys_, 0.0, 0, 1)
    assert naive.prfaas_egress == pytest.approx(20e6 / 8 / (40_000 + 600 * naive.split.l_long))


def test_a_colocated_profile_keeps_the_planners_old_model():
    sys_ = plan.system(_profile(), 20.0, 1 / 64, 16)
    assert not plan.handoff_measured(_profile())
    assert sys_.kv_bytes.poly == (33792.0, 512.0)
    assert plan.decode_handoff(_profile(), sys_.dist) == (0.0, 0.0)


def test_the_handoff_lowers_every_pd_prediction_and_leaves_the_ordering():
    wire = [float(33792 + 512 * n) for n in TOKENS]
    before = plan.predict(plan.system(_profile(), 20.0, 1 / 64, 16))
    after = plan.predict(plan.system(_profile([0.03] * 3, wire), 20.0, 1 / 64, 16))
    assert after["all_remote"].lam < before["all_remote"].lam  # the decode now binds naive
    assert after["all_remote"].bound == "pdd"
    assert after["bandwidth_aware"].lam >= after["all_remote"].lam > after["local_only"].lam


def test_a_prefill_that_used_part_of_its_share_is_planned_at_what_the_share_sustains():
    """The pair's fast prefill waited on the handoff part of the time: its throughput is its share over its
    CPU per request, not the wall time of four requests; a prefill that used its whole share keeps its wall."""
    entry = {"tokens": TOKENS, "s_per_request": [0.08, 0.15, 0.33], "cores": 0.7,
             "prefill_cpu_s": [0.035, 0.105, 0.25]}
    assert plan.sustained_s(entry) == pytest.approx([0.05, 0.15, 0.33])
    assert plan.hardware_of(entry, "H200-like").prefill_s.at(32) == pytest.approx(0.05)
    assert plan.sustained_s({"tokens": TOKENS, "s_per_request": [0.1, 0.2, 0.3]}) == [0.1, 0.2, 0.3]


class _StandInPair:
    """Counters that advance as a pair's would: the decode burns `idle` CPU/s plus 0.02 s per request."""

    url = "http://stand-in"

    def __init__(self, idle: float):
        self.idle, self.t0, self.recv, self.bytes = idle, time.monotonic(), 0.0, 0

    def counters(self):
        return (0.5 * self.recv, self.recv + self.idle * (time.monotonic() - self.t0), self.bytes)


def test_a_batchs_receive_cpu_is_the_decodes_cpu_less_its_idle_rate(monkeypatch):
    p = _StandInPair(idle=0.05)

    def run(url, prompts, out_tokens):
        time.sleep(0.1)
        p.recv += 0.02 * len(prompts)
        p.bytes += sum(33792 + 512 * len(x) for x in prompts)
        return 0.1

    monkeypatch.setattr(profile, "makespan", run)
    monkeypatch.setattr(profile, "PREFILL_LENGTHS", (32, 256))
    entry = profile.prefill_curve(p, __import__("random").Random(0), idle_rate=0.05)
    assert entry["decode_recv_cpu_s"] == pytest.approx([0.02, 0.02], abs=0.005)
    assert entry["wire_bytes"] == [33792 + 512 * 32, 33792 + 512 * 256]
    assert entry["prefill_cpu_s"] == pytest.approx([0.01, 0.01])


def test_the_pair_is_the_demos_prefill_on_the_remote_core_and_its_decode_with_transport_counters():
    dep, stats_url = pair.pair_deployment("tiny:tiny-qwen35-hybrid", "/keys", shared=True)
    prefill, decode = dep.servers
    assert (prefill.name, prefill.pool, decode.pool) == (pair.PREFILL, "local_prefill", "decode")
    assert prefill.cpu_share == hardware.pool_share("prfaas")  # switched per kind by the profile
    assert decode.cpu_share == hardware.pool_share("decode")
    port = prefill.args[prefill.args.index("--prfaas-zmq-stats-port") + 1]
    assert stats_url == f"http://127.0.0.1:{port}/stats"
    assert ("--prfaas-zmq-curve-keys", "/keys") == dep.server_args  # the demo's encrypted data plane
    assert dep.router["policy"] == "local_only" and "transport_stats_url" not in dep.router
    unshared, _ = pair.pair_deployment("tiny:tiny-qwen35-hybrid", None, shared=False)
    assert all(s.cpu_share is None for s in unshared.servers)


def test_cpu_seconds_count_a_servers_child_processes():
    burn = "import time\nt=time.process_time()\nwhile time.process_time()-t<0.3: pass\ntime.sleep(30)"
    spawn = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {burn!r}])"
    parent = subprocess.Popen([sys.executable, "-c", spawn])
    try:
        deadline = time.monotonic() + 20
        while pair.cpu_seconds(parent.pid) < 0.3 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pair.cpu_seconds(parent.pid) >= 0.3
    finally:
        import psutil

        for child in psutil.Process(parent.pid).children(recursive=True):
            child.kill()
        parent.kill()
        parent.wait()


def test_a_colocated_cached_profile_is_measured_again_on_the_pair():
    assert profile.cache_key("/m/tiny", True)["version"] >= 2
    assert "pair" in profile.cache_key("/m/tiny", True)["method"]


def test_policies_the_planner_ties_may_come_in_either_order():
    """Both heterogeneous clusters bound by the one decode: the planner predicts PrfaaS = naive, so a
    repetition where naive leads is no disagreement, while homogeneous PD ahead of either is."""
    from dataclasses import replace

    from prfaas_sgl.tools.demo import measure

    wire = [float(33792 + 512 * n) for n in TOKENS]
    preds = plan.predict(plan.system(_profile([0.03] * 3, wire), 20.0, 1 / 64, 16))
    preds["bandwidth_aware"] = replace(preds["bandwidth_aware"], lam=preds["all_remote"].lam)
    labels = {"bandwidth_aware": "PrfaaS", "local_only": "homogeneous PD", "all_remote": "naive"}
    runs = lambda t: {p: measure.Runs(p, labels[p], list(v), [1.0] * len(v)) for p, v in t.items()}  # noqa: E731
    swapped = runs({"bandwidth_aware": [3.0, 2.8], "local_only": [1.0, 1.1], "all_remote": [2.9, 3.1]})
    assert measure.stability(swapped, preds).endswith(
        "every repetition consistent with the planner's PrfaaS = naive > homogeneous PD (= : predicted within 2%)")
    wrong = runs({"bandwidth_aware": [3.0, 0.8], "local_only": [1.0, 1.1], "all_remote": [2.9, 3.1]})
    assert measure.stability(wrong, preds).endswith("— planner: PrfaaS = naive > homogeneous PD")
