"""End-to-end simulations (short, seeded) driven by the router's real policy objects."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from prfaas_sgl.cli import main
from prfaas_sgl.router.planner import ProfileError, load_scenario
from prfaas_sgl.router.policy import ThresholdPolicy
from prfaas_sgl.router.sim.config import sim_config
from prfaas_sgl.router.sim.engine import Simulator
from prfaas_sgl.router.sim.run import build, simulate
from prfaas_sgl.router.sim.workload import SimRequest

ROOT = Path(__file__).resolve().parents[2]
CASE = load_scenario(ROOT / "scenarios" / "paper_case_study.toml")


def cfg(**kw):
    return sim_config(CASE.sim, duration_s=kw.pop("duration_s", 300.0), **kw)


def test_light_load_has_no_queueing():
    doc = simulate(CASE, replace(cfg(), arrival=replace(cfg().arrival, rate=0.3)))
    t = doc["totals"]
    assert t["completed"] == t["requests"] > 50
    assert t["tpot_s"]["p50"] == pytest.approx(0.025)
    assert t["ttft_s"]["p50"] < 4.0  # about the no-queue prefill time
    assert 0.35 < t["offload_fraction"] < 0.65 and t["slo_attainment"] == 1.0


def test_policy_objects_make_the_decisions():
    sim = build(CASE, cfg(threshold=10_000))
    assert isinstance(sim.policy, ThresholdPolicy) and sim.policy.threshold == 10_000
    sim.run()
    for r in sim.reqs:
        assert (r.route == "prfaas") == (r.input_len > 10_000)
        assert r.prefill.startswith("prfaas-" if r.route == "prfaas" else "pd-p-")
        assert r.decode_end > r.decode_start >= r.kv_ready >= r.prefill_end > r.prefill_start >= r.arrival


def test_baselines_route_everything_one_way():
    local = simulate(CASE, cfg(policy="local_only", duration_s=120))["totals"]
    remote = simulate(CASE, cfg(policy="all_remote", duration_s=120))["totals"]
    assert local["offload_fraction"] == 0.0 and local["link_gbytes"] == 0.0
    assert remote["offload_fraction"] == 1.0 and remote["link_gbytes"] > 0


def test_link_drop_slows_transfers():
    base = cfg(duration_s=300, threshold=0.0)
    base = replace(base, arrival=replace(base.arrival, rate=0.1))
    fast = simulate(CASE, base)["totals"]["ttft_s"]["p50"]
    slow = simulate(CASE, replace(base, bandwidth_trace=((0.0, 0.01),)))["totals"]["ttft_s"]["p50"]
    assert slow > fast + 2.0  # 1 Gbit/s: the ~0.6 GB median KV takes ~5 s, far past its ~1.2 s prefill


def test_prefix_cache_hits_reduce_work():
    c = replace(cfg(duration_s=300, cache_blocks=50_000), prefix=replace(cfg().prefix, hit_rate=0.8,
                                                                        cached_fraction=0.6, groups=4))
    t = simulate(CASE, c)["totals"]
    assert t["cache_hit_token_fraction"] > 0.3


def test_controller_moves_threshold():
    sim = build(CASE, cfg(duration_s=600, controller=True, threshold=2_000, controller_interval_s=30))
    sim.run()
    ts = [s.threshold for s in sim.samples]
    assert ts[0] == 2_000 and ts[-1] > 10_000  # toward the ~19.6K optimum, 25% per step


def test_bad_sim_settings_name_the_field():
    with pytest.raises(ProfileError, match="sim.arrival.kind: expected poisson"):
        sim_config({"arrival": {"kind": "weibull"}})
    with pytest.raises(ProfileError, match="sim.bogus: unknown setting"):
        sim_config({"bogus": 1})
    with pytest.raises(ProfileError, match="sim.prefill: expected 0 <= prefill < local.instances = 8"):
        build(CASE, cfg(prefill=9))


def test_cli_simulate_trace(tmp_path, capsys):
    tr = tmp_path / "tr.jsonl"
    tr.write_text("".join(json.dumps({"timestamp": 500 * i, "input_length": 30_000 if i % 2 else 4_000,
                                      "output_length": 64, "hash_ids": [7, 8, i + 100]}) + "\n" for i in range(40)))
    assert main(["simulate", str(ROOT / "scenarios" / "paper_case_study.toml"), "--trace", str(tr),
                 "--out", str(tmp_path / "o")]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["totals"]["requests"] == doc["totals"]["completed"] == 40
    assert doc["totals"]["offload_fraction"] == 0.5
    assert (tmp_path / "o" / "timeseries.png").exists()


def test_decode_load_counts_requests_routed_there_not_yet_arrived():
    # The router counts a decode's requests from routing to the end of the response (forward.py dec.inflight).
    # Five requests arriving together are all still in prefill when the last is routed: counting only those whose
    # KV reached decode saw five idle decodes each time and sent all five to pd-d-0 (a burst then queued there
    # while the other decodes idled: seed 7 of the burst study, 24 s mean decode wait on one decode, 0 on another).
    reqs = [SimRequest(i, 0.01 * i, 4096, 8, ()) for i in range(5)]
    sim = Simulator(CASE.system, cfg(threshold=100_000), (3, 5), 100_000, reqs)
    sim.run()
    assert sorted(r.decode for r in reqs) == [f"pd-d-{i}" for i in range(5)]
