"""prfaas_hybrid's lower tiers beyond one colocated server, on real CPU SGLang servers (tiny GDN hybrid):

- two servers share one real mooncake_master (this module starts it on 127.0.0.1) with write-through
  (--prfaas-tier-publish) and one tier key: server B, which never saw a prompt, serves an extension of
  it from what server A computed and published; the tier counters are in both servers' /metrics;
- a PD prefill with a host tier (prfaas_zmq to a decode): a prefix its 1,024-token device pool evicted is
  loaded back from the tier and the KV of the request's slots crosses to the decode.
Greedy tokens equal a colocated server with prefix caching off; pool integrity is checked after every
release (PRFAAS_CACHEPOOL_CHECK=1)."""
from __future__ import annotations

import re

import pytest

from prfaas_sgl.cachepool.tiers.auth import KEY_FILE, write_key
from prfaas_sgl.cachepool.tiers.master import MooncakeMaster
from prfaas_sgl.tools.launch import free_port

from .conftest import HYBRID, farm_for, spec
from .pd import generate_body, pd_generate, post
from .prompts import prompt_ids
from .scrape import metric, wait_metric

pytestmark = pytest.mark.sglang
GRID = 64  # --chunked-prefill-size: state checkpoints (and index blocks) at chunk ends
NEW = 8
CHECK = {"PRFAAS_CACHEPOOL_CHECK": "1"}
POOL = dict(chunked_prefill_size=GRID, max_total_tokens=1024, max_mamba_slots=24)
MASTER = MooncakeMaster()
ZMQ = ("--prfaas-zmq-timeout-s", "120")


@pytest.fixture(scope="module", autouse=True)
def mooncake_master():
    MASTER.start()
    yield MASTER
    MASTER.stop()


def _specs(log_dir):
    key = str(log_dir / KEY_FILE)
    write_key(key)
    shared = ("--radix-cache-backend", "prfaas_hybrid", "--enable-cache-report", "--enable-metrics",
              "--prfaas-tier-storage", "mooncake", "--prfaas-tier-mooncake-master", MASTER.addr,
              "--prfaas-tier-publish", "--prfaas-tier-key", key)
    return {
        "a": spec(log_dir, "tiers-shared-a", HYBRID, **POOL, max_running_requests=4, env=CHECK, extra_args=shared),
        "b": spec(log_dir, "tiers-shared-b", HYBRID, **POOL, max_running_requests=4, env=CHECK, extra_args=shared),
        "prefill": spec(log_dir, "tiers-pd-prefill", HYBRID, mode="prefill", transfer_backend="prfaas_zmq",
                        bootstrap_port=free_port(), env=CHECK, **POOL,
                        extra_args=ZMQ + ("--radix-cache-backend", "prfaas_hybrid", "--enable-cache-report",
                                          "--prfaas-tier-host-bytes", str(256 << 20))),
        # batch-1 decode: batched CPU matmuls flip near-tie tokens of the random-weight model
        "decode": spec(log_dir, "tiers-pd-decode", HYBRID, mode="decode", transfer_backend="prfaas_zmq",
                       max_running_requests=1, extra_args=ZMQ),
        # the session's hybrid reference (same flags as test_cachepool_pd.py's "colocated": one server)
        "nocache": spec(log_dir, "pool_pd_colocated", HYBRID, chunked_prefill_size=GRID, max_running_requests=1,
                        extra_args=("--disable-radix-cache",)),
    }


farm = farm_for(_specs, shared=("nocache",))


def _gen(url: str, ids: list[int]) -> dict:
    return post(url + "/generate", generate_body(ids, NEW))


def _log(farm, name: str) -> str:
    return farm[name].log_path.read_text(errors="replace")


def test_a_server_that_never_saw_a_prompt_loads_it_from_what_another_published(farm, model_paths):
    path = model_paths["hybrid"]
    prompt = prompt_ids(path, 600, seed=1200)
    _gen(farm["a"].url, prompt)
    # 9 chunks of 64 tokens: 9 KV blocks + 9 states written through while A still holds them
    assert wait_metric(farm["a"].url, "prfaas_tier_published_total", 18) >= 18
    ext = prompt + prompt_ids(path, 40, seed=1250)
    out = _gen(farm["b"].url, ext)
    assert out["meta_info"]["cached_tokens"] == 576, out["meta_info"]
    assert out["output_ids"] == _gen(farm["nocache"].url, ext)["output_ids"]
    assert re.search(r"hit extended from 0 to 576 tokens \(.*storage_hits=18", _log(farm, "b"))
    assert wait_metric(farm["b"].url, "prfaas_tier_hits_total", 18, tier="storage") >= 18
    assert metric(farm["b"].url, "prfaas_tier_refused_total") == 0
    assert metric(farm["b"].url, "prfaas_tier_loaded_bytes_total") > 0
    for name in ("a", "b"):
        log = _log(farm, name)
        assert "signed (HMAC-SHA256)" in log and "AssertionError" not in log
        assert log.count("prfaas_hybrid integrity ok") >= 1


def test_a_pd_prefill_serves_an_evicted_prefix_from_its_host_tier(farm, model_paths):
    path = model_paths["hybrid"]
    p = farm["prefill"]
    prompts = [prompt_ids(path, 600, seed=1300 + i) for i in range(4)]  # 2,400 tokens through a 1,024 pool
    for ids in prompts:
        out = pd_generate(p.url, farm["decode"].url, p.spec.bootstrap_port, generate_body(ids, NEW))
        assert "output_ids" in out and not out.get("error"), out
    again = prompts[0] + prompt_ids(path, 20, seed=1350)
    out = pd_generate(p.url, farm["decode"].url, p.spec.bootstrap_port, generate_body(again, NEW))
    assert out["prefill"]["meta_info"]["cached_tokens"] == 576, out["prefill"]["meta_info"]
    assert out["output_ids"] == _gen(farm["nocache"].url, again)["output_ids"]
    log = _log(farm, "prefill")
    assert re.search(r"hit extended from 0 to 576 tokens \(.*host_hits=18", log)
    assert log.count("prfaas_hybrid integrity ok") >= 5 and "AssertionError" not in log
