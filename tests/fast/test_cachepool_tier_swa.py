"""prfaas_hybrid tiers under a sliding-window hybrid, over SGLang's real paged SWATokenToKVPoolAllocator at page
16 on CPU (as test_cachepool_backend_swa_paged.py) with real full and SWA KV buffers: what the device pool
evicts is demoted (a KV entry and a window entry per block), a later match loads the full KV back and the
window pages of the blocks the hit needs byte-exact, a corrupt window ends the hit one boundary early, and
every full and SWA page is free or held by exactly what should hold it afterwards. Before this
change the tier flags refused every sliding-window server at start-up (all of these failed there)."""
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

from prfaas_sgl.cachepool.tiers import KV, WINDOW
from prfaas_sgl.config import PrfaasConfig
from prfaas_sgl.srt import flags
from prfaas_sgl.srt.cachepool_backend import cache as backend
from prfaas_sgl.srt.cachepool_backend.tier_window import WindowTiers

PAGE, FULL_SLOTS, SWA_SLOTS, ROWS, CHUNK, SWS = 16, 1024, 512, 4, 32, 23  # window 24 tokens: 2 blocks
PROMPT = list(range(100, 220))  # 120 tokens: blocks 0-6 (112 tokens) cached


class _Kv(BaseSWAKVPool):
    swa_req_ring_size = None

    def register_mapping(self, mapping):
        self.full_to_swa_index_mapping = mapping

    def translate_loc_from_full_to_swa(self, idx):
        return self.full_to_swa_index_mapping[idx]


_Kv.__abstractmethods__ = frozenset()


def _buffers(slots: int) -> NS:
    return NS(k_buffer=[torch.zeros(slots + PAGE, 2, 4) for _ in range(2)],
              v_buffer=[torch.zeros(slots + PAGE, 2, 4) for _ in range(2)])


def _cache(tmp_path, mode="null", **tier_flags):
    kv = object.__new__(_Kv)
    kv.full_kv_pool, kv.swa_kv_pool = _buffers(FULL_SLOTS), _buffers(SWA_SLOTS)
    alloc = SWATokenToKVPoolAllocator(FULL_SLOTS, SWA_SLOTS, PAGE, torch.float32, "cpu", kv, False)
    rtp = NS(req_to_token=torch.zeros((ROWS, 320), dtype=torch.int32))
    cfg = PrfaasConfig(tier_storage_path=str(tmp_path / "l3"), **tier_flags)
    args = NS(chunked_prefill_size=CHUNK, disaggregation_mode=mode, model_path="tiny-swa", **{flags.CONFIG_ATTR: cfg})
    params = NS(page_size=PAGE, token_to_kv_pool_allocator=alloc, req_to_token_pool=rtp, sliding_window_size=SWS)
    ctx = NS(params=params, server_args=args, is_hybrid_ssm=False, is_hybrid_swa=True, enable_hierarchical_cache=False,
             disable_radix_cache=False, full_tokens_per_layer=100, tp_rank=0, tp_size=1)
    return backend.build(ctx), alloc, kv


def _tensors(pool: NS) -> list[torch.Tensor]:
    return pool.k_buffer + pool.v_buffer


def _at(pool: NS, slot: int) -> torch.Tensor:
    return torch.cat([t[slot].reshape(-1) for t in _tensors(pool)])


def _prefill(cache, alloc, kv, tokens: list[int], seed: int, row: int = 0):
    """A colocated/PD-prefill request at page 16 (matched, random KV written into its full slots and their
    SWA peers, checkpointed per chunk, finished, released). Returns per position (full KV, window KV)."""
    done = [False]
    req = NS(rid=f"r{seed}", extra_key=None, cache_salt=None, full_untruncated_fill_ids=array("q", tokens),
             kv=ReqKvInfo(req_pool_idx=row), finished=lambda: done[0])
    node = _match(cache, tokens[:-1])
    lock = cache.inc_lock_ref(node)
    k = len(node.tokens)
    slots_row = cache.req_to_token_pool.req_to_token[row]
    slots_row[:k] = cache.path_device_indices(node).to(torch.int32)
    req.kv.cache_protected_len = k
    t = lambda v: torch.tensor([v], dtype=torch.int64)  # noqa: E731
    last = int(slots_row[k - 1]) if k else -1
    new = alloc.alloc_extend(t(k), t(k), t(len(tokens)), t(len(tokens)), t(last), len(tokens) - k)
    slots_row[k:len(tokens)] = new.to(torch.int32)
    g = torch.Generator().manual_seed(seed)
    peers = alloc.full_to_swa_index_mapping[new]
    for ts, idx in ((_tensors(kv.full_kv_pool), new), (_tensors(kv.swa_kv_pool), peers)):
        for tensor in ts:
            tensor[idx] = torch.randn(tensor[idx].shape, generator=g)
    full = slots_row[:len(tokens)].to(torch.int64)
    wanted = [(_at(kv.full_kv_pool, int(s)), _at(kv.swa_kv_pool, int(alloc.full_to_swa_index_mapping[s])))
              for s in full]
    for end in range(k + CHUNK, len(tokens), CHUNK):
        cache.checkpoint(req, up_to=end)
    done[0] = True
    cache.checkpoint(req, up_to=len(tokens))
    cache.free_kv_row(req.kv, [(req.kv.cache_protected_len, len(tokens))])
    cache.on_release(req, checkpointed=True)
    cache.dec_lock_ref(node, lock)
    return wanted


