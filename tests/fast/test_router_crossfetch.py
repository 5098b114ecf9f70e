"""Prefixes across clusters through the shared store (router/crossfetch.py): the paper's abundant cache rule
in the real router, the automatic rule on the measured link and the cost model, and what /metrics counts.

A prompt of 10,000 tokens whose first 9,000 the PrfaaS prefill r0 computed and wrote through to the store;
the local prefills l0/l1 hold none of it. Threshold t = 8,192."""
from __future__ import annotations

import dataclasses

import pytest

from prfaas_sgl.router.cluster import Cluster
from prfaas_sgl.router.config import RouterConfig
from prfaas_sgl.router.cost import price_fetch
from prfaas_sgl.router.metrics import RouterMetrics
from prfaas_sgl.router.policy import (
    InstanceView, LinkView, ModelCost, PolicyParams, RouteInput, make_policy)
from prfaas_sgl.router.routing import RoutingCore

GBIT = 1e9
KV = 1000.0  # bytes per token
STATE = 50_000.0  # bytes per linear-state entry
COST = ModelCost(kv_bytes_per_token=KV, state_bytes=STATE, local_coef=(0.0, 1e-4, 0.0),
                 remote_coef=(0.0, 5e-5, 0.0))
PROMPT, STORED, T = 10_000, 9_000, 8192
MEMBERS = frozenset({"r0", "l0", "l1"})


def views(r_cached=STORED, l_cached=0, r_queued=0):
    return (InstanceView("r0", "prfaas", True, r_queued, 0, r_cached),
            InstanceView("l0", "local_prefill", True, 0, 0, l_cached),
            InstanceView("l1", "local_prefill", True, 0, 0, 0), InstanceView("d0", "decode", True, 0, 0, 0))


def decide(rule, policy="threshold", link=LinkView(100 * GBIT), store=STORED, readers=MEMBERS, prompt=PROMPT,
           insts=None, **params):
    p = make_policy(policy, PolicyParams(threshold=T, cache_rule=rule, **params), COST)
    return p.decide(RouteInput(prompt, insts or views(), link, 0.0, store_prefix=store, store_readers=readers))


@pytest.mark.parametrize("policy", ["threshold", "bandwidth_aware", "paced"])
def test_abundant_routes_the_extension_local_and_credits_the_stored_prefix(policy):
    """Fails before the store credit: the abundant rule sent the request local on r0's hit but charged l0 the
    whole prompt (incremental 10,000: SGLang could not move the prefix). PrfaaS is busy (100,000 queued
    tokens, 5 s), so the bandwidth-aware policies keep the threshold route."""
    d = decide("abundant", policy, insts=views(r_queued=100_000))
    assert (d.route, d.prefill, d.incremental_len) == ("local", "l0", PROMPT - STORED)
    assert (d.fetch, d.fetched_len, d.fetch_bytes) == ("fetch", STORED, STORED * KV + STATE)


def test_scarce_is_todays_rule_and_says_when_the_store_held_more():
    d = decide("scarce")  # local holds nothing: 10,000 > t -> PrfaaS, where r0's own hit counts
    assert (d.route, d.prefill, d.incremental_len, d.fetch) == ("prfaas", "r0", PROMPT - STORED, "")
    d = decide("scarce", prompt=5000, store=4096, insts=views(r_cached=4096))  # short: local recomputes
    assert (d.route, d.prefill, d.incremental_len, d.fetch, d.fetched_len) == ("local", "l0", 5000, "recompute", 0)


def test_auto_moves_the_prefix_only_when_loading_beats_recomputing_at_the_measured_rate():
    # local saves 9,000 tokens x 1e-4 s = 0.9 s; loading moves 9,000 x 1 kB + one 50 kB state = 72.4 Mbit
    fast = LinkView(GBIT, goodput_bps=100e6, busy=1.0)  # 0.724 s < 0.9 s
    slow = LinkView(GBIT, goodput_bps=50e6, busy=1.0)  # 1.448 s > 0.9 s
    d = decide("auto", link=fast, fetch_rtt_s=0.0)
    assert (d.route, d.prefill, d.incremental_len, d.fetch) == ("local", "l0", PROMPT - STORED, "fetch")
    d = decide("auto", link=slow, fetch_rtt_s=0.0)
    assert (d.route, d.prefill, d.incremental_len, d.fetch) == ("prfaas", "r0", PROMPT - STORED, "")
    # a configured store rate overrides the link's
    d = decide("auto", link=slow, fetch_rtt_s=0.0, fetch_gbps=1.0)
    assert (d.route, d.fetch) == ("local", "fetch")
    # round trips count: 0.25 s for the one interval tips the fast link over the 0.9 s saved
    d = decide("auto", link=fast, fetch_rtt_s=0.25)
    assert d.route == "prfaas"


