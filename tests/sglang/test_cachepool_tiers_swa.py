"""prfaas_hybrid with a host tier on real CPU SGLang servers of a sliding-window hybrid (tiny-mimo-v2-swa: SWA
window 128 and full-attention layers, page size 16), the pattern of test_cachepool_tiers.py: a device pool of
1,024 tokens, four 600-token prompts, then the first again. What the device pool evicted (full-attention KV
blocks and window pages) comes back from the host tier; the hit equals what a server whose device pool never
evicted gives, and the greedy tokens equal a server with prefix caching off.

Run alone (starts three tiny servers on CPU; the models are built by `make models`):
    .venv/bin/python -m pytest -p no:cacheprovider -q -rs --timeout=1800 tests/sglang/test_cachepool_tiers_swa.py
"""
from __future__ import annotations

import re

import pytest

from prfaas_sgl.tools.models.tiny import ensure

from .conftest import farm_for, spec
from .pd import generate_body, post
from .prompts import prompt_ids

pytestmark = pytest.mark.sglang
MIMO = "tiny-mimo-v2-swa"
NEW = 8
# page 16: what test_families.py runs MiMo at (a PD decode needs it; colocated accepts any page dividing 16)
COMMON = dict(chunked_prefill_size=64, page_size=16, max_running_requests=4)
TIER = ("--radix-cache-backend", "prfaas_hybrid", "--enable-cache-report")
CHECK = {"PRFAAS_CACHEPOOL_CHECK": "1"}


def _specs(log_dir):
    return {
        "tiers": spec(log_dir, "cachepool-tiers-swa", MIMO, max_total_tokens=1024, **COMMON, env=CHECK,
                      extra_args=(*TIER, "--prfaas-tier-host-bytes", str(256 << 20))),
        # the same cache with a device pool the four prompts fit in: the hit the tiers must give back
        "device": spec(log_dir, "cachepool-swa-device", MIMO, max_total_tokens=8192, **COMMON, env=CHECK,
                       extra_args=TIER),
        "nocache": spec(log_dir, "tiers-swa-nocache", MIMO, max_total_tokens=8192, **COMMON,
                        extra_args=("--disable-radix-cache",)),
    }


farm = farm_for(_specs)


def _gen(url: str, ids: list[int]) -> dict:
    return post(url + "/generate", generate_body(ids, NEW))


def test_an_swa_prefix_evicted_from_the_device_is_served_from_the_host_tier(farm):
    path = str(ensure(MIMO))
    prompts = [prompt_ids(path, 600, seed=900 + i) for i in range(4)]  # 2,400 tokens against a 1,024-token pool
    again = prompts[0] + prompt_ids(path, 20, seed=950)
    cached = {}
    for name in ("tiers", "device"):
        for p in prompts:
            _gen(farm[name].url, p)
        out = _gen(farm[name].url, again)
        cached[name] = out["meta_info"]["cached_tokens"]
        assert out["output_ids"] == _gen(farm["nocache"].url, again)["output_ids"], name
    assert cached["tiers"] == cached["device"] and cached["tiers"] >= 512 and cached["tiers"] % 16 == 0, cached
    log = farm["tiers"].log_path.read_text(errors="replace")
    assert re.search(rf"hit extended from \d+ to {cached['tiers']} tokens \(.*host_hits=", log), "no tier load logged"
    assert "entries: KV" in log and log.count("prfaas_hybrid integrity ok") >= 5 and "AssertionError" not in log
