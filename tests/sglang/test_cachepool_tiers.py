"""prfaas_hybrid with lower tiers on real CPU SGLang servers (tiny GDN hybrid, colocated): a device pool of
1,024 KV tokens, prompts whose working set is several times that, and hits that the device pool no longer
holds served from the tiers and loaded back, greedy tokens equal to a server with prefix caching off,
integrity checked after every release. Two tier servers: a host tier only, and a host tier of a few
entries over a Mooncake Store (a real mooncake_master this module starts on 127.0.0.1)."""
from __future__ import annotations

import re
import time
import urllib.request

import pytest

from prfaas_sgl.cachepool.tiers.master import MooncakeMaster

from .conftest import HYBRID, farm_for, reference_spec, spec
from .pd import generate_body, post
from .prompt_trees import check_tree, prompt_tree
from .prompts import prompt_ids

pytestmark = pytest.mark.sglang
GRID = 64  # --chunked-prefill-size: state checkpoints at chunk ends
POOL_TOKENS = 1024
COMMON = dict(chunked_prefill_size=GRID, max_total_tokens=POOL_TOKENS, max_mamba_slots=24, max_running_requests=4)
NEW = 8
MASTER = MooncakeMaster()  # started before the farm (module fixture below), stopped after it
TIER = ("--radix-cache-backend", "prfaas_hybrid", "--enable-cache-report")


@pytest.fixture(scope="module", autouse=True)
def mooncake_master():
    MASTER.start()
    yield MASTER
    MASTER.stop()


def _specs(log_dir):
    return {
        "tiers": spec(log_dir, "cachepool-tiers", HYBRID, **COMMON, env={"PRFAAS_CACHEPOOL_CHECK": "1"},
                      extra_args=(*TIER, "--prfaas-tier-host-bytes", str(256 << 20))),
        # ~8 entries of ~33 KB fit the host tier: the rest spills into Mooncake
        "mooncake": spec(log_dir, "cachepool-tiers-mooncake", HYBRID, **COMMON, env={"PRFAAS_CACHEPOOL_CHECK": "1"},
                         extra_args=(*TIER, "--prfaas-tier-host-bytes", str(256 << 10), "--prfaas-tier-storage",
                                     "mooncake", "--prfaas-tier-mooncake-master", MASTER.addr)),
        # prefix caching off: the session's shared reference (conftest.reference_spec), no server start here
        "nocache": reference_spec(log_dir, HYBRID),
    }


farm = farm_for(_specs, shared=("nocache",))


def _log(farm, name: str = "tiers") -> str:
    return farm[name].log_path.read_text(errors="replace")


def _gen(url: str, ids: list[int]) -> dict:
    return post(url + "/generate", generate_body(ids, NEW))


@pytest.mark.parametrize("name, tier", [("tiers", "host_hits"), ("mooncake", "storage_hits")])
def test_a_prefix_evicted_from_the_device_is_served_from_a_lower_tier(farm, model_paths, name, tier):
    prompts = [prompt_ids(model_paths["hybrid"], 600, seed=900 + i) for i in range(4)]  # 2,400 tokens of KV
    for p in prompts:
        _gen(farm[name].url, p)
    # prompts 2-4 (1,800 tokens) evicted prompt 1 from the 1,024-token device pool: its 9 chunks come back
    # from the host tier (Mooncake for the second server, whose host tier they overflowed)
    again = prompts[0] + prompt_ids(model_paths["hybrid"], 20, seed=950)
    out = _gen(farm[name].url, again)
    assert out["meta_info"]["cached_tokens"] == 576, out["meta_info"]
    assert out["output_ids"] == _gen(farm["nocache"].url, again)["output_ids"]
    log = _log(farm, name)
    assert re.search(rf"hit extended from \d+ to 576 tokens \(.*{tier}=", log), f"no load with {tier} logged"
    assert log.count("prfaas_hybrid integrity ok") >= 5 and "AssertionError" not in log


def test_random_prompt_trees_over_the_tiers_match_no_cache(farm, model_paths):
    """A random tree of shared prefixes (<= 1,000 tokens each against the 1,024-token device pool, so most
    hits need the host tier) gives the no-cache server's greedy tokens and log-probs."""
    tiers, nocache = farm["tiers"].url, farm["nocache"].url
    before = _log(farm).count("hit extended from")
    hits, _ = check_tree(prompt_tree(model_paths["hybrid"], seed=31, n=10, max_len=1000),
                         lambda body: post(tiers + "/generate", body), lambda body: post(nocache + "/generate", body),
                         lambda out: out["meta_info"]["cached_tokens"])
    assert hits >= 3, f"only {hits} of 10 prompts hit; the tree no longer tests hits"
    assert _log(farm).count("hit extended from") > before
    assert "AssertionError" not in _log(farm)


def test_a_storage_hit_is_prefetched_while_the_request_waits(farm, model_paths):
    """The storage part of a hit is read and verified on the prefetch worker as the request enters the
    queue (tier_prefetch); the scheduler thread's match then loads staged entries and the host tier only.
    Greedy tokens equal the no-cache server's."""
    url, hybrid = farm["mooncake"].url, model_paths["hybrid"]
    prompts = [prompt_ids(hybrid, 600, seed=1900 + i) for i in range(4)]
    for p in prompts:
        _gen(url, p)
    again = prompts[0] + prompt_ids(hybrid, 20, seed=1950)
    out = post(url + "/generate", {**generate_body(again, NEW), "rid": "prefetch-probe"})
    assert out["meta_info"]["cached_tokens"] == 576, out["meta_info"]
    assert out["output_ids"] == _gen(farm["nocache"].url, again)["output_ids"]
    staged = re.search(r"tier prefetch for prefetch-probe: (\d+) entries staged", _log(farm, "mooncake"))
    assert staged and int(staged.group(1)) > 0, "the storage entries were not prefetched"


def test_with_the_mooncake_master_gone_the_server_recomputes(farm, model_paths):
    """Store down mid-run: a prompt whose chunks were demoted to Mooncake is recomputed (or served from
    what the host tier still has), with the no-cache server's tokens, without a hang."""
    MASTER.stop()
    ids = prompt_ids(model_paths["hybrid"], 600, seed=901) + prompt_ids(model_paths["hybrid"], 20, seed=951)
    t0 = time.monotonic()
    out = _gen(farm["mooncake"].url, ids)
    assert time.monotonic() - t0 < 120, "a request waited on the dead store"
    assert out["output_ids"] == _gen(farm["nocache"].url, ids)["output_ids"]
    assert urllib.request.urlopen(farm["mooncake"].url + "/health", timeout=30).status == 200
    log = _log(farm, "mooncake")
    assert "storage tier" in log and "treated as a miss" in log and "AssertionError" not in log
