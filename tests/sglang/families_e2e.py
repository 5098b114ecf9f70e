"""Not collected by `make test` (its name has no test_ prefix) until both families pass on CPU: run it with
`.venv/bin/python -m pytest -q tests/sglang/families_e2e.py`.

The paper's other hybrid families on real SGLang (CPU): Kimi Linear (KDA : MLA = 3 : 1) and a
MiMo-V2-Flash-style SWA : GQA = 3 : 1 model (window 128). Per family: colocated greedy == HF transformers
greedy; PD over prfaas_zmq (chunked prefill 512 < the 1,600-token prompt) == colocated; the bytes the
prefill's transport acknowledged == router/kv_accounting.py within 1% — MLA moves one latent buffer per
layer, SWA layers only the window's pages. Three servers per family, one family at a time; then Kimi Linear
and the MiMo-style SWA model under `--radix-cache-backend prfaas_hybrid`, each against a no-cache server
(two more servers each)."""
from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path

import pytest

from prfaas_sgl.launch import free_port
from prfaas_sgl.models.tiny import ensure
from router.kv_accounting import account_path

from .conftest import Farm, spec
from .pd import generate_body, pd_generate, post
from .prompts import prompt_ids
from .reference import hf_greedy

pytestmark = pytest.mark.sglang
NEW = 8
CHUNK = 512
LENGTHS = (100, 1600)  # inside the SWA window, and >= 1,500 tokens: several chunks, 12x the window
KIMI, MIMO = "tiny-kimi-linear", "tiny-mimo-v2-swa"
# K/V buffers the prefill registers (PrfaasKVManager's layout log line) and the first one's bytes per page:
# Kimi: 2 MLA layers, one latent of 32 + 8 fp32 each; MiMo: 2 GQA layers x (K, V), K = 1 head x 16 fp32.
KV_BUFFERS = {KIMI: (2, (32 + 8) * 4), MIMO: (4, 16 * 4)}


def _specs(log_dir: Path, model: str) -> dict:
    stats = free_port()
    zmq = ("--prfaas-zmq-timeout-s", "120", "--prfaas-zmq-chunk-bytes", "65536")
    return {
        "colocated": spec(log_dir, f"{model}_colocated", model, chunked_prefill_size=CHUNK),
        "prefill": spec(log_dir, f"{model}_prefill", model, mode="prefill", transfer_backend="prfaas_zmq",
                        bootstrap_port=free_port(), chunked_prefill_size=CHUNK,
                        extra_args=zmq + ("--prfaas-zmq-stats-port", str(stats))),
        "decode": spec(log_dir, f"{model}_decode", model, mode="decode", transfer_backend="prfaas_zmq",
                       max_running_requests=1, extra_args=zmq),
        "stats_url": f"http://127.0.0.1:{stats}/stats",
    }


@pytest.fixture(scope="module", params=[KIMI, MIMO])
def family(request, log_dir):
    specs = _specs(log_dir, request.param)
    stats_url = specs.pop("stats_url")
    farm = Farm(specs).start()
    try:
        yield request.param, str(ensure(request.param)), farm, stats_url
    finally:
        farm.stop()


def acked_bytes(stats_url: str) -> int:
    with urllib.request.urlopen(stats_url, timeout=10) as r:
        return sum(link["bytes_total"] for link in json.loads(r.read())["links"].values())


def settled_bytes(stats_url: str, before: int, timeout_s: float = 10.0) -> int:
    """Acknowledged bytes once they stop growing (the last ack can land just after decode answers)."""
    last, deadline = acked_bytes(stats_url), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = acked_bytes(stats_url)
        if now == last and now > before:
            return now
        last = now
    return last


@pytest.mark.parametrize("length", LENGTHS)
def test_colocated_matches_hf(family, length):
    name, path, farm, _ = family
    ids = prompt_ids(path, length, seed=length)
    out = post(farm["colocated"].url + "/generate", generate_body(ids, NEW))
    assert out["meta_info"]["prompt_tokens"] == length, out
    assert out["output_ids"] == hf_greedy(path, ids, NEW), name


@pytest.mark.parametrize("length", LENGTHS)
def test_pd_matches_colocated_and_wire_bytes_match_accounting(family, length):
    name, path, farm, stats_url = family
    ids = prompt_ids(path, length, seed=length)
    body = generate_body(ids, NEW)
    colocated = post(farm["colocated"].url + "/generate", body)["output_ids"]
    before = acked_bytes(stats_url)
    out = pd_generate(farm["prefill"].url, farm["decode"].url, farm["prefill"].spec.bootstrap_port, body)
    assert out.get("output_ids") == colocated, out
    moved = settled_bytes(stats_url, before) - before
    acct = account_path(path)
    expected = acct.request_bytes(length)
    assert abs(moved - expected) <= 0.01 * expected, (name, length, moved, expected, acct)
    if acct.swa_window and length > acct.swa_window:  # SWA: the window's pages, not every page
        every_page = length * (acct.kv_bytes_per_token + acct.swa_bytes_per_token) + acct.state_bytes
        assert moved < every_page * 0.5, (moved, every_page)
        print(f"{name} {length} tokens: {moved} B moved, {every_page} B with every SWA page "
              f"({every_page / moved:.2f}x)")


