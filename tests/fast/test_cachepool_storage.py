"""BlockStorage applies the bookkeeping's index lists to real tensors (CPU torch)."""
from __future__ import annotations

import torch

from prfaas_sgl.cachepool import GroupSpec, HybridCachePool, PoolConfig
from prfaas_sgl.cachepool.storage import BlockStorage

BS = 4
CFG = PoolConfig(40, BS, (GroupSpec("attn", "full", 2, kv_bytes_per_token=4),  # page 32 B = block
                          GroupSpec("gdn", "linear", 1, state_bytes=100, checkpoint_interval=8)))


def test_tokens_round_trip_through_block_table():
    pool, store = HybridCachePool(CFG), BlockStorage(CFG)
    a = pool.admit("r", list(range(10)))
    table = a.group("attn").block_table
    kv = torch.randint(0, 255, (2, 10, 4), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    store.write_tokens("attn", table, 0, kv[:, :5])  # tokens [0, 5) then [5, 10): crosses block 1
    store.write_tokens("attn", table, 5, kv[:, 5:])
    assert torch.equal(store.read_tokens("attn", table, 0, 10), kv)
    assert torch.equal(store.read_tokens("attn", table, 3, 9), kv[:, 3:9])
    # token 6 is slot 2 of the table's second block, layer 1
    assert torch.equal(store.page_view("attn")[table[1], 1, 2], kv[1, 6])


def test_state_split_over_blocks_checkpoint_and_restore():
    pool, store = HybridCachePool(CFG), BlockStorage(CFG)
    a = pool.admit("r1", list(range(9)))
    gdn = a.group("gdn")
    assert len(gdn.state_blocks) == 4  # 100 B over 32-B blocks: 3 full + 1 padded
    state = torch.arange(25, dtype=torch.float32)  # 100 bytes
    store.write_state("gdn", gdn.state_blocks, state)
    store.snapshot(gdn, 8)  # the state after exactly 8 tokens
    pool.commit("r1", 9)
    store.write_state("gdn", gdn.state_blocks, state * 0)  # r1 moves on
    pool.free("r1")
    b = pool.admit("r2", list(range(8)) + [99, 98])
    g2 = b.group("gdn")
    assert b.num_cached_tokens == 8 and g2.restore_from == gdn.checkpoint_writes[0][1]
    store.restore(g2)
    assert torch.equal(store.read_state("gdn", g2.state_blocks).view(torch.float32), state)


def test_gather_scatter_blocks_between_two_pools():
    src, dst = BlockStorage(CFG), BlockStorage(CFG)
    src.buffer.copy_(torch.randint(0, 255, src.buffer.shape, dtype=torch.uint8))
    wire = src.gather_blocks([5, 1, 7])
    dst.scatter_blocks([0, 2, 3], wire)
    assert torch.equal(dst.buffer[[0, 2, 3]], src.buffer[[5, 1, 7]])
    assert int(dst.buffer[1].sum()) == 0
