"""prfaas_hybrid's tiers on a PD decode server of a sliding-window hybrid (tiny-mimo-v2-swa: window 128, page 16;
DecodeWindowKvCache, KV only), real CPU SGLang servers, prfaas_zmq: a prompt the decode's 1,024-token device
pool evicted comes back from its host tier into full-attention pages only (SGLang's decode allocates the SWA
tail fresh and matches before it), the prefill stops sending exactly the KV bytes the decode loaded, and the
greedy tokens equal a colocated server with prefix caching off (the same flags as test_cachepool_tiers_swa's)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from prfaas_sgl.tools.launch import free_port
from prfaas_sgl.tools.models.tiny import ensure

from .conftest import farm_for, spec
from .pd import generate_body, pd_generate, post
from .prompts import prompt_ids
from .scrape import acked_bytes, settled_bytes, stats_url_of
from .test_cachepool_tiers_pd_decode import DECODE, ZMQ

pytestmark = pytest.mark.sglang
MIMO = "tiny-mimo-v2-swa"
NEW = 8
CHECK = {"PRFAAS_CACHEPOOL_CHECK": "1"}


def _specs(log_dir):
    stats = free_port()
    page = dict(page_size=16, chunked_prefill_size=64)
    return {
        "prefill": spec(log_dir, "tiers-dec-swa-prefill", MIMO, mode="prefill", transfer_backend="prfaas_zmq",
                        bootstrap_port=free_port(), max_total_tokens=8192, **page,
                        extra_args=ZMQ + ("--radix-cache-backend", "prfaas_hybrid",
                                          "--prfaas-zmq-stats-port", str(stats))),
        "decode": spec(log_dir, "tiers-dec-swa-host", MIMO, mode="decode", transfer_backend="prfaas_zmq",
                       max_running_requests=1, max_total_tokens=1024, env=CHECK, **page,
                       extra_args=ZMQ + DECODE + ("--prfaas-tier-host-bytes", str(64 << 20))),
        "nocache": spec(log_dir, "tiers-swa-nocache", MIMO, max_total_tokens=8192, max_running_requests=4, **page,
                        extra_args=("--disable-radix-cache",)),
    }


farm = farm_for(_specs)


def _pd(farm, ids: list[int]) -> int:
    p = farm["prefill"]
    url = stats_url_of(p)
    before = acked_bytes(url)
    out = pd_generate(p.url, farm["decode"].url, p.spec.bootstrap_port, generate_body(ids, NEW))
    assert "output_ids" in out and not out.get("error"), out
    assert out["output_ids"] == post(farm["nocache"].url + "/generate", generate_body(ids, NEW))["output_ids"]
    return settled_bytes(url, before) - before


def test_an_swa_prefix_the_decode_evicted_comes_back_from_its_host_tier_into_full_pages(farm):
    path = str(ensure(MIMO))
    prompts = [prompt_ids(path, 600, seed=3100 + i) for i in range(3)]  # 1,800 tokens through 1,024
    cold = [_pd(farm, ids) for ids in prompts]
    sent = _pd(farm, prompts[0] + prompt_ids(path, 20, seed=3150))
    log = Path(farm["decode"].log_path).read_text(errors="replace")
    m = re.search(r"hit extended from (\d+) to (\d+) tokens \(.*host_hits=(\d+).*loaded_bytes=(\d+)", log)
    # SGLang matches before the request's SWA tail: (620 - 1 - 128) // 16 * 16 = 480 tokens at most
    assert m and int(m.group(2)) >= 400 and int(m.group(3)) == (int(m.group(2)) - int(m.group(1))) // 16, m
    # the prefill no longer sends exactly the full-attention KV the decode loaded from its tier; the window
    # pages of the tail cross either way, and 620 tokens take one 16-token page of full KV more than 600
    loaded, page = int(m.group(4)), int(m.group(4)) // int(m.group(3))
    assert sent == cold[0] + page - loaded, (sent, cold, loaded, page)
    assert "AssertionError" not in log and log.count("prfaas_hybrid integrity ok") >= 4
