"""prfaas_hybrid's factory per server role: what it accepts, what it refuses (with the flag to fix it),
and the index it builds (prefill: full KV + state checkpoints, transfer-bound admissions; decode:
full-attention KV only, since the prefill always sends the prompt-end state)."""
from __future__ import annotations

from array import array
from types import SimpleNamespace as NS

import pytest
import torch
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey

from prfaas_sgl.cachepool.hashing import block_hashes
from prfaas_sgl.srt.cachepool_backend import cache as backend
from prfaas_sgl.srt.cachepool_backend.mirror import Insert


def _ctx(mode: str = "null", disable_radix_cache: bool = False, chunk: int | None = 64):
    freed: list = []
    allocator = NS(size=4096, device="cpu", free=freed.append)
    req_pool = NS(mamba_pool=NS(size=32), mamba_allocator=NS(free=freed.append))
    params = NS(page_size=1, token_to_kv_pool_allocator=allocator, req_to_token_pool=req_pool)
    sa = NS(chunked_prefill_size=chunk, disaggregation_mode=mode)
    return NS(params=params, server_args=sa, is_hybrid_ssm=True, is_hybrid_swa=False,
              enable_hierarchical_cache=False, disable_radix_cache=disable_radix_cache)


def test_decode_without_decode_radix_cache_names_the_flag():
    with pytest.raises(ValueError, match="--disaggregation-decode-enable-radix-cache"):
        backend.build(_ctx("decode", disable_radix_cache=True))


def test_colocated_with_radix_cache_disabled_is_refused():
    with pytest.raises(ValueError, match="conflicts with --disable-radix-cache"):
        backend.build(_ctx("null", disable_radix_cache=True))


def test_prefill_keeps_the_hybrid_index_and_chunk_grid():
    cache = backend.build(_ctx("prefill", chunk=128))
    assert cache.cfg.role == "prefill" and type(cache) is backend.LinearStateCache
    assert [m.kind for m in cache.pool.managers] == ["full", "linear"]
    assert cache.cfg.checkpoint_interval == 128


@pytest.mark.parametrize("chunk", [None, 100, 8192])
def test_decode_indexes_kv_only_whatever_the_chunk_size(chunk):
    cache = backend.build(_ctx("decode", chunk=chunk))
    assert type(cache) is backend.DecodeKvCache and [m.kind for m in cache.pool.managers] == ["full"]
    assert cache.mamba_evictable_size() == 0 and cache.mamba_protected_size() == 0


@pytest.mark.parametrize("mode", ["null", "prefill", "decode"])
def test_a_linear_model_gets_state_answers_only_where_it_keeps_states(mode):
    """What SGLang asks every cache: the mamba side on a linear model, never a window."""
    cache = backend.build(_ctx(mode))
    assert type(cache) is (backend.DecodeKvCache if mode == "decode" else backend.LinearStateCache)
    assert cache.supports_mamba() and not cache.supports_swa() and cache.sliding_window_size is None
    assert cache.swa_evictable_size() == 0 and cache.swa_protected_size() == 0


def test_prefill_and_colocated_index_blocks_are_one_chunk():
    """A linear-state hit ends on the chunk grid, so the index hashes one block per chunk (any chunk
    size; 16-token blocks cost 512x the per-block work of a 8K chunk for no longer hit)."""
    for mode in ("null", "prefill"):
        cache = backend.build(_ctx(mode, chunk=100))
        assert cache.bs == cache.cfg.checkpoint_interval == cache.pool.cfg.block_size == 100
    assert backend.build(_ctx("decode", chunk=100)).bs == 16  # decode hits are any block-aligned KV prefix


