"""Layer-group streaming over prfaas_zmq on real SGLang servers (CPU), one PD pair per family (dense Llama,
GDN, KDA + MLA, SWA + GQA): a long prompt's K/V leaves group by group while later layers compute, and
the decode's greedy tokens equal a colocated server's; a prompt under the minimum keeps the chunk path.

Layer-wise really happened: the prefill's transport stats (`layerwise`) count the gates its forward
hooks opened inside a forward, and the group sends staged while that forward still ran."""
from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from prfaas_sgl.tools.launch import free_port
from prfaas_sgl.tools.models.tiny import ensure

from .conftest import HYBRID, LLAMA, Farm, spec
from .pd import generate_body, pd_generate, post
from .prompts import prompt_ids

pytestmark = pytest.mark.sglang
NEW = 8
CHUNK = 192  # a multiple of every page size (SGLang requires it)
LONG, SHORT = 1100, 120  # LONG streams (>= MIN_TOKENS) in 6 chunks, the last one ending mid-page; SHORT does not
MIN_TOKENS = 600
KIMI, MIMO = "tiny-kimi-linear", "tiny-mimo-v2-swa"
# SGLang's SWA decode preallocates only the window's pages at page size > 1 (see test_families.py)
PAGE = {KIMI: 1, MIMO: 16, LLAMA: 1, HYBRID: 1}
FULL_ATTENTION_LAYERS = {LLAMA: 2, HYBRID: 2, KIMI: 2, MIMO: 2}  # one group per layer below


def _specs(log_dir: Path, model: str, stats: int) -> dict:
    zmq = ("--prfaas-zmq-timeout-s", "120", "--prfaas-zmq-chunk-bytes", "65536")
    layerwise = ("--prfaas-layerwise-layers-per-group", "1", "--prfaas-layerwise-min-tokens", str(MIN_TOKENS))
    page = dict(page_size=PAGE[model])
    return {
        "colocated": spec(log_dir, f"lw_{model}_colocated", model, chunked_prefill_size=CHUNK, **page,
                          extra_args=("--disable-radix-cache",)),
        "prefill": spec(log_dir, f"lw_{model}_prefill", model, mode="prefill", transfer_backend="prfaas_zmq",
                        bootstrap_port=free_port(), chunked_prefill_size=CHUNK, **page,
                        extra_args=zmq + layerwise + ("--prfaas-zmq-stats-port", str(stats))),
        "decode": spec(log_dir, f"lw_{model}_decode", model, mode="decode", transfer_backend="prfaas_zmq",
                       max_running_requests=1, extra_args=zmq, **page),
    }


@pytest.fixture(scope="module", params=[LLAMA, HYBRID, KIMI, MIMO])
def family(request, log_dir):
    stats = free_port()
    farm = Farm(_specs(log_dir, request.param, stats)).start()
    try:
        yield request.param, str(ensure(request.param)), farm, f"http://127.0.0.1:{stats}/stats"
    finally:
        farm.stop()


def counters(stats_url: str) -> dict[str, int]:
    with urllib.request.urlopen(stats_url, timeout=10) as r:
        return json.loads(r.read()).get("layerwise", {})


def test_layerwise_pd_matches_colocated_and_streams_only_long_prompts(family):
    name, path, farm, stats_url = family
    p = farm["prefill"]
    before = counters(stats_url)
    for length in (SHORT, LONG):
        ids = prompt_ids(path, length, seed=length)
        body = generate_body(ids, NEW)
        colocated = post(farm["colocated"].url + "/generate", body)["output_ids"]
        out = pd_generate(p.url, farm["decode"].url, p.spec.bootstrap_port, body)
        assert out.get("output_ids") == colocated, (name, length, out)
        after = counters(stats_url)
        grew = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        if length == SHORT:
            assert not any(grew.values()), (name, "a short prompt streamed", grew)
            continue
        chunks = -(-LONG // CHUNK)
        assert grew.get("gates_opened_in_forward", 0) == chunks * FULL_ATTENTION_LAYERS[name], (name, grew)
        assert grew.get("gates_opened_after_forward", 0) == 0, (name, grew)
        assert grew.get("pages_streamed", 0) == -(-LONG // PAGE[name]), (name, grew)
        print(f"{name}: {grew}")
    log = Path(p.spec.log_path).read_text(errors="replace")
    assert "layer-wise: " in log and "streaming off" not in log, name
