"""prfaas_hybrid's tiers on a PD decode server (DecodeKvCache, KV only), in process over SGLang's real KV
allocator and MambaPool (CPU tensors): what the decode's device pool evicts goes to the host or file tier
as KV entries, and a later match of the prompt (SGLang's decode_prefix_len) is extended from them at any
block boundary, byte-exact, without a state; a corrupt entry ends the hit at the block before it."""
from __future__ import annotations

import time
from array import array
from types import SimpleNamespace as NS

import pytest
import torch
from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
from sglang.srt.mem_cache.memory_pool import MambaPool
from sglang.srt.mem_cache.radix_cache import RadixKey

from prfaas_sgl.cachepool.tiers import KV, STATE
from prfaas_sgl.config import PrfaasConfig
from prfaas_sgl.srt import flags
from prfaas_sgl.srt.cachepool_backend import cache as backend
from prfaas_sgl.srt.cachepool_backend import tier_prefetch
from prfaas_sgl.srt.cachepool_backend.decode_kv import DecodeKvCache
from prfaas_sgl.srt.cachepool_backend.tier_decode import KvTiers

BS, SLOTS, KV_TOKENS = 16, 4, 8 * 16
PROMPT = list(range(100, 100 + 5 * BS + 3))  # 5 full blocks and 3 tokens: a hit of 5 blocks at most


def _cache(tmp_path, kv_tokens=KV_TOKENS, **tier_flags):
    shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=64, n_groups=2, num_heads=4, head_dim=16,
                                    state_size=16, conv_kernel=4)
    mamba = MambaPool(size=SLOTS, spec_state_size=0, cache_params=Mamba2CacheParams(shape=shape, layers=[0, 1]),
                      mamba_layer_ids=[0, 1], device="cpu")
    rtp = NS(req_to_token=torch.zeros((4, kv_tokens), dtype=torch.int32), mamba_pool=mamba,
             mamba_allocator=NS(alloc=lambda k: None, free=lambda idx: None),
             translate_mamba_indices=lambda i: i, free_mamba_cache=lambda req: None)
    kvcache = NS(k_buffer=[torch.zeros(kv_tokens + 1, 2, 8) for _ in range(2)],
                 v_buffer=[torch.zeros(kv_tokens + 1, 2, 8) for _ in range(2)])
    kv = TokenToKVPoolAllocator(kv_tokens, torch.float32, "cpu", kvcache, False)
    cfg = PrfaasConfig(tier_storage_path=str(tmp_path / "store"), **tier_flags)
    # the decode's chunk size is the prefill's business: any value (SGLang's default here)
    args = NS(chunked_prefill_size=8192, disaggregation_mode="decode", model_path="tiny",
              **{flags.CONFIG_ATTR: cfg})
    ctx = NS(params=NS(page_size=1, token_to_kv_pool_allocator=kv, req_to_token_pool=rtp), server_args=args,
             is_hybrid_ssm=True, is_hybrid_swa=False, enable_hierarchical_cache=False, disable_radix_cache=False,
             tp_rank=0, tp_size=1)
    return backend.build(ctx), kv, kvcache


def _receive(cache, kv, kvcache, tokens, seed):
    """What a decode holds once prfaas_zmq wrote a request's KV and it finished: random KV in its row,
    cached at release. Returns the KV bytes per token."""
    g = torch.Generator().manual_seed(seed)
    req = NS(rid=f"r{seed}", extra_key=None, cache_salt=None, full_untruncated_fill_ids=array("q", tokens),
             finished=lambda: True, kv=NS(req_pool_idx=0, holds_mamba=False, kv_committed_len=len(tokens)))
    slots = kv.alloc(len(tokens))
    cache.req_to_token_pool.req_to_token[0, :len(tokens)] = slots.to(torch.int32)
    for t in kvcache.k_buffer + kvcache.v_buffer:
        t[slots] = torch.randn(t[slots].shape, generator=g)
    cache.checkpoint(req, up_to=len(tokens))
    kv_of_token = [torch.cat([t[slots[i]].reshape(-1) for t in kvcache.k_buffer + kvcache.v_buffer])
                   for i in range(len(tokens))]
    kv.free(slots[len(tokens) // BS * BS:])  # the tail SGLang frees; the tree took the full blocks
    cache.on_release(req, checkpointed=True)
    return kv_of_token


def _match(cache, tokens, rid="again"):
    """The decode prealloc queue's match (disaggregation/decode.py _match_prefix_and_lock)."""
    req = NS(rid=rid, kv=NS(req_pool_idx=1, holds_mamba=False))
    return cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens)), req=req,
                                                cow_mamba=cache.supports_mamba()))