def _match(cache, tokens: list[int]):
    req = NS(rid="probe", kv=ReqKvInfo())
    return cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens)), req=req)).last_device_node


def _evict_all(cache, alloc) -> None:
    cache.evict(EvictParams(num_tokens=FULL_SLOTS))
    assert not cache.mirror.kv_of and not cache.mirror.swa_of
    assert (alloc.full_available_size(), alloc.swa_available_size()) == (FULL_SLOTS, SWA_SLOTS)


def _nothing_leaked(cache, alloc) -> None:
    cache.check_integrity()
    _evict_all(cache, alloc)
    cache.check_integrity()


@pytest.mark.parametrize("tiers, mode", [(dict(tier_host_bytes=1 << 20), "null"), (dict(tier_storage="file"), "null"),
                                         (dict(tier_host_bytes=1 << 20), "prefill")], ids=["host", "file", "pd_prefill"])
def test_an_evicted_swa_prefix_loads_back_byte_exact_with_its_window(tmp_path, tiers, mode):
    cache, alloc, kv = _cache(tmp_path, mode=mode, **tiers)
    assert isinstance(cache.tiers, WindowTiers) and cache.tiers.window_blocks == 2
    wanted = _prefill(cache, alloc, kv, PROMPT, seed=1)
    _evict_all(cache, alloc)
    assert cache.tiers.stack.stats.put == 14  # 7 KV blocks + 7 windows
    node = _match(cache, PROMPT + [7] * 30)
    assert len(node.tokens) == 112
    slots = cache.path_device_indices(node)
    for i, s in enumerate(slots.tolist()):
        assert torch.equal(_at(kv.full_kv_pool, s), wanted[i][0]), i
    # the hit's window: blocks 5-6 (tokens [80, 112)) have live SWA pages holding the prompt's own window;
    # blocks 0-4 were loaded full-side only (no window page spent on them)
    peers = alloc.full_to_swa_index_mapping[slots]
    assert bool((peers[80:] > 0).all()) and bool((peers[:80] == 0).all())
    for i in range(80, 112):
        assert torch.equal(_at(kv.swa_kv_pool, int(peers[i])), wanted[i][1]), i
    assert (cache.tiers.loaded_blocks, cache.tiers.loaded_windows) == (7, 2)
    assert alloc.swa_available_size() == SWA_SLOTS - 32
    cache.check_integrity()
    assert len(_match(cache, PROMPT + [7] * 30).tokens) == 112  # the device pool holds the hit now
    _prefill(cache, alloc, kv, PROMPT + [7] * 30, seed=2, row=1)  # a request then runs on the loaded prefix
    _nothing_leaked(cache, alloc)


@pytest.mark.parametrize("kind, other", [(WINDOW, KV), (KV, WINDOW)], ids=["window", "kv"])
def test_a_corrupt_last_entry_ends_the_hit_one_boundary_early_and_leaks_nothing(tmp_path, kind, other):
    """Block 6's window (or its KV) is corrupt: the hit ends at block 6 with the windows of blocks 4-5
    loaded instead, block 6's slots go back, and its other entry stays in the tier."""
    cache, alloc, kv = _cache(tmp_path, tier_host_bytes=1 << 20)
    wanted = _prefill(cache, alloc, kv, PROMPT, seed=3)
    _evict_all(cache, alloc)
    host, fp = cache.tiers.stack.host, cache.tiers.stack.fp
    key = fp.key(kind, cache.pool.hashes(PROMPT)[6])
    blob = bytearray(host.get(key))
    blob[-3] ^= 0x10
    host.put(key, bytes(blob))
    node = _match(cache, PROMPT + [7] * 30)
    assert len(node.tokens) == 96 and cache.tiers.stack.stats.corrupt == 1 and key not in host
    peers = alloc.full_to_swa_index_mapping[cache.path_device_indices(node)]
    for i in range(64, 96):
        assert torch.equal(_at(kv.swa_kv_pool, int(peers[i])), wanted[i][1]), i
    assert cache.tiers.loaded_blocks == 6 and not cache.mirror.kv_of.keys() & {cache.pool.hashes(PROMPT)[6]}
    assert alloc.full_available_size() == FULL_SLOTS - 96 and alloc.swa_available_size() == SWA_SLOTS - 32
    assert fp.key(other, cache.pool.hashes(PROMPT)[6]) in host
    _nothing_leaked(cache, alloc)


