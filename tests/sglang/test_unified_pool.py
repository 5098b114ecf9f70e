"""`--prfaas-unified-pool` on real CPU SGLang servers (issue 17), tiny hybrid GDN model: KV tokens and GDN
states in ONE slab with one block free list, colocated and as a PD prefill/decode pair with prfaas_zmq
moving the strided slab rows (`srt.buf_infos` -> `transfer.buffers.Strided`). A second decode keeps
SGLang's packed pools: the wire is per logical buffer, so the two pool kinds pair. The colocated server
asks for more running requests than SGLang's Mamba cap gives a fixed split (slab_rows.py).

Checked: greedy tokens == a colocated server without prefix caching; prefix hits; bursts that overfill
the slabs finish (PD: exactly) and leave the servers healthy; check_integrity() after every release
(PRFAAS_CACHEPOOL_CHECK=1) and SGLang's idle leak check never fail.
"""
from __future__ import annotations

import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from prfaas_sgl.tools.launch import free_port

from .conftest import HYBRID, farm_for, spec
from .pd import generate_body, pd_generate, post
from .prompts import prompt_ids
from .test_cachepool_pd import _log_facts

pytestmark = pytest.mark.sglang
GRID = 64  # prefill's --chunked-prefill-size: its state checkpoints
BS = 16  # the backend's index block size
NEW = 8
ZMQ = ("--prfaas-zmq-timeout-s", "120")
CHECK = {"PRFAAS_CACHEPOOL_CHECK": "1"}
POOL = dict(max_total_tokens=2048, max_mamba_slots=24)  # re-laid as one slab: the burst overfills it
UNIFIED = ("--radix-cache-backend", "prfaas_hybrid", "--prfaas-unified-pool", "--enable-cache-report")


def _specs(log_dir):
    return {
        "prefill": spec(log_dir, "unified_prefill", HYBRID, mode="prefill", transfer_backend="prfaas_zmq",
                        bootstrap_port=free_port(), chunked_prefill_size=GRID, env=CHECK, **POOL,
                        extra_args=ZMQ + UNIFIED),
        # batch-1 decodes: batched CPU matmuls flip near-tie tokens of the random-weight model
        "decode": spec(log_dir, "unified_decode", HYBRID, mode="decode", transfer_backend="prfaas_zmq",
                       max_running_requests=1, env=CHECK, **POOL,
                       extra_args=ZMQ + UNIFIED + ("--disaggregation-decode-enable-radix-cache",)),
        "packed_decode": spec(log_dir, "packed_decode", HYBRID, mode="decode", transfer_backend="prfaas_zmq",
                              max_running_requests=1, extra_args=ZMQ),
        # 16 rows asked; SGLang's Mamba cap would give 24 / 3 = 8. Extend attention over the new queries only,
        # as bench_unified_pool.py --attention query-only runs it: the reference keeps stock torch_native (queries
        # padded to the whole context), so the colocated checks compare that attention with SGLang's too
        "unified": spec(log_dir, "unified_colocated", HYBRID, chunked_prefill_size=GRID, env=CHECK, **POOL,
                        max_running_requests=16, extra_args=UNIFIED + ("--prfaas-cpu-query-only-attention",)),
        # the same reference server as test_cachepool_pd.py / test_router_decode_cache.py (shared)
        "colocated": spec(log_dir, "pool_pd_colocated", HYBRID, chunked_prefill_size=GRID, max_running_requests=1,
                          extra_args=("--disable-radix-cache",)),
    }


farm = farm_for(_specs, shared=("colocated",))


def _pd(farm, ids: list[int], decode: str = "decode") -> dict:
    p = farm["prefill"]
    out = pd_generate(p.url, farm[decode].url, p.spec.bootstrap_port, generate_body(ids, NEW))
    assert "output_ids" in out and not out.get("error"), out
    return out


def _colocated(farm, ids: list[int]) -> list[int]:
    return post(farm["colocated"].url + "/generate", generate_body(ids, NEW))["output_ids"]


def _slab_built(farm, name: str) -> None:
    text = farm[name].log_path.read_text(errors="replace")
    assert re.search(r"prfaas unified pool: \d+ blocks of \d+ B", text), f"{name}: slab not built"
    assert "memory leak detected" not in text, f"{name}: SGLang's idle leak check failed"


def test_shared_system_prompt_hits_on_both_unified_sides(farm, model_paths):
    path = model_paths["hybrid"]
    system = prompt_ids(path, 300, seed=7)
    questions = [prompt_ids(path, 20, seed=100 + i) for i in range(3)]
    outs = [_pd(farm, system + q) for q in questions]
    for q, o in zip(questions, outs):
        assert o["output_ids"] == _colocated(farm, system + q)
    # the second prefill resumes at its last chunk end inside the shared prompt (256 = 4 x 64) and ends
    # its first chunk at the branch point its match reports (288, the shared prompt's 18 whole 16-token
    # blocks), keeping a state there: the third resumes at 288. Decode holds KV in 16-token index blocks:
    # the same 18 whole blocks
    assert [o["prefill"]["meta_info"]["cached_tokens"] for o in outs] == [0, 256, 288]
    assert [o["meta_info"]["cached_tokens"] for o in outs] == [0, 288, 288]
    for name in ("prefill", "decode"):
        _slab_built(farm, name)
        ok, errors, _, _ = _log_facts(farm, name)
        assert ok >= len(questions) and errors == 0, (name, ok, errors)


