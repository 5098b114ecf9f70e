"""SGLang's token allocator and Mamba slot allocator over one slab's blocks: a KV token and
a state never share a block, exhaustion is reported the way SGLang expects (None), freed blocks serve
the other kind, and SGLang's idle leak check (available + held == size) holds on both sides. CPU, no
server: SGLang's own pool classes, writes through their own APIs."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from prfaas_sgl.cachepool.slab_blocks import FREE, KV, STATE
from prfaas_sgl.srt.cachepool_backend.slab_pools import plan_layout
from prfaas_sgl.srt.cachepool_backend.unified import build_pools
from tests.support.sglang_context import sglang_context  # noqa: F401 - autouse

F32 = torch.float32
# 2 full layers of 1 KV head x 2; 2 GDN layers with a conv state (2, 3) and a recurrent state (9,)
PARAMS = SimpleNamespace(shape=SimpleNamespace(conv=[(2, 3)], temporal=(9,)),
                         dtype=SimpleNamespace(conv=F32, temporal=F32), is_kda=False, layers=[0, 1])
LAYOUT = plan_layout(2, 1, 2, F32, PARAMS, num_linear_layers=2, granularity=2)
BS = LAYOUT.tokens_per_block  # 4 tokens per block
FULL = SimpleNamespace(dtype=F32, head_num=1, head_dim=2, layer_num=2, v_head_dim=2)


def _pools(num_blocks: int, rows: list[int]):
    return build_pools(LAYOUT, num_blocks, full=FULL, cache_params=PARAMS, mamba_layer_ids=[0, 1],
                       device="cpu", reserve=lambda: rows[0])


def test_kv_tokens_fill_a_block_before_taking_the_next():
    p = _pools(6, [0])
    a = p.token_allocator.alloc(3)
    b = p.token_allocator.alloc(2)
    assert a.tolist() == [4, 5, 6] and b.tolist() == [7, 8]  # block 1's tokens, then block 2's
    assert p.blocks.kind[1:3] == [KV, KV] and p.blocks.count(KV) == 2


def test_a_state_never_lands_in_a_kv_block():
    p = _pools(5, [0])
    kv = p.token_allocator.alloc(BS + 1)  # blocks 1 and 2
    st = p.state_allocator.alloc(2)
    assert st.tolist() == [3, 4] and set(st.tolist()).isdisjoint((kv // BS).tolist())
    assert p.state_allocator.alloc(1) is None and p.token_allocator.alloc(BS) is None  # exhausted
    assert p.token_allocator.alloc(BS - 1) is not None  # the rest of block 2 is still KV's


def test_last_token_freed_returns_the_block_to_states():
    p = _pools(4, [0])
    kv = p.token_allocator.alloc(2 * BS)
    p.state_allocator.alloc(1)
    assert p.state_allocator.alloc(1) is None
    p.token_allocator.free(kv[BS:BS + 1])  # one token of block 2: the block stays KV
    assert p.state_allocator.alloc(1) is None
    p.token_allocator.free(kv[BS + 1:])
    assert p.state_allocator.alloc(1).tolist() == [2]
    assert p.token_allocator.available_size() == 0


def test_double_free_is_refused():
    p = _pools(4, [0])
    kv = p.token_allocator.alloc(2)
    p.token_allocator.free(kv[:1])
    with pytest.raises(RuntimeError, match="twice"):
        p.token_allocator.free(kv[:1])
    st = p.state_allocator.alloc(1)
    p.state_allocator.free(st)
    with pytest.raises(ValueError):
        p.state_allocator.free(st)


def test_free_group_defers_until_the_end():
    p = _pools(4, [0])
    kv = p.token_allocator.alloc(BS)
    p.token_allocator.free_group_begin()
    p.token_allocator.free(kv)
    assert p.blocks.count(KV) == 1
    p.token_allocator.free_group_end()
    assert p.blocks.count(KV) == 0 and p.blocks.num_free() == 3


def test_kv_side_never_takes_the_states_of_free_request_rows():
    rows = [2]
    p = _pools(6, rows)
    assert p.token_allocator.available_size() == 3 * BS
    assert p.token_allocator.alloc(3 * BS + 1) is None
    p.token_allocator.alloc(3 * BS)
    assert p.state_allocator.alloc(2).tolist() == [4, 5]  # both rows still find their state


def test_writes_through_sglang_pools_stay_in_their_blocks():
    """SGLang's set_kv_buffer on allocated KV slots and a state written through the Mamba pool's views
    never touch each other's blocks."""
    p = _pools(5, [0])
    kv = p.token_allocator.alloc(BS + 2)
    st = p.state_allocator.alloc(2)
    layer = SimpleNamespace(layer_id=1)
    p.kv_pool.set_kv_buffer(layer, kv, torch.full((len(kv), 1, 2), 7.0), torch.full((len(kv), 1, 2), 8.0))
    for t in (*p.mamba_pool.mamba_cache.conv, p.mamba_pool.mamba_cache.temporal):
        t[:, st] = 9.0
    for b in range(5):
        vals = set(p.slab.block(b).view(F32).unique().tolist())
        want = {0.0, 7.0, 8.0} if p.blocks.kind[b] == KV else {0.0, 9.0} if p.blocks.kind[b] == STATE else {0.0}
        assert vals <= want, (b, vals)
    assert torch.equal(p.kv_pool.get_key_buffer(1)[kv], torch.full((len(kv), 1, 2), 7.0))


def test_randomized_no_overlap_and_sglang_leak_check_holds():
    """Random allocs/frees of both kinds through SGLang's allocator APIs; after each step no block
    holds both kinds, and each side's available + held == its size (SGLang's idle invariant)."""
    rng, rows = random.Random(5), [1]
    p = _pools(16, rows)
    tok, st = p.token_allocator, p.state_allocator
    tokens, states = [], []
    for _ in range(300):
        if rng.random() < 0.5:
            if rng.random() < 0.55:
                got = tok.alloc(rng.randint(1, 2 * BS))
                tokens += got.tolist() if got is not None else []
            elif tokens:
                rng.shuffle(tokens)
                n = rng.randint(1, len(tokens))
                tok.free(torch.tensor(tokens[:n]))
                del tokens[:n]
        elif rng.random() < 0.55:
            got = st.alloc(1)
            states += got.tolist() if got is not None else []
        elif states:
            st.free(torch.tensor([states.pop(rng.randrange(len(states)))]))
        rows[0] = rng.randint(0, 2)
        p.blocks.check()
        kv_blocks = {t // BS for t in tokens}
        assert kv_blocks.isdisjoint(states) and 0 not in kv_blocks and 0 not in states
        assert all(p.blocks.kind[b] == KV for b in kv_blocks) and all(p.blocks.kind[s] == STATE for s in states)
        assert tok.available_size() + len(tokens) == tok.size
        assert st.available_size() + len(states) == p.mamba_pool.size
        assert p.blocks.count(FREE) + p.blocks.count(KV) + p.blocks.count(STATE) == 15