def test_the_kv_mirror_has_a_row_per_entry_that_can_hold_slots():
    """kv_table rows are the mirror's own: cached KV entries hold bs of SGLang's slots each, so at most
    size // bs of them exist; a row per pool block (states and head-room included) cost 364 MB at 2M
    slots with 8K-token blocks. Rows of removed entries are taken again."""
    cache = backend.build(_ctx("decode"))  # KV only, 16-token blocks
    assert tuple(cache.mirror.kv_table.shape) == (4096 // 16 + 1, 16) and cache.pool.cfg.num_blocks > 2 * 4096 // 16
    tokens = list(range(50))
    cache.pool.admit("r", tokens, num_tokens=48)
    cache.pool.commit("r", 48)
    row = torch.arange(1000, 1048, dtype=torch.int64)
    cache.mirror.apply(cache.pool.drain_events(), Insert(row, {h: i for i, h in enumerate(cache.pool.hashes(tokens[:48]))}))
    assert sorted(cache.mirror.kv_of.values()) == [0, 1, 2]
    assert cache.mirror.kv_slots(cache.pool.hashes(tokens[:48])).tolist() == list(range(1000, 1048))
    cache.pool.free("r")
    while cache.pool.evict_lru():
        cache._apply()
    cache.mirror.flush()
    assert not cache.mirror.kv_of and sorted(cache.mirror._free_rows) == list(range(257))
    cache.check_integrity()


def test_a_lock_on_a_match_takes_no_pool_blocks():
    """A lock pins the hit (KV block and state) and takes nothing: it used to be a pool request of its
    own, with a working-state block and a block for one token past the match."""
    cache = backend.build(_ctx("null", chunk=64))
    tokens = list(range(100))
    cache.pool.admit("r", tokens, num_tokens=64, state_at_end=True)
    cache.pool.commit("r", 64)
    (h,) = cache.pool.hashes(tokens[:64])
    cache.mirror.apply(cache.pool.drain_events(), Insert(torch.arange(1000, 1064), {h: 0}, h, torch.tensor([5])))
    cache.pool.free("r")
    free = cache.pool.usage().free
    node = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens)))).last_device_node
    lock = cache.inc_lock_ref(node)
    assert len(node.tokens) == 64 and cache.pool.usage().free == free
    assert cache.evictable_size() == 0 and cache.mamba_evictable_size() == 0
    cache.dec_lock_ref(node, lock.to_dec_params())
    assert cache.evictable_size() == 64 and cache.mamba_evictable_size() == 1
    cache.check_integrity()


def test_a_checkpoint_hashes_its_prompt_only_up_to_its_end():
    """The first chunk's checkpoint of a long prompt hashes that chunk, not the whole prompt (which
    SGLang already knows at the first chunk): each chunk's blocks are hashed at its own checkpoint."""
    cache = backend.build(_ctx("decode"))  # KV only, 16-token blocks
    tokens = array("q", range(1000, 1000 + 16 * 10 + 5))
    req = NS(rid="a", extra_key=None, cache_salt=None, full_untruncated_fill_ids=tokens,
             kv=NS(req_pool_idx=0, mamba_pool_idx=None, holds_mamba=False))
    cache.req_to_token_pool.req_to_token = torch.arange(1, 4097, dtype=torch.int32)[None, :]
    cache.checkpoint(req, up_to=16)
    assert cache.memo.get("a", tokens, blocks=0).hashes == block_hashes(tokens[:16], 16)
    cache.checkpoint(req, up_to=48)
    assert cache.memo.get("a", tokens, blocks=0).hashes == block_hashes(tokens[:48], 16)
    assert cache.mirror.kv_slots(block_hashes(tokens[:48], 16)).tolist() == list(range(1, 49))


def test_prefill_without_chunked_prefill_is_a_startup_error():
    with pytest.raises(ValueError, match="--chunked-prefill-size 0 must be a positive multiple"):
        backend.build(_ctx("prefill", chunk=None))


def test_decode_match_ignores_states_and_stages_no_copy():
    """A decode hit is any block-aligned KV prefix (minus the token that must be computed), with no
    Mamba copy staged: the transferred state overwrites the request's slot anyway."""
    cache = backend.build(_ctx("decode"))
    tokens = list(range(100))
    cache.pool.admit("r", tokens, num_tokens=80)
    cache.pool.commit("r", 80)
    row = torch.arange(80, dtype=torch.int64)
    cache.mirror.apply(cache.pool.drain_events(), Insert(row, {h: i for i, h in enumerate(cache.pool.hashes(tokens[:80]))}))
    cache.pool.free("r")
    cache._drain()
    kv = NS(mamba_cow_src_index=None, mamba_needs_clear=False, holds_mamba=False)
    result = cache.match_prefix(NS(key=_Key(tokens[:90]), req=NS(kv=kv), cow_mamba=True))
    assert result.device_prefix_len == 80  # 5 whole blocks; a hybrid index would need a state there
    assert kv.mamba_cow_src_index is None and kv.mamba_needs_clear is False
    assert cache.path_device_indices(result.last_device_node).tolist() == list(range(80))


class _Key:
    """The parts of SGLang's RadixKey the backend reads."""

    def __init__(self, ids):
        self.ids, self.is_bigram, self.extra_key, self.cache_salt = ids, False, None, None
        self.token_ids = ids  # uncapped (no limit)

    def raw_token_ids(self):
        return self.ids

    def __len__(self):
        return len(self.ids)

