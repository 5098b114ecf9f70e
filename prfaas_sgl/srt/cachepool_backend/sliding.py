"""SlidingWindowCache: prfaas_hybrid for sliding-window hybrids (SWA + full attention, no linear layers;
colocated and PD prefill; the decode server's kind is decode_kv.DecodeWindowKvCache). Page size:
any that divides the index block, so a cached block is whole pages.

A full group and an SWA group (window = sliding_window_size + 1) instead of the linear one; a hit is
any block boundary whose window pages survive (swa.py, docs/cachepool-swa.md). A checkpoint raises the
request's swa_evict_floor over what it hands the tree, so SGLang's window eviction never frees
tree-owned pages.
"""
from __future__ import annotations

import torch
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

from prfaas_sgl.cachepool import GroupSpec, HybridCachePool

from . import config as backend_config
from .base import Entry, PrfaasHybridCache
from .mirror import FULL, Insert, Mirror
from .swa import SWA, SwaMemory


class SlidingWindowCache(PrfaasHybridCache):
    def __init__(self, params, cfg: backend_config.BackendConfig) -> None:
        super().__init__(params, cfg)
        self.sliding_window_size = cfg.swa_window - 1

    @classmethod
    def config_for(cls, ctx, mode: str) -> backend_config.BackendConfig:
        """Full and SWA slots together size the virtual pool; no state slots."""
        p = ctx.params
        alloc = p.token_to_kv_pool_allocator
        return backend_config.from_server(ctx.server_args.chunked_prefill_size, alloc.size_full + alloc.size_swa, 0,
                                          role=mode, swa_window=p.sliding_window_size + 1)

    def _groups(self) -> tuple[GroupSpec, ...]:
        return super()._groups() + (GroupSpec(SWA, "swa", 1, kv_bytes_per_token=1, window=self.cfg.swa_window),)

    def _mirror(self, pool: HybridCachePool) -> Mirror:
        """A removed full entry whose window pages went first frees its full side only."""
        swa = SwaMemory(self.token_to_kv_pool_allocator)
        return self._mirror_over(pool, swa.free_full, swa)

    # -- checkpoints ----------------------------------------------------------------------------
    def _offers_nothing(self, req, length: int, up_to: int) -> bool:
        """Never: every checkpoint raises the request's swa_evict_floor (_stage)."""
        return False

    def _stage(self, req, insert: Insert, last_hash: int, length: int, up_to: int) -> None:
        insert.swa_limit = self._protect_windows(req, length)

    def _protect_windows(self, req, length: int) -> int:
        """Row positions below which this checkpoint may give the tree window pages. SGLang's window
        eviction frees the row's [swa_dead_lo, cursor); raising swa_evict_floor over [0, length)
        keeps it off pages the tree takes, but only while it has freed nothing there (the floor also
        decides which part release frees full-side only). A finished request frees nothing more."""
        kv = req.kv
        if req.finished():
            return length
        dead_lo = kv.swa_dead_lo(self.page_size)
        if kv.get_evicted_seqlen(ComponentType.SWA) <= dead_lo:
            kv.swa_evict_floor = max(kv.swa_evict_floor, length)
            return length
        return dead_lo

    def _free_windows(self, kv, ent: Entry, ranges: list[tuple[int, int]]) -> None:
        """free_kv_row skips the blocks the tree took, but the tree owns their window pages only
        while its SWA index holds them: the live pages of the others are still the request's."""
        bs = self.bs
        mine = [i for i, h in ent.stored.items() if h not in self.mirror.swa_of
                and any(s < (i + 1) * bs and i * bs < e for s, e in ranges)]
        if mine:
            row = self.req_to_token_pool.req_to_token[kv.req_pool_idx]
            pos = torch.tensor(mine, dtype=torch.int64, device=row.device)
            slots = row[(torch.arange(bs, device=row.device) + pos[:, None] * bs).reshape(-1)].to(torch.int64)
            self.mirror.swa.free_window(slots[self.mirror.swa.alive(slots)])

    # -- eviction and sizes ---------------------------------------------------------------------
    def _evict_group(self, short_kv: bool, short_windows: bool) -> str | None:
        """Short of window pages only, evict SWA entries first (they serve only hits no longer than
        theirs); short of KV, full entries (their window pages go with them)."""
        return FULL if short_kv else SWA if short_windows else None

    def swa_evictable_size(self) -> int:
        return self.pool.idle_blocks(SWA) * self.bs

    def supports_mamba(self) -> bool:
        return False

    def supports_swa(self) -> bool:
        return True
