"""prfaas_hybrid with tiers, in process over SGLang's real MambaPool and KV allocator (CPU tensors): what
the device pool evicts is demoted (KV blocks and state checkpoints), a later match of the same prompt is
extended from the host or file tier and loads the exact bytes back into fresh slots, and every tier
fault (corrupt entry, tier too small, another model's entries) ends the hit early instead of raising."""
from __future__ import annotations

import os
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

from prfaas_sgl.cachepool.tiers import KV
from prfaas_sgl.config import PrfaasConfig
from prfaas_sgl.srt import flags
from prfaas_sgl.srt.cachepool_backend import cache as backend

CHUNK, SLOTS, KV_TOKENS = 32, 8, 3 * 32
PROMPT = list(range(100, 100 + 2 * CHUNK + 5))


def _cache(tmp_path, model: str = "tiny", mode: str = "null", **tier_flags):
    shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=64, n_groups=2, num_heads=4, head_dim=16,
                                    state_size=16, conv_kernel=4)
    mamba = MambaPool(size=SLOTS, spec_state_size=0, cache_params=Mamba2CacheParams(shape=shape, layers=[0, 1]),
                      mamba_layer_ids=[0, 1], device="cpu")
    free = set(range(3, SLOTS + 1))  # slots 1-2 are the requests' own

    def alloc(k):
        return torch.tensor([free.pop() for _ in range(k)], dtype=torch.int64) if len(free) >= k else None

    rtp = NS(req_to_token=torch.zeros((4, 256), dtype=torch.int32), mamba_pool=mamba,
             mamba_allocator=NS(alloc=alloc, free=lambda idx: free.update(idx.reshape(-1).tolist())),
             translate_mamba_indices=lambda i: i, free_mamba_cache=lambda req: None)
    kvcache = NS(k_buffer=[torch.zeros(KV_TOKENS + 1, 2, 8) for _ in range(2)],
                 v_buffer=[torch.zeros(KV_TOKENS + 1, 2, 8) for _ in range(2)])
    kv = TokenToKVPoolAllocator(KV_TOKENS, torch.float32, "cpu", kvcache, False)
    cfg = PrfaasConfig(tier_storage_path=str(tmp_path / "l3"), **tier_flags)
    args = NS(chunked_prefill_size=CHUNK, disaggregation_mode=mode, model_path=model, **{flags.CONFIG_ATTR: cfg})
    ctx = NS(params=NS(page_size=1, token_to_kv_pool_allocator=kv, req_to_token_pool=rtp), server_args=args,
             is_hybrid_ssm=True, is_hybrid_swa=False, enable_hierarchical_cache=False, disable_radix_cache=False,
             tp_rank=0, tp_size=1)
    return backend.build(ctx), mamba, kv, kvcache


def _compute(cache, mamba, kv, kvcache, tokens, seed):
    """What a prefill of `tokens` leaves: random KV in its row, a random state at each chunk end
    (checkpointed), then the request's release. Returns {boundary: state tensors}, the row's KV."""
    g = torch.Generator().manual_seed(seed)
    req = NS(rid=f"r{seed}", extra_key=None, cache_salt=None, full_untruncated_fill_ids=array("q", tokens),
             finished=lambda: False,
             kv=NS(req_pool_idx=0, mamba_pool_idx=torch.tensor(1), mamba_cow_src_index=None,
                   mamba_needs_clear=False, holds_mamba=True))
    slots = kv.alloc(len(tokens))
    cache.req_to_token_pool.req_to_token[0, :len(tokens)] = slots.to(torch.int32)
    for t in kvcache.k_buffer + kvcache.v_buffer:
        t[slots] = torch.randn(t[slots].shape, generator=g)
    states = {}
    for b in range(CHUNK, len(tokens) + 1, CHUNK):
        for t in [*mamba.mamba_cache.conv, mamba.mamba_cache.temporal]:
            t[:, 1] = torch.randn(t[:, 1].shape, generator=g).to(t.dtype)
        states[b] = [t[:, 1].clone() for t in [*mamba.mamba_cache.conv, mamba.mamba_cache.temporal]]
        cache.checkpoint(req, up_to=b)
    kv_of_token = [torch.cat([t[slots[i]].reshape(-1) for t in kvcache.k_buffer + kvcache.v_buffer])
                   for i in range(len(tokens))]
    kv.free(slots[len(tokens) // CHUNK * CHUNK:])  # the tail SGLang frees; the tree took the full blocks
    cache.on_release(req, checkpointed=True)
    return states, kv_of_token


def _match(cache, tokens):
    req = NS(rid="again", kv=NS(req_pool_idx=1, mamba_pool_idx=torch.tensor(2), mamba_cow_src_index=None,
                                mamba_needs_clear=False, holds_mamba=True))
    res = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens)), req=req, cow_mamba=True))
    return res, req


