"""`--radix-cache-backend prfaas_hybrid` on a real CPU SGLang server with the tiny hybrid GDN model.

Shared system prompt -> prefix hits on the checkpoint grid (cached_tokens == the last grid boundary
inside the shared prefix), greedy tokens equal to a server with prefix caching off and to HF; a burst
larger than the KV pool waits (or fails cleanly), the server stays healthy, and the backend's
check_integrity() (PRFAAS_CACHEPOOL_CHECK=1, after every release) never fails.
"""
from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from .conftest import HYBRID, farm_for, reference_spec, spec
from .pd import generate_body, post
from .prompt_trees import check_tree, prompt_tree
from .prompts import prompt_ids
from .reference import hf_greedy

pytestmark = pytest.mark.sglang
GRID = 64  # --chunked-prefill-size: state checkpoints are taken at chunk ends
NEW = 8
POOL_TOKENS = 2048  # small, so the burst test exhausts it
COMMON = dict(chunked_prefill_size=GRID, max_total_tokens=POOL_TOKENS, max_mamba_slots=24,
              max_running_requests=8)


def _specs(log_dir):
    return {
        "pool": spec(log_dir, "cachepool", HYBRID, **COMMON, env={"PRFAAS_CACHEPOOL_CHECK": "1"},
                     extra_args=("--radix-cache-backend", "prfaas_hybrid", "--enable-cache-report",
                                 "--enable-metrics")),  # /v1/loads cache_hit_rate needs metrics on
        # prefix caching off: the session's shared reference (conftest.reference_spec), no server start here
        "nocache": reference_spec(log_dir, HYBRID),
    }


farm = farm_for(_specs, shared=("nocache",))


def _gen(url: str, ids: list[int], new: int = NEW) -> dict:
    return post(url + "/generate", generate_body(ids, new))


def _integrity_lines(farm) -> tuple[int, int]:
    text = farm["pool"].log_path.read_text(errors="replace")
    # SGLang's own start-up logs a harmless Traceback (gc-freeze warmup ping), so look for ours
    return text.count("prfaas_hybrid integrity ok"), text.count("AssertionError")


def test_shared_system_prompt_hits_and_matches_no_cache(farm, model_paths):
    system = prompt_ids(model_paths["hybrid"], 300, seed=7)
    questions = [prompt_ids(model_paths["hybrid"], 20, seed=100 + i) for i in range(4)]  # 320 tokens: one 64-token chunk after the hit
    outs = [_gen(farm["pool"].url, system + q) for q in questions]
    cached = [o["meta_info"]["cached_tokens"] for o in outs]
    # first request computes everything; later ones resume at the last grid boundary <= 300
    assert cached == [0, 256, 256, 256], cached
    for q, o in zip(questions, outs):
        assert o["output_ids"] == _gen(farm["nocache"].url, system + q)["output_ids"]
    assert outs[1]["output_ids"] == hf_greedy(model_paths["hybrid"], system + questions[1], NEW)
    loads = json.loads(urllib.request.urlopen(farm["pool"].url + "/v1/loads", timeout=30).read())
    assert _find(loads, "cache_hit_rate") == 0.8, loads  # the last prefill: 256 of 320 tokens hit
    ok, tracebacks = _integrity_lines(farm)
    assert ok >= 4 and tracebacks == 0


def test_exhausting_the_pool_waits_and_stays_consistent(farm, model_paths):
    # 6 distinct 600-token prompts: ~3.7K tokens of KV against a 2,048-token pool
    prompts = [prompt_ids(model_paths["hybrid"], 600, seed=500 + i) for i in range(6)]
    with ThreadPoolExecutor(len(prompts)) as ex:
        outs = list(ex.map(lambda p: post(farm["pool"].url + "/generate", generate_body(p, 16), 900), prompts))
    for o in outs:  # each finished, or was refused with an HTTP error; never a crash
        assert len(o.get("output_ids", [])) == 16 or o.get("http_status"), o
    assert sum(1 for o in outs if "output_ids" in o) >= 1
    # (burst outputs are not compared: a different decode batch may flip a near-tie in float32)
    assert urllib.request.urlopen(farm["pool"].url + "/health", timeout=30).status == 200
    # LRU may have evicted any burst prompt by now: run one twice; the second resumes at 576 = 9 x 64
    _gen(farm["pool"].url, prompts[0], 16)
    again = _gen(farm["pool"].url, prompts[0], 16)
    assert again["meta_info"]["cached_tokens"] == 576
    assert again["output_ids"] == _gen(farm["nocache"].url, prompts[0], 16)["output_ids"]
    ok, tracebacks = _integrity_lines(farm)
    assert ok >= len(prompts) + 2 and tracebacks == 0  # one check per release



def test_random_prompt_trees_hit_the_pool_and_match_no_cache(farm, model_paths):
    """GDN, colocated: a random tree of shared prefixes (prompt_trees.py; <= 1,000 tokens each against the
    2,048-token pool, so entries are evicted between hits) gives the no-cache server's greedy tokens."""
    pool, nocache = farm["pool"].url, farm["nocache"].url
    hits, _ = check_tree(prompt_tree(model_paths["hybrid"], seed=21, n=10, max_len=1000),
                         lambda body: post(pool + "/generate", body), lambda body: post(nocache + "/generate", body),
                         lambda out: out["meta_info"]["cached_tokens"])
    assert hits >= 3, f"only {hits} of 10 prompts hit the pool; the tree no longer tests hits"


def _find(obj, key):
    """First value under `key` anywhere in a JSON document."""
    if isinstance(obj, dict):
        if key in obj:
            return obj[key]
        obj = list(obj.values())
    if isinstance(obj, list):
        for v in obj:
            found = _find(v, key)
            if found is not None:
                return found
    return None
