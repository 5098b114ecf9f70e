"""The paper's other hybrid families on real SGLang (CPU): Kimi Linear (KDA : MLA = 3 : 1) and a
MiMo-V2-Flash-style SWA : GQA = 3 : 1 model (window 128). Per family, one farm of four servers: colocated
greedy == HF transformers greedy; PD over prfaas_zmq (chunked prefill 512 < the 1,600-token prompt) ==
colocated; the bytes the prefill's transport acknowledged == router/kv_accounting.py within 1% — MLA moves
one latent buffer per layer, SWA layers only the window's pages; and `--radix-cache-backend prfaas_hybrid`
prefix hits == the colocated server, which runs with prefix caching off: colocated, and under PD with the
pool on the prefill and the decode, for both families (MiMo's PD pair at page size 16, below). A fifth server,
a layer-wise prefill (layerwise.py), streams into the same decode, checked against the same colocated server:
one server start here instead of a farm of three in test_layerwise.py."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from prfaas_sgl.tools.launch import free_port
from prfaas_sgl.tools.models.tiny import ensure
from router.kv_accounting import Dtypes, account_path

from .conftest import Farm, forked, spec
from .layerwise import check_layerwise
from .layerwise import prefill_spec as layerwise_prefill_spec
from .pd import generate_body, pd_generate, post
from .prompt_trees import check_tree, prompt_tree
from .prompts import prompt_ids
from .reference import hf_greedy
from .scrape import acked_bytes, settled_bytes

pytestmark = pytest.mark.sglang
NEW = 8
CHUNK = 512
LENGTHS = (100, 1600)  # inside the SWA window, and >= 1,500 tokens: several chunks, 12x the window
KIMI, MIMO = "tiny-kimi-linear", "tiny-mimo-v2-swa"
# K/V buffers the prefill registers (PrfaasKVManager's layout log line) and the first one's bytes per token:
# Kimi: 2 MLA layers, one latent of 32 + 8 fp32 each; MiMo: 2 GQA layers x (K, V), K = 1 head x 16 fp32.
KV_BUFFERS = {KIMI: (2, (32 + 8) * 4), MIMO: (4, 16 * 4)}


# SGLang 0.5.23's decode preallocates only the SWA tail (the window's pages) when page_size > 1
# (disaggregation/decode.py `_uses_swa_tail_prealloc`); at page size 1 it preallocates the whole prompt plus
# 512 reserved tokens in an SWA pool sized for the tail, and a request that cannot fit waits forever.
PAGE = {KIMI: 1, MIMO: 16}
# What our CPU servers keep: --dtype float32 (launch._cpu_args) and linear-attention conv states in float32 too
# (srt/cpu/fixes.conv_states_in_float32; SGLang's own default, bf16, made outputs depend on the chunk grid).
CPU_DTYPES = Dtypes(kv=4, conv=4, ssm=4)
CHECK = {"PRFAAS_CACHEPOOL_CHECK": "1"}
GRID = 64  # the cache pool server's chunk: KDA states are checkpointed at chunk ends


def _specs(log_dir: Path, model: str) -> dict:
    stats, lw_stats = free_port(), free_port()
    zmq = ("--prfaas-zmq-timeout-s", "120", "--prfaas-zmq-chunk-bytes", "65536")
    page = dict(page_size=PAGE[model])
    slots = dict(max_mamba_slots=24) if model == KIMI else {}
    pool = dict(chunked_prefill_size=GRID, max_total_tokens=4096, max_running_requests=4, **slots)
    # PD with the pool on both sides. The plain PD tests send prompts no other test sends first, so they
    # miss both pools and move every byte.
    pd_pool = (("--radix-cache-backend", "prfaas_hybrid", "--enable-cache-report"), CHECK)
    return {
        # prefix caching off: the reference for PD and for the cache pool's hits alike
        "colocated": spec(log_dir, f"{model}_colocated", model, chunked_prefill_size=CHUNK, **page,
                          extra_args=("--disable-radix-cache",)),
        "prefill": spec(log_dir, f"{model}_prefill", model, mode="prefill", transfer_backend="prfaas_zmq",
                        bootstrap_port=free_port(), chunked_prefill_size=CHUNK, **page, env=pd_pool[1],
                        extra_args=zmq + pd_pool[0] + ("--prfaas-zmq-stats-port", str(stats))),
        "decode": spec(log_dir, f"{model}_decode", model, mode="decode", transfer_backend="prfaas_zmq",
                       max_running_requests=1, **page, env=pd_pool[1],
                       extra_args=zmq + pd_pool[0] + ("--disaggregation-decode-enable-radix-cache",)),
        "pool": spec(log_dir, f"{model}_cachepool", model, **pool, env=CHECK,
                     extra_args=("--radix-cache-backend", "prfaas_hybrid", "--enable-cache-report")),
        # a prefill of its own (no pool): on "prefill" layer-wise would take the 1,600-token prompts, which
        # keep the chunk path there
        "lw_prefill": layerwise_prefill_spec(log_dir, f"{model}_lw_prefill", model, PAGE[model], lw_stats),
        "stats_urls": {role: f"http://127.0.0.1:{port}/stats" for role, port in (("prefill", stats),
                                                                                  ("lw_prefill", lw_stats))},
    }


@pytest.fixture(scope="module", params=[KIMI, MIMO])
def family(request, log_dir):
    specs = _specs(log_dir, request.param)
    stats_urls = specs.pop("stats_urls")
    farm = Farm(specs, fork=forked(request)).start()
    try:
        yield request.param, str(ensure(request.param)), farm, stats_urls
    finally:
        farm.stop()


@pytest.mark.parametrize("length", LENGTHS)
def test_colocated_matches_hf(family, length):
    name, path, farm, _ = family
    ids = prompt_ids(path, length, seed=length)
    out = post(farm["colocated"].url + "/generate", generate_body(ids, NEW))
    assert out["meta_info"]["prompt_tokens"] == length, out
    assert out["output_ids"] == hf_greedy(path, ids, NEW), name


@pytest.mark.parametrize("length", LENGTHS)
def test_pd_matches_colocated_and_wire_bytes_match_accounting(family, length):
    name, path, farm, stats_urls = family
    stats_url = stats_urls["prefill"]
    ids = prompt_ids(path, length, seed=length)
    body = generate_body(ids, NEW)
    colocated = post(farm["colocated"].url + "/generate", body)["output_ids"]
    before = acked_bytes(stats_url)
    out = pd_generate(farm["prefill"].url, farm["decode"].url, farm["prefill"].spec.bootstrap_port, body)
    assert out.get("output_ids") == colocated, out
    moved = settled_bytes(stats_url, before) - before
    acct = account_path(path, CPU_DTYPES)
    expected = acct.request_bytes(length, PAGE[name])
    assert abs(moved - expected) <= 0.01 * expected, (name, length, moved, expected, acct)
    if acct.swa_window and length > acct.swa_window:  # SWA: the window's pages, not every page
        every_page = dataclasses.replace(acct, swa_window=length).request_bytes(length, PAGE[name])
        assert moved < every_page * 0.5, (moved, every_page)
        print(f"{name} {length} tokens: {moved} B moved, {every_page} B with every SWA page "
              f"({every_page / moved:.2f}x)")


def test_layerwise_pd_matches_colocated_and_streams_only_long_prompts(family):
    """Layer-wise prefill (chunk 192) -> the family decode (pool on; these prompts hit nothing there), greedy
    tokens == the colocated server (chunk 512: the pool server's hits already match it across chunk sizes)."""
    name, path, farm, stats_urls = family
    check_layerwise(name, path, farm["lw_prefill"], farm["decode"], farm["colocated"], stats_urls["lw_prefill"],
                    PAGE[name])


def test_kv_buffers_per_layer(family):
    """MLA registers one latent buffer per MLA layer; GQA a K and a V buffer per full-attention layer
    (SWA layers' pages travel as state)."""
    name, _, farm, _ = family
    log = Path(farm["prefill"].spec.log_path).read_text(errors="replace")
    found = re.search(r"(\d+) kv buffers \((\d+) B/page\)", log)
    assert found, "prefill log has no prfaas_zmq layout line"
    buffers, per_token = KV_BUFFERS[name]
    assert (int(found[1]), int(found[2])) == (buffers, per_token * PAGE[name])


# --radix-cache-backend prfaas_hybrid. Kimi Linear: KDA states are checkpointed at chunk ends (GRID) and
# restored on a hit exactly as GDN's (fast: test_cachepool_backend_states.py over SGLang's MambaPool with
# KDA's shapes), so later requests resume at the last checkpoint <= 300. MiMo (docs/cachepool-swa.md): a hit
# needs full-attention KV for the whole prefix but SWA pages only for the window before it, and there is no
# state grid: later requests resume at the last whole 16-token block of the shared 300 tokens.
CACHED = {KIMI: [0, 256, 256], MIMO: [0, 288, 288]}


def test_prefix_cache_pool_hits_match_no_cache(family):
    name, path, farm, _ = family
    system = prompt_ids(path, 300, seed=7)  # > 2 SWA windows: the hit's early blocks need no SWA pages
    questions = [prompt_ids(path, 20, seed=100 + i) for i in range(3)]
    outs = [post(farm["pool"].url + "/generate", generate_body(system + q, NEW)) for q in questions]
    assert [o["meta_info"]["cached_tokens"] for o in outs] == CACHED[name], outs
    for q, o in zip(questions, outs):
        ref = post(farm["colocated"].url + "/generate", generate_body(system + q, NEW))["output_ids"]
        assert o["output_ids"] == ref, name
    log = Path(farm["pool"].spec.log_path).read_text(errors="replace")
    assert log.count("prfaas_hybrid integrity ok") >= 3 and "AssertionError" not in log


def test_random_prompt_trees_hit_the_pool_and_match_no_cache(family):
    """Colocated route: greedy tokens through the cache pool (chunk 64, hits resumed mid-prompt) == the
    no-cache server (chunk 512) on every prompt of a random tree (bound: prompt_trees.LOGPROB_BOUND)."""
    name, path, farm, _ = family
    hits, _ = check_tree(prompt_tree(path, seed=11, n=10), _to(farm["pool"]), _to(farm["colocated"]),
                         lambda out: out["meta_info"]["cached_tokens"])
    assert hits >= 3, f"{name}: only {hits} of 10 prompts hit the pool; the tree no longer tests hits"


def test_random_prompt_trees_through_pd_pools_match_no_cache(family):
    """PD route with the pool on both sides: prefill hits resume at its 512-token checkpoints (Kimi) or any
    16-token block whose window survives (MiMo), decode hits skip their prefix on the wire (MiMo: up to
    the window tail SGLang's decode allocates afresh); greedy tokens == the no-cache colocated server on
    every prompt."""
    name, path, farm, _ = family
    p = farm["prefill"]
    hits, _ = check_tree(prompt_tree(path, seed=12, n=10),
                         lambda body: pd_generate(p.url, farm["decode"].url, p.spec.bootstrap_port, body),
                         _to(farm["colocated"]), _pd_cached)
    assert hits >= 3, f"{name}: only {hits} of 10 PD prompts hit a pool; the tree no longer tests hits"


def _to(server):
    return lambda body: post(server.url + "/generate", body)


def _pd_cached(out: dict) -> int:
    return out["meta_info"]["cached_tokens"] + out["prefill"]["meta_info"]["cached_tokens"]
