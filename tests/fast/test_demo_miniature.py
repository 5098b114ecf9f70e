"""The demo's miniature of the paper: emulated GPU kinds as CPU shares, the planner on a measured profile,
and the measured-vs-predicted table with its stability verdict (prfaas_sgl/tools/demo/{hardware,profile,plan,
measure}.py). The real-server run is `make demo` (tests/sglang/demo_smoke_e2e.py runs a reduced one)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from prfaas_sgl.tools.demo import hardware, measure, plan, profile
from prfaas_sgl.tools.demo.topology import EQUAL_COST, PHASES, DemoLink, deployment

LOOPBACK = DemoLink("127.0.0.1", "127.0.0.1", None, None)


def test_shares_echo_h200_vs_h20_compute_for_prefill_and_bandwidth_for_decode():
    h200, h20p, h20d = (hardware.cores(*k) for k in ((hardware.H200, "prefill"),
                                                     (hardware.H20, "prefill"), (hardware.H20, "decode")))
    assert h200 == hardware.REFERENCE_CORES
    assert h200 / h20p == pytest.approx(989 / 148, rel=0.01)  # ~6.7x dense BF16 TFLOPS
    assert h200 / h20d == pytest.approx(4.8 / 4.0, rel=0.01)  # ~1.2x HBM bandwidth
    assert hardware.pool_share("prfaas").cpus == (hardware.REMOTE_CORE,)
    assert hardware.pool_share("decode").cpus == hardware.pool_share("local_prefill").cpus == (hardware.LOCAL_CORE,)
    # the local core's servers together leave room for the unshared router and load generator
    assert 2 * h20p + h20d < 0.85


def test_the_demo_deployment_gives_each_pool_its_share_only_when_asked():
    shared = deployment(LOOPBACK, "tiny:tiny-qwen35-hybrid", "prfaas_zmq", 300, 20.0, shares=True)
    for s in shared.servers:
        assert s.cpu_share == hardware.pool_share(s.pool), s.name
    plain = deployment(LOOPBACK, "tiny:tiny-qwen35-hybrid", "prfaas_zmq", 300, 20.0)
    assert all(s.cpu_share is None for s in plain.servers)


def test_the_equal_cost_phase_is_homogeneous_pd_with_one_server_doubled():
    homogeneous = next(p for p in PHASES if p.policy == "local_only")
    assert (EQUAL_COST.policy, EQUAL_COST.servers) == (homogeneous.policy, homogeneous.servers)
    assert EQUAL_COST.merged == ("local-prefill-1",) and EQUAL_COST.key == "local_only_equal_cost"
    assert {p.key for p in PHASES if not p.shift} == {"bandwidth_aware", "local_only", "all_remote"}


def test_the_demo_says_it_falls_back_when_shares_cannot_be_applied(monkeypatch, capsys):
    from prfaas_sgl.tools.demo.__main__ import use_shares

    monkeypatch.setattr(hardware, "shares_problem", lambda: "a CPU quota needs write access: run as root")
    assert use_shares(argparse.Namespace(no_shares=False)) is False
    out = capsys.readouterr().out
    assert "falling back" in out and "run as root" in out and "unshared" in out
    monkeypatch.setattr(hardware, "shares_problem", lambda: None)
    assert use_shares(argparse.Namespace(no_shares=False)) is True
    assert "H200-like" in capsys.readouterr().out


def _profile(remote_speedup: float) -> dict:
    local = [0.13, 0.33, 1.0]
    return {"prfaas": {"tokens": [32, 256, 1024], "s_per_request": [s / remote_speedup for s in local]},
            "local_prefill": {"tokens": [32, 256, 1024], "s_per_request": local},
            "decode": {"batch": 8, "step_s": 0.03}}


def test_the_planner_on_an_h200_h20_profile_puts_prfaas_ahead_of_both_baselines():
    preds = plan.predict(plan.system(_profile(6.7), 20.0, 1 / 64, 16))
    prfaas, homo, naive = preds["bandwidth_aware"], preds["local_only"], preds["all_remote"]
    assert prfaas.lam > naive.lam > homo.lam
    assert 2 < prfaas.threshold < 2048 and 0 < prfaas.offload < 1
    assert (homo.bound, homo.offload, homo.threshold) == ("pdp", 0.0, None)
    assert naive.offload == 1.0 and naive.threshold is None
    equal = preds["local_only_equal_cost"]  # an H200 costs ~2 H20s: 3 local prefill / 1 decode
    assert equal.lam == pytest.approx(1.5 * homo.lam) and equal.servers == "0 + 3/1"
    table = plan.format_predictions(preds)
    assert f"| PrfaaS | 1 + 1/1 | {prfaas.threshold} |" in table and "| homogeneous PD | 0 + 2/1 | - |" in table


def test_on_equal_hardware_the_planner_predicts_no_prfaas_gain():
    """The unshared fallback: a remote server no faster than a local one; PrfaaS's 1 + 1 prefill servers
    then sustain what homogeneous PD's 2 local ones do (the link at 20 Mbit/s does not bind)."""
    preds = plan.predict(plan.system(_profile(1.0), 20.0, 1 / 64, 16))
    assert preds["bandwidth_aware"].lam == pytest.approx(preds["local_only"].lam, rel=0.05)


