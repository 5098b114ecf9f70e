"""A prefix crosses clusters through a shared Mooncake Store, on real CPU SGLang servers routed by the router's
own routing core.

    cluster A (PrfaaS)  server "a" --publish--> mooncake_master (127.0.0.1) <--load-- server "b"  cluster B (local)

Both servers run `prfaas_hybrid` with a storage tier on the same master, entries signed with one tier key,
and write what they compute through to it (`--prfaas-tier-publish`). They are colocated servers: the tiers
serve colocated servers only today, so the router's HTTP forwarder (which speaks SGLang's PD protocol) cannot
front them; the test drives the router's `RoutingCore` (its `Cluster`, policy and `/metrics`) and posts
each request to the prefill it picks. The router names both `--store-instances`, threshold 256, abundant
cache rule. A 640-token prompt goes to A (uncached, above t); its extension goes to B, credited the prefix
the store holds, and B loads it from Mooncake (cached_tokens, its log's storage hits) instead of recomputing;
greedy tokens equal a colocated server without prefix caching. With the master killed, the next such
extension is recomputed: the load fails within Mooncake's RPC timeout (~4.4 s measured in
tests/fast/test_cachepool_tier_mooncake.py), tokens still equal, both servers healthy.
"""
from __future__ import annotations

import re
import time
import urllib.request

import pytest

from prfaas_sgl.cachepool.hashing import block_hashes
from prfaas_sgl.cachepool.tiers.auth import write_key
from prfaas_sgl.cachepool.tiers.master import MooncakeMaster
from prfaas_sgl.router.cluster import Cluster
from prfaas_sgl.router.config import InstanceSpec, RouterConfig
from prfaas_sgl.router.metrics import RouterMetrics
from prfaas_sgl.router.routing import RoutingCore

from .conftest import HYBRID, farm_for, reference_spec, spec
from .pd import generate_body, post
from .prompts import prompt_ids

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(900)]
GRID = 64  # chunk = the linear states' checkpoint grid = the router's block
T = 256  # threshold: a 640-token uncached prompt goes to PrfaaS, a 100-token increment stays local
NEW = 8
BASE, EXT = 640, 100
RPC_BOUND_S = 10.0  # the fallback's bound: Mooncake's RPC timeout (~4.4 s measured) with room for a loaded CPU
MASTER = MooncakeMaster()


@pytest.fixture(scope="module", autouse=True)
def mooncake_master():
    MASTER.start()
    yield MASTER
    MASTER.stop()


def _specs(log_dir):
    key = str(log_dir / "tier.secret")
    write_key(key)
    tiers = ("--radix-cache-backend", "prfaas_hybrid", "--enable-cache-report", "--prfaas-tier-storage", "mooncake",
             "--prfaas-tier-mooncake-master", MASTER.addr, "--prfaas-tier-publish", "--prfaas-tier-key", key)
    server = dict(chunked_prefill_size=GRID, max_running_requests=1, extra_args=tiers,
                  env={"PRFAAS_CACHEPOOL_CHECK": "1"})
    return {"a": spec(log_dir, "xc_a", HYBRID, **server), "b": spec(log_dir, "xc_b", HYBRID, **server),
            "nocache": reference_spec(log_dir, HYBRID)}


farm = farm_for(_specs, shared=("nocache",))


@pytest.fixture(scope="module")
def core(farm, tmp_path_factory):
    tok = tmp_path_factory.mktemp("tok")
    (tok / "tokenizer.json").write_text("{}")  # the core routes token ids; it never tokenizes
    cfg = RouterConfig.from_flags(
        prfaas=(InstanceSpec(farm["a"].url, bootstrap_port=1, name="a"),),
        local_prefill=(InstanceSpec(farm["b"].url, bootstrap_port=1, name="b"),),
        decode=(InstanceSpec(farm["nocache"].url, name="d"),),  # no decode step here: never posted to
        tokenizer_path=str(tok), policy="threshold", threshold=T, cache_rule="abundant", store_instances="a,b",
        block_size=GRID, fetch_grid_tokens=GRID)
    cluster = Cluster(cfg)
    for name in cluster.instances:
        cluster.probed(name, True)
    return RoutingCore(cfg, cluster, RouterMetrics())


