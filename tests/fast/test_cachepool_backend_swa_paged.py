"""prfaas_hybrid for a sliding-window hybrid at page size 16, the page size SGLang's PD decode needs
for such a model (it then preallocates only the SWA tail), over SGLang's real paged
SWATokenToKVPoolAllocator and ReqKvInfo: the PD prefill keeps SlidingWindowCache, the PD decode gets
DecodeWindowKvCache (full-attention KV only). After each scenario every full and SWA page is free or
held by exactly what should hold it, counted through the allocator's own sizes."""
from __future__ import annotations

from array import array
from types import SimpleNamespace as NS

import pytest
import torch
from sglang.srt.managers.schedule_batch import ReqKvInfo
from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
from sglang.srt.mem_cache.base_swa_memory_pool import BaseSWAKVPool
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

from prfaas_sgl.srt.cachepool_backend import cache as backend

PAGE, FULL_SLOTS, SWA_SLOTS, ROWS, CHUNK, SWS = 16, 1024, 512, 4, 32, 23


class _Kv(BaseSWAKVPool):
    full_kv_pool = swa_kv_pool = None
    swa_req_ring_size = None

    def register_mapping(self, mapping):
        self.full_to_swa_index_mapping = mapping

    def translate_loc_from_full_to_swa(self, idx):
        return self.full_to_swa_index_mapping[idx]


_Kv.__abstractmethods__ = frozenset()


def allocator(page: int = PAGE) -> SWATokenToKVPoolAllocator:
    return SWATokenToKVPoolAllocator(FULL_SLOTS, SWA_SLOTS, page, torch.float32, "cpu", object.__new__(_Kv), False)


def ctx(alloc, mode="null", ssm=False):
    rtp = NS(req_to_token=torch.zeros((ROWS, 320), dtype=torch.int32))
    params = NS(page_size=alloc.page_size, token_to_kv_pool_allocator=alloc, req_to_token_pool=rtp,
                sliding_window_size=SWS)
    return NS(params=params, server_args=NS(chunked_prefill_size=CHUNK, disaggregation_mode=mode),
              is_hybrid_ssm=ssm, is_hybrid_swa=True, enable_hierarchical_cache=False, disable_radix_cache=False,
              full_tokens_per_layer=100)


def _alloc(alloc, row_slots, prefix: int, end: int, swa_tail: int | None = None) -> torch.Tensor:
    """SGLang's paged extend of row positions [prefix, end) (swa_tail: the decode's tail-only SWA)."""
    last = int(row_slots[prefix - 1]) if prefix else -1
    t = lambda v: torch.tensor([v], dtype=torch.int64)  # noqa: E731
    args = (t(prefix), t(prefix), t(end), t(end), t(last), end - prefix)
    out = alloc.alloc_extend(*args) if swa_tail is None else alloc.alloc_extend_swa_tail(*args, swa_tail)
    row_slots[prefix:end] = out.to(torch.int32)
    return out


def _request(cache, row: int, tokens: list[int]):
    done = [False]
    req = NS(rid=f"r{row}-{len(tokens)}", extra_key=None, cache_salt=None, full_untruncated_fill_ids=array("q", tokens),
             kv=ReqKvInfo(req_pool_idx=row), finished=lambda: done[0])
    return req, done


def _match(cache, tokens: list[int], limit: int | None = None):
    req = NS(rid="probe", kv=ReqKvInfo())
    key = RadixKey(array("q", tokens[:limit]))
    return cache.match_prefix(MatchPrefixParams(key=key, req=req)).last_device_node


def _release(cache, req, done, end: int) -> None:
    done[0] = True
    cache.checkpoint(req, up_to=end)
    cache.free_kv_row(req.kv, [(req.kv.cache_protected_len, end)])
    cache.on_release(req, checkpointed=True)


def _prefill(cache, alloc, row: int, tokens: list[int]) -> None:
    """Colocated or PD-prefill request: matched, computed in CHUNK chunks, finished and released."""
    req, done = _request(cache, row, tokens)
    node = _match(cache, tokens, -1)
    lock = cache.inc_lock_ref(node)
    k = len(node.tokens)
    rows = cache.req_to_token_pool.req_to_token[row]
    rows[:k] = cache.path_device_indices(node).to(torch.int32)
    req.kv.cache_protected_len = k
    _alloc(alloc, rows, k, len(tokens))
    for end in range(k + CHUNK, len(tokens), CHUNK):
        cache.checkpoint(req, up_to=end)
    _release(cache, req, done, len(tokens))
    cache.dec_lock_ref(node, lock)


def _drained(cache, alloc) -> None:
    cache.evict(EvictParams(num_tokens=FULL_SLOTS))
    assert not cache.mirror.kv_of and not cache.mirror.swa_of
    assert (alloc.full_available_size(), alloc.swa_available_size()) == (FULL_SLOTS, SWA_SLOTS)
    cache.check_integrity()


@pytest.mark.parametrize("mode, kind", [("null", backend.SlidingWindowCache), ("prefill", backend.SlidingWindowCache),
                                        ("decode", backend.DecodeWindowKvCache)])
