"""--prfaas-unified-pool in process: `unify` turns SGLang's own configure() result (a real
HybridReqToTokenPool + HybridLinearKVPool + TokenToKVPoolAllocator, CPU, tiny) into one slab, and
prfaas_hybrid's LRU then frees memory for either kind through the calls SGLang's scheduler makes
(`alloc_req_slots` -> ensure_mamba_capacity -> evict_for_alloc, `alloc_token_slots` -> evict)."""
from __future__ import annotations

from array import array
from types import SimpleNamespace as NS

import pytest
import torch
from sglang.srt.managers.schedule_batch import ReqKvInfo
from sglang.srt.mem_cache.allocation import alloc_req_slots, alloc_token_slots
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigResult
from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, HybridReqToTokenPool

from prfaas_sgl.cachepool.slab_blocks import KV
from prfaas_sgl.config import PrfaasConfig
from prfaas_sgl.srt import flags
from prfaas_sgl.srt.cachepool_backend import after_configure
from prfaas_sgl.srt.cachepool_backend import cache as backend
from prfaas_sgl.srt.cachepool_backend.slab_alloc import SlabStateAllocator, SlabTokenAllocator
from prfaas_sgl.srt.cachepool_backend.unified import unify
from tests.support.sglang_context import sglang_context  # noqa: F401 - autouse

F32, CHUNK, BS = torch.float32, 32, 16  # 16 tokens per slab block: E = 32 B, state = 120 B
PARAMS = NS(shape=NS(conv=[(2, 3)], temporal=(9,)), dtype=NS(conv=F32, temporal=F32), is_kda=False, layers=[1, 2])


def _configurator(**server):
    sa = NS(**{"radix_cache_backend": "prfaas_hybrid", "disaggregation_mode": "null", **server})
    return NS(server_args=sa, is_draft_worker=False, spec_algorithm=NS(is_none=lambda: True),
              mambaish_config=NS(mamba2_cache_params=PARAMS))


def _sglang_result(rows: int = 2, kv_tokens: int = 400, mamba_slots: int = 8,
                   context: int = 64) -> KVCacheConfigResult:
    """What configure() returns for a 2-full + 2-GDN-layer model (default: 400 KV tokens, 8 Mamba slots)."""
    req = HybridReqToTokenPool(size=rows, mamba_size=mamba_slots, mamba_spec_state_size=rows, max_context_len=context,
                               device="cpu", enable_memory_saver=False, cache_params=PARAMS,
                               mamba_layer_ids=[1, 2], enable_mamba_extra_buffer=False,
                               enable_overlap_schedule=False)
    kv = HybridLinearKVPool(size=kv_tokens, dtype=F32, page_size=1, head_num=1, head_dim=2,
                            full_attention_layer_ids=[0, 3], device="cpu", mamba_pool=req.mamba_pool)
    return KVCacheConfigResult(max_total_num_tokens=kv_tokens, max_running_requests=rows,
                               full_max_total_num_tokens=None, swa_max_total_num_tokens=None,
                               req_to_token_pool=req, token_to_kv_pool=kv,
                               token_to_kv_pool_allocator=TokenToKVPoolAllocator(kv_tokens, F32, "cpu", kv, False),
                               memory_pool_config=None)


def _server():
    out = unify(_sglang_result(), _configurator())
    ctx = NS(params=NS(page_size=1, token_to_kv_pool_allocator=out.token_to_kv_pool_allocator,
                       req_to_token_pool=out.req_to_token_pool),
             server_args=NS(chunked_prefill_size=CHUNK, disaggregation_mode="null"), is_hybrid_ssm=True,
             is_hybrid_swa=False, enable_hierarchical_cache=False, disable_radix_cache=False)
    return backend.build(ctx), out.req_to_token_pool, out.token_to_kv_pool_allocator


def _req(tokens: list[int]):
    return NS(rid=f"r{tokens[0]}", extra_key=None, cache_salt=None, full_untruncated_fill_ids=array("q", tokens),
              kv=ReqKvInfo())


