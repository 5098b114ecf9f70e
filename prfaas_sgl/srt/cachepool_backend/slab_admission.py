"""States priced at admission over the unified slab (--prfaas-unified-pool, colocated and PD prefill).

SGLang allocates a new request's working state (`alloc_req_slots`, which fails loudly) and then its KV
tokens (`alloc_token_slots`) in the same scheduler step that admitted it, after its PrefillAdder has
checked the budget this module shapes. Nothing else allocates in between, so a state needs no block
kept for it across steps; it needs the admission to have counted one:

    SlabTokenAllocator.request_slot_reserve   a request without a row is charged one block's tokens
                                              (bs) beside its prompt: KV and states share one budget
    SlabPrefillBudget.check_prefill           ... and is refused unless a whole block is free or
                                              freeable for its state (free KV tokens inside a block
                                              that still holds live tokens cannot hold a state)

Tokens the budget may promise: what the KV side may take now, or, with every idle cache entry evicted
(KV tokens and states alike, prfaas_hybrid's evict() stops when the allocators can serve), all of it
but the blocks SlabBlocks keeps from KV (R, `ADMISSION_RESERVE`):

    KV now       p + max(0, F - R) * bs          p: free tokens of KV-owned blocks, F: free blocks
    evicted      p + ev + (F + idle - R) * bs    ev: idle cached KV tokens, idle: idle cached states

Every path then holds: n states fit in F + idle blocks, and the KV tokens fit in what the n states
leave. A request that already holds its state (a copy-on-write prefix hit took it at match time) is
charged again; that over-count is why R is 2, not 1: with nothing running, F + idle >= R before the
match, so the hit still finds the one block it is charged.
"""
from __future__ import annotations

from sglang.srt.mem_cache.prefill_budget import PrefillBudget

ADMISSION_RESERVE = 2  # blocks the KV side never takes while states are priced at admission


class SlabPrefillBudget(PrefillBudget):
    """One PrefillAdder pass over the slab. `states`: states charged this pass (each is allocated
    when the pass's batch is built, before the next pass). Mutates nothing but its own counters."""

    def __init__(self, allocator, tree_cache, *, num_mixed_decode_tokens: int = 0) -> None:
        super().__init__(allocator, tree_cache, num_mixed_decode_tokens=num_mixed_decode_tokens)
        self.blocks, self.bs = allocator.slab_blocks, allocator.bs
        self.states = 0

    def state_room(self) -> int:
        """Blocks a state charged now would still find: free ones and idle cached states."""
        return self.blocks.state_available() + self.tree_cache.mamba_evictable_size() - self.states

    def _available_and_evictable(self) -> int:
        idle = self.tree_cache.mamba_evictable_size()
        evicted = (self.allocator.loose_tokens() + self.tree_cache.full_evictable_size()
                   + (self.blocks.num_free() + idle - self.blocks.reserve()) * self.bs)
        return max(self.allocator.available_size(), evicted)

    def check_prefill(self, **kwargs) -> tuple[bool, int | None]:
        # the candidate may already hold its state (a prefix hit); refused alike: a conservative
        # block, never a state promised that is not there
        if self.state_room() < 1:
            return False, None
        return super().check_prefill(**kwargs)

    def reserve(self, extend_input_len: int, max_new_tokens: int, *, extra_tokens: int = 0,
                **kwargs) -> None:
        super().reserve(extend_input_len, max_new_tokens, extra_tokens=extra_tokens, **kwargs)
        # extra_tokens is request_slot_reserve's charge here (SGLang adds mamba_gap_reserve, 0 for
        # allocators other than its own unified ones, and per-shard pages, 0 without KV sharding)
        self.states += extra_tokens // self.bs
