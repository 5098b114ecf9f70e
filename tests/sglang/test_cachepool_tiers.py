"""prfaas_hybrid with a host tier on a real CPU SGLang server (tiny GDN hybrid, colocated): a device pool
of 1,024 KV tokens, prompts whose working set is several times that, and hits that the device pool no
longer holds served from the host tier: loaded back, the cached-token count of the device-only server
exceeded, greedy tokens equal to a server with prefix caching off, integrity checked after every release."""
from __future__ import annotations

import re

import pytest

from .conftest import HYBRID, farm_for, spec
from .pd import generate_body, post
from .prompt_trees import check_tree, prompt_tree
from .prompts import prompt_ids

pytestmark = pytest.mark.sglang
GRID = 64  # --chunked-prefill-size: state checkpoints at chunk ends
POOL_TOKENS = 1024
COMMON = dict(chunked_prefill_size=GRID, max_total_tokens=POOL_TOKENS, max_mamba_slots=24, max_running_requests=4)
NEW = 8


def _specs(log_dir):
    return {
        "tiers": spec(log_dir, "cachepool-tiers", HYBRID, **COMMON, env={"PRFAAS_CACHEPOOL_CHECK": "1"},
                      extra_args=("--radix-cache-backend", "prfaas_hybrid", "--enable-cache-report",
                                  "--prfaas-tier-host-bytes", str(256 << 20))),
        "nocache": spec(log_dir, "tiers-nocache", HYBRID, **COMMON, extra_args=("--disable-radix-cache",)),
    }


farm = farm_for(_specs)


def _log(farm) -> str:
    return farm["tiers"].log_path.read_text(errors="replace")


def _gen(url: str, ids: list[int]) -> dict:
    return post(url + "/generate", generate_body(ids, NEW))


def test_a_prefix_evicted_from_the_device_is_served_from_the_host_tier(farm, model_paths):
    prompts = [prompt_ids(model_paths["hybrid"], 600, seed=900 + i) for i in range(4)]  # 2,400 tokens of KV
    for p in prompts:
        _gen(farm["tiers"].url, p)
    # prompts 2-4 (1,800 tokens) evicted prompt 1 from the 1,024-token device pool: its 9 chunks come back
    # from the host tier
    again = prompts[0] + prompt_ids(model_paths["hybrid"], 20, seed=950)
    out = _gen(farm["tiers"].url, again)
    assert out["meta_info"]["cached_tokens"] == 576, out["meta_info"]
    assert out["output_ids"] == _gen(farm["nocache"].url, again)["output_ids"]
    log = _log(farm)
    assert re.search(r"hit extended from \d+ to 576 tokens", log), "no load from the host tier logged"
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
