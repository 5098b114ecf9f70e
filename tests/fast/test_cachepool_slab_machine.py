"""prfaas_hybrid over ONE slab (--prfaas-unified-pool), driven by the same random interleavings
of SGLang's calls as test_cachepool_backend_calls (requests, chunk checkpoints, releases, locks,
evictions), on `unify`'s allocators over SGLang's real pools. After every step:

- the live KV token slots are exactly the cached ones plus the live rows' own, and the KV-owned blocks
  exactly the blocks holding them (an emptied block goes back to the shared list at once);
- the state blocks are exactly the cached states plus the live requests' own;
- no block is both, block 0 is neither, and the free list agrees (SlabBlocks.check);
- SGLang's idle leak invariant holds on both sides whenever no request is live.
"""
from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from sglang.srt.mem_cache.base_prefix_cache import EvictParams

from prfaas_sgl.cachepool.slab_blocks import KV, STATE
from prfaas_sgl.srt.cachepool_backend import cache as backend
from prfaas_sgl.srt.cachepool_backend.unified import unify
from tests.fast.test_cachepool_backend_calls import CHUNK, ROWS, BackendMachine
from tests.fast.test_cachepool_slab_backend import _configurator, _sglang_result
from tests.support.sglang_context import sglang_context  # noqa: F401 - autouse

BS = 16  # tokens per slab block of the tiny layout (test_cachepool_slab_backend)


class SlabBackendMachine(BackendMachine):
    def __init__(self) -> None:
        RuleBasedStateMachine.__init__(self)
        out = unify(_sglang_result(rows=ROWS, kv_tokens=640, mamba_slots=10, context=256), _configurator())
        self.alloc, self.rtp = out.token_to_kv_pool_allocator, out.req_to_token_pool
        ctx = backend_ctx(self.alloc, self.rtp)
        self.cache = backend.build(ctx)
        self.gathers, real_gather = [0], self.cache.mirror._gather
        self.cache.mirror._gather = lambda *a: (self.gathers.__setitem__(0, self.gathers[0] + 1), real_gather(*a))
        self.live: dict[int, list] = {}
        self.n = 0

    @rule(tokens=st.integers(0, 300), states=st.integers(0, 3))
    def evict(self, tokens, states):  # over a slab each eviction is flushed: no one-free bound here
        self.cache.evict(EvictParams(num_tokens=tokens, mamba_num=states))

    @invariant()
    def slots_conserved(self):
        mirror, blocks = self.cache.mirror, self.alloc.slab_blocks
        held = set(mirror.kv_slots(list(mirror.kv_of)).tolist())
        for req, node, _, _ in self.live.values():
            n = len(req.full_untruncated_fill_ids)
            held |= set(self.rtp.req_to_token[req.kv.req_pool_idx, len(node.tokens):n].tolist())
        assert set(torch.nonzero(self.alloc._live).flatten().tolist()) == held, "KV slots leaked or lost"
        assert {t // BS for t in held} == {b for b, k in enumerate(blocks.kind) if k == KV}
        states = [int(t) for t in mirror.state_of.values()] + [int(e[0].kv.mamba_pool_idx) for e in self.live.values()]
        assert len(states) == len(set(states)) == blocks.count(STATE)
        assert set(states) == {b for b, k in enumerate(blocks.kind) if k == STATE}
        blocks.check()
        if not self.live:
            c, pool = self.cache, self.rtp
            assert self.alloc.available_size() + c.full_evictable_size() + c.full_protected_size() == self.alloc.size
            assert (pool.mamba_allocator.available_size() + c.mamba_evictable_size() + c.mamba_protected_size()
                    == pool.mamba_pool.size)


def backend_ctx(alloc, rtp):
    return NS(params=NS(page_size=1, token_to_kv_pool_allocator=alloc, req_to_token_pool=rtp),
              server_args=NS(chunked_prefill_size=CHUNK, disaggregation_mode="null"), is_hybrid_ssm=True,
              is_hybrid_swa=False, enable_hierarchical_cache=False, disable_radix_cache=False)


TestSlabBackendMachine = SlabBackendMachine.TestCase
TestSlabBackendMachine.settings = settings(max_examples=15, stateful_step_count=30, deadline=None,
                                           suppress_health_check=[HealthCheck.too_slow])
