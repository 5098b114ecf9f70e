"""LinearStateCache: prfaas_hybrid for hybrid linear-attention models (Mamba/GDN/KDA/Lightning), colocated or
on a prefill server.

A state is one SGLang Mamba-pool slot, copied whole (`MambaPool.copy_from`: every conv tensor and the
recurrent one), so the family's shapes never reach this module: GDN's conv (dim, K-1), KDA's transposed
(K-1, 3 H D) and Lightning's recurrent-only state are cached and restored alike
(tests/fast/test_cachepool_backend_states.py).

A checkpoint copies the request's slot into a fresh slot (as SGLang's MambaComponent does for
no_buffer); a hit sets `mamba_cow_src_index`, and the scheduler copies it into the request's slot
before the forward. A hit ends at a block whose state the pool holds. SGLang's no_buffer strategy
holds a request's state at each chunk end, at its prompt's end and when it finishes, and calls
checkpoint() at each: every one that lands on a block boundary is cached (`_state_at`), as SGLang's
tree keeps each. Where the KV of a match reaches past its state (a shared prefix that ends inside
a chunk), the match reports that branch point (SGLang's mamba_branching_seqlen) and the unified
slab's admission ends the request's first chunk there (slab_admission.py), so the next request
sharing the prefix hits all of it.
"""
from __future__ import annotations

from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams

from prfaas_sgl.cachepool import GroupSpec

from . import config as backend_config
from .base import Node, PrfaasHybridCache
from .mirror import LINEAR


class LinearStateCache(PrfaasHybridCache):
    @classmethod
    def config_for(cls, ctx, mode: str) -> backend_config.BackendConfig:
        """Index blocks of one chunk each. A hit ends where a state is cached, on the checkpoint grid
        (chunk ends), so a finer block never lengthens a hit or shares more KV; it only multiplies
        what the scheduler thread does per block (hash, index lookup, event, row gather): 8,192
        blocks for a 128K-token prompt at 16 tokens, 16 at an 8K chunk."""
        p, chunk = ctx.params, ctx.server_args.chunked_prefill_size
        # no chunking: from_server says what to pass; --prfaas-unified-pool sizes its slab blocks in
        # multiples of the 16-token hash block (unified.GRANULARITY) and keeps it
        slab = getattr(p.token_to_kv_pool_allocator, "slab_blocks", None) is not None
        block = chunk if chunk and chunk > 0 and not slab else 16
        return backend_config.from_server(chunk, p.token_to_kv_pool_allocator.size,
                                          p.req_to_token_pool.mamba_pool.size, block_size=block, role=mode)

    def _groups(self) -> tuple[GroupSpec, ...]:
        # one block per state; no grid: a state is checkpointed where SGLang holds one (_state_at)
        return super()._groups() + (GroupSpec(LINEAR, "linear", 1, state_bytes=self.bs, checkpoint_interval=0),)

    # -- match ----------------------------------------------------------------------------------
    def _matched(self, params: MatchPrefixParams, node: Node) -> Node:
        """A hit restores the state at its end (copy staged into the request's slot); without a slot
        for it, a miss."""
        req = params.req
        # SGLang's scheduler matches each waiting request (init_next_round_input) right before its
        # PrefillAdder prices it: the slab's admission budget asks whether it already holds a state
        self.last_matched_req = req
        if node.hashes and params.cow_mamba and req is not None and not self._cow(req, node):
            node = self.root_node
        if not node.hashes and params.cow_mamba and req is not None and req.kv.mamba_cow_src_index is not None:
            req.kv.mamba_cow_src_index = None  # an earlier match staged a copy this miss must not run
            req.kv.mamba_needs_clear = True
        return node

    def _branch_point(self, params: MatchPrefixParams, hashes: list[int], num_tokens: int, node: Node) -> int | None:
        """The end of the KV this match could reuse past its state, when it is past the hit: a
        request sharing a prefix that ends inside a chunk. The slab's admission ends the request's
        first chunk there, so its state is checkpointed where the next one branches off.

            cached   [ KV ...................................)   j blocks in the KV index
            states   [.......... k)                             k = len(node.hashes)
            request  [hit ...... k)[first chunk ..... j)[rest ...)
        Only blocks past the hit are looked up (at most a chunk's worth: states lie at chunk ends)."""
        req, k = params.req, len(node.hashes)
        limit = min(len(hashes), max(0, num_tokens - 1) // self.bs)
        j, kv_of = k, self.mirror.kv_of
        while j < limit and hashes[j] in kv_of:
            j += 1
        self.last_matched_branch = j * self.bs if j > k and req is not None and params.cow_mamba else None
        return self.last_matched_branch

    def _cow(self, req, node: Node) -> bool:
        """Stage the copy of the checkpoint at the match end into the request's state slot."""
        if not req.kv.holds_mamba:
            slot = self._alloc_state(pin=node)
            if slot is None:
                return False
            req.kv.mamba_pool_idx = slot[0]
        req.kv.mamba_cow_src_index = self.mirror.state_of[node.hashes[-1]]
        req.kv.mamba_needs_clear = False
        return True

    def _alloc_state(self, pin: Node | None = None):
        """A free Mamba slot, evicting LRU entries (never `pin`'s) if needed; None if none can be freed."""
        alloc = self.req_to_token_pool.mamba_allocator
        slot = alloc.alloc(1)
        if slot is None:
            receipt = self.inc_lock_ref(pin) if pin is not None else None
            self.evict(EvictParams(mamba_num=1))
            slot = alloc.alloc(1)
            if receipt is not None:
                self.dec_lock_ref(pin, receipt.to_dec_params())
        return slot

    # -- checkpoints ----------------------------------------------------------------------------
    def _state_at(self, req, last_hash: int, length: int, up_to: int) -> tuple[bool, object]:
        """A state wherever the request's slot holds one on a block boundary: SGLang checkpoints at
        every chunk end, at the end of the prompt and when the request finishes, and its slot then
        holds the state of exactly `up_to` tokens. Off a block boundary (up_to > length) no block
        can name it. A copy is taken only if the pool has none at that hash (the mark then only
        refreshes the cached one's recency); no slot to copy into: no mark.

            tokens  [0 ........ length)[.. up_to)      up_to == length: a state at length
        """
        if up_to != length or not _state_is_up_to(req, up_to):
            return False, None
        if last_hash in self.mirror.state_of:
            return True, None
        state = self._snapshot(req)
        return state is not None, state

    def _snapshot(self, req):
        """Copy the request's state into a fresh slot; None if no slot can be freed."""
        slot = self._alloc_state()
        if slot is not None:
            pool = self.req_to_token_pool
            src = pool.translate_mamba_indices(req.kv.mamba_pool_idx.unsqueeze(0))
            pool.mamba_pool.copy_from(src, pool.translate_mamba_indices(slot))
        return slot

    # -- sizes ----------------------------------------------------------------------------------
    def reset(self) -> None:
        super().reset()
        self._linear_idle = self.pool.idle_counter(LINEAR)

    def mamba_evictable_size(self) -> int:
        return self._linear_idle()


def _state_is_up_to(req, up_to: int) -> bool:
    """A finished request may release fewer tokens than its state has seen (SGLang's
    strip_thinking_cache, a speculative step past the stop); its state then has no block to name."""
    finished = getattr(req, "finished", None)  # the benchmarks' stand-in requests never finish
    return finished is None or not finished() or up_to == getattr(req.kv, "kv_committed_len", up_to)