def _serve(cache, pool, tokens: list[int]):
    """One request through SGLang's admission calls, checkpointed and released as the scheduler does.
    Returns the state slot (= slab block) it ran in."""
    req = _req(tokens)
    row = alloc_req_slots(pool, [req], cache)[0]
    state = int(req.kv.mamba_pool_idx)
    pool.req_to_token[row, :len(tokens)] = alloc_token_slots(cache, len(tokens)).to(torch.int32)
    req.kv.kv_allocated_len = len(tokens)
    for end in [*range(CHUNK, len(tokens), CHUNK), len(tokens)]:  # each chunk end, then the release
        cache.checkpoint(req, up_to=end)
    cache.free_kv_row(req.kv, [(0, len(tokens))])
    cache.on_release(req, checkpointed=True)
    pool.free(req)
    return state


def _hog(pool) -> list[int]:
    """Every block the state side can still take (another request's states, say)."""
    got = pool.mamba_allocator.alloc(pool.mamba_allocator.available_size())
    return got.tolist()


def _idle_check(cache, pool, tok) -> None:
    """SGLang's idle leak check (invariant_checker._check_full_pool / _check_mamba_pool)."""
    assert tok.available_size() + cache.full_evictable_size() + cache.full_protected_size() == tok.size
    st = pool.mamba_allocator.available_size()
    assert st + cache.mamba_evictable_size() + cache.mamba_protected_size() == pool.mamba_pool.size


def test_unify_sizes_one_slab_from_sglangs_bytes():
    cache, pool, tok = _server()
    blocks = tok.slab_blocks
    # (401 tokens x 32 B + 9 states x 120 B) // 512 B
    assert blocks.num_blocks == 27 and pool.mamba_pool.mamba_cache.temporal.shape[1] == 27
    assert tok.size == (26 - 2) * BS and pool.mamba_pool.size == 26 - 2 - 1  # 2 free rows reserved
    _idle_check(cache, pool, tok)


def test_a_state_takes_the_block_of_an_evicted_kv_entry():
    cache, pool, tok = _server()
    _serve(cache, pool, list(range(100, 120)))  # 20 tokens: one KV block cached, no state (off the grid)
    (lru_block,) = [b for b, k in enumerate(tok.slab_blocks.kind) if k == KV]
    _serve(cache, pool, list(range(300, 320)))  # a second, more recent one
    hog = _hog(pool)
    assert pool.mamba_allocator.available_size() == 0
    b = _req(list(range(500, 510)))
    alloc_req_slots(pool, [b], cache)  # needs a state: the LRU KV entry is evicted for it
    assert int(b.kv.mamba_pool_idx) == lru_block and len(cache.mirror.kv_of) == 1
    pool.free_mamba_cache(b)
    pool.free(b)
    pool.mamba_allocator.free(torch.tensor(hog))
    _idle_check(cache, pool, tok)


