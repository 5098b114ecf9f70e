"""SGLang's own KV pool and Mamba pool classes running over one cache-pool slab: their
writes land in the slab block the cache pool would assign, with no copy (CPU, no server)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from sglang.srt.mem_cache.memory_pool import MambaPool

from prfaas_sgl.cachepool.slab import Slab
from prfaas_sgl.srt.cachepool_backend.slab_pools import SlabMHATokenToKVPool, bind_mamba_pool, plan_layout
from tests.support.sglang_context import sglang_context  # noqa: F401 - autouse

F32 = torch.float32
# 2 full layers of 1 KV head x 2; 2 GDN layers with a conv state (2, 3) and a recurrent state (9,)
PARAMS = SimpleNamespace(shape=SimpleNamespace(conv=[(2, 3)], temporal=(9,)),
                         dtype=SimpleNamespace(conv=F32, temporal=F32), is_kda=False, layers=[0, 1])
LAYOUT = plan_layout(2, 1, 2, F32, PARAMS, num_linear_layers=2, granularity=2)
NUM_BLOCKS = 6


def test_plan_layout_for_tiny_qwen35_hybrid():
    """The shapes SGLang gives tiny-qwen35-hybrid in fp32 (2 KV heads x 16; GDN conv 128 x 3, state
    4 x 16 x 16; 2 full and 6 linear layers)."""
    params = SimpleNamespace(shape=SimpleNamespace(conv=[(128, 3)], temporal=(4, 16, 16)),
                             dtype=SimpleNamespace(conv=F32, temporal=F32))
    layout = plan_layout(2, 2, 16, F32, params, num_linear_layers=6, granularity=16)
    assert (layout.tokens_per_block, layout.block_bytes, layout.state_bytes) == (80, 40960, 33792)


def test_sglang_kv_writes_land_in_the_slab_block():
    slab = Slab(LAYOUT, NUM_BLOCKS)
    pool = SlabMHATokenToKVPool(slab, dtype=F32, head_num=1, head_dim=2, layer_num=2)
    assert pool.k_buffer[1].untyped_storage().data_ptr() == slab.buffer.untyped_storage().data_ptr()
    bs = LAYOUT.tokens_per_block
    slot = 2 * bs + 1  # block 2, token 1
    pool.set_kv_buffer(SimpleNamespace(layer_id=1), torch.tensor([slot]), torch.full((1, 1, 2), 3.0),
                       torch.full((1, 1, 2), 4.0))
    token = slab.block(2).view(F32).view(bs, LAYOUT.token_bytes // 4)[1]
    assert token.tolist() == [0, 0, 0, 0, 3, 3, 4, 4]  # layer 0's K V untouched, layer 1's K V
    assert int(slab.buffer.view(F32).count_nonzero()) == 4  # those 4 floats, nothing else
    assert pool.get_key_buffer(1)[slot].tolist() == [[3.0, 3.0]]


def test_sglang_mamba_copy_moves_a_state_between_blocks():
    slab = Slab(LAYOUT, NUM_BLOCKS)
    pool = MambaPool(size=NUM_BLOCKS - 1, spec_state_size=NUM_BLOCKS - 1, cache_params=PARAMS,
                     mamba_layer_ids=[0, 1], device="cpu")
    bind_mamba_pool(pool, slab, PARAMS.shape.conv, PARAMS.shape.temporal)
    pool.mamba_cache.temporal[:, 4] = 5.0
    pool.mamba_cache.conv[0][:, 4] = 6.0
    pool.copy_from(torch.tensor([4]), torch.tensor([1]))  # a checkpoint copy, slot 4 -> slot 1
    assert torch.equal(slab.block(1), slab.block(4))
    assert int(slab.block(1)[LAYOUT.state_bytes:].count_nonzero()) == 0  # the padding stays clear
    others = [b for b in range(NUM_BLOCKS) if b not in (1, 4)]
    assert all(int(slab.block(b).count_nonzero()) == 0 for b in others)


def test_bind_refuses_a_pool_of_another_size():
    slab = Slab(LAYOUT, NUM_BLOCKS)
    pool = MambaPool(size=3, spec_state_size=3, cache_params=PARAMS, mamba_layer_ids=[0, 1], device="cpu")
    with pytest.raises(ValueError, match="size=5"):
        bind_mamba_pool(pool, slab, PARAMS.shape.conv, PARAMS.shape.temporal)
