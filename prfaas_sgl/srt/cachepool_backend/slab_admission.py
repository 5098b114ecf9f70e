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
charged again in tokens; that over-count is why R is 2, not 1: with nothing running, F + idle >= R
before the match, so the hit still finds the one block it is charged.

The pass also shapes the first chunk of a candidate so that it ends where a state can be cached
(`_chunk_to_a_state`): at the branch point the match reported, or on a block boundary when the budget
cuts it short. SGLang's no_buffer strategy holds a state only at chunk ends, and prfaas_hybrid names a
state by the block it ends on.

The state check itself skips a candidate that holds its state: a waiting request keeps the state its
hit took while it waits, so a queue of hits can hold every free block, and refusing them all (each
for want of a block that they themselves hold) stalls the server with nothing running. And when
every live KV token is an idle cached one (nothing runs), every KV block is freeable for a state:

    state room = F + idle states + (KV blocks if live KV tokens == idle cached KV tokens else 0)
"""
from __future__ import annotations

import logging
import time

from sglang.srt.mem_cache.prefill_budget import PrefillBudget

from prfaas_sgl.cachepool.slab_blocks import KV

log = logging.getLogger(__name__)
ADMISSION_RESERVE = 2  # blocks the KV side never takes while states are priced at admission
REFUSAL_LOG_EVERY_S = 10.0
_last_refusal_log = [0.0]


class SlabPrefillBudget(PrefillBudget):
    """One PrefillAdder pass over the slab. `states`: states charged this pass (each is allocated
    when the pass's batch is built, before the next pass). Mutates nothing but its own counters."""

    def __init__(self, allocator, tree_cache, *, num_mixed_decode_tokens: int = 0) -> None:
        super().__init__(allocator, tree_cache, num_mixed_decode_tokens=num_mixed_decode_tokens)
        self.blocks, self.bs = allocator.slab_blocks, allocator.bs
        # a state is named by the cache's index block (16 tokens), not the slab block (bs tokens: one
        # state's bytes, 80 tokens for the benchmark's model); chunk ends align to the former
        self.index_block = getattr(tree_cache, "bs", 1)
        self.states = 0
        self.cut = False  # a chunk this pass was cut before the budget ran out (see _chunk_to_a_state)

    def state_room(self) -> int:
        """Blocks a state charged now would still find: free ones, idle cached states, and every KV
        block when all live KV is idle cache (eviction then frees whole blocks)."""
        return (self.blocks.state_available() + self.tree_cache.mamba_evictable_size()
                + self.freeable_kv_blocks() - self.states)

    def freeable_kv_blocks(self) -> int:
        """KV blocks eviction is sure to free: all of them when no request holds a KV token (one live
        token of a running request keeps its whole block, so otherwise none is counted)."""
        live = self.blocks.count(KV) * self.bs - self.allocator.loose_tokens()
        return self.blocks.count(KV) if live and live == self.tree_cache.full_evictable_size() else 0

    def _available_and_evictable(self) -> int:
        idle = self.tree_cache.mamba_evictable_size()
        evicted = (self.allocator.loose_tokens() + self.tree_cache.full_evictable_size()
                   + (self.blocks.num_free() + idle - self.blocks.reserve()) * self.bs)
        return max(self.allocator.available_size(), evicted)

    def check_prefill(self, **kwargs) -> tuple[bool, int | None]:
        if not self._holds_state() and self.state_room() < 1:
            self._log_refusal()
            return False, None
        ok, limit = super().check_prefill(**kwargs)
        extend = kwargs["extend_input_len"]
        if not ok or limit is None:
            return ok, limit
        if self.cut and extend > limit:
            return True, 0  # a second chunked request this pass: PrefillAdder stops (OTHER)
        limit = self._chunk_to_a_state(limit, kwargs["input_tokens"], extend)
        self.cut = self.cut or extend > limit
        return ok, limit

    def _chunk_to_a_state(self, limit: int, input_tokens: int, extend: int) -> int:
        """The chunk limit, so that the candidate's first chunk ends where its state can be cached: at
        the branch point its match reported (the next request sharing that prefix then hits all of
        it), else, if the chunk is cut short, on a block boundary (a state between boundaries has no
        block to name it). A chunk that would be emptied is left alone. A chunk ended early leaves
        budget for later candidates, but SGLang tracks one chunked request per pass
        (PrefillAdder.new_chunked_req): after a cut, check_prefill admits only whole prompts.

            tokens  [hit ... prefix)[chunk ............ prefix + limit)      cut: the end floors to a block
                                    [chunk ..... branch)                     branch inside: ends there
        """
        prefix, end, ib = input_tokens - extend, input_tokens - extend + limit, self.index_block
        branch = self._branch_of_candidate(input_tokens)
        if branch is not None and prefix < branch < min(end, input_tokens):
            return branch - prefix
        if end < input_tokens and end // ib * ib > prefix:
            return end // ib * ib - prefix
        return limit

    def _branch_of_candidate(self, input_tokens: int) -> int | None:
        """The branch point of the request being priced: the cache's last match (see _holds_state),
        if it was this request's (same length)."""
        c = self.tree_cache
        req = getattr(c, "last_matched_req", None)
        if req is None or len(req.full_untruncated_fill_ids) != input_tokens:
            return None
        return getattr(c, "last_matched_branch", None)

    def fit_chunk(self, *, extend_input_len: int, max_new_tokens: int, chunk_limit: int) -> int | None:
        """A continuing chunk (it starts on a block boundary: the previous one ended there) that is cut
        ends on a block boundary too, unless that leaves it empty."""
        limit = super().fit_chunk(extend_input_len=extend_input_len, max_new_tokens=max_new_tokens,
                                  chunk_limit=chunk_limit)
        ib = self.index_block
        if limit is None or extend_input_len <= limit:
            return limit
        self.cut = True  # it stays the pass's chunked request
        return limit // ib * ib if limit >= ib else limit

    def _holds_state(self) -> bool:
        """Does the candidate being priced hold its state already (the request the cache matched
        last, see linear.py _matched)?"""
        req = getattr(self.tree_cache, "last_matched_req", None)
        return req is not None and req.kv.holds_mamba

    def _log_refusal(self) -> None:
        """At most one line per REFUSAL_LOG_EVERY_S: a refusal repeats every scheduler step."""
        now = time.monotonic()
        if now - _last_refusal_log[0] < REFUSAL_LOG_EVERY_S:
            return
        _last_refusal_log[0] = now
        b, c = self.blocks, self.tree_cache
        log.info("prfaas unified pool: admission refused for want of a state block: %d free blocks (%d for "
                 "states), %d KV blocks (%d loose tokens, %d idle cached), %d idle cached states, %d states "
                 "charged this pass", b.num_free(), b.state_available(), b.count(KV), self.allocator.loose_tokens(),
                 c.full_evictable_size(), c.mamba_evictable_size(), self.states)

    def reserve(self, extend_input_len: int, max_new_tokens: int, *, extra_tokens: int = 0,
                **kwargs) -> None:
        super().reserve(extend_input_len, max_new_tokens, extra_tokens=extra_tokens, **kwargs)
        # extra_tokens is request_slot_reserve's charge here (SGLang adds mamba_gap_reserve, 0 for
        # allocators other than its own unified ones, and per-shard pages, 0 without KV sharding)
        self.states += extra_tokens // self.bs
