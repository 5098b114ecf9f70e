"""The demo's pieces that need no SGLang server: phases and their servers, the shift phase's recommendation
rule, the table rows, the note on what the demo cannot emulate, and the switch timeline plot."""

from __future__ import annotations

from prfaas_sgl.tools.demo import shift
from prfaas_sgl.tools.demo.live import use_servers
from prfaas_sgl.tools.demo.table import NOT_EMULATED, format_side_by_side
from prfaas_sgl.tools.demo.topology import PHASES, DemoLink, deployment
from prfaas_sgl.router.actuators.base import Action, Split
from prfaas_sgl.router.cluster import Cluster
from prfaas_sgl.router.config import RouterConfig
from tests.support.router_standin import build_tiny_tokenizer

LOOPBACK = DemoLink("127.0.0.1", "127.0.0.1", None, None)


def demo_dep():
    return deployment(LOOPBACK, "tiny:tiny-qwen35-hybrid", "prfaas_zmq", 300, 20.0)


def test_homogeneous_baseline_gets_as_many_servers_as_prfaas_all_local():
    dep = demo_dep()
    pools = {s.name: s.pool for s in dep.servers}
    by_label = {p.label: p for p in PHASES}
    prfaas = next(p for p in PHASES if p.policy == "bandwidth_aware" and not p.shift)
    homog = next(p for p in PHASES if p.policy == "local_only")
    assert len(homog.servers) == len(prfaas.servers) == 3
    assert all(pools[n] != "prfaas" for n in homog.servers)
    assert sum(pools[n] == "decode" for n in homog.servers) == sum(pools[n] == "decode" for n in prfaas.servers)
    assert all(set(p.servers) <= set(pools) for p in by_label.values())
    shifting = [p for p in PHASES if p.shift]
    assert len(shifting) == 1 and sum(pools[n] == "local_prefill" for n in shifting[0].servers) == 2


def test_stack_starts_the_servers_and_leaves_the_router_to_the_demo():
    dep = demo_dep()
    assert len(dep.on("demo")) == len(dep.servers) == 4 and not dep.router_on("demo")


def test_use_servers_drains_the_others(tmp_path):
    dep = demo_dep()
    cluster = Cluster(RouterConfig.from_flags(**dep.router_fields(tokenizer_path=build_tiny_tokenizer(str(tmp_path / "t")))))
    for phase in PHASES:
        use_servers(cluster, phase.servers)
        serving = {n for n, i in cluster.instances.items() if not i.draining}
        assert serving == set(phase.servers), phase.label


def test_length_rule_recommends_by_prompt_length():
    rule = shift.LengthRule((2, 1), 300, long_tokens=250, short_tokens=150, window=4)
    for n in (400, 500, 450, 420):
        rule.observe(n, 0.0)
    assert rule.maybe_update(1.0) is None  # silent until active
    rule.active = True
    assert rule.maybe_update(1.0).recommended_split == (2, 1)
    for n in (50, 60, 40, 70):
        rule.observe(n, 2.0)
    upd = rule.maybe_update(3.0)
    assert upd.recommended_split == (1, 2) and upd.threshold == 300


def fake_results(t0: float, ttfts: list[float]) -> dict:
    reqs = [{"send_s": float(i), "ttft_s": t} for i, t in enumerate(ttfts)]
    summary = {"ok": len(ttfts), "requests": len(ttfts), "request_throughput": 1.0, "goodput": 1.0,
               "ttft_s": {"p50": 0.5, "p90": 0.9}, "tpot_s": {"p50": 0.1, "p90": 0.2}, "e2e_s": {"p50": 1.0}}
    return {"started_unix": t0, "requests": reqs, "summary": summary, "router": {}, "routes": {},
            "servers": "1 + 2/1"}


def test_tables_say_the_servers_and_what_is_not_emulated():
    text = format_side_by_side([("A", fake_results(0.0, [0.5])), ("B", fake_results(0.0, [0.6]))])
    assert "| servers (remote + local P/D) | 1 + 2/1 | 1 + 2/1 |" in text
    note = "\n".join(NOT_EMULATED)
    assert "H200" in note and "same CPU" in note and "restart" in note and "fall back" in note


def test_switch_timeline_plot_and_action_lines(tmp_path):
    before, after = Split(2, 1), Split(1, 2)
    actions = [Action("processes", before, after, "more_decode", "in_progress", "local-prefill-1: x -> y"),
               Action("processes", before, after, "more_decode", "applied", "local-prefill-1: 80 s")]
    parts = [("A", fake_results(100.0, [0.5, 0.7])), ("B", fake_results(103.0, [1.5, 2.0, 0.4]))]
    path = shift.plot_timeline(parts, actions, [104.0, 180.0], tmp_path / "timeline.png")
    assert path.stat().st_size > 1000
    lines = shift.describe(actions, [104.0, 180.0], 100.0)
    assert lines[1].startswith("+   80s [processes] applied: 2P/1D -> 1P/2D (more_decode)")
