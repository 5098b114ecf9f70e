"""States priced at admission over the unified slab, through SGLang's own PrefillAdder: KV may take the
whole slab (no block kept per free request row), and a request admitted is never left without a block
for its state, also when the free KV tokens are scattered inside blocks that still hold live tokens."""
from __future__ import annotations

from array import array

import pytest
import torch
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder
from sglang.srt.mem_cache.allocation import alloc_req_slots, alloc_token_slots
from sglang.srt.sampling.sampling_params import SamplingParams

from prfaas_sgl.cachepool.slab_blocks import FREE, KV
from prfaas_sgl.srt.cachepool_backend.slab_admission import ADMISSION_RESERVE, SlabPrefillBudget
from prfaas_sgl.srt.cachepool_backend.unified import unify
from tests.fast.test_cachepool_slab_backend import BS, CHUNK, NS, _configurator, _serve, _sglang_result, backend
from tests.support.sglang_context import sglang_context  # noqa: F401 - autouse

ROWS = 10


def _server(mode: str = "null"):
    conf = _configurator(max_running_requests=ROWS, disaggregation_mode=mode,
                         disaggregation_transfer_backend="prfaas_zmq")
    out = unify(_sglang_result(rows=2, context=512), conf)
    pool, tok = out.req_to_token_pool, out.token_to_kv_pool_allocator
    ctx = NS(params=NS(page_size=1, token_to_kv_pool_allocator=tok, req_to_token_pool=pool),
             server_args=NS(chunked_prefill_size=CHUNK, disaggregation_mode=mode), is_hybrid_ssm=True,
             is_hybrid_swa=False, enable_hierarchical_cache=False, disable_radix_cache=False)
    return backend.build(ctx), pool, tok, out


def _req(i: int, n: int, new: int = 4) -> Req:
    ids = array("q", range(1000 * i + 1, 1000 * i + 1 + n))
    return Req(f"r{i}", "", ids, SamplingParams(max_new_tokens=new, temperature=0.0))


def _admit(cache, tok, waiting: list[Req], chunk: int | None = None) -> list[Req]:
    """One scheduler pass: SGLang's PrefillAdder over `waiting`, as get_new_batch_prefill runs it."""
    adder = PrefillAdder(1, cache, tok, None, 1.0, 1 << 20, chunk)
    for req in waiting:
        if len(adder.can_run_list) >= cache.req_to_token_pool.available_size():
            break  # the scheduler's row cap (get_num_allocatable_reqs), checked before each candidate
        req.init_next_round_input(cache)
        if adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None) != AddReqResult.CONTINUE:
            break
    return adder.can_run_list


def _run(cache, pool, reqs: list[Req]) -> None:
    """What prepare_for_extend allocates for an admitted batch: rows and states, then KV tokens (both
    raise RuntimeError if admission promised what is not there)."""
    rows = alloc_req_slots(pool, reqs, cache)
    loc = alloc_token_slots(cache, sum(r.extend_len for r in reqs))
    at = 0
    for r, row in zip(reqs, rows):
        r.kv.req_pool_idx = row
        pool.req_to_token[row, r.prefix_len:r.prefix_len + r.extend_len] = loc[at:at + r.extend_len]
        at += r.extend_len


def test_kv_may_take_every_block_but_the_reserve_while_rows_are_free():
    cache, pool, tok, out = _server()
    blocks = tok.slab_blocks
    assert pool.available_size() == ROWS and tok.price_states
    assert tok.available_size() == (blocks.num_blocks - 1 - ADMISSION_RESERVE) * BS
    assert out.max_total_num_tokens == (blocks.num_blocks - 2 - ADMISSION_RESERVE) * BS
    assert isinstance(tok.create_prefill_budget(cache), SlabPrefillBudget)
    assert tok.request_slot_reserve(has_req_pool_slot=False) == BS
    assert tok.request_slot_reserve(has_req_pool_slot=True) == 0


def test_a_decode_server_keeps_a_block_per_free_row():
    """PD decode pre-allocates outside the PrefillAdder: states stay reserved per free row there."""
    cache, pool, tok, out = _server("decode")
    assert not tok.price_states and tok.request_slot_reserve(has_req_pool_slot=False) == 0
    assert tok.available_size() == (tok.slab_blocks.num_blocks - 1 - ROWS) * BS
    assert type(tok.create_prefill_budget(cache)) is not SlabPrefillBudget


def test_one_long_prompt_fills_the_slab_and_still_gets_its_state():
    cache, pool, tok, _ = _server()
    long = tok.available_size() - BS - 8  # its own state block, 1 page, 4 new tokens: the rest is KV
    (r,) = _admit(cache, tok, [_req(1, long)])
    _run(cache, pool, [r])
    blocks = tok.slab_blocks
    assert blocks.count(KV) * BS >= long > (blocks.num_blocks - 1 - ROWS) * BS  # past the per-row reserve
    blocks.check()