def test_a_loaded_prefix_ends_on_the_checkpoint_grid_with_a_state_per_interval():
    d = decide("abundant", fetch_grid_tokens=64)
    upto = STORED - STORED % 64  # 8,960: the servers resume from a checkpoint only
    assert (d.incremental_len, d.fetched_len) == (PROMPT - upto, upto)
    assert d.fetch_bytes == upto * KV + (upto // 64) * STATE
    # the whole prompt stored: SGLang computes at least one token, so the credit stops short of the end
    d = decide("abundant", store=PROMPT, prompt=PROMPT, fetch_grid_tokens=64, insts=views(r_cached=PROMPT))
    assert d.incremental_len == PROMPT - (PROMPT - 1) // 64 * 64


def test_only_store_members_are_credited():
    d = decide("abundant", readers=frozenset({"r0", "l1"}))  # l0 keeps its own cache only
    assert (d.prefill, d.incremental_len, d.fetch) == ("l1", PROMPT - STORED, "fetch")
    d = decide("abundant", readers=frozenset())
    assert (d.route, d.incremental_len, d.fetch) == ("local", PROMPT, "")  # the abundant rule without a move


def test_price_fetch_counts_intervals_from_the_own_prefix():
    f = price_fetch(COST, False, 1000, own=128, upto=640, grid=64, rtt_s=0.01, rate_bps=8e6)
    assert (f.tokens, f.intervals, f.nbytes) == (512, 8, 512 * KV + 8 * STATE)
    assert f.fetch_s == pytest.approx(8 * 0.01 + f.nbytes * 8 / 8e6)
    assert f.saved_s == pytest.approx(512 * 1e-4) and not f.pays


def _core(tmp_path, **kw) -> RoutingCore:
    (tmp_path / "tokenizer.json").write_text("{}")
    cfg = RouterConfig.from_flags(prfaas=("http://h:1;bootstrap=1;name=r0",), local_prefill=(
        "http://h:2;bootstrap=1;name=l0",), decode=("http://h:3;name=d0",), tokenizer_path=str(tmp_path),
        policy="threshold", block_size=64, kv_bytes_per_token=KV, state_bytes=STATE, **kw)
    cluster = Cluster(cfg)
    for name in cluster.instances:
        cluster.probed(name, True)
    return RoutingCore(cfg, cluster, RouterMetrics())


def _metric(core: RoutingCore, line: str) -> float:
    text = core.metrics.render(core.cluster, T, 1.0).decode()
    return next(float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith(line))


def test_the_router_publishes_what_members_compute_and_counts_fetches(tmp_path):
    core = _core(tmp_path, threshold=T, cache_rule="abundant", store_instances="r0,l0")
    first = list(range(141))  # 9,024 tokens in 141 blocks: long, uncached -> PrfaaS, which writes them through
    assert core.route(141 * 64, first, now=0.0).decision.route == "prfaas"
    assert core.cluster.store.prefix_blocks(first) == 141
    d = core.route(157 * 64, first + list(range(500, 516)), now=0.0).decision  # + 1,024 tokens
    assert (d.route, d.prefill, d.incremental_len, d.fetched_len) == ("local", "l0", 1024, 9024)
    assert _metric(core, 'prfaas_router_prefix_fetch_decisions_total{outcome="fetch",route="local"}') == 1
    assert _metric(core, "prfaas_router_prefix_fetch_tokens_total") == 9024
    assert _metric(core, "prfaas_router_prefix_fetch_predicted_bytes_total") == 9024 * KV + STATE


def test_a_non_member_prefill_publishes_nothing(tmp_path):
    core = _core(tmp_path, threshold=T, cache_rule="abundant", store_instances="l0")
    core.route(141 * 64, list(range(141)), now=0.0)  # r0 computed it but does not write through
    assert core.cluster.store.prefix_blocks(list(range(141))) == 0


@pytest.mark.parametrize("kw, flag", [({"store_instances": "d0"}, "--store-instances"),
                                      ({"store_capacity_tokens": 0}, "--store-capacity-tokens")])
def test_store_settings_are_checked(tmp_path, kw, flag):
    with pytest.raises(ValueError, match=flag):
        _core(tmp_path, **kw)


def test_cache_rule_auto_is_a_valid_setting():
    assert dataclasses.replace(PolicyParams(), cache_rule="auto").cache_rule == "auto"
    with pytest.raises(ValueError, match="cache_rule"):
        PolicyParams(cache_rule="plenty")


def _sim(rule: str):
    from pathlib import Path

    from prfaas_sgl.router.planner import load_scenario
    from prfaas_sgl.router.sim.config import sim_config
    from prfaas_sgl.router.sim.run import build

    case = load_scenario(Path(__file__).resolve().parents[2] / "scenarios" / "paper_case_study.toml")
    c = sim_config(case.sim, duration_s=300.0, cache_blocks=50_000, cache_rule=rule, threshold=12_000)
    c = dataclasses.replace(c, prefix=dataclasses.replace(c.prefix, hit_rate=0.8, cached_fraction=0.6, groups=4))
    sim = build(case, c)
    sim.run()
    return sim


def test_the_simulator_loads_credited_prefixes_before_computing_the_increment():
    """The simulator's prefills share one store: under "abundant" a local prefill credited a prefix PrfaaS
    computed first loads it (fetch_s of the decision, charged before its increment); under "scarce" nothing
    is loaded and each cluster computes what its own cache lacks."""
    scarce, abundant = _sim("scarce"), _sim("abundant")
    assert not any(r.fetch_s for r in scarce.reqs)
    moved = [r for r in abundant.reqs if r.fetch_s > 0]
    assert moved and all(r.prefill_end - r.prefill_start > r.fetch_s for r in moved if r.prefill_end == r.prefill_end)
    computed = lambda sim: sum(r.incremental for r in sim.reqs)  # noqa: E731
    assert computed(abundant) < computed(scarce)


def test_the_bandwidth_aware_estimate_counts_the_load_itself():
    """A credited prefix is not free: at a 10 Mbit/s store the 9 MB load takes 7.2 s, so the local route is
    ready in ~7.3 s, not 0.1 s, and the busy PrfaaS (20,000 queued tokens: ~1.05 s) takes the request.
    Without the load's time the local route looked 0.1 s away and kept it."""
    d = decide("abundant", "bandwidth_aware", insts=views(r_queued=20_000), fetch_gbps=0.01)
    assert (d.route, d.prefill, d.reason, d.incremental_len) == ("prfaas", "r0", "local_slower", PROMPT - STORED)
    d = decide("abundant", "bandwidth_aware", insts=views(r_queued=20_000), fetch_gbps=100.0)
    assert (d.route, d.prefill, d.reason, d.fetch) == ("local", "l0", "short", "fetch")


def test_the_rule_and_the_fetch_rate_are_admin_settable(tmp_path):
    """/admin/routing (RoutingCore.set_routing) switches to the automatic rule and sets the store's rate:
    at 10 kbit/s loading 9,024 tokens never pays (the extension goes back to r0, which holds them), at
    100 Gbit/s it does (the local cluster takes it and loads them)."""
    core = _core(tmp_path, threshold=T, store_instances="r0,l0")
    first = list(range(141))
    core.route(141 * 64, first, now=0.0)
    ext = first + list(range(500, 516))
    core.set_routing({"cache_rule": "auto", "fetch_gbps": 1e-5}, why="test")
    d = core.route(157 * 64, ext, now=0.0).decision
    assert (d.route, d.prefill, d.fetch, d.incremental_len) == ("prfaas", "r0", "", 1024)
    state = core.set_routing({"fetch_gbps": 100.0}, why="test")
    assert (state["cache_rule"], state["fetch_gbps"]) == ("auto", 100.0)
    d = core.route(157 * 64, first + list(range(600, 616)), now=0.0).decision  # r0 published ext: another one
    assert (d.route, d.prefill, d.fetch, d.incremental_len) == ("local", "l0", "fetch", 1024)