def _runs(table: dict[str, list[float]]) -> dict[str, measure.Runs]:
    labels = {"bandwidth_aware": "PrfaaS", "local_only": "homogeneous PD", "all_remote": "naive"}
    return {p: measure.Runs(p, labels[p], list(v), [1.0] * len(v)) for p, v in table.items()}


def test_the_measured_table_gives_the_spread_and_a_plain_stability_verdict():
    preds = plan.predict(plan.system(_profile(6.7), 20.0, 1 / 64, 16))
    stable = _runs({"bandwidth_aware": [3.0, 3.2, 3.1], "local_only": [1.0, 1.1, 0.9],
                    "all_remote": [2.0, 2.1, 2.2]})
    assert measure.stability(stable, preds) == ("ordering stable over 3 repetition(s): PrfaaS > naive > "
                                                "homogeneous PD — the planner's")
    table = measure.format_measured(stable, preds)
    assert "| PrfaaS | 1 + 1/1 |" in table and "3.10 (3.00–3.20)" in table and "| 3.10x |" in table
    shaky = _runs({"bandwidth_aware": [3.0, 1.9, 3.1], "local_only": [1.0, 1.1, 0.9],
                   "all_remote": [2.0, 2.1, 2.2]})
    verdict = measure.stability(shaky, preds)
    assert verdict.startswith("ordering NOT stable over 3 repetitions: PrfaaS > naive > homogeneous PD; "
                              "naive > PrfaaS > homogeneous PD;")
    assert json.loads(measure.to_json(stable, preds))["bandwidth_aware"]["predicted"]["lam"] == preds[
        "bandwidth_aware"].lam


def test_a_cached_profile_is_reused_and_a_changed_key_measures_again(tmp_path, monkeypatch):
    cache, model = tmp_path / "profile.json", "/models/tiny-qwen35-hybrid"
    calls = []
    monkeypatch.setattr(profile, "measure", lambda *a: calls.append(a) or _profile(6.7))
    first = profile.load_or_measure(model, cache, tmp_path / "log", lambda m: None)
    assert len(calls) == 1 and json.loads(cache.read_text())["key"] == profile.cache_key(model, True)
    assert profile.load_or_measure(model, cache, tmp_path / "log", lambda m: None) == first
    assert len(calls) == 1  # cached
    profile.load_or_measure(model, cache, tmp_path / "log", lambda m: None, shared=False)
    assert len(calls) == 2  # the unshared fallback is another profile