def test_slab_prefill_feeds_a_packed_decode(farm, model_paths):
    """Different pool kinds on the two sides: strided slab rows land in SGLang's packed pools."""
    prompts = [prompt_ids(model_paths["hybrid"], n, seed=40 + n) for n in (90, 333)]
    for ids in prompts:
        out = _pd(farm, ids, decode="packed_decode")
        assert out["output_ids"] == _colocated(farm, ids)
        assert out["meta_info"]["cached_tokens"] == 0  # the packed decode has no prefix cache


def test_burst_overfilling_both_slabs_finishes_exactly(farm, model_paths):
    # 5 distinct 700-token prompts at once: 3,500 tokens of KV against slabs of about 2,048 tokens plus
    # 24 states each, so prefill requests wait for transfers, and cached blocks of either kind are evicted
    prompts = [prompt_ids(model_paths["hybrid"], 700, seed=1700 + i) for i in range(5)]
    with ThreadPoolExecutor(len(prompts)) as ex:
        outs = list(ex.map(lambda ids: _pd(farm, ids), prompts))
    for ids, o in zip(prompts, outs):
        assert o["output_ids"] == _colocated(farm, ids)
    for name in ("prefill", "decode"):
        assert urllib.request.urlopen(farm[name].url + "/health", timeout=30).status == 200
        _slab_built(farm, name)
    _, errors, _, transfer = _log_facts(farm, "prefill")
    # no request left admitted, no transfer-cache block left once the last transfer completed
    assert errors == 0 and transfer[-1] == (0, 0), (errors, transfer[-3:])
    _, errors, _, _ = _log_facts(farm, "decode")
    assert errors == 0
    # and the pair still serves, hitting on the freshest prompt
    again = _pd(farm, prompts[-1])
    assert again["output_ids"] == outs[-1]["output_ids"]


# -- colocated ----------------------------------------------------------------------------------------
def _gen(farm, ids: list[int], new: int = NEW) -> dict:
    out = post(farm["unified"].url + "/generate", generate_body(ids, new))
    assert "output_ids" in out, out
    return out


def test_colocated_rows_grow_past_the_mamba_cap(farm):
    text = farm["unified"].log_path.read_text(errors="replace")
    assert "prfaas unified pool: 16 request rows (SGLang's Mamba cap gave 8)" in text


def test_colocated_shared_prompt_hits_and_matches_no_cache(farm, model_paths):
    text = farm["unified"].log_path.read_text(errors="replace")
    assert "torch_native extend attends with its new queries only" in text
    system = prompt_ids(model_paths["hybrid"], 300, seed=7)
    questions = [prompt_ids(model_paths["hybrid"], 20, seed=200 + i) for i in range(3)]
    outs = [_gen(farm, system + q) for q in questions]
    # the second hits the last 64-token chunk end inside the 300-token system prompt (256); its match
    # reports the branch point 288 (the last whole 16-token block of the shared prefix), its first chunk
    # ends there and keeps a state, and the third hits all 288
    assert [o["meta_info"]["cached_tokens"] for o in outs] == [0, 256, 288]
    for q, o in zip(questions, outs):
        assert o["output_ids"] == _colocated(farm, system + q)
    _slab_built(farm, "unified")


def test_colocated_prompt_past_the_per_row_reserve_matches_no_cache(farm, model_paths):
    """States are priced at admission (slab_admission.py), not reserved per free row: with 16 rows the
    KV side of 46 blocks of 80 tokens held at most (46 - 1 - 16) x 80 = 2,320 tokens that way; now up to
    (46 - 4) x 80 = 3,360. A 3,000-token prompt runs alone, checkpointing every 64 tokens as it goes."""
    text = farm["unified"].log_path.read_text(errors="replace")
    assert re.search(r"prfaas unified pool: 46 blocks of \d+ B \(80 tokens.*states priced at admission", text)
    ids = prompt_ids(model_paths["hybrid"], 3000, seed=900)
    out = post(farm["unified"].url + "/generate", generate_body(ids, NEW), 900)
    assert out.get("output_ids") == _colocated(farm, ids), out
    _slab_built(farm, "unified")


def test_colocated_burst_overfilling_the_slab_stays_consistent(farm, model_paths):
    # 8 distinct 600-token prompts at once on 16 rows: 4.8K tokens of KV against a slab whose KV side holds
    # at most 3,360 (46 blocks of 80 tokens), so requests wait and cached entries are evicted
    prompts = [prompt_ids(model_paths["hybrid"], 600, seed=500 + i) for i in range(8)]
    with ThreadPoolExecutor(len(prompts)) as ex:
        outs = list(ex.map(lambda p: post(farm["unified"].url + "/generate", generate_body(p, 16), 900), prompts))
    for o in outs:  # each finished, or was refused with an HTTP error; never a crash
        assert len(o.get("output_ids", [])) == 16 or o.get("http_status"), o
    assert sum(1 for o in outs if "output_ids" in o) >= 1
    # LRU may have evicted any burst prompt by now: run one twice; the second resumes at 576 = 9 x 64
    _gen(farm, prompts[0], 16)
    again = _gen(farm, prompts[0], 16)
    assert again["meta_info"]["cached_tokens"] == 576
    assert again["output_ids"] == post(farm["colocated"].url + "/generate", generate_body(prompts[0], 16))["output_ids"]
    _slab_built(farm, "unified")
    ok, errors, _, _ = _log_facts(farm, "unified")
    assert ok >= len(prompts) and errors == 0
