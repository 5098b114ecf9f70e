"""One physical pool for KV pages and linear-attention states: the aligned layout, the
SGLang-shaped views over one buffer, and HybridCachePool's groups allocating from it — the split between
KV and states moves with the workload, eviction is LRU across both kinds, and no block is ever written
by two owners."""
from __future__ import annotations

import random

import pytest
import torch

from prfaas_sgl.cachepool import PoolExhaustedError, PoolLayoutError, RequestTooLongError
from prfaas_sgl.cachepool import HybridCachePool
from prfaas_sgl.cachepool.slab import Slab
from prfaas_sgl.cachepool.slab_layout import SlabLayout

F32 = torch.float32
# small model: 2 full layers of 1 KV head x 2 (fp32: 8 B rows), 2 linear layers with a conv part of
# 6 floats and a recurrent part of 9 floats: E = 32 B, S = 48 + 72 = 120 B -> bs = 4, B = 128 B
KV_ROWS = [(8, 8), (8, 8)]
PARTS = [("conv", 24, 2), ("temporal", 36, 2)]
SHAPES = {"conv": (2, 3), "temporal": (9,)}
LAYOUT = SlabLayout.plan(KV_ROWS, PARTS, granularity=2)
BS = LAYOUT.tokens_per_block


def test_small_layout_numbers():
    assert (LAYOUT.token_bytes, LAYOUT.state_bytes, BS, LAYOUT.block_bytes) == (32, 120, 4, 128)
    assert LAYOUT.kv_offsets == ((0, 8), (16, 24))
    assert [(p.name, p.offset) for p in LAYOUT.state_parts] == [("conv", 0), ("temporal", 48)]


def test_tiny_qwen35_hybrid_layout():
    """tiny-qwen35-hybrid in fp32: 2 full layers of 2 KV heads x 16 (128-B rows); 6 GDN layers with a
    conv state of 128 channels x 3 and a recurrent state of 4 heads x 16 x 16."""
    layout = SlabLayout.plan([(128, 128)] * 2, [("conv", 128 * 3 * 4, 6), ("temporal", 4 * 16 * 16 * 4, 6)], 16)
    assert (layout.token_bytes, layout.state_bytes) == (512, 33792)
    assert (layout.tokens_per_block, layout.block_bytes) == (80, 40960)  # 66 tokens, rounded up to 16s
    assert round(layout.state_padding, 3) == 0.175
    pool = HybridCachePool(layout.pool_config(100, checkpoint_interval=160))
    assert pool.managers[1].state_blocks == 1  # one state is one block, never a run of blocks


@pytest.mark.parametrize("rows, parts, g, what", [
    ([], PARTS, 2, "kv_rows"),
    (KV_ROWS, [], 2, "state_parts"),
    (KV_ROWS, [("a", 4, 1), ("a", 4, 1)], 2, "repeat"),
    (KV_ROWS, PARTS, 0, "granularity"),
])
def test_bad_layouts_say_what_to_change(rows, parts, g, what):
    with pytest.raises(PoolLayoutError, match=what):
        SlabLayout.plan(rows, parts, g)


def test_views_share_one_buffer_and_stay_inside_their_block():
    slab = Slab(LAYOUT, 6)
    views = [*slab.kv_views(0, F32, 1, 2), *slab.kv_views(1, F32, 1, 2),
             *(slab.state_view(n, F32, s) for n, s in SHAPES.items())]
    base = slab.buffer.untyped_storage().data_ptr()
    assert all(v.untyped_storage().data_ptr() == base for v in views)
    assert views[0].shape == (6 * BS, 1, 2) and views[4].shape == (2, 6, 2, 3)

    k1 = slab.kv_views(1, F32, 1, 2)[0]
    k1[2 * BS + 3] = 7.0  # token 3 of block 2, layer 1's K: bytes 2*128 + 3*32 + 16
    _assert_only_bytes_changed(slab, 2 * 128 + 3 * 32 + 16, 8)

    slab.buffer.zero_()
    slab.state_view("temporal", F32, (9,))[1, 4] = 1.0  # layer 1's recurrent state in block 4
    _assert_only_bytes_changed(slab, 4 * 128 + 48 + 36, 36)