def _evict_all(cache):
    cache.evict(EvictParams(num_tokens=KV_TOKENS))
    assert not cache.mirror.kv_of


def _assert_kv(cache, kvcache, res, want):
    slots = cache.path_device_indices(res.last_device_node)
    for i, s in enumerate(slots.tolist()):
        got = torch.cat([t[s].reshape(-1) for t in kvcache.k_buffer + kvcache.v_buffer])
        assert torch.equal(got, want[i]), i


@pytest.mark.parametrize("tiers", [dict(tier_host_bytes=1 << 20), dict(tier_storage="file")], ids=["host", "file"])
def test_a_decode_prefix_its_device_pool_evicted_is_loaded_back_byte_exact(tmp_path, tiers):
    cache, kv, kvcache = _cache(tmp_path, **tiers)
    assert isinstance(cache, DecodeKvCache) and isinstance(cache.tiers, KvTiers)
    want = _receive(cache, kv, kvcache, PROMPT, seed=1)
    _evict_all(cache)
    assert cache.tiers.stack.stats.put == 5  # one KV entry per block, no state
    res = _match(cache, PROMPT + [7, 8])
    assert res.device_prefix_len == 5 * BS  # every block boundary is a decode hit: no state grid
    _assert_kv(cache, kvcache, res, want)
    assert cache.tiers.loaded_blocks == 5 and cache.tiers.loaded_states == 0
    cache.check_integrity()


def test_a_decode_hit_extends_past_its_device_part_at_a_boundary_off_any_state_grid(tmp_path):
    cache, kv, kvcache = _cache(tmp_path, tier_host_bytes=1 << 20)
    want = _receive(cache, kv, kvcache, PROMPT, seed=2)
    # blocks 0-1 stay on the device (locked while the rest is evicted): device hit 2 blocks, tier part 1
    node = _match(cache, PROMPT[:2 * BS + 1], rid="first").last_device_node
    receipt = cache.inc_lock_ref(node)
    cache.evict(EvictParams(num_tokens=KV_TOKENS))
    cache.dec_lock_ref(node, receipt.to_dec_params())
    assert len(cache.mirror.kv_of) == 2
    res = _match(cache, PROMPT[:3 * BS + 5])
    assert res.device_prefix_len == 3 * BS and cache.tiers.loaded_blocks == 1
    _assert_kv(cache, kvcache, res, want)


def test_a_corrupt_decode_entry_ends_the_hit_at_the_block_before_it_and_leaks_nothing(tmp_path):
    cache, kv, kvcache = _cache(tmp_path, tier_host_bytes=1 << 20)
    want = _receive(cache, kv, kvcache, PROMPT, seed=3)
    _evict_all(cache)
    host, key = cache.tiers.stack.host, cache.tiers.stack.fp.key(KV, cache.memo.get("x", PROMPT).hashes[3])
    blob = bytearray(host.get(key))
    blob[-3] ^= 0x10
    host.put(key, bytes(blob))
    res = _match(cache, PROMPT + [7])
    assert res.device_prefix_len == 3 * BS and cache.tiers.stack.stats.corrupt == 1
    _assert_kv(cache, kvcache, res, want)
    cache.check_integrity()
    assert kv.available_size() + cache.evictable_size() == KV_TOKENS  # the unused slot block went back


def test_a_decode_tier_writes_kv_entries_only_in_the_prefills_format(tmp_path):
    cache, kv, kvcache = _cache(tmp_path, tier_storage="file")
    _receive(cache, kv, kvcache, PROMPT, seed=4)
    _evict_all(cache)
    stack, hashes = cache.tiers.stack, cache.memo.get("x", PROMPT).hashes
    assert all(stack.contains(KV, h) for h in hashes[:5])
    assert not any(stack.contains(STATE, h) for h in hashes[:5])
    assert stack.fp.key(KV, hashes[0]).startswith("pfx-")