def _evict_all(cache):
    cache.evict(EvictParams(num_tokens=KV_TOKENS, mamba_num=SLOTS))
    assert not cache.mirror.kv_of and not cache.mirror.state_of


@pytest.mark.parametrize("tiers, mode", [(dict(tier_host_bytes=1 << 20), "null"), (dict(tier_storage="file"), "null"),
                                         (dict(tier_host_bytes=1 << 20), "prefill")], ids=["host", "file", "pd_prefill"])
def test_an_evicted_prefix_is_loaded_back_byte_exact(tmp_path, tiers, mode):
    cache, mamba, kv, kvcache = _cache(tmp_path, mode=mode, **tiers)
    states, kv_bytes = _compute(cache, mamba, kv, kvcache, PROMPT, seed=1)
    _evict_all(cache)
    assert cache.tiers.stack.stats.put == 4  # 2 KV blocks + 2 state checkpoints
    res, req = _match(cache, PROMPT + [7])
    assert res.device_prefix_len == 2 * CHUNK
    slots = cache.path_device_indices(res.last_device_node)
    for i, s in enumerate(slots.tolist()):
        got = torch.cat([t[s].reshape(-1) for t in kvcache.k_buffer + kvcache.v_buffer])
        assert torch.equal(got, kv_bytes[i]), i
    src = int(req.kv.mamba_cow_src_index)  # the loaded checkpoint the scheduler copies into the request
    for want, t in zip(states[2 * CHUNK], [*mamba.mamba_cache.conv, mamba.mamba_cache.temporal]):
        assert torch.equal(t[:, src], want)
    cache.check_integrity()
    assert cache.tiers.loaded_blocks == 2 and cache.tiers.loaded_states == 2


def test_a_corrupt_block_ends_the_hit_at_the_boundary_before_it(tmp_path):
    cache, mamba, kv, kvcache = _cache(tmp_path, tier_host_bytes=1 << 20)
    _compute(cache, mamba, kv, kvcache, PROMPT, seed=2)
    _evict_all(cache)
    host, key = cache.tiers.stack.host, cache.tiers.stack.fp.key(KV, cache.memo.get("x", PROMPT).hashes[1])
    blob = bytearray(host.get(key))
    blob[-3] ^= 0x10
    host.put(key, bytes(blob))
    res, _ = _match(cache, PROMPT + [7])
    assert res.device_prefix_len == CHUNK and cache.tiers.stack.stats.corrupt == 1
    cache.check_integrity()
    assert kv.available_size() + cache.evictable_size() == KV_TOKENS  # nothing leaked


def test_a_tier_too_small_misses_and_recomputes(tmp_path):
    cache, mamba, kv, kvcache = _cache(tmp_path, tier_host_bytes=1000)  # smaller than one KV block
    _compute(cache, mamba, kv, kvcache, PROMPT, seed=3)
    _evict_all(cache)
    res, _ = _match(cache, PROMPT + [7])
    assert res.device_prefix_len == 0 and cache.tiers.stack.stats.dropped == 4


def test_another_models_entries_in_a_shared_store_are_never_loaded(tmp_path):
    writer, mamba, kv, kvcache = _cache(tmp_path, model="model-a", tier_storage="file")
    _compute(writer, mamba, kv, kvcache, PROMPT, seed=4)
    _evict_all(writer)
    reader = _cache(tmp_path, model="model-b", tier_storage="file")[0]
    res, _ = _match(reader, PROMPT + [7])
    assert res.device_prefix_len == 0


def test_without_tier_flags_the_cache_has_no_tiers(tmp_path):
    assert _cache(tmp_path)[0].tiers is None


def test_tier_flags_on_a_pd_decode_server_give_its_kv_only_cache_kv_only_tiers(tmp_path):
    from prfaas_sgl.srt.cachepool_backend.tier_decode import KvTiers

    assert type(_cache(tmp_path, mode="decode", tier_host_bytes=1 << 20)[0].tiers) is KvTiers


def test_a_storage_tier_that_cannot_start_leaves_the_server_serving(tmp_path):
    """A store down at start (here: the file tier's directory is a file) is a fault like any other: the
    server starts with what it has (the host tier, or no tiers) instead of refusing to serve."""
    (tmp_path / "l3").write_text("not a directory")
    cache = _cache(tmp_path, tier_host_bytes=1 << 20, tier_storage="file")[0]
    assert cache.tiers is not None and cache.tiers.stack.storage is None
    assert _cache(tmp_path, tier_storage="file")[0].tiers is None


@pytest.fixture
def tier_key(tmp_path):
    from prfaas_sgl.cachepool.tiers.auth import write_key

    path = str(tmp_path / "tier.secret")
    write_key(path)
    return path