def _assert_only_bytes_changed(slab: Slab, start: int, n: int) -> None:
    """Bytes [start, start+n) hold non-zero floats and every other byte of the slab is still 0."""
    inside = slab.buffer[start:start + n].view(F32)
    assert bool((inside != 0).all())
    assert int(slab.buffer.count_nonzero()) == int(slab.buffer[start:start + n].count_nonzero())


def test_views_reject_a_shape_that_is_not_the_layout():
    slab = Slab(LAYOUT, 2)
    with pytest.raises(ValueError, match="rows are 8/8 B"):
        slab.kv_views(0, F32, 2, 2)
    with pytest.raises(ValueError, match="36 B per layer"):
        slab.state_view("temporal", F32, (8,))


# -- the groups on one pool ---------------------------------------------------------------------

def _kinds(pool: HybridCachePool) -> dict[int, str]:
    """block -> group name, for every block a request holds or the index caches."""
    out: dict[int, str] = {}
    for m in pool.managers:
        for _, blocks in m.index_entries():
            out.update((b, m.name) for b in blocks)
    for rid in pool.request_ids():
        for m, blocks in zip(pool.managers, pool.held(rid)):
            out.update((b, m.name) for b in blocks)
    return out


def _split(pool: HybridCachePool) -> tuple[int, int]:
    kinds = list(_kinds(pool).values())
    return kinds.count("full"), kinds.count("linear")


def _long(pool, rid, tokens):
    pool.admit(rid, tokens)
    pool.commit(rid, len(tokens))
    pool.free(rid)
    pool.check_integrity()


def test_split_moves_both_ways_under_one_capacity():
    """16 blocks. A long prompt leaves 11 KV blocks and 2 states cached; 7 short requests then hold 7
    states (and 7 KV blocks) by evicting 2 states and 7 KV pages; a long prompt again takes KV back from states. A fixed
    half/half split would have refused the first prompt (11 KV blocks > 8)."""
    pool = HybridCachePool(LAYOUT.pool_config(16, checkpoint_interval=4 * BS))
    _long(pool, "long", list(range(44)))
    assert _split(pool) == (11, 2)
    for i in range(7):
        pool.admit(f"s{i}", [1000 + i] * 3)
    pool.check_integrity()
    # 7 + 7 in use; the two cached states went first (LRU), two of the 11 KV pages are still cached
    assert _split(pool) == (9, 7) and (pool.usage().in_use, pool.usage().cached_idle) == (14, 2)
    for i in range(7):
        pool.free(f"s{i}")
    _long(pool, "long2", list(range(500, 544)))
    kv, states = _split(pool)
    assert kv >= 11 and states <= 16 - kv and kv + states <= 16


def test_eviction_hands_a_state_block_to_kv_and_a_kv_block_to_a_state():
    """LRU across kinds: the first checkpoint is released first (at commit), so a KV request that finds
    the free list short takes its block; then a state request takes the LRU KV tail."""
    pool = HybridCachePool(LAYOUT.pool_config(16, checkpoint_interval=4 * BS))
    a = pool.admit("long", list(range(44)))
    state_at_16 = a.group("linear").checkpoint_writes[0][1][0]
    kv_tail = a.group("full").block_table[-1]
    pool.commit("long", 44)
    pool.free("long")
    assert pool.usage().free == 3 and pool.blocks.lru_blocks()[0] == state_at_16
    b = pool.admit("kv", [9] * 16, num_tokens=15)  # 4 KV blocks + 1 working state: 5 > 3 free
    assert state_at_16 in b.group("full").block_table  # a state's memory became a KV page
    pool.free("kv")  # its blocks go to the free list (nothing committed)
    for i in range(5):
        pool.admit(f"s{i}", [2000 + i])  # 1 KV + 1 state each: 10 > 7 free
    taken = {b for rid in pool.request_ids() for b in pool.held(rid)[1]}
    assert kv_tail in taken  # the LRU KV tail's memory became a state
    pool.check_integrity()


