"""LinearStateCache: prfaas_hybrid for hybrid linear-attention models (Mamba/GDN/KDA/Lightning), colocated or
on a prefill server.

A state is one SGLang Mamba-pool slot, copied whole (`MambaPool.copy_from`: every conv tensor and the
recurrent one), so the family's shapes never reach this module: GDN's conv (dim, K-1), KDA's transposed
(K-1, 3 H D) and Lightning's recurrent-only state are cached and restored alike
(tests/fast/test_cachepool_backend_states.py).

A checkpoint copies the request's slot into a fresh slot (as SGLang's MambaComponent does for
no_buffer); a hit sets `mamba_cow_src_index`, and the scheduler copies it into the request's slot
before the forward. A hit ends at a block whose state the pool holds, so the pool's linear group
plans a state checkpoint every `checkpoint_interval` tokens (the chunk size: SGLang holds a state at
chunk ends only).
"""
from __future__ import annotations

from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams

from prfaas_sgl.cachepool import GroupSpec

from . import config as backend_config
from .base import Entry, Node, PrfaasHybridCache
from .mirror import LINEAR, Insert


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
        return super()._groups() + (GroupSpec(LINEAR, "linear", 1, state_bytes=self.bs,  # one block per state
                                              checkpoint_interval=self.cfg.checkpoint_interval),)

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
    def _stage(self, req, insert: Insert, last_hash: int, length: int, up_to: int) -> None:
        """The request's state, if up_to is a checkpoint boundary (its slot holds exactly that state)
        the pool has no state for yet."""
        on_grid = length == up_to and up_to % self.cfg.checkpoint_interval == 0
        if on_grid and last_hash not in self.mirror.state_of:
            insert.state_hash, insert.state = last_hash, self._snapshot(req)

    def _snapshot(self, req):
        """Copy the request's state into a fresh slot; None if no slot can be freed."""
        slot = self._alloc_state()
        if slot is not None:
            pool = self.req_to_token_pool
            src = pool.translate_mamba_indices(req.kv.mamba_pool_idx.unsqueeze(0))
            pool.mamba_pool.copy_from(src, pool.translate_mamba_indices(slot))
        return slot

    def _commit_point(self, ent: Entry, hashes: list[int], length: int, insert: Insert) -> int:
        """Tokens to commit. The pool plans a checkpoint at every grid boundary a request crosses,
        but SGLang holds a state only at chunk ends: commit stops before the first boundary with
        neither a state from this checkpoint nor an indexed one (it would index a wrong state).
        Boundaries up to ent.checked were committed by an earlier call, so each is checked once.

            grid   |----c----|----c----|----c----|
            chunks [  chunk  )[ short )[  chunk   )   <- the second boundary has no state: stop
        """
        c, bs = self.cfg.checkpoint_interval, self.bs
        if not ent.first_gap:
            for b in range((max(ent.start, ent.checked) // c + 1) * c, length + 1, c):
                h = hashes[b // bs - 1]
                if not (h in self.mirror.state_of or (h == insert.state_hash and insert.state is not None)):
                    ent.first_gap = b
                    break
            else:
                ent.checked = max(ent.checked, length)
        return min(length, ent.first_gap - 1) if ent.first_gap else length

    # -- sizes ----------------------------------------------------------------------------------
    def mamba_evictable_size(self) -> int:
        return self.pool.idle_blocks(LINEAR)
