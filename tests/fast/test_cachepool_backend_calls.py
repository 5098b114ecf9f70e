"""prfaas_hybrid driven through SGLang's calls on SGLang's real KV allocator, random interleavings of
requests, chunk checkpoints, releases, locks and evictions. After every step:

- every KV slot is exactly one of free / cached (mirror) / in a live request's row, and every Mamba slot
  one of free / cached / a live request's (batched frees neither leak nor free twice);
- each size query equals a recount of the pool's LRU (the O(1) counters);
- the pool's hashes for each live request equal hashing its tokens from scratch (incremental hashing);
and each checkpoint stores its new blocks with at most one gather, each evict() frees KV with at most
one allocator call.
"""
from __future__ import annotations

from array import array
from types import SimpleNamespace as NS

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey

from prfaas_sgl.cachepool.hashing import block_hashes
from prfaas_sgl.srt.cachepool_backend import cache as backend
from prfaas_sgl.srt.cachepool_backend.mirror import Mirror

KV, STATES, ROWS, CHUNK = 640, 10, 4, 32  # slots, Mamba slots, request rows, checkpoint interval
PREFIXES = [list(range(1000, 1200)), list(range(5000, 5200))]


class Slots:
    """A Mamba slot allocator that refuses a double free (SGLang's only concatenates)."""

    def __init__(self, n: int) -> None:
        self.free_set, self.n = set(range(1, n + 1)), n

    def alloc(self, k: int):
        if len(self.free_set) < k:
            return None
        return torch.tensor([self.free_set.pop() for _ in range(k)], dtype=torch.int64)

    def free(self, idx) -> None:
        got = idx.reshape(-1).tolist()
        assert len(set(got)) == len(got) and not set(got) & self.free_set, f"state double free {got}"
        self.free_set |= set(got)


class FakeKv:
    def __init__(self, row: int) -> None:
        self.req_pool_idx, self.mamba_pool_idx, self.mamba_cow_src_index = row, None, None
        self.mamba_needs_clear, self.cache_protected_len = False, 0

    @property
    def holds_mamba(self) -> bool:
        return self.mamba_pool_idx is not None

    def get_evicted_seqlen(self, component) -> int:
        return 0

    def swa_dead_lo(self, page_size: int) -> int:
        return 0


def _build():
    alloc = TokenToKVPoolAllocator(KV, torch.float32, "cpu", None, False)
    states = Slots(STATES)

    def free_mamba_cache(req):
        states.free(req.kv.mamba_pool_idx.unsqueeze(0))
        req.kv.mamba_pool_idx = None
    pool = NS(req_to_token=torch.zeros((ROWS, 256), dtype=torch.int32), mamba_allocator=states,
              mamba_pool=NS(size=STATES, copy_from=lambda src, dst: None), translate_mamba_indices=lambda i: i,
              free_mamba_cache=free_mamba_cache)
    return alloc, states, pool


class BackendMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.alloc, self.states, self.rtp = _build()
        self.kv_frees = 0
        real_free = self.alloc.free

        def free(idx):  # SGLang's allocator concatenates blindly: check for a double free here
            got = idx.reshape(-1).tolist()
            assert len(set(got)) == len(got) and not set(got) & set(self.alloc.free_pages.tolist()), "KV double free"
            self.kv_frees += 1
            real_free(idx)
        self.alloc.free = free
        ctx = NS(params=NS(page_size=1, token_to_kv_pool_allocator=self.alloc, req_to_token_pool=self.rtp),
                 server_args=NS(chunked_prefill_size=CHUNK, disaggregation_mode="null"), is_hybrid_ssm=True,
                 is_hybrid_swa=False, enable_hierarchical_cache=False, disable_radix_cache=False)
        self.cache = backend.build(ctx)
        self.gathers, real_gather = [0], self.cache.mirror._gather
        self.cache.mirror._gather = lambda *a: (self.gathers.__setitem__(0, self.gathers[0] + 1), real_gather(*a))
        self.live: dict[int, list] = {}  # row -> [req, node, lock, computed]
        self.n = 0

    @precondition(lambda self: len(self.live) < ROWS)
    @rule(p=st.integers(0, 1), cut=st.integers(0, 200), tail=st.lists(st.integers(0, 3), max_size=40))
    def start(self, p, cut, tail):
        tokens = PREFIXES[p][:cut] + tail
        if len(tokens) < 2:
            return
        row = min(set(range(ROWS)) - set(self.live))
        kv, c = FakeKv(row), self.cache
        req = NS(rid=f"r{self.n}", extra_key=None, cache_salt=None, full_untruncated_fill_ids=array("q", tokens), kv=kv)
        self.n += 1
        node = c.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens[:-1])), req=req, cow_mamba=True)).last_device_node
        lock = c.inc_lock_ref(node)
        if not kv.holds_mamba:
            slot = c._alloc_state()
            kv.mamba_pool_idx = None if slot is None else slot[0]
        prefix, need = c.path_device_indices(node), len(tokens) - len(node.tokens)
        if self.alloc.available_size() < need:
            c.evict(EvictParams(num_tokens=need - self.alloc.available_size()))
        fresh = self.alloc.alloc(need) if kv.holds_mamba else None
        if fresh is None:  # no room: the scheduler would keep it waiting
            if kv.holds_mamba:
                self.rtp.free_mamba_cache(req)
            c.dec_lock_ref(node, lock.to_dec_params())
            return
        self.rtp.req_to_token[row, :len(tokens)] = torch.cat([prefix, fresh]).to(torch.int32)
        kv.cache_protected_len = len(prefix)
        self.live[row] = [req, node, lock, len(prefix)]

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def chunk_end(self, data):
        entry = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        req, end = entry[0], entry[3] + CHUNK
        if end < len(req.full_untruncated_fill_ids):
            before = self.gathers[0]
            self.cache.checkpoint(req, up_to=end)
            assert self.gathers[0] - before <= 1, "a checkpoint gathered its blocks more than once"
            entry[3] = end

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def release(self, data):
        row = data.draw(st.sampled_from(sorted(self.live)))
        req, node, lock, _ = self.live.pop(row)
        n, c = len(req.full_untruncated_fill_ids), self.cache
        c.checkpoint(req, up_to=n)
        c.free_kv_row(req.kv, [(req.kv.cache_protected_len, n)])
        c.dec_lock_ref(node, lock.to_dec_params())
        c.on_release(req, checkpointed=True)

    @rule(tokens=st.integers(0, 300), states=st.integers(0, 3))
    def evict(self, tokens, states):
        before = self.kv_frees
        self.cache.evict(EvictParams(num_tokens=tokens, mamba_num=states))
        assert self.kv_frees - before <= 1, "evict() freed KV slots in more than one allocator call"

    @invariant()
    def slots_conserved(self):
        mirror = self.cache.mirror
        cached = mirror.kv_slots(list(mirror.kv_of)).tolist()
        rows = [self.rtp.req_to_token[r, len(e[1].tokens):len(e[0].full_untruncated_fill_ids)].tolist()
                for r, e in self.live.items()]
        free = self.alloc.free_pages.tolist()
        held = set(cached).union(*map(set, rows)) if rows else set(cached)
        assert len(free) == len(set(free)) and not set(free) & held, "a KV slot is free and held"
        # cached slots inside a live row are that row's blocks it handed to the tree
        assert len(free) + len(held) == KV, f"KV slots leaked: {KV - len(free) - len(held)}"
        states = [int(t) for t in mirror.state_of.values()] + [int(e[0].kv.mamba_pool_idx) for e in self.live.values()]
        assert len(states) == len(set(states)) and not set(states) & self.states.free_set
        assert len(states) + len(self.states.free_set) == STATES, "Mamba slots leaked"

    @invariant()
    def sizes_equal_a_recount(self):
        c, blocks = self.cache, self.cache.pool.blocks
        idle = {m.name: 0 for m in c.pool.managers}
        for b in blocks.lru_blocks():
            idle[blocks.owner[b].name] += 1
        assert c.evictable_size() == c.full_evictable_size() == idle["full"] * c.bs
        assert c.protected_size() == len(c.mirror.kv_of) * c.bs - idle["full"] * c.bs
        assert c.mamba_evictable_size() == idle["linear"]
        assert c.mamba_protected_size() == len(c.mirror.state_of) - idle["linear"]
        c.check_integrity()

    @invariant()
    def hashes_equal_from_scratch(self):
        """Each pool request's hashes are those of its tokens, and cover every block it holds (a
        checkpoint hashes only up to its end, not the whole prompt)."""
        bs = self.cache.bs
        for pool_req in self.cache.pool._reqs.values():
            if not pool_req.token_ids:  # a lock's pin: the matched hashes, no tokens, nothing to grow
                continue
            h = pool_req.hashes
            assert h == block_hashes(list(pool_req.token_ids)[:len(h) * bs], bs)
            assert len(h) >= pool_req.num_tokens // bs


TestBackendMachine = BackendMachine.TestCase
TestBackendMachine.settings = settings(max_examples=20, stateful_step_count=30, deadline=None,
                                       suppress_health_check=[HealthCheck.too_slow])


def test_mirror_frees_removed_slots_before_a_reused_row_is_stored():
    """A removed entry's kv_table row is taken again at once (one row here): the old slots must go back
    before the row is overwritten, or the new slots would be freed instead (pins Mirror.apply's flush
    before _store)."""
    freed: list = []
    m = Mirror(2, 1, torch.device("cpu"), free_kv=freed.append, free_state=freed.append)
    from prfaas_sgl.cachepool import BlockRemoved, BlockStored
    from prfaas_sgl.srt.cachepool_backend.mirror import Insert
    m.apply([BlockStored([11], None, [0, 0], 2, None, group="full")], Insert(torch.tensor([7, 8]), {11: 0}))
    m.apply([BlockRemoved([11], group="full"), BlockStored([12], None, [1, 1], 2, None, group="full")],
            Insert(torch.tensor([5, 6]), {12: 0}))
    assert [t.tolist() for t in freed] == [[7, 8]] and m.kv_slots([12]).tolist() == [5, 6]
