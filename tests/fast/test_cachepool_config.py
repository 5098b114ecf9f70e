"""Start-up layout errors and admission errors name the sizes to change; events match SGLang's wire shape."""
from __future__ import annotations

from typing import Optional

import msgspec
import pytest

from prfaas_sgl.cachepool import (EventBatch, GroupSpec, HybridCachePool, PoolConfig, PoolLayoutError,
                                  RequestTooLongError)


def test_attention_pages_that_do_not_divide_name_the_sizes():
    groups = (GroupSpec("a", "full", 3, kv_bytes_per_token=8), GroupSpec("b", "swa", 2, kv_bytes_per_token=8,
                                                                     window=16))
    with pytest.raises(PoolLayoutError, match=r"\{'b': 256\}.*384 bytes"):
        PoolConfig(num_blocks=8, block_size=16, groups=groups)


def test_smaller_page_that_divides_is_padded():
    groups = (GroupSpec("a", "full", 2, kv_bytes_per_token=8), GroupSpec("b", "swa", 1, kv_bytes_per_token=8,
                                                                     window=16))
    assert PoolConfig(num_blocks=8, block_size=16, groups=groups).block_bytes == 256


def test_checkpoint_interval_must_be_block_multiple():
    groups = (GroupSpec("a", "full", 1, kv_bytes_per_token=8),
              GroupSpec("g", "linear", 3, state_bytes=100, checkpoint_interval=100))
    with pytest.raises(PoolLayoutError, match="checkpoint_interval=100 .* block_size=64"):
        PoolConfig(num_blocks=8, block_size=64, groups=groups)


@pytest.mark.parametrize("groups, msg", [
    ((), "no layer groups"),
    ((GroupSpec("g", "linear", 1, state_bytes=8, checkpoint_interval=4),), "kv_bytes_per_token > 0"),
    ((GroupSpec("a", "full", 1, kv_bytes_per_token=8),) * 2, "repeat"),
    ((GroupSpec("a", "swa", 1, kv_bytes_per_token=8),), "window=0"),
])
def test_bad_layouts(groups, msg):
    with pytest.raises((PoolLayoutError, ValueError), match=msg):
        PoolConfig(num_blocks=8, block_size=4, groups=groups)


def test_unknown_kind_lists_the_registry():
    with pytest.raises(ValueError, match=r"\['full', 'linear', 'swa'\]"):
        PoolConfig(num_blocks=8, block_size=4, groups=(GroupSpec("x", "mla", 1, kv_bytes_per_token=8),))


def test_request_longer_than_pool_fails_at_admission():
    groups = (GroupSpec("a", "full", 1, kv_bytes_per_token=8),
              GroupSpec("g", "linear", 3, state_bytes=40, checkpoint_interval=8))
    pool = HybridCachePool(PoolConfig(num_blocks=20, block_size=4, groups=groups))
    # 32 tokens: 8 KV blocks + working state 4 + 4 checkpoints x 4 = 28 > 20
    with pytest.raises(RequestTooLongError, match="32 tokens need 28 blocks .* only 20"):
        pool.admit("r", list(range(32)))
    assert pool.request_ids() == [] and pool.usage().free == 20
    pool.admit("r", list(range(8)))  # 2 + 4 + 4 = 10 fits
    pool.check_integrity()


class SglBlockStored(msgspec.Struct, tag="BlockStored"):
    """Mirror of sglang 0.5.23 disaggregation/kv_events.py BlockStored (required fields as there)."""
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str] = None


class SglBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[SglBlockStored]
    attn_dp_rank: Optional[int] = None


def test_events_decode_with_sglang_shaped_structs():
    pool = HybridCachePool(PoolConfig(8, 4, (GroupSpec("a", "full", 1, kv_bytes_per_token=8),),
                                      enable_events=True))
    pool.admit("r", list(range(9)))
    pool.commit("r", 9)
    wire = msgspec.msgpack.encode(EventBatch(1.5, pool.drain_events()))
    batch = msgspec.msgpack.decode(wire, type=SglBatch)
    (ev,) = batch.events
    assert ev.token_ids == list(range(8)) and ev.block_size == 4 and ev.parent_block_hash is None
    assert len(ev.block_hashes) == 2


def test_bookkeeping_imports_neither_torch_nor_sglang():
    import subprocess
    import sys
    code = ("import sys, prfaas_sgl.cachepool, prfaas_sgl.cachepool.storage; "
            "bad = [m for m in ('torch', 'sglang') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
