"""What one request's calls cost prfaas_hybrid on the scheduler thread, pinned by what they do:

- a match takes SGLang's key as the scheduler builds it (the request's own token array, capped by
  RadixKey.limit) without copying it, honours the cap, and its checkpoints then find that same array
  in the hash memo (nothing to compare);
- a checkpoint that can give the tree nothing (every full block inside the locked hit, no state on a
  block boundary) takes no pool request: the lock already pins the hit;
- the KV slots of a hit whose kv_table rows are not one run come back in order;
- a streaming session's next turn, which rewrites the last turn's array in place, is refused with this
  backend by SGLang, and would get hits for its own tokens only (hashes.py's module docstring).

Runs on SGLang's real KV allocator (test_cachepool_backend_calls' fixtures, 32-token blocks).
"""
from __future__ import annotations

from array import array
from types import SimpleNamespace as NS

import pytest
import torch
from sglang.srt.mem_cache import registry
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey

from prfaas_sgl.cachepool.hashing import block_hashes
from prfaas_sgl.srt import cachepool_backend
from prfaas_sgl.srt.cachepool_backend import cache as backend
from prfaas_sgl.srt.cachepool_backend.mirror import Mirror
from tests.fast.test_cachepool_backend_calls import CHUNK, FakeKv, _build


def _ctx():
    alloc, states, rtp = _build()
    return NS(params=NS(page_size=1, token_to_kv_pool_allocator=alloc, req_to_token_pool=rtp),
              server_args=NS(chunked_prefill_size=CHUNK, disaggregation_mode="null"), is_hybrid_ssm=True,
              is_hybrid_swa=False, enable_hierarchical_cache=False, disable_radix_cache=False)


def _cache():
    ctx = _ctx()
    return backend.build(ctx), ctx.params.token_to_kv_pool_allocator, ctx.params.req_to_token_pool


def _match(cache, ids: array, rid: str, row: int = 0):
    req = NS(rid=rid, extra_key=None, cache_salt=None, full_untruncated_fill_ids=ids, kv=FakeKv(row))
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey(ids, limit=len(ids) - 1), req=req, cow_mamba=True))
    return req, m


def _admit(cache, alloc, rtp, ids: array, rid: str, row: int = 0):
    """Match, lock and allocate as the scheduler does; returns (req, node, lock receipt)."""
    req, m = _match(cache, ids, rid, row)
    node = m.last_device_node
    lock = cache.inc_lock_ref(node)
    if not req.kv.holds_mamba:
        req.kv.mamba_pool_idx = cache._alloc_state()[0]
    prefix, need = cache.path_device_indices(node), len(ids) - m.device_prefix_len
    if alloc.available_size() < need:
        cache.evict(EvictParams(num_tokens=need - alloc.available_size()))
    rtp.req_to_token[row, :len(ids)] = torch.cat([prefix, alloc.alloc(need)]).to(torch.int32)
    req.kv.cache_protected_len = len(prefix)
    return req, node, lock


def _release(cache, req, node, lock) -> None:
    n = len(req.full_untruncated_fill_ids)
    cache.checkpoint(req, up_to=n)
    cache.free_kv_row(req.kv, [(req.kv.cache_protected_len, n)])
    cache.dec_lock_ref(node, lock.to_dec_params())
    cache.on_release(req, checkpointed=True)


def _serve(cache, alloc, rtp, ids: array, rid: str) -> int:
    req, node, lock = _admit(cache, alloc, rtp, ids, rid)
    p = req.kv.cache_protected_len
    for end in range(p + CHUNK, len(ids), CHUNK):
        cache.checkpoint(req, up_to=end)
    _release(cache, req, node, lock)
    return p


def test_a_capped_key_is_matched_to_its_cap_and_its_array_is_the_memo_source():
    """65 tokens served: states at 32 and 64. The same prompt capped at 64 tokens may hit only
    block [0, 32) (one token of the cap is left to compute); the full array would hit 64. The memo
    keeps the request's array itself, so its checkpoints compare no tokens."""
    cache, alloc, rtp = _cache()
    prompt = array("q", range(100, 165))
    _serve(cache, alloc, rtp, prompt, "first")
    ids = array("q", prompt)
    req, m = _match(cache, ids, "second")
    assert m.device_prefix_len == 32
    assert cache.memo._by_rid["second"].source is ids
    cache.on_release(req, checkpointed=False)
    cache.check_integrity()