def test_flushing_caches_asks_each_server_to_wait_for_idle_and_names_a_refusal():
    import http.server
    import threading

    seen = []

    class H(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            seen.append(self.path)
            busy = self.server.server_port == ports[1]
            self.send_response(400 if busy else 200)
            self.end_headers()
            self.wfile.write(b"still running" if busy else b"Cache flushed.")

        def log_message(self, *a):
            pass

    servers = [http.server.HTTPServer(("127.0.0.1", 0), H) for _ in range(2)]
    ports = [s.server_port for s in servers]
    for s in servers:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    try:
        measure.flush_caches([f"http://127.0.0.1:{ports[0]}"], wait_s=5)
        assert seen == ["/flush_cache?timeout=5"]
        with pytest.raises(RuntimeError, match=rf"127.0.0.1:{ports[1]}/flush_cache refused \(400\): still running"):
            measure.flush_caches([f"http://127.0.0.1:{p}" for p in ports], wait_s=5)
    finally:
        for s in servers:
            s.shutdown()


def test_a_role_switch_gives_an_emulated_server_the_share_of_its_new_pool():
    from prfaas_sgl.tools.launch import ServerSpec
    from prfaas_sgl.tools.server_control import LaunchedServers

    old = ServerSpec(model_path="/m", port=1, mode="prefill", bootstrap_port=2,
                     cpu=hardware.pool_share("local_prefill"))
    assert LaunchedServers({}, share_for=hardware.pool_share)._respec("lp", old, "decode").cpu == \
        hardware.pool_share("decode")
    assert LaunchedServers({})._respec("lp", old, "decode").cpu == old.cpu  # prfaas up: the file's share stays
    unshared = ServerSpec(model_path="/m", port=1, mode="prefill", bootstrap_port=2)
    assert LaunchedServers({}, share_for=hardware.pool_share)._respec("lp", unshared, "decode").cpu is None


def test_the_router_compares_the_pools_with_the_profiled_prefill_times(tmp_path):
    """The router's defaults are paper-scale: they would take a 0.105-core local prefill (~2 ms a token) for
    ~20x faster than it is when the bandwidth-aware policy weighs moving a request there."""
    from prfaas_sgl.router.config import RouterConfig
    from prfaas_sgl.router.cost import ModelCost

    prof = _profile(6.7)
    cost = plan.router_cost(prof)
    model = ModelCost(1.0, 0.0, tuple(cost["local_prefill_coef"]), tuple(cost["remote_prefill_coef"]))
    for pool, key in (("local_prefill", "prefill_s_local"), ("prfaas", "prefill_s_remote")):
        for n, s in zip(prof[pool]["tokens"], prof[pool]["s_per_request"]):
            assert getattr(model, key)(n) == pytest.approx(s, rel=0.25, abs=0.03), (pool, n)
    dep = deployment(LOOPBACK, "tiny:tiny-qwen35-hybrid", "prfaas_zmq", 300, 20.0, cost=cost)
    (tmp_path / "tokenizer.json").write_text("{}")
    rcfg = RouterConfig.from_flags(**dep.router_fields(tokenizer_path=str(tmp_path)))
    assert rcfg.cost.local_coef == tuple(cost["local_prefill_coef"])
    assert rcfg.cost.remote_coef == tuple(cost["remote_prefill_coef"])


def test_after_a_flush_the_router_no_longer_takes_a_long_prompt_for_cached_on_a_local_server(tmp_path):
    """Repetitions reuse their prompts: a homogeneous run leaves them all in the router's index of the local
    prefill servers, and the next PrfaaS run, caches flushed, must still send the long ones to PrfaaS."""
    from prfaas_sgl.cachepool.hashing import block_hashes
    from prfaas_sgl.router.cluster import Cluster
    from prfaas_sgl.router.config import RouterConfig
    from prfaas_sgl.router.policy import make_policy
    from prfaas_sgl.tools.demo.live import forget_caches

    dep = deployment(LOOPBACK, "tiny:tiny-qwen35-hybrid", "prfaas_zmq", 187, 20.0)
    (tmp_path / "tokenizer.json").write_text("{}")
    cfg = RouterConfig.from_flags(**dep.router_fields(tokenizer_path=str(tmp_path)))
    cluster = Cluster(cfg)
    for inst in cluster.instances.values():
        inst.healthy = True
    cluster.drain("local-prefill-1")  # the PrfaaS phase's servers
    policy = make_policy("bandwidth_aware", cfg.policy_params, cfg.cost)
    prompt = list(range(10, 10 + 697))
    hashes = block_hashes(prompt, cfg.block_size)
    cluster.instances["local-prefill-0"].index.insert(hashes)  # the homogeneous run routed it there
    assert policy.decide(cluster.route_input(len(prompt), hashes, 0.0)).route == "local"
    forget_caches(cluster)
    d = policy.decide(cluster.route_input(len(prompt), hashes, 0.0))
    assert (d.route, d.prefill, d.reason) == ("prfaas", "prfaas-0", "long")


def test_a_run_with_failed_requests_runs_again_and_the_table_counts_what_still_failed(monkeypatch, capsys):
    """A decode that drops a connection failed 63 of a run's 64 requests within 1.2 s: 0.80 req/s entered the
    homogeneous mean as if measured."""
    from prfaas_sgl.tools.demo import __main__ as demo

    outcomes = iter([{"summary": {"errors": 63, "request_throughput": 0.8}},
                     {"summary": {"errors": 0, "request_throughput": 1.5}}])
    monkeypatch.setattr(demo, "run_policy", lambda *a, **kw: next(outcomes))
    args = argparse.Namespace(out=Path("out"), concurrency=24, sessions=64)
    phase = next(p for p in PHASES if p.policy == "local_only")
    preds = {phase.key: argparse.Namespace(threshold=None)}
    res = demo.measured_run(argparse.Namespace(url="http://router"), "tok", args, None, preds, phase, 0)
    assert res["summary"] == {"errors": 0, "request_throughput": 1.5}
    assert "63 of 64 requests failed: running this phase again" in capsys.readouterr().out
    runs = measure.Runs("local_only", "homogeneous PD")
    runs.add({"summary": {"errors": 2, "request_throughput": 1.4, "ttft_s": {"p90": 3.0}}})
    preds = plan.predict(plan.system(_profile(6.7), 20.0, 1 / 64, 16))
    assert measure.format_measured({"local_only": runs}, preds).splitlines()[-1].endswith("| 3.00 | 2 |")
    assert json.loads(measure.to_json({"local_only": runs}, preds))["local_only"]["errors"] == [2]


def test_a_refusal_while_the_server_is_still_switching_does_not_end_the_switch():
    from prfaas_sgl.router.actuators.base import Action, Split
    from prfaas_sgl.tools.demo.shift import switch_ended

    def act(outcome: str) -> Action:
        return Action("processes", Split(2, 1), Split(1, 2), "more_decode", outcome)

    started, refused = act("in_progress"), act("refused")
    assert not switch_ended([])  # the controller has not acted yet
    assert not switch_ended([started, refused])  # the demo once ran "after the switch" here, mid-restart
    assert switch_ended([started, refused, act("applied")])
    assert switch_ended([started, act("failed")])
    assert switch_ended([refused])  # nothing is switching: no reason to wait
