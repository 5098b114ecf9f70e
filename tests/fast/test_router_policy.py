"""Routing policies: pure decide() over fake cluster views (time passed in, no I/O)."""

from __future__ import annotations

import pytest

from prfaas_sgl.router.policy import (
    AllRemotePolicy, BandwidthAwarePolicy, InstanceView, LinkView, LocalOnlyPolicy, ModelCost, NoInstanceError,
    PolicyParams, RouteInput, ThresholdPolicy, local_fallback, make_policy)

GBIT = 1e9
COST = ModelCost(kv_bytes_per_token=1000.0, state_bytes=0.0, local_coef=(0.0, 1e-4, 0.0),
                 remote_coef=(0.0, 5e-5, 0.0))


def inst(name, pool, cached=0, queued=0, inflight=0, healthy=True):
    return InstanceView(name, pool, healthy, queued, inflight, cached)


def cluster(r_cached=0, l_cached=0, **kw):
    return (inst("r0", "prfaas", cached=r_cached), inst("l0", "local_prefill", cached=l_cached),
            inst("l1", "local_prefill"), inst("d0", "decode", inflight=2), inst("d1", "decode", inflight=1))


def route(policy, prompt, instances=None, link=LinkView(100 * GBIT), now=0.0):
    return policy.decide(RouteInput(prompt, instances or cluster(), link, now))


def test_threshold_routes_by_incremental_length_and_picks_least_loaded_decode():
    p = ThresholdPolicy(PolicyParams(threshold=1000))
    d = route(p, 1000)
    assert (d.route, d.prefill, d.decode, d.incremental_len, d.reason) == ("local", "l0", "d1", 1000, "short")
    d = route(p, 1001)
    assert (d.route, d.prefill, d.decode, d.incremental_len, d.reason) == ("prfaas", "r0", "d1", 1001, "long")


def test_scarce_rule_uses_local_cache_only():
    p = ThresholdPolicy(PolicyParams(threshold=1000, cache_rule="scarce"))
    # 5000 - 4096 local hit = 904 <= t: stays local, on the cache-affine instance.
    d = route(p, 5000, cluster(l_cached=4096))
    assert (d.route, d.prefill, d.incremental_len) == ("local", "l0", 904)
    # The remote hit does not count under "scarce": 5000 uncached locally -> PrfaaS computes 5000-4096.
    d = route(p, 5000, cluster(r_cached=4096))
    assert (d.route, d.prefill, d.incremental_len) == ("prfaas", "r0", 904)


def test_abundant_rule_uses_the_longest_prefix_anywhere():
    p = ThresholdPolicy(PolicyParams(threshold=1000, cache_rule="abundant"))
    d = route(p, 5000, cluster(r_cached=4096))
    assert (d.route, d.prefill, d.incremental_len) == ("local", "l0", 5000)  # tie on load: by name


def test_affinity_yields_to_load_when_overloaded():
    insts = (inst("l0", "local_prefill", cached=512, queued=100), inst("l1", "local_prefill", queued=0),
             inst("d0", "decode"))
    p = LocalOnlyPolicy(PolicyParams(overload_tokens=1000))
    assert route(p, 600, insts).prefill == "l0"
    busy = (inst("l0", "local_prefill", cached=512, queued=5000),) + insts[1:]
    d = route(p, 600, busy)
    assert (d.prefill, d.incremental_len) == ("l1", 600)


def test_baselines_and_pool_fallbacks():
    assert route(LocalOnlyPolicy(), 10**6).route == "local"
    assert route(AllRemotePolicy(), 1).route == "prfaas"
    no_remote = (inst("r0", "prfaas", healthy=False), inst("l0", "local_prefill"), inst("d0", "decode"))
    d = route(AllRemotePolicy(), 1, no_remote)
    assert (d.route, d.reason) == ("local", "no_prfaas")
    with pytest.raises(NoInstanceError):
        route(ThresholdPolicy(), 1, (inst("l0", "local_prefill"), inst("d0", "decode", healthy=False)))


def test_local_fallback_excludes_the_failed_instance_and_never_goes_remote():
    d = local_fallback(RouteInput(5000, cluster(l_cached=4096), LinkView(GBIT), 0.0), frozenset({"l0"}))
    assert (d.route, d.prefill, d.reason, d.incremental_len) == ("local", "l1", "retry_local", 5000)
    with pytest.raises(NoInstanceError):
        local_fallback(RouteInput(5, cluster(), LinkView(GBIT), 0.0), frozenset({"l0", "l1"}))


