"""Decode cache affinity in the routing core: with --decode-affinity-slack the router remembers which
decode served which prompt (approximate index) and sends a follow-up sharing that prefix there, so the
decode-side prefix cache (prfaas_hybrid / SGLang's decode radix cache) keeps those pages off the link."""
from __future__ import annotations

from prfaas_sgl.router.cluster import Cluster
from prfaas_sgl.router.config import InstanceSpec, RouterConfig
from prfaas_sgl.router.metrics import RouterMetrics
from prfaas_sgl.router.routing import RoutingCore


def _core(tmp_path, slack: int) -> RoutingCore:
    (tmp_path / "tokenizer.json").write_text("{}")
    cfg = RouterConfig(local_prefill=(InstanceSpec("http://h:1", bootstrap_port=1),),
                       decode=(InstanceSpec("http://h:2"), InstanceSpec("http://h:3")),
                       tokenizer_path=str(tmp_path), decode_affinity_slack=slack, policy="threshold")
    cluster = Cluster(cfg)
    for name in cluster.instances:  # instances start out of rotation until a /health probe passes
        cluster.probed(name, True)
    return RoutingCore(cfg, cluster, RouterMetrics())


def _conversation(core: RoutingCore) -> list[str]:
    """Turn 1, two unrelated requests, then turn 2 (turn 1's blocks + 2 more). Each decode is still
    running what it got (the router's in-flight count), so at turn 2 decode0 runs 2 and decode1 1."""
    picks = []
    for hashes in ([1, 2, 3, 4], [9, 8], [7, 7], [1, 2, 3, 4, 5, 6]):
        d = core.route(64 * len(hashes), hashes, now=0.0).decision
        core.cluster.instances[d.decode].inflight += 1
        picks.append(d.decode)
    return picks


def test_follow_up_turn_goes_to_the_decode_holding_its_prefix(tmp_path):
    core = _core(tmp_path, slack=1)
    # turn 2: decode0 holds 4 blocks of it and runs one more request than decode1: within slack 1
    assert _conversation(core) == ["decode0", "decode1", "decode0", "decode0"]
    assert core.cluster.instances["decode0"].index.match([1, 2, 3, 4, 5, 6]) == 6


def test_off_by_default_least_loaded_and_no_decode_index(tmp_path):
    core = _core(tmp_path, slack=-1)
    assert _conversation(core) == ["decode0", "decode1", "decode0", "decode1"]  # least loaded
    assert all(core.cluster.instances[n].index.match([1, 2, 3, 4]) == 0 for n in ("decode0", "decode1"))


def test_affinity_gives_way_to_load_beyond_the_slack(tmp_path):
    core = _core(tmp_path, slack=0)
    core.route(256, [1, 2, 3, 4], now=0.0)  # -> decode0, indexed there
    core.cluster.instances["decode0"].inflight = 1
    assert core.route(384, [1, 2, 3, 4, 5, 6], now=0.0).decision.decode == "decode1"  # 1 > 0 + slack 0
    core.cluster.instances["decode1"].inflight = 1  # equal load: decode1 now holds the longer prefix
    assert core.route(448, [1, 2, 3, 4, 5, 6, 7], now=0.0).decision.decode == "decode1"
    core.cluster.instances["decode1"].inflight = 2
    assert core.route(448, [1, 2, 3, 4, 5, 6, 7], now=0.0).decision.decode == "decode0"


def test_link_counts_what_decode_does_not_hold_before_this_prompt_is_recorded_there(tmp_path):
    """The link's share of a remote request is the prompt minus decode's prefix *before* the request: turn 1
    (nothing cached) puts all its KV on the link, turn 2 only the blocks decode does not hold yet."""
    (tmp_path / "tokenizer.json").write_text("{}")
    cfg = RouterConfig.from_flags(prfaas=(InstanceSpec("http://h:0", bootstrap_port=1),),
                       local_prefill=(InstanceSpec("http://h:1", bootstrap_port=1),), decode=(InstanceSpec("http://h:2"),),
                       tokenizer_path=str(tmp_path), decode_affinity_slack=0, policy="threshold", threshold=1,
                       block_size=64, kv_bytes_per_token=10.0, state_bytes=5.0)
    cluster = Cluster(cfg)
    for name in cluster.instances:
        cluster.probed(name, True)
    core = RoutingCore(cfg, cluster, RouterMetrics())
    turn1 = core.route(256, [1, 2, 3, 4], now=0.0)
    turn2 = core.route(384, [1, 2, 3, 4, 5, 6], now=0.0)
    assert (turn1.decision.route, turn2.decision.route) == ("prfaas", "prfaas")
    assert turn1.link.nbytes == 5.0 + 10.0 * 256  # before: 5.0, as if decode held the prompt already
    assert turn2.link.nbytes == 5.0 + 10.0 * 128
