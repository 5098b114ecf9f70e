"""The exposed transfer tail, modelled once (`cost.Streaming`, `cost.kv_ready_s`) for the router's remote-route
estimate and the simulator's KV-ready time: a remote request's KV streams while its prefill computes, except
the last chunk's pages (chunk path) or the last chunk's last layer group's (layer-wise, prompts of at least
min_tokens) and the states, which only leave after the last forward."""
from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest

from prfaas_sgl.router.cluster import Cluster
from prfaas_sgl.router.config import parse_config
from prfaas_sgl.router.cost import ModelCost, Streaming, kv_ready_s
from prfaas_sgl.router.planner import load_scenario
from prfaas_sgl.router.metrics import RouterMetrics
from prfaas_sgl.router.policy import BandwidthAwarePolicy, InstanceView, LinkView, PolicyParams, RouteInput
from prfaas_sgl.router.routing import RoutingCore
from prfaas_sgl.router.sim.config import sim_config
from prfaas_sgl.router.sim.run import build
from prfaas_sgl.transfer.config import LayerwiseConfig
from tests.support.router_standin import build_tiny_tokenizer

GBIT = 1e9
CASE = load_scenario(Path(__file__).resolve().parents[2] / "scenarios" / "paper_case_study.toml")


def test_the_chunk_path_tail_is_the_last_chunk():
    s = Streaming(chunk_tokens=512)
    assert s.tail_fraction(7936) == pytest.approx(256 / 7936)  # 15 full chunks, then 256 tokens
    assert s.tail_fraction(1024) == pytest.approx(0.5)
    assert s.tail_fraction(300) == 1.0  # one chunk: nothing streams before the last forward
    assert Streaming(chunk_tokens=0).tail_fraction(100_000) == 1.0
    assert s.tail_fraction(0) == 0.0


def test_layerwise_divides_the_last_chunk_by_its_groups_from_min_tokens_on():
    s = Streaming(chunk_tokens=512, attention_layers=7, layers_per_group=2, min_tokens=4096)
    assert s.groups(7936) == 4 and s.tail_fraction(7936) == pytest.approx(256 / 7936 / 4)
    assert s.groups(4095) == 1 and s.tail_fraction(4095) == pytest.approx((4095 - 7 * 512) / 4095)
    assert Streaming(chunk_tokens=512, layers_per_group=2).groups(7936) == 1  # layer count unknown: no groups


def test_the_servers_defaults_and_checks_are_the_layerwise_configs():
    assert (Streaming().layers_per_group, Streaming().min_tokens) == (LayerwiseConfig().layers_per_group,
                                                                       LayerwiseConfig().min_tokens)
    with pytest.raises(ValueError, match="min_tokens"):
        Streaming(min_tokens=0)


def test_tail_bytes_carry_the_states_and_the_tail_share_of_the_pages():
    cost = ModelCost(kv_bytes_per_token=1000.0, state_bytes=5e6, streaming=Streaming(chunk_tokens=8192))
    assert cost.tail_bytes(20_000) == pytest.approx(5e6 + 1000.0 * (20_000 - 2 * 8192))
    assert kv_ready_s(compute_s=2.0, drain_s=1.0, tail_s=0.5) == 2.5  # compute-bound: the tail is exposed
    assert kv_ready_s(compute_s=2.0, drain_s=3.0, tail_s=0.5) == 3.0  # link-bound: the tail is in the drain


def test_the_router_adds_the_exposed_tail_to_a_compute_bound_remote_route():
    # 40k tokens at 1 Gbit/s: 40 MB drains in 0.32 s while the 2 s prefill runs; its last chunk (7,232
    # tokens after four of 8,192: 7.2 MB, 58 ms) only leaves after it (before: max(compute, drain) = 2.0 s)
    cost = ModelCost(kv_bytes_per_token=1000.0, local_coef=(0.0, 1e-4, 0.0), remote_coef=(0.0, 5e-5, 0.0),
                     streaming=Streaming(chunk_tokens=8192))
    p = BandwidthAwarePolicy(PolicyParams(threshold=1000), cost)
    inp = RouteInput(40_000, (), LinkView(GBIT), 0.0)
    inst = InstanceView("x", "prfaas", True, 0, 0, 0)
    _, remote_s = p.ready_s(inp, inst, inst, cost.kv_bytes(40_000))
    assert remote_s == pytest.approx(2.0 + (40_000 - 4 * 8192) * 1000.0 * 8 / GBIT)


def test_the_router_takes_the_servers_streaming_settings_from_its_flags(tmp_path):
    base = ["--tokenizer-path", build_tiny_tokenizer(str(tmp_path / "tok")), "--decode", "http://127.0.0.1:1",
            "--prfaas", "http://127.0.0.1:2;bootstrap=3"]
    cfg = parse_config(base)
    assert RoutingCore(cfg, Cluster(cfg), RouterMetrics()).cost.streaming == Streaming()
    cfg = parse_config(base + ["--chunk-tokens", "512", "--attention-layers", "8", "--layerwise-layers-per-group", "2",
                               "--layerwise-min-tokens", "4096"])
    cost = RoutingCore(cfg, Cluster(cfg), RouterMetrics()).policy.cost  # what routes are priced with
    assert cost.streaming == Streaming(chunk_tokens=512, attention_layers=8, layers_per_group=2, min_tokens=4096)
    # 7,936 tokens: 15 chunks of 512, then 256 tokens whose KV leaves in 4 groups; only the last group follows
    assert cost.tail_bytes(7936) == pytest.approx(cost.state_bytes + cost.kv_bytes_per_token * 64)
    (tmp_path / "r.toml").write_text("layerwise_layers_per_group = 1\nattention_layers = 2\n")
    assert parse_config(["--config", str(tmp_path / "r.toml"), *base]).model_cost.streaming.groups(8192) == 2
    with pytest.raises(ValueError, match="--layerwise-min-tokens"):
        parse_config(base + ["--layerwise-min-tokens", "0"])


def _one_remote_request(**stream):
    """(prefill end -> KV ready, the request, the simulator) of the first remote request of a light,
    link-rich case-study run."""
    cfg = sim_config(CASE.sim, duration_s=60.0, threshold=0.0, **stream)
    sim = build(CASE, replace(cfg, arrival=replace(cfg.arrival, rate=0.05)))
    sim.run()
    req = next(r for r in sim.reqs if r.route == "prfaas")
    return req.kv_ready - req.prefill_end, req, sim


def test_the_simulator_exposes_the_same_tail():
    chunk_gap, req, sim = _one_remote_request(chunk_tokens=8192)
    layer_gap, _, layered = _one_remote_request(chunk_tokens=8192, attention_layers=8, layerwise_layers_per_group=1,
                                                layerwise_min_tokens=1)
    tokens = req.incremental
    assert tokens > 8192  # a multi-chunk prompt: most of its KV streamed during the prefill
    for gap, s in ((chunk_gap, sim), (layer_gap, layered)):  # an idle link: the gap is the tail alone
        assert gap == pytest.approx(min(req.kv_bytes, s.cost.tail_bytes(tokens)) / s.link.rate)
    pages = sim.cost.kv_bytes_per_token * (tokens - (math.ceil(tokens / 8192) - 1) * 8192)
    assert chunk_gap - layer_gap == pytest.approx(pages * (1 - 1 / 8) / sim.link.rate)  # the states stay
