"""SGLang 0.5.23's side of bench_cachepool_gpu_sizes.py: its `UnifiedRadixCache` (FULL + MAMBA, no_buffer,
page 1) driven through the calls its scheduler makes on the tree for one request, with a stand-in Req that
carries the fields those calls read. Paths are inside sglang/srt/.

    admit    Req.init_next_round_input -> match_kv_cache (managers/schedule_batch.py:1734,
             mem_cache/common.py:221): match_prefix with the request and cow_mamba; a hit with a state
             takes the request's own state slot there (MambaComponent.finalize_match_result_in_cache,
             unified_cache/components/mamba.py:196). Then the lock (managers/schedule_policy.py:1690),
             a state slot for a hit without one, the KV of the rest (evicting when short) written into
             the request's row (mem_cache/allocation.py alloc_for_extend).
    chunk    each chunk end before the last: checkpoint_kv_cache -> tree.checkpoint(req, up_to=extend_end)
             (managers/scheduler.py:3776, common.py:278) -> checkpoint_into_tree
             (mem_cache/unified_radix_cache.py:1164): the components' prepare (a fresh state slot and a
             copy of the request's state, mamba.py:604), the insert, the path re-read, the row rewrite
             onto the tree's slots, unlock and re-lock on the new node, the components' cleanup (mamba.py:684).
    release  release_kv_cache (common.py:400) on the tree: checkpoint(req, up_to=owned_kv_len) with the
             request finished (the tree takes its state slot, or frees it if it has one there), free_kv_row
             (base_prefix_cache.py:497) of [cache_protected_len, owned), unlock, on_release(req,
             checkpointed=True) (common.py:431-439, unified_radix_cache.py:1152).

Left out, on this side as on ours: release_kv_cache's steps that run the same for any tree (claim_kv_row's
streaming-session check, refresh_fill_ids, the over-allocation free, req_to_token_pool.free, mark_kv_released);
the checkpoint at the prompt's end before decode (batch_result_processor.py:394: a mix sequence stands for
prompt + output, decode is not replayed); the deferred copy-on-write of the hit's state (forward stream).
SGLang's no_buffer scheduler never checkpoints at the match's mamba_branching_seqlen: only the extra-buffer
track reads it (managers/schedule_batch.py:2998, 3216).
"""
from __future__ import annotations

import time
from array import array


def key(ids: array):
    """SGLang 0.5.23's match key (Req.init_next_round_input): the request's array, capped by a limit."""
    from sglang.srt.mem_cache.radix_cache import RadixKey
    return RadixKey(ids, limit=len(ids) - 1)


class StandInReq:
    """The fields of SGLang's Req its tree's match, checkpoint and release read; the KV record is
    SGLang's own ReqKvInfo, on request-pool row 0 (the row both sides of the harness write)."""

    session = session_id = priority = kv_rotation_base = extra_key = cache_salt = None
    finished_reason = to_finish = last_node = lock = None
    prefix_len = 0

    def __init__(self, rid: str, ids: array) -> None:
        from sglang.srt.managers.schedule_batch import ReqKvInfo
        self.rid, self.origin_input_ids, self.full_untruncated_fill_ids = rid, ids, ids
        self.kv = ReqKvInfo(req_pool_idx=0)

    def finished(self) -> bool:
        return self.finished_reason is not None


class Sglang:
    def __init__(self, alloc, pool, cache, chunk: int, now=time.thread_time) -> None:
        self.alloc, self.pool, self.cache, self.chunk, self.now = alloc, pool, cache, chunk, now

    def match(self, ids: array, rid: str, req=None):
        """A probe match (no request: no state slot is taken)."""
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        return self.cache.match_prefix(MatchPrefixParams(key=key(ids)))

    def _slot(self):
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams
        s = self.pool.mamba_allocator.alloc(1)
        if s is None:
            self.cache.evict(EvictParams(num_tokens=0, mamba_num=1))
            s = self.pool.mamba_allocator.alloc(1)
        return s

    def admit(self, ids: array, rid: str) -> StandInReq:
        """Match, lock, a state slot, the row: the request ready for its first chunk."""
        import torch
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
        c, req = self.cache, StandInReq(rid, ids)
        m = c.match_prefix(MatchPrefixParams(key=key(ids), req=req, cow_mamba=True))
        p = m.device_prefix_len
        req.last_node, req.prefix_len = m.last_device_node, p
        req.kv.cache_protected_len = p if m.cache_protected_len is None else m.cache_protected_len
        req.lock = c.lock(req.last_node)
        if not req.kv.holds_mamba:  # no state at the hit to copy: HybridReqToTokenPool.alloc's slot
            req.kv.mamba_pool_idx = self._slot()[0]
        need = len(ids) - p
        if self.alloc.available_size() < need:
            c.evict(EvictParams(num_tokens=need - self.alloc.available_size()))
        self.pool.req_to_token[0, :len(ids)] = torch.cat([c.path_device_indices(req.last_node)[:p],
                                                          self.alloc.alloc(need)])
        req.kv.kv_allocated_len = req.kv.kv_committed_len = len(ids)
        return req

    def release(self, req: StandInReq) -> None:
        """release_kv_cache's calls on the tree, the request finished."""
        c, end = self.cache, req.kv.kv_committed_len
        req.finished_reason = "length"
        c.checkpoint(req, up_to=end)
        c.free_kv_row(req.kv, [(req.kv.cache_protected_len, end)])
        c.unlock(req.lock)
        req.lock = None
        c.on_release(req, checkpointed=True)

    def serve(self, ids: array, rid: str, times: dict | None = None) -> int:
        """One request: admitted, checkpointed at each chunk end counted from the hit, released;
        returns the tokens its match hit."""
        req = self.admit(ids, rid)
        p = req.prefix_len
        for end in range(p + self.chunk, len(ids), self.chunk):
            t0 = self.now()
            self.cache.checkpoint(req, up_to=end)
            if times is not None:
                times["checkpoint"].append((self.now() - t0) * 1e3)
        t0 = self.now()
        self.release(req)
        if times is not None:
            times["release"].append((self.now() - t0) * 1e3)
        return p

    def evict(self, tokens: int) -> None:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams
        self.cache.evict(EvictParams(num_tokens=tokens))

    def cached_tokens(self) -> int:
        return self.cache.full_evictable_size() + self.cache.full_protected_size()