def test_a_checkpoint_inside_the_locked_hit_takes_no_pool_request():
    """A prompt served, then a request extending it by less than a block: its hit is the cached
    prompt's blocks, so its release checkpoint has nothing to give the tree and admits nothing (only
    the lock's pin is a pool request). Everything is released and the prompt still hits."""
    cache, alloc, rtp = _cache()
    prompt = array("q", range(100, 170))  # 70 tokens: blocks [0, 64), states at 32 and 64
    _serve(cache, alloc, rtp, prompt, "first")
    ids = array("q", list(prompt) + [7, 8, 9])
    req, node, lock = _admit(cache, alloc, rtp, ids, "second")
    assert req.kv.cache_protected_len == 64
    cache.checkpoint(req, up_to=len(ids))
    assert [r for r in cache.pool.request_ids() if not r.startswith("lock:")] == []
    cache.free_kv_row(req.kv, [(64, len(ids))])
    cache.dec_lock_ref(node, lock.to_dec_params())
    cache.on_release(req, checkpointed=True)
    assert cache.pool.request_ids() == [] and cache.total_size() == 64
    assert alloc.available_size() + cache.total_size() == alloc.size
    assert _match(cache, ids, "third")[1].device_prefix_len == 64
    cache.check_integrity()


def test_a_checkpoint_past_the_hit_still_admits_and_stores():
    """The same request extended past a block boundary does give the tree a block: it is admitted."""
    cache, alloc, rtp = _cache()
    prompt = array("q", range(100, 170))
    _serve(cache, alloc, rtp, prompt, "first")
    ids = array("q", list(prompt) + list(range(500, 530)))  # 100 tokens: block [64, 96) is new
    assert _serve(cache, alloc, rtp, ids, "second") == 64
    assert cache.total_size() == 96
    cache.check_integrity()


def test_a_release_less_than_a_block_past_the_last_chunk_end_does_not_grow_the_pool_request():
    """A chunk end stored block [64, 96) and its state; the release at 100 tokens has no new full block
    and no state on a block boundary, so the pool request is neither grown nor committed again."""
    cache, alloc, rtp = _cache()
    prompt = array("q", range(100, 170))
    _serve(cache, alloc, rtp, prompt, "first")
    ids = array("q", list(prompt) + list(range(500, 530)))  # 100 tokens
    req, node, lock = _admit(cache, alloc, rtp, ids, "second")
    cache.checkpoint(req, up_to=96)  # the chunk end: block [64, 96) and a state at 96
    grows = []
    real_grow = cache.pool.grow
    cache.pool.grow = lambda *a, **k: (grows.append(a), real_grow(*a, **k))[1]
    _release(cache, req, node, lock)
    assert grows == [] and cache.total_size() == 96
    assert _match(cache, ids + array("q", [1]), "third")[1].device_prefix_len == 96
    cache.check_integrity()


def test_size_queries_read_the_pool_of_the_moment_across_a_reset():
    """The size queries read the pool's idle counters through callables bound at reset: after a
    flush (reset) they must read the new pool, not the old one's counts."""
    cache, alloc, rtp = _cache()
    _serve(cache, alloc, rtp, array("q", range(100, 170)), "first")
    assert cache.evictable_size() == cache.pool.idle_blocks("full") * cache.bs == 64
    assert cache.mamba_evictable_size() == cache.pool.idle_blocks("linear") == 2
    assert cache.protected_size() == 0
    cache.reset()
    assert cache.evictable_size() == cache.mamba_evictable_size() == cache.protected_size() == 0
    _serve(cache, alloc, rtp, array("q", range(300, 340)), "second")
    assert cache.evictable_size() == cache.pool.idle_blocks("full") * cache.bs == 32
    assert cache.mamba_evictable_size() == cache.pool.idle_blocks("linear") == 1


def test_the_slots_of_rows_that_are_not_one_run_come_back_in_order():
    m = Mirror(2, 8, torch.device("cpu"), free_kv=lambda s: None, free_state=lambda s: None)
    m.kv_table.copy_(torch.arange(16).view(8, 2))
    assert m.kv_slots_of_rows([3, 4, 7, 1, 2]).tolist() == [6, 7, 8, 9, 14, 15, 2, 3, 4, 5]
    many = [7 - (i % 8) for i in range(40)]  # more rows than a cat of slices is worth
    assert m.kv_slots_of_rows(many).tolist() == torch.arange(16).view(8, 2)[many].reshape(-1).tolist()


