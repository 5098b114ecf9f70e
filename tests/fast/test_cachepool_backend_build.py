"""prfaas_hybrid's factory per server role: what it accepts, what it refuses (with the flag to fix it),
and the index it builds (prefill: full KV + state checkpoints, transfer-bound admissions; decode:
full-attention KV only, since the prefill always sends the prompt-end state)."""
from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
import torch

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


def test_prefill_chunk_off_grid_is_a_startup_error():
    with pytest.raises(ValueError, match="--chunked-prefill-size 100 must be a positive multiple of 16"):
        backend.build(_ctx("prefill", chunk=100))


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

    def raw_token_ids(self):
        return self.ids

    def __len__(self):
        return len(self.ids)