def test_kv_buffers_per_layer(family):
    """MLA registers one latent buffer per MLA layer; GQA a K and a V buffer per full-attention layer
    (SWA layers' pages travel as state)."""
    name, _, farm, _ = family
    log = Path(farm["prefill"].spec.log_path).read_text(errors="replace")
    found = re.search(r"(\d+) kv buffers \((\d+) B/page\)", log)
    assert found, "prefill log has no prfaas_zmq layout line"
    assert (int(found[1]), int(found[2])) == KV_BUFFERS[name]


# --radix-cache-backend prfaas_hybrid with Kimi Linear: KDA states are checkpointed at chunk ends and restored
# on a hit exactly as GDN's (tests/fast/test_cachepool_backend_states.py over SGLang's MambaPool with KDA's
# shapes); here on a real server, against one with prefix caching off. MiMo (SWA) below.
GRID = 64


@pytest.fixture(scope="module")
def kimi_pool(log_dir):
    common = dict(chunked_prefill_size=GRID, max_total_tokens=4096, max_mamba_slots=24, max_running_requests=4)
    farm = Farm({
        "pool": spec(log_dir, "kimi_cachepool", KIMI, **common, env={"PRFAAS_CACHEPOOL_CHECK": "1"},
                     extra_args=("--radix-cache-backend", "prfaas_hybrid", "--enable-cache-report")),
        "nocache": spec(log_dir, "kimi_nocache", KIMI, **common, extra_args=("--disable-radix-cache",)),
    }).start()
    try:
        yield str(ensure(KIMI)), farm
    finally:
        farm.stop()


def test_kimi_prefix_cache_pool_hits_match_no_cache(kimi_pool):
    path, farm = kimi_pool
    system = prompt_ids(path, 300, seed=7)
    questions = [prompt_ids(path, 20, seed=100 + i) for i in range(3)]
    outs = [post(farm["pool"].url + "/generate", generate_body(system + q, NEW)) for q in questions]
    # the first computes everything; later ones resume at the last KDA checkpoint (chunk end) <= 300
    assert [o["meta_info"]["cached_tokens"] for o in outs] == [0, 256, 256], outs
    for q, o in zip(questions, outs):
        assert o["output_ids"] == post(farm["nocache"].url + "/generate", generate_body(system + q, NEW))["output_ids"]
    log = Path(farm["pool"].spec.log_path).read_text(errors="replace")
    assert log.count("prfaas_hybrid integrity ok") >= 3 and "AssertionError" not in log


# --radix-cache-backend prfaas_hybrid with the sliding-window hybrid, colocated (docs/cachepool-swa.md): a hit
# needs full-attention KV for the whole prefix but SWA pages only for the window (127 + 1 tokens) before it;
# the pool keeps those and drops the rest under pressure (tests/fast/test_cachepool_backend_swa.py).
@pytest.fixture(scope="module")
def mimo_pool(log_dir):
    common = dict(chunked_prefill_size=GRID, max_total_tokens=4096, max_running_requests=4)
    farm = Farm({
        "pool": spec(log_dir, "mimo_cachepool", MIMO, **common, env={"PRFAAS_CACHEPOOL_CHECK": "1"},
                     extra_args=("--radix-cache-backend", "prfaas_hybrid", "--enable-cache-report")),
        "nocache": spec(log_dir, "mimo_nocache", MIMO, **common, extra_args=("--disable-radix-cache",)),
    }).start()
    try:
        yield str(ensure(MIMO)), farm
    finally:
        farm.stop()


def test_mimo_prefix_cache_pool_hits_match_no_cache(mimo_pool):
    path, farm = mimo_pool
    system = prompt_ids(path, 300, seed=7)  # > 2 windows: the hit's early blocks need no SWA pages
    questions = [prompt_ids(path, 20, seed=100 + i) for i in range(3)]
    outs = [post(farm["pool"].url + "/generate", generate_body(system + q, NEW)) for q in questions]
    # no state grid: later ones resume at the last whole 16-token block of the shared 300 tokens
    assert [o["meta_info"]["cached_tokens"] for o in outs] == [0, 288, 288], outs
    for q, o in zip(questions, outs):
        assert o["output_ids"] == post(farm["nocache"].url + "/generate", generate_body(system + q, NEW))["output_ids"]
    log = Path(farm["pool"].spec.log_path).read_text(errors="replace")
    assert log.count("prfaas_hybrid integrity ok") >= 3 and "AssertionError" not in log