def _prealloc_queue(cache, rids):
    """A stand-in DecodePreallocQueue: its scheduler's tree_cache and its queue of DecodeRequests."""
    reqs = [NS(req=NS(rid=r, origin_input_ids=list(PROMPT), extra_key=None, cache_salt=None)) for r in rids]
    return NS(scheduler=NS(tree_cache=cache), queue=reqs)


def test_a_decode_storage_hit_is_prefetched_from_arrival_and_matched_without_a_storage_call(tmp_path):
    """DecodePreallocQueue.add starts the prefetch (KV entries only: no state grid on a decode); the prealloc
    pass matches with storage closed and loads the staged entries byte-exact."""
    cache, kv, kvcache = _cache(tmp_path, tier_storage="file")
    want = _receive(cache, kv, kvcache, PROMPT, seed=5)
    _evict_all(cache)
    queue = _prealloc_queue(cache, ["again"])
    tier_prefetch.around_decode_enqueue(lambda q, r: None, queue, queue.queue[0].req)
    pf = cache.tiers.prefetch
    job = pf._jobs["again"]
    assert job.done.wait(10) and job.fetched == 5 and pf.stats.fetched_bytes == 5 * cache.tiers.io.kv_bytes
    gets = []
    storage = cache.tiers.stack.storage
    real_get = storage.get
    storage.get = lambda *a: gets.append(a) or real_get(*a)

    def prealloc_pass(q):
        assert cache.tiers.stack.scheduling
        return _match(cache, PROMPT + [7])

    res = tier_prefetch.around_decode_prealloc(prealloc_pass, queue)
    assert res.device_prefix_len == 5 * BS and gets == [] and pf.stats.used == 5
    assert cache.tiers.stack.stats.storage_hits == 5 and not cache.tiers.stack.scheduling
    _assert_kv(cache, kvcache, res, want)


def test_a_decode_request_sits_out_the_prealloc_pass_while_its_prefetch_runs(tmp_path):
    from prfaas_sgl.cachepool.tiers.prefetch import Job

    cache = _cache(tmp_path, tier_storage="file")[0]
    pf = cache.tiers.prefetch
    queue = _prealloc_queue(cache, "abc")
    pf._jobs["b"] = Job("b", array("q"), time.monotonic() + 0.3)  # still running: never queued to the worker
    seen = []

    def prealloc_pass(q):  # preallocates the first request it sees
        seen.append([d.req.rid for d in q.queue])
        q.queue = q.queue[1:]

    tier_prefetch.around_decode_prealloc(prealloc_pass, queue)
    assert seen == [["a", "c"]] and [d.req.rid for d in queue.queue] == ["b", "c"]
    time.sleep(0.35)  # b's hold runs out
    tier_prefetch.around_decode_prealloc(prealloc_pass, queue)
    assert seen[-1] == ["b", "c"] and pf.stats.abandoned == 1


@pytest.mark.parametrize("tier", ["host", "file", "file_prefetched"])
def test_the_scheduler_thread_cost_of_a_decode_tier_hit(tmp_path, capsys, tier):
    """Measured, bounded only loosely: the match of a 37-block hit (600-token prompt) from the tier on the
    decode's scheduler thread (plan, get, verify, copy into the pool, index); prefetched: the storage part
    read and verified on the worker before the pass, as the prealloc hooks do."""
    flags_ = dict(tier_host_bytes=64 << 20) if tier == "host" else dict(tier_storage="file")
    cache, kv, kvcache = _cache(tmp_path, kv_tokens=1024, **flags_)
    prompt = list(range(1000, 1600))
    _receive(cache, kv, kvcache, prompt, seed=6)
    times = []
    for i in range(7):
        cache.evict(EvictParams(num_tokens=1024))
        if tier == "file_prefetched":
            assert cache.tiers.prefetch.start(f"p{i}", array("q", prompt + [1])).done.wait(10)
        cache.tiers.stack.scheduling = tier == "file_prefetched"
        t0 = time.perf_counter()
        assert _match(cache, prompt + [1], rid=f"p{i}").device_prefix_len == 37 * BS
        times.append(time.perf_counter() - t0)
        cache.tiers.stack.scheduling = False
    med = sorted(times)[3]
    with capsys.disabled():
        print(f"\ndecode {tier} tier hit, 37 KV entries of {cache.tiers.io.kv_bytes} bytes: match median "
              f"{med * 1e3:.2f} ms (min {min(times) * 1e3:.2f})")
    assert med < 1.0