def test_a_window_the_device_evicted_is_loaded_for_full_kv_it_still_holds(tmp_path):
    """Short of window pages only, SWA entries go first: the full KV stays on the device, the windows go to
    the tier, and a match pairs fresh SWA pages with the device's own full slots."""
    cache, alloc, kv = _cache(tmp_path, tier_host_bytes=1 << 20)
    wanted = _prefill(cache, alloc, kv, PROMPT, seed=4)
    cache.evict(EvictParams(num_tokens=0, swa_num_tokens=112))  # the 7 windows, nothing more
    assert len(cache.mirror.kv_of) == 7 and not cache.mirror.swa_of
    node = _match(cache, PROMPT + [7])
    assert len(node.tokens) == 112 and cache.tiers.loaded_blocks == 0 and cache.tiers.loaded_windows == 2
    slots = cache.path_device_indices(node)
    peers = alloc.full_to_swa_index_mapping[slots]
    for i in range(80, 112):
        assert torch.equal(_at(kv.swa_kv_pool, int(peers[i])), wanted[i][1]), i
    _nothing_leaked(cache, alloc)


@pytest.mark.parametrize("mode", ["null", "prefill"])
def test_tier_flags_serve_colocated_and_pd_prefill_sliding_window_servers(tmp_path, mode):
    assert isinstance(_cache(tmp_path, mode=mode, tier_host_bytes=1 << 20)[0].tiers, WindowTiers)


def test_a_sliding_window_decode_loads_an_evicted_prefix_into_full_pages_only(tmp_path):
    """A PD decode (DecodeWindowKvCache, KV only): a request as SGLang preallocates it (SWA peers for its
    tail only) is released, its 7 full blocks evicted into the host tier; a later match capped before the
    new request's tail (SGLang's max_prefix_len) is loaded back into full pages from the full side of the
    allocator, byte-exact, no window page taken, everything given back on eviction."""
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    from prfaas_sgl.srt.cachepool_backend.tier_decode import WindowKvTiers

    from . import test_cachepool_backend_swa_paged as paged

    cache, alloc, kv = _cache(tmp_path, mode="decode", tier_host_bytes=1 << 20)
    assert type(cache.tiers) is WindowKvTiers
    req, done = paged._request(cache, 0, PROMPT)
    new = paged._alloc(alloc, cache.req_to_token_pool.req_to_token[0], 0, 120, swa_tail=24)
    req.kv.set_evicted_seqlen(ComponentType.SWA, 120 - 24)
    g = torch.Generator().manual_seed(11)
    for t in _tensors(kv.full_kv_pool):  # what prfaas_zmq wrote into the full slots
        t[new] = torch.randn(t[new].shape, generator=g)
    want = [_at(kv.full_kv_pool, int(s)) for s in new[:112]]
    paged._release(cache, req, done, 120)
    cache.evict(EvictParams(num_tokens=FULL_SLOTS))
    assert not cache.mirror.kv_of and cache.tiers.stack.stats.put == 7  # KV entries only
    node = paged._match(cache, PROMPT + [7] * 30, limit=112)
    assert len(node.tokens) == 96 and cache.tiers.loaded_blocks == 6  # the key's last token stays uncached
    for i, s in enumerate(cache.path_device_indices(node).tolist()):
        assert torch.equal(_at(kv.full_kv_pool, s), want[i]), i
    assert alloc.swa_available_size() == SWA_SLOTS and alloc.full_available_size() == FULL_SLOTS - 96
    paged._drained(cache, alloc)


def test_the_window_plan_needs_the_last_window_blocks_and_device_windows_before_the_device_hit():
    from prfaas_sgl.cachepool.tiers.plan import window_extension

    hashes, asked, gone = list(range(10)), [], {7}

    def tier(h):
        asked.append(h)
        return h not in gone

    plan = lambda start, device: window_extension(hashes, start, 9, 2, lambda h: h < 9, device.__contains__, tier)  # noqa: E731
    assert plan(2, {0, 1}) == 7  # block 7's window missing: k = 9, 8 need it; k = 7 needs blocks 5-6
    assert asked == [8, 7, 6, 5]  # nearest first, each block once
    gone.add(5)  # k = 7, 6 need block 5's window; k = 5 needs block 3's, before the device hit: device only
    assert plan(4, set()) == 4 and plan(4, {3}) == 5