@pytest.mark.parametrize("cached", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_admitted_requests_always_find_their_states_over_fragmented_kv(seed, cached):
    """Running requests hold one token in each of most blocks (KV has free tokens there, no free blocks
    to spare), then waves of new requests arrive: every admitted batch gets its rows, states and tokens
    (SGLang raises otherwise), and admission stops at the blocks a state can still take."""
    g = torch.Generator().manual_seed(seed)
    cache, pool, tok, _ = _server()
    blocks = tok.slab_blocks
    running = _fragment(cache, pool, tok, g, cached)
    waiting = [_req(10 + i, int(torch.randint(1, 3 * BS, (1,), generator=g))) for i in range(ROWS)]
    admitted = 0
    while waiting and pool.available_size():
        batch = _admit(cache, tok, waiting)
        if not batch:
            break
        _run(cache, pool, batch)
        admitted += len(batch)
        waiting = [w for w in waiting if w not in batch]
        blocks.check()
    assert admitted >= 1
    if waiting and pool.available_size():  # what stopped it: no block for one more state, or no tokens
        budget = tok.create_prefill_budget(cache)
        assert budget.state_room() < 1 or budget.remaining_total <= len(waiting[0].origin_input_ids) + 4 + 1 + BS
    assert len(running) + admitted <= ROWS


def test_without_the_block_check_the_same_waves_crash(monkeypatch):
    """Negative control: tokens alone (free KV tokens inside live blocks) would admit requests whose
    states find no block, and SGLang fails loudly (HybridReqToTokenPool.alloc asserts)."""
    monkeypatch.setattr(SlabPrefillBudget, "state_room", lambda self: 1 << 20)
    crashed = 0
    for seed in range(6):
        g = torch.Generator().manual_seed(seed)
        cache, pool, tok, _ = _server()
        _fragment(cache, pool, tok, g, cached=False)
        waiting = [_req(10 + i, int(torch.randint(1, 3 * BS, (1,), generator=g))) for i in range(ROWS)]
        try:
            while waiting and pool.available_size():
                batch = _admit(cache, tok, waiting)
                if not batch:
                    break
                _run(cache, pool, batch)
                waiting = [w for w in waiting if w not in batch]
        except (RuntimeError, AssertionError):  # alloc_req_slots, or the pool's own assert before it
            crashed += 1
    assert crashed >= 1


def _fragment(cache, pool, tok, g, cached: bool) -> list[Req]:
    """`cached`: two finished requests left in the cache (idle KV entries and checkpointed states,
    evictable for either kind). Then two running requests whose KV tokens interleave over most free blocks, one of
    which finishes and frees its tokens: the other keeps one or more live tokens in each of them."""
    blocks = tok.slab_blocks
    for i in (3, 4) if cached else ():
        n = CHUNK + 1 + int(torch.randint(0, BS, (1,), generator=g))
        _serve(cache, pool, list(range(7000 + 100 * i, 7000 + 100 * i + n)))
    assert not cached or (cache.mamba_evictable_size() and cache.full_evictable_size())
    a, b = _req(1, 1), _req(2, 1)
    _run(cache, pool, _admit(cache, tok, [a, b]))
    n = (blocks.num_free() - ADMISSION_RESERVE - 2) * BS
    loc = alloc_token_slots(cache, n)
    mine = torch.rand(n, generator=g) < 0.15
    tok.free(loc[~mine])
    assert blocks.count(FREE) < ROWS and tok.loose_tokens() > 2 * BS
    return [a, b]


def _one_pass(cache, tok, pool, waiting: list[Req]) -> list[Req]:
    """get_new_batch_prefill's loop: match, price, and on the first refusal give back the state the
    refused request's match took (scheduler.py does) and stop."""
    adder = PrefillAdder(1, cache, tok, None, 1.0, 1 << 20, None)
    for req in waiting:
        req.init_next_round_input(cache)
        if adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None) != AddReqResult.CONTINUE:
            if req not in adder.can_run_list and req.kv.holds_mamba:
                pool.mamba_allocator.free(req.kv.mamba_pool_idx.unsqueeze(-1))
                req.kv.mamba_pool_idx, req.kv.mamba_cow_src_index = None, None
            break
    return adder.can_run_list


def test_waiting_hits_that_hold_their_states_are_not_refused_for_a_block():
    """KV filled with idle cached entries, then a shared prompt whose two chunk-end states take the last
    free blocks: each waiting request that hits it takes its copy-on-write state at match time. Priced as
    if it still needed one, only the first of three was admitted per pass (the others found no free
    block: they held it); now all three are, and all get their rows, states and tokens."""
    cache, pool, tok, _ = _server()
    for i in range(20):
        _serve(cache, pool, list(range(20000 + 1000 * i, 20000 + 1000 * i + BS)))
    system = list(range(7000, 7000 + 2 * CHUNK))
    _serve(cache, pool, system)
    assert tok.slab_blocks.num_free() <= 2
    waiting = [_req(50 + j, 8) for j in range(3)]
    for w in waiting:
        w.origin_input_ids = array("q", system + list(w.origin_input_ids))
        w.full_untruncated_fill_ids = w.origin_input_ids
    batch = _one_pass(cache, tok, pool, waiting)
    assert batch == waiting and all(r.prefix_len == 2 * CHUNK for r in batch)
    _run(cache, pool, batch)
    tok.slab_blocks.check()


def test_with_nothing_holding_kv_every_kv_block_is_freeable_for_a_state():
    """All live KV is idle cache: eviction frees whole blocks, so the state check counts them; one running
    request's live token (it keeps its block) makes the count 0 again."""
    cache, pool, tok, _ = _server()
    for i in range(6):
        _serve(cache, pool, list(range(20000 + 1000 * i, 20000 + 1000 * i + BS + 3)))
    budget = tok.create_prefill_budget(cache)
    assert budget.freeable_kv_blocks() == tok.slab_blocks.count(KV) > 0
    (r,) = _admit(cache, tok, [_req(1, 5)])
    _run(cache, pool, [r])
    assert tok.create_prefill_budget(cache).freeable_kv_blocks() == 0