def test_a_match_copies_no_tokens_and_a_locked_hit_reads_its_slots_in_place():
    """The match handle and the memo keep the request's own array (SGLang only appends to it): no
    copy of the prompt per match. A locked hit's KV slots are a view of the mirror's table (its rows
    are not reused while pinned), equal to the slots the first request wrote. Output tokens appended
    in place are hashed on the request's next checkpoint, from the same array."""
    cache, alloc, rtp = _cache()
    prompt = array("q", range(100, 170))  # blocks [0, 64), states at 32 and 64
    _serve(cache, alloc, rtp, prompt, "first")
    cached = cache.mirror.kv_slots(list(cache.memo.get(None, prompt).hashes[:2]))
    ids = array("q", list(prompt) + [7, 8, 9])
    req, node, lock = _admit(cache, alloc, rtp, ids, "second")
    assert node.ids is ids and node.length == 64 and node.tokens == ids[:64]
    assert cache.memo._by_rid["second"].tokens is ids
    path = cache.path_device_indices(node)
    assert path.untyped_storage().data_ptr() == cache.mirror.kv_table.untyped_storage().data_ptr()
    assert torch.equal(path, cached)
    ids.extend(range(500, 530))  # decode output, appended in place as SGLang's refresh_fill_ids does
    rtp.req_to_token[0, 73:103] = alloc.alloc(30).to(torch.int32)
    cache.checkpoint(req, up_to=96)
    assert cache.memo._by_rid["second"].tokens is ids and len(cache.memo._by_rid["second"].hashes) == 3
    _release(cache, req, node, lock)
    cache.check_integrity()
    assert _match(cache, array("q", ids), "third")[1].device_prefix_len == 96


def test_sglang_runs_no_streaming_session_on_this_backend(monkeypatch):
    """Streaming sessions are SGLang's only in-place rewrite of a request's token array; its tree
    cache factory refuses them with any cache but its own UnifiedRadixCache, so the memo never sees one."""
    cachepool_backend.register()
    memory = NS(radix_cache_backend=cachepool_backend.NAME, enable_hierarchical_cache=False,
                enable_session_radix_cache=False, radix_eviction_policy="lru")
    monkeypatch.setattr(registry, "get_memory", lambda: memory)
    monkeypatch.setattr(registry, "get_serving", lambda: NS(enable_streaming_session=False))
    assert isinstance(registry.create_tree_cache(_ctx()), backend.PrfaasHybridCache)
    monkeypatch.setattr(registry, "get_serving", lambda: NS(enable_streaming_session=True))
    with pytest.raises(NotImplementedError, match="--enable-streaming-session"):
        registry.create_tree_cache(_ctx())


def test_a_session_turn_rewriting_the_last_turns_array_in_place_hits_only_its_own_tokens():
    """What session_controller._share_token_arrays does to the array, were sessions allowed here: turn
    2 appends to turn 1's array and is aborted while waiting (matched, never released: its memo entry
    stays); turn 3 trims the same array back to turn 1's length and appends other tokens. Turn 3's
    hashes are those of its own tokens, turn 2's stale entry is not read for it, and the pool then
    serves each content only its own hit (32-token blocks, states at 32, 64, 96)."""
    cache, alloc, rtp = _cache()
    ids = array("q", range(100, 170))  # turn 1: blocks [0, 64) and their states cached
    _serve(cache, alloc, rtp, ids, "turn1")
    committed = len(ids)
    ids.extend(range(500, 530))  # turn 2: 100 tokens, block [64, 96) not cached
    turn2 = array("q", ids)
    assert _match(cache, ids, "turn2")[1].device_prefix_len == 64
    stale = cache.memo._by_rid["turn2"]
    assert stale.tokens is ids and stale.hashes == block_hashes(turn2, 32, cache.memo.seed)[:3]
    del ids[committed:]  # turn 3, in place
    ids.extend(range(900, 930))
    want = block_hashes(ids, 32, cache.memo.seed)
    req, m = _match(cache, ids, "turn3")
    assert m.device_prefix_len == 64 and m.last_device_node.hashes == tuple(want[:2])
    assert cache.memo._by_rid["turn3"].hashes == want[:3] != stale.hashes  # the same array, its own hashes
    cache.on_release(req, checkpointed=False)
    assert _serve(cache, alloc, rtp, ids, "turn3") == 64
    assert _match(cache, ids + array("q", [1]), "again")[1].device_prefix_len == 96
    assert _match(cache, turn2 + array("q", [1]), "turn2-copy")[1].device_prefix_len == 64
    cache.check_integrity()