def _routed(core: RoutingCore, farm, ids: list[int]) -> tuple[str, dict, float]:
    """Route through the core, post to the prefill it picked; (its name, the answer, seconds)."""
    d = core.route(len(ids), block_hashes(ids, GRID), time.monotonic()).decision
    t0 = time.monotonic()
    out = post(farm[d.prefill].url + "/generate", generate_body(ids, NEW))
    assert "output_ids" in out, out
    return d.prefill, out, time.monotonic() - t0


def _metric(core: RoutingCore, name: str) -> float:
    text = core.metrics.render(core.cluster, T, 1.0).decode()
    return next((float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.split(" ")[0] == name), 0.0)


def _keys() -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{MASTER.metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return int(float(re.search(r"^master_key_count (\S+)", text, re.M).group(1)))


def _published(before: int, at_least: int, timeout_s: float = 60.0) -> None:
    """Wait until the master holds ``at_least`` more keys: the publisher puts on its own thread, after the
    server answered."""
    deadline = time.monotonic() + timeout_s
    while _keys() - before < at_least:
        assert time.monotonic() < deadline, f"the store got {_keys() - before} keys, not {at_least}, in {timeout_s} s"
        time.sleep(0.2)


def _log(farm, name: str) -> str:
    return farm[name].log_path.read_text(errors="replace")


def _computed_on_a_then_extended(core, farm, model_paths, seed: int) -> list[int]:
    """A BASE-token prompt routed to A, which computes and publishes it (a KV block and a state per chunk);
    returns its extension by EXT tokens."""
    keys = _keys()
    base = prompt_ids(model_paths["hybrid"], BASE, seed=seed)
    assert _routed(core, farm, base)[0] == "a"
    _published(keys, 2 * (BASE // GRID) - 1)  # the last chunk's state may be the request's end state
    return base + prompt_ids(model_paths["hybrid"], EXT, seed=seed + 1)


def test_an_extension_on_the_other_cluster_loads_its_prefix_from_the_store(core, farm, model_paths):
    ext = _computed_on_a_then_extended(core, farm, model_paths, seed=1200)
    name, out, _ = _routed(core, farm, ext)
    assert name == "b"  # the abundant rule: 740 - 640 stored = 100 <= t, credited to the local cluster
    assert _metric(core, 'prfaas_router_prefix_fetch_decisions_total{outcome="fetch",route="local"}') == 1
    assert _metric(core, "prfaas_router_prefix_fetch_tokens_total") == BASE
    # B never saw the prompt: its hit is all loaded, from Mooncake (it has no host tier)
    assert out["meta_info"]["cached_tokens"] >= BASE - GRID, out["meta_info"]
    m = re.search(r"hit extended from (\d+) to (\d+) tokens \(.*?storage_hits=(\d+)", _log(farm, "b"))
    assert m and int(m[1]) == 0 and int(m[2]) == out["meta_info"]["cached_tokens"] and int(m[3]) > 0, m
    assert out["output_ids"] == post(farm["nocache"].url + "/generate", generate_body(ext, NEW))["output_ids"]
    assert "AssertionError" not in _log(farm, "a") + _log(farm, "b")


def test_with_the_store_down_the_extension_is_recomputed_within_the_rpc_timeout(core, farm, model_paths):
    ext = _computed_on_a_then_extended(core, farm, model_paths, seed=1300)
    t0 = time.monotonic()
    ref = post(farm["nocache"].url + "/generate", generate_body(ext, NEW))
    recompute_s = time.monotonic() - t0  # what computing the whole extension costs on this machine now
    MASTER.stop()
    loads = _log(farm, "b").count("hit extended from")
    name, out, wall_s = _routed(core, farm, ext)
    assert name == "b" and out["meta_info"]["cached_tokens"] == 0, out["meta_info"]
    assert out["output_ids"] == ref["output_ids"]
    assert wall_s < recompute_s + RPC_BOUND_S, (wall_s, recompute_s)
    assert _log(farm, "b").count("hit extended from") == loads  # nothing loaded: recomputed
    assert "treated as a miss" in _log(farm, "b")  # the tier's log of the failed store call
    for s in ("a", "b"):
        with urllib.request.urlopen(farm[s].url + "/health", timeout=10) as r:
            assert r.status == 200