def test_a_keyed_server_never_loads_unsigned_entries_a_shared_store_holds(tmp_path, tier_key):
    """Someone who can write to the store (here: a keyless server of the same model) put entries there:
    a server with a tier key refuses each one (counted, removed), loads nothing into its device pool,
    and recomputes."""
    writer, mamba, kv, kvcache = _cache(tmp_path, tier_storage="file")
    _compute(writer, mamba, kv, kvcache, PROMPT, seed=5)
    _evict_all(writer)
    reader = _cache(tmp_path, tier_storage="file", tier_key=tier_key)[0]
    res, _ = _match(reader, PROMPT + [7])
    assert res.device_prefix_len == 0 and reader.tiers.stack.stats.refused_mac >= 1
    assert not reader.mirror.kv_of and not reader.mirror.state_of and reader.tiers.loaded_blocks == 0
    assert not reader.tiers.stack.storage.exists(reader.tiers.stack.fp.key(KV, reader.memo.get("y", PROMPT).hashes[0]))


def test_a_signed_prefix_loads_back_under_the_same_key(tmp_path, tier_key):
    writer, mamba, kv, kvcache = _cache(tmp_path, tier_storage="file", tier_key=tier_key)
    _compute(writer, mamba, kv, kvcache, PROMPT, seed=6)
    _evict_all(writer)
    res, _ = _match(writer, PROMPT + [7])
    assert res.device_prefix_len == 2 * CHUNK and writer.tiers.stack.stats.refused_mac == 0


@pytest.mark.parametrize("where", ["mooncake_off_loopback", "file_others_can_write"])
def test_a_storage_tier_others_can_write_needs_a_key(tmp_path, tier_key, caplog, where):
    """Without --prfaas-tier-key such a tier is left out with an error that says how to fix it (the
    server serves with its host tier); with the key it is used. The check runs before any connection."""
    if where == "mooncake_off_loopback":
        flags_ = dict(tier_storage="mooncake", tier_mooncake_master="192.0.2.1:50051")  # TEST-NET: unroutable
    else:
        (tmp_path / "l3").mkdir()
        os.chmod(tmp_path / "l3", 0o777)
        flags_ = dict(tier_storage="file")
    cache = _cache(tmp_path, tier_host_bytes=1 << 20, **flags_)[0]
    assert cache.tiers is not None and cache.tiers.stack.storage is None
    assert "--prfaas-tier-key" in caplog.text and "left out" in caplog.text
    if where == "file_others_can_write":
        assert _cache(tmp_path, tier_key=tier_key, **flags_)[0].tiers.stack.storage is not None


def test_with_write_through_a_server_that_never_saw_a_prompt_loads_it_from_the_shared_store(tmp_path, tier_key):
    """--prfaas-tier-publish: what the writer indexes is put in the store while the writer still holds it
    (nothing evicted); a second server of the same model and key loads the prefix byte-exact from there."""
    writer, mamba, kv, kvcache = _cache(tmp_path, tier_storage="file", tier_key=tier_key, tier_publish=True)
    states, kv_bytes = _compute(writer, mamba, kv, kvcache, PROMPT, seed=7)
    assert writer.tiers.stack.publisher.flush(10)
    assert writer.tiers.stack.counters()["published"] == 4 and writer.mirror.kv_of  # still on the device
    reader, mamba_r, _, kvcache_r = _cache(tmp_path, tier_storage="file", tier_key=tier_key)
    res, req = _match(reader, PROMPT + [7])
    assert res.device_prefix_len == 2 * CHUNK and reader.tiers.stack.stats.storage_hits == 4
    slots = reader.path_device_indices(res.last_device_node)
    for i, s in enumerate(slots.tolist()):
        assert torch.equal(torch.cat([t[s].reshape(-1) for t in kvcache_r.k_buffer + kvcache_r.v_buffer]), kv_bytes[i])
    for want, t in zip(states[2 * CHUNK], [*mamba_r.mamba_cache.conv, mamba_r.mamba_cache.temporal]):
        assert torch.equal(t[:, int(req.kv.mamba_cow_src_index)], want)
    assert reader.tiers.stack.publisher is None  # off unless asked


def test_without_write_through_nothing_reaches_the_store_until_evicted(tmp_path):
    writer, mamba, kv, kvcache = _cache(tmp_path, tier_storage="file")
    _compute(writer, mamba, kv, kvcache, PROMPT, seed=8)
    res, _ = _match(_cache(tmp_path, tier_storage="file")[0], PROMPT + [7])
    assert res.device_prefix_len == 0