def bw(**kw):
    return BandwidthAwarePolicy(PolicyParams(threshold=1000, **kw), COST)


def remote_queue(tokens):
    # r0 holding ``tokens`` queued: wait = 5e-5 s/token * tokens
    return (inst("r0", "prfaas", queued=tokens), inst("l0", "local_prefill"), inst("l1", "local_prefill"),
            inst("d0", "decode"))


def test_queued_remote_bytes_the_link_clears_in_time_do_not_divert():
    # Regression (first version): KV of remote requests still waiting for prefill counted as link load, so
    # a PrfaaS queue alone closed the remote route. Here r0's 1 s queue lets the 1 Gbit/s link clear the
    # 100 MB queued ahead; remote = 1 s wait + 1 s prefill = 2 s beats local 2 s * (1 + slack).
    p = bw()
    d = route(p, 20_000, remote_queue(20_000), LinkView(GBIT, bytes_queued=100e6))
    assert (d.route, d.reason, p.congested) == ("prfaas", "long", False)


def test_link_congestion_latch_uses_bytes_in_flight_with_hysteresis_and_hold():
    # pressure = in-flight MB * 8 / 1000 Mbit/s / 1 s budget; 20k tokens: local 2.0 s, remote prefill 1.0 s.
    p = bw(high_watermark=0.8, low_watermark=0.5, hold_s=2.0)
    link = lambda mb: LinkView(GBIT, bytes_in_flight=mb * 1e6)  # noqa: E731
    d = route(p, 20_000, link=link(300), now=0.0)  # p = 2.4: congested; remote = 320 MB / 125 MB/s = 2.56 s
    assert (d.route, d.reason, p.congested) == ("local", "link_congested", True)
    d = route(p, 20_000, link=link(60), now=1.0)  # p = 0.48 < low but hold_s not over; remote 1.0 s < 2.0 s
    assert (d.route, d.reason, p.congested) == ("prfaas", "long", True)
    assert route(p, 20_000, link=link(70), now=2.5).route == "prfaas" and p.congested  # 0.56 > low
    assert route(p, 20_000, link=link(60), now=2.6).route == "prfaas" and not p.congested


def test_margin_needs_congestion_to_move_on_a_small_gain():
    # 300 MB queued ahead of an idle r0: remote = 2.56 s vs local 2.0 s. Uncongested, local must be 1.5x
    # sooner (3.0 > 2.56): stay. Congested (in-flight bytes), any gain moves it.
    p = bw()
    assert route(p, 20_000, link=LinkView(GBIT, bytes_queued=300e6)).route == "prfaas"
    d = route(p, 20_000, link=LinkView(GBIT, bytes_in_flight=300e6))
    assert (d.route, d.reason) == ("local", "link_congested")


def test_no_move_into_a_pool_that_misses_the_target():
    # Congested link makes remote 10.2 s, but both local instances have a 6 s queue: 8 s > target 6 s, so
    # the long request stays remote rather than making the local pool late too.
    insts = (inst("r0", "prfaas"), inst("l0", "local_prefill", queued=60_000), inst("l1", "local_prefill", queued=60_000),
             inst("d0", "decode"))
    d = route(bw(), 20_000, insts, LinkView(GBIT, bytes_in_flight=1250e6))
    assert (d.route, d.reason) == ("prfaas", "long")
    assert route(bw(target_s=9.0), 20_000, insts, LinkView(GBIT, bytes_in_flight=1250e6)).route == "local"


def test_short_request_moves_remote_when_local_is_backed_up_unless_link_congested():
    insts = (inst("r0", "prfaas"), inst("l0", "local_prefill", queued=50_000), inst("l1", "local_prefill", queued=50_000),
             inst("d0", "decode"))
    d = route(bw(), 900, insts)  # local 5.09 s, remote 0.045 s prefill + 7 ms transfer
    assert (d.route, d.prefill, d.incremental_len, d.reason) == ("prfaas", "r0", 900, "local_slower")
    d = route(bw(), 900, insts, LinkView(GBIT, bytes_in_flight=200e6))  # pressure 1.6: congested
    assert (d.route, d.reason) == ("local", "short")