def test_kv_tokens_take_the_block_of_an_evicted_state():
    cache, pool, tok = _server()
    _serve(cache, pool, list(range(100, 100 + CHUNK + 1)))  # 2 KV blocks + the state at 32 cached
    assert len(cache.mirror.state_of) == 1 and len(cache.mirror.kv_of) == 2
    hog = _hog(pool)
    pool.mamba_allocator.free(torch.tensor(hog[:2]))  # 2 free blocks: the 2 free rows' reserve
    assert tok.available_size() == 0
    loc = alloc_token_slots(cache, BS)  # the LRU entry is the state: evicting it frees one block
    assert not cache.mirror.state_of and len(cache.mirror.kv_of) == 2
    assert all(tok.slab_blocks.kind[b] == KV for b in (loc // BS).tolist())
    tok.free(loc)
    pool.mamba_allocator.free(torch.tensor(hog[2:]))
    _idle_check(cache, pool, tok)


def test_exhaustion_is_refused_the_way_sglang_expects():
    cache, pool, tok = _server()
    hog = _hog(pool)  # states leave the 2 rows' reserve + 1 block: KV's capacity never reaches 0
    assert pool.mamba_allocator.alloc(1) is None and tok.size == BS
    loc = alloc_token_slots(cache, BS)
    with pytest.raises(RuntimeError, match="Out of memory"):
        alloc_token_slots(cache, 1)  # nothing cached to evict: SGLang's own error, nothing corrupted
    tok.slab_blocks.check()
    tok.free(loc)
    pool.mamba_allocator.free(torch.tensor(hog))
    _idle_check(cache, pool, tok)


@pytest.mark.parametrize("server, reason", [(dict(radix_cache_backend=None), "radix-cache-backend prfaas_hybrid"),
                                            (dict(disaggregation_mode="prefill",
                                                  disaggregation_transfer_backend="mooncake"), "prfaas_zmq")])
def test_refuses_what_it_does_not_serve(server, reason):
    with pytest.raises(ValueError, match=reason):
        unify(_sglang_result(), _configurator(**server))


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_serves_pd_under_prfaas_zmq(mode):
    out = unify(_sglang_result(), _configurator(disaggregation_mode=mode, disaggregation_transfer_backend="prfaas_zmq"))
    assert isinstance(out.token_to_kv_pool_allocator, SlabTokenAllocator)


def test_refuses_per_slot_side_pools():
    result = _sglang_result()
    result.req_to_token_pool.mamba_ckpt_pool = object()  # --enable int8 checkpoints: sized by Mamba slots
    with pytest.raises(ValueError, match="int8 Mamba checkpoints"):
        unify(result, _configurator())


def test_the_flag_turns_it_on():
    conf = _configurator()
    assert after_configure(_sglang_result(), conf) is None  # off: SGLang's pools stay
    setattr(conf.server_args, flags.CONFIG_ATTR, PrfaasConfig(unified_pool=True))
    out = after_configure(_sglang_result(), conf)
    assert isinstance(out.token_to_kv_pool_allocator, SlabTokenAllocator)
    assert isinstance(out.req_to_token_pool.mamba_allocator, SlabStateAllocator)


def test_rows_grow_past_sglangs_mamba_cap_and_each_gets_a_state():
    """SGLang capped the rows at its fixed split's Mamba slots / 3 (here 2 rows); over the slab the
    operator's --max-running-requests (10) comes back, at most half the blocks, and ten requests at once
    each take a row and a state block."""
    out = unify(_sglang_result(rows=2), _configurator(max_running_requests=10))
    pool, tok = out.req_to_token_pool, out.token_to_kv_pool_allocator
    assert out.max_running_requests == pool.size == 10 == pool.available_size()
    assert pool.req_to_token.shape[0] == pool.req_index_to_mamba_index_mapping.shape[0] == 11
    ctx = NS(params=NS(page_size=1, token_to_kv_pool_allocator=tok, req_to_token_pool=pool),
             server_args=NS(chunked_prefill_size=CHUNK, disaggregation_mode="null"), is_hybrid_ssm=True,
             is_hybrid_swa=False, enable_hierarchical_cache=False, disable_radix_cache=False)
    cache = backend.build(ctx)
    reqs = [_req([100 * i + 1, 2, 3]) for i in range(10)]
    rows = alloc_req_slots(pool, reqs, cache)
    assert sorted(rows) == list(range(1, 11))
    states = {int(r.kv.mamba_pool_idx) for r in reqs}
    assert len(states) == 10 and 0 not in states
    tok.slab_blocks.check()
    # half the blocks at most: a request for more rows than that stops there
    many = unify(_sglang_result(rows=2), _configurator(max_running_requests=1000))
    assert many.max_running_requests == (many.token_to_kv_pool_allocator.slab_blocks.num_blocks - 1) // 2
    # nothing asked: SGLang's rows stay
    assert unify(_sglang_result(rows=2), _configurator()).max_running_requests == 2