def test_every_role_serves_a_sliding_window_model_at_page_16(mode, kind):
    cache = backend.build(ctx(allocator(), mode=mode))
    assert type(cache) is kind and cache.supports_swa() and cache.sliding_window_size == SWS
    assert [m.kind for m in cache.pool.managers] == (["full"] if mode == "decode" else ["full", "swa"])


def test_page_sizes_the_index_blocks_cannot_hold_are_refused():
    with pytest.raises(ValueError, match="needs a --page-size dividing 16"):
        backend.build(ctx(allocator(page=3)))
    with pytest.raises(ValueError, match="needs --page-size > 1"):  # decode at page 1 lets a hit reach the window
        backend.build(ctx(allocator(page=1), mode="decode"))
    with pytest.raises(ValueError, match="needs --page-size 1 for a linear-attention model"):
        backend.build(_linear(allocator()))


def _linear(alloc):
    c = ctx(alloc)
    c.is_hybrid_swa, c.is_hybrid_ssm = False, True
    return c


@pytest.mark.parametrize("mode", ["null", "prefill"])
def test_a_paged_prefill_hits_whole_pages_with_their_window_and_frees_every_page(mode):
    """120 tokens at page 16: the tree takes blocks 0-6 (112 tokens); the half page [112, 120) goes back at
    release. A 150-token extension hits at 112 on the prompt's own slots and window pages, and after
    both requests and an eviction of everything, every full and SWA page is free."""
    alloc = allocator()
    cache = backend.build(ctx(alloc, mode=mode))
    first = list(range(100, 220))
    _prefill(cache, alloc, 0, first)
    assert alloc.full_available_size() == FULL_SLOTS - 112
    assert alloc.swa_available_size() == SWA_SLOTS - 112  # SGLang's test driver evicts no window here
    node = _match(cache, first + [7] * 30)
    assert len(node.tokens) == 112
    slots = cache.path_device_indices(node)
    assert torch.equal(slots, cache.req_to_token_pool.req_to_token[0, :112].to(torch.int64))
    assert bool((alloc.full_to_swa_index_mapping[slots[112 - SWS - 1:]] > 0).all())
    _prefill(cache, alloc, 1, first + [7] * 30)
    assert len(cache.mirror.kv_of) == 9  # 150 // 16
    cache.check_integrity()
    _drained(cache, alloc)


def test_the_decode_tree_keeps_full_pages_only_and_hits_before_the_tail():
    """A decode request as SGLang preallocates it at page 16 (SWA peers for the tail only, the SWA
    evicted cursor at the tail start): at release the tree takes the full pages of [0, 112) and no
    window page, so every SWA page goes back; the next request hits the full prefix up to its own tail."""
    alloc = allocator()
    cache = backend.build(ctx(alloc, mode="decode"))
    tokens, tail = list(range(100, 220)), 24  # SGLang: tail start = (120 - 1 - max(23, 16)) // 16 * 16 = 96
    req, done = _request(cache, 0, tokens)
    rows = cache.req_to_token_pool.req_to_token[0]
    _alloc(alloc, rows, 0, 120, swa_tail=tail)
    req.kv.set_evicted_seqlen(ComponentType.SWA, 120 - tail)
    assert alloc.swa_available_size() == SWA_SLOTS - 2 * PAGE
    _release(cache, req, done, 120)
    assert (alloc.full_available_size(), alloc.swa_available_size()) == (FULL_SLOTS - 112, SWA_SLOTS)
    assert cache.swa_evictable_size() == cache.swa_protected_size() == 0
    # the next match stops before its own tail (SGLang's max_prefix_len: 150 - 38 = 112 tokens), and the
    # pool's match leaves a key's last token uncached: a 96-token hit on the prompt's own full slots
    node = _match(cache, tokens + [7] * 30, limit=112)
    assert len(node.tokens) == 96
    assert torch.equal(cache.path_device_indices(node), cache.mirror.kv_slots(cache.pool.hashes(tokens)[:6]))
    assert cache.evict(EvictParams(num_tokens=0, swa_num_tokens=64)).num_tokens_evicted == 0
    _drained(cache, alloc)


@pytest.mark.parametrize("backend_name, refused", [("prfaas_hybrid", False), (None, True)])
def test_sglangs_decode_cache_check_lets_the_pool_serve_swa_compress_models(backend_name, refused):
    """SGLang refuses a decode radix cache for MiMo-V2-style models (own SWA head geometry) because its own
    tree cannot serve them; the hook lifts that one refusal for prfaas_hybrid only."""
    from sglang.srt import runtime_context as sglang_rc
    from sglang.srt.mem_cache import kv_cache_builder
    from sglang.srt.server_args import ServerArgs

    from prfaas_sgl.srt import cachepool_backend

    cachepool_backend.register()
    sglang_rc.reset_context()
    sglang_rc.publish(ServerArgs(model_path="dummy", device="cpu", radix_cache_backend=backend_name), role="tokenizer")
    try:
        check = lambda: cachepool_backend.around_decode_cache_check(  # noqa: E731
            kv_cache_builder.validate_decode_radix_cache, model_config=NS(is_hybrid_swa_compress=True),
            token_to_kv_pool=object(), is_hybrid_swa=True, enable_hierarchical_cache=False)
        if refused:
            with pytest.raises(ValueError, match="SWA-compress"):
                check()
        else:
            check()
    finally:
        sglang_rc.reset_context()