def test_measured_goodput_slows_the_link():
    # 20 MB in flight at 0.1 Gbit/s goodput = 1.6 s > budget: congested; remote 40 MB -> 3.2 s > local 2.0 s.
    p = bw()
    d = route(p, 20_000, link=LinkView(GBIT, goodput_bps=0.1 * GBIT, bytes_in_flight=20e6))
    assert (d.route, d.reason) == ("local", "link_congested")


def test_remote_slower_than_local_stays_local():
    p = BandwidthAwarePolicy(PolicyParams(threshold=1000), COST)
    # Local: 2000 * 1e-4 = 0.2 s. Remote: 0.5 s transport queue + 0.1 s prefill > 0.2 s.
    d = route(p, 2000, link=LinkView(100 * GBIT, queue_delay_s=0.5))
    assert (d.route, d.reason) == ("local", "remote_slower")
    assert route(p, 2000, link=LinkView(100 * GBIT, queue_delay_s=0.05)).route == "prfaas"


def test_registry_and_mutable_threshold():
    p = make_policy("threshold", PolicyParams(threshold=10))
    assert route(p, 11).route == "prfaas"
    p.threshold = 100
    assert route(p, 11).route == "local"
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("nope")


def test_router_link_state_splits_queued_from_in_flight_and_reads_transport_stats():
    from prfaas_sgl.router.cluster import LinkState, apply_link_stats

    link = LinkState(GBIT)
    a, b = link.add(100e6, start_at=10.0), link.add(30e6, start_at=12.0)
    assert link.view(9.0).bytes_in_flight == 0.0 and link.view(9.0).bytes_queued == 130e6
    v = link.view(11.0)
    assert (v.bytes_in_flight, v.bytes_queued) == (100e6, 30e6)
    link.done(a)
    link.done(a)  # idempotent: a retried attempt may release twice
    assert (link.view(13.0).bytes_in_flight, link.view(13.0).bytes_queued) == (30e6, 0.0)
    link.done(b)
    assert link.transfers == {}
    # prfaas_sgl.transfer's snapshot shape: per-window goodput and a queue-delay summary
    apply_link_stats(link, {"goodput_bps": {"1s": 4e9, "10s": 5e9}, "queue_delay_s": {"n": 3, "mean": 0.25}})
    assert (link.goodput_bps, link.queue_delay_s, link.stats_ok) == (4e9, 0.25, True)
    apply_link_stats(link, {"goodput_bps": 2e9, "queue_delay_s": 0.5})
    assert (link.view(0.0).goodput_bps, link.view(0.0).queue_delay_s) == (2e9, 0.5)


def _decodes(d0_cached=0, d0_inflight=2, d1_inflight=1):
    return (inst("l0", "local_prefill"), inst("d0", "decode", cached=d0_cached, inflight=d0_inflight),
            inst("d1", "decode", inflight=d1_inflight))


@pytest.mark.parametrize("slack, d0_inflight, expect", [
    (-1, 2, "d1"),  # off: least loaded even though d0 holds the prefix
    (1, 2, "d0"),  # d0 runs one more request than d1: within the slack, its cached prefix wins
    (0, 2, "d1"),  # no slack: the busier affine decode loses
    (3, 5, "d1"),  # 4 more than the least loaded: overloaded, least loaded wins
])
def test_decode_affinity_prefers_the_decode_holding_the_prefix_within_slack(slack, d0_inflight, expect):
    inp = RouteInput(5000, _decodes(d0_cached=4096, d0_inflight=d0_inflight), LinkView(GBIT), 0.0, slack)
    assert ThresholdPolicy(PolicyParams(threshold=10_000)).decide(inp).decode == expect


def test_decode_affinity_without_any_decode_hit_is_least_loaded():
    inp = RouteInput(5000, _decodes(d0_cached=0, d0_inflight=0, d1_inflight=0), LinkView(GBIT), 0.0, 8)
    assert ThresholdPolicy(PolicyParams(threshold=10_000)).decide(inp).decode == "d0"  # tie: by name
    inp = RouteInput(5000, _decodes(d0_cached=0, d0_inflight=1, d1_inflight=0), LinkView(GBIT), 0.0, 8)
    assert ThresholdPolicy(PolicyParams(threshold=10_000)).decide(inp).decode == "d1"