def test_a_hit_is_planned_with_one_exists_rpc_to_the_mooncake_master(tmp_path):
    """The plan asks the store about every entry it may load (2 KV blocks, 2 states) in one BatchExistKey
    RPC, not an ExistKey per entry (before: 6 per match); counted by the real mooncake_master itself."""
    from prfaas_sgl.cachepool.tiers.master import MooncakeMaster

    master = MooncakeMaster().start()
    try:
        cache, mamba, kv, kvcache = _cache(tmp_path, tier_storage="mooncake", tier_mooncake_master=master.addr)
        _compute(cache, mamba, kv, kvcache, PROMPT, seed=9)
        _evict_all(cache)
        rpcs = ("master_exist_key_requests_total", "master_batch_exist_key_requests_total")
        before = [master.metric(n) for n in rpcs]
        res, _ = _match(cache, PROMPT + [7])
        assert res.device_prefix_len == 2 * CHUNK and cache.tiers.stack.stats.storage_hits == 4
        assert [master.metric(n) - b for n, b in zip(rpcs, before)] == [0, 1]
        cache.tiers.stack.storage.close()  # before the master goes: a client left behind retries for ~10 s
    finally:
        master.stop()


def _wait_attached(stack, timeout_s: float = 30.0) -> None:
    """Until the attach thread has attached the storage tier (it retries every STORAGE_RETRY_S)."""
    deadline = time.monotonic() + timeout_s
    while stack.storage is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert stack.storage is not None


def test_a_mooncake_master_absent_at_start_is_named_at_once_and_attached_once_it_runs(tmp_path, caplog, monkeypatch):
    """Mooncake's own setup retries an absent master 20 times (~88 s, measured) before failing, and the
    server then ran without the store for good. Now it starts at once without it, names the master and
    why, counts it, and attaches the store when the master comes up (servers and master start in any order)."""
    from prfaas_sgl.cachepool.tiers.master import MooncakeMaster
    from prfaas_sgl.srt.cachepool_backend import tier_cache

    monkeypatch.setattr(tier_cache, "STORAGE_RETRY_S", 0.5)
    master = MooncakeMaster()  # its port is chosen; nothing listens there yet
    t0 = time.monotonic()
    cache, mamba, kv, kvcache = _cache(tmp_path, tier_storage="mooncake", tier_mooncake_master=master.addr)
    assert time.monotonic() - t0 < 3.0
    stack = cache.tiers.stack
    assert stack.storage is None and stack.stats.storage_attach_failures >= 1
    assert master.addr in caplog.text and "not reachable" in caplog.text
    _compute(cache, mamba, kv, kvcache, PROMPT, seed=10)
    _evict_all(cache)  # no tier holds anything yet: dropped, and the match below recomputes
    assert stack.stats.dropped == 4 and _match(cache, PROMPT + [7])[0].device_prefix_len == 0
    master.start()
    try:
        _wait_attached(stack)
        if cache.mirror.kv_of:
            _evict_all(cache)
        _compute(cache, mamba, kv, kvcache, PROMPT, seed=11)
        _evict_all(cache)
        res, _ = _match(cache, PROMPT + [7])
        assert res.device_prefix_len == 2 * CHUNK and stack.stats.storage_hits == 4
        stack.storage.close()
    finally:
        master.stop()


def test_a_mooncake_master_that_never_answers_at_start_holds_start_up_only_for_the_probe(tmp_path, caplog,
                                                                                        monkeypatch):
    """Regression ("never a hang"): a stopped master accepts connections and never answers;
    Mooncake's setup, which keeps the GIL, then held the server's start-up for good. Its setup is now
    probed in a child process killed at SETUP_PROBE_TIMEOUT_S: the server starts without the store,
    counts and names it, and the attach thread, probing the same way, attaches it after SIGCONT."""
    from prfaas_sgl.cachepool.tiers import storage
    from prfaas_sgl.cachepool.tiers.master import MooncakeMaster
    from prfaas_sgl.srt.cachepool_backend import tier_cache

    monkeypatch.setattr(tier_cache, "STORAGE_RETRY_S", 0.5)
    monkeypatch.setattr(storage, "SETUP_PROBE_TIMEOUT_S", 1.0)
    master = MooncakeMaster().start()
    master.hang()
    cache = None
    try:
        t0 = time.monotonic()
        cache, mamba, kv, kvcache = _cache(tmp_path, tier_storage="mooncake", tier_mooncake_master=master.addr)
        assert time.monotonic() - t0 < 3.0
        stack = cache.tiers.stack
        assert stack.storage is None and stack.stats.storage_attach_failures >= 1
        assert master.addr in caplog.text and "no answer" in caplog.text
        master.resume()
        _wait_attached(stack)
        _compute(cache, mamba, kv, kvcache, PROMPT, seed=12)
        _evict_all(cache)
        res, _ = _match(cache, PROMPT + [7])
        assert res.device_prefix_len == 2 * CHUNK and stack.stats.storage_hits == 4
        stack.storage.close()
    finally:
        if cache is not None:
            cache.tiers.attacher.stop()
        master.resume()
        master.stop()
