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


def test_bandwidth_watermarks_with_hysteresis_and_hold():
    # Budget = 1 Gbit/s * 1 s = 125 MB; a 20k-token prompt is 20 MB of KV.
    p = BandwidthAwarePolicy(PolicyParams(threshold=1000, high_watermark=0.8, low_watermark=0.5, hold_s=2.0),
                             COST)
    link = lambda mb: LinkView(GBIT, bytes_in_flight=mb * 1e6)  # noqa: E731
    assert route(p, 20_000, link=link(50), now=0.0).route == "prfaas"  # (50+20)/125 = 0.56
    d = route(p, 20_000, link=link(90), now=1.0)  # (90+20)/125 = 0.88 > 0.8: close
    assert (d.route, d.reason) == ("local", "link_congested")
    assert route(p, 20_000, link=link(70), now=1.5).reason == "link_congested"  # 0.56 > low: still closed
    assert route(p, 20_000, link=link(10), now=2.5).reason == "link_congested"  # below low, but hold_s
    assert route(p, 20_000, link=link(10), now=3.1).route == "prfaas"  # hold over and 0.08 < 0.5


def test_measured_goodput_shrinks_the_budget():
    p = BandwidthAwarePolicy(PolicyParams(threshold=1000), COST)
    slow = LinkView(GBIT, goodput_bps=0.1 * GBIT, bytes_in_flight=0.0)  # budget 12.5 MB < 20 MB request
    assert route(p, 20_000, link=slow).reason == "link_congested"


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