def test_exhaustion_changes_nothing():
    pool = HybridCachePool(LAYOUT.pool_config(8, checkpoint_interval=4 * BS))
    for i in range(4):
        pool.admit(f"r{i}", [i] * 3)  # 1 KV + 1 state each: all 8 blocks in use, nothing evictable
    before = (pool.usage(), _kinds(pool))
    with pytest.raises(PoolExhaustedError):
        pool.admit("x", [77] * 3)
    with pytest.raises(PoolExhaustedError):
        pool.grow("r0", 5, [0] * 5)  # a second KV block for r0
    assert (pool.usage(), _kinds(pool)) == before
    with pytest.raises(RequestTooLongError):
        pool.admit("huge", list(range(40)))  # 10 KV + 1 + 2 checkpoints > 8 blocks
    pool.check_integrity()


# -- randomized: bookkeeping and bytes agree ------------------------------------------------------

class _Tagger:
    """Writes a distinct value into every block the pool hands out, through the views of the block's
    kind, and checks that every block still held or cached keeps its value: a block given to two
    owners, or a KV page and a state overlapping in the slab, shows up as a changed tag."""

    def __init__(self, slab: Slab) -> None:
        self.slab = slab
        self.kv = [v for layer in range(len(KV_ROWS)) for v in slab.kv_views(layer, F32, 1, 2)]
        self.states = [slab.state_view(n, F32, s) for n, s in SHAPES.items()]
        self.tag: dict[int, float] = {}
        self.next = 1.0

    def write(self, block: int, kind: str) -> None:
        self.tag[block], self.next = self.next, self.next + 1
        for v in self._views(block, kind):
            v.fill_(self.tag[block])

    def check(self, kinds: dict[int, str]) -> None:
        for b, kind in kinds.items():
            for v in self._views(b, kind):
                assert bool((v == self.tag[b]).all()), f"block {b} ({kind}) lost its tag {self.tag[b]}"

    def _views(self, b: int, kind: str):
        if kind == "full":
            return [v[b * BS:(b + 1) * BS] for v in self.kv]
        return [s[:, b] for s in self.states]


def _new_blocks(alloc, admitted: bool) -> list[tuple[int, str]]:
    full, lin = alloc.group("full"), alloc.group("linear")
    out = [(b, "full") for b in full.new_blocks]
    if admitted:
        out += [(b, "linear") for b in lin.state_blocks]
    out += [(b, "linear") for _, blocks in lin.checkpoint_writes for b in blocks]
    return out


@pytest.mark.parametrize("seed", range(6))
def test_random_workload_keeps_every_block_to_one_owner(seed):
    rng = random.Random(seed)
    pool = HybridCachePool(LAYOUT.pool_config(24, checkpoint_interval=2 * BS))
    tagger = _Tagger(Slab(LAYOUT, 24))
    prefixes = [list(range(100 * p, 100 * p + 40)) for p in range(3)]
    live: dict[str, list] = {}  # rid -> [tokens, allocated]
    hits = 0
    for step in range(300):
        op = rng.random()
        if op < 0.4 or not live:
            tokens = prefixes[rng.randrange(3)][:rng.randrange(0, 41)] + [rng.randrange(5) for _ in range(rng.randrange(1, 8))]
            rid = f"r{step}"
            try:
                a = pool.admit(rid, tokens, min(len(tokens), pool.match(tokens) + rng.randrange(1, 20)))
            except (PoolExhaustedError, RequestTooLongError):
                pool.check_integrity()
                tagger.check(_kinds(pool))
                continue
            hits += a.num_cached_tokens > 0
            for b, kind in _new_blocks(a, admitted=True):
                tagger.write(b, kind)
            pool.commit(rid, a.num_tokens)
            live[rid] = [tokens, a.num_tokens]
        elif op < 0.75:
            rid = rng.choice(sorted(live))
            tokens, n = live[rid]
            if n < len(tokens):
                n2 = min(len(tokens), n + rng.randrange(1, 20))
                try:
                    a = pool.grow(rid, n2)
                except PoolExhaustedError:
                    pass
                else:
                    for b, kind in _new_blocks(a, admitted=False):
                        tagger.write(b, kind)
                    pool.commit(rid, n2)
                    live[rid][1] = n2
        else:
            rid = rng.choice(sorted(live))
            del live[rid]
            pool.free(rid)
        pool.check_integrity()
        tagger.check(_kinds(pool))
    assert hits > 0  # the run did exercise shared prefixes
