"""Tiers under a sliding-window hybrid's prfaas_hybrid cache (SlidingWindowCache, colocated or PD prefill).

A hit at block boundary k needs the full-attention KV of blocks [0, k) and the window pages of the
w = ceil((window - 1) / bs) blocks before k (cachepool's SlidingWindowManager). Demotion puts both
(tier_cache.Tiers.demote: a KV entry per full block, a WINDOW entry per block whose window the tree
held); a load brings back what the device lacks:

    blocks     [0 ...... k0)[k0 ................................ k)
    device     full KV + the windows the device hit k0 holds
    loaded     KV of the blocks not in kv_of (fresh full slots)
               windows of [k - w, k) not in swa_of (fresh SWA pages, paired with their full slots,
               loaded or still on the device), nearest first
    fault      a KV entry missing at j: k = j; a window missing at j: k = j, and the windows of
               [j - w, j) are fetched as well, so the hit ends one boundary early, not at k0

Then the blocks [k0, reached) are indexed through one pool request, as a request's checkpoint would:
the full group stores the loaded KV, the SWA group the windows (the mirror rejects a block whose full
slots have no live SWA peers, so a block loaded without its window is indexed full-side only). What was
allocated and not indexed goes back to SGLang's allocators before returning.
"""
from __future__ import annotations

from typing import Optional

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams

from prfaas_sgl.cachepool import PoolExhaustedError
from prfaas_sgl.cachepool.tiers import KV, WINDOW
from prfaas_sgl.cachepool.tiers.plan import window_extension

from .mirror import Insert
from .tier_cache import Tiers
from .tier_io import PoolBytes


def window_bytes(cache) -> PoolBytes:
    """PoolBytes over a sliding-window model's full and SWA pools (no state)."""
    alloc = cache.token_to_kv_pool_allocator
    if getattr(alloc, "swa_req_ring", False):
        raise ValueError("prfaas_hybrid tiers: this server keeps SWA pages in per-request rings (no paged "
                         "window to save or load); run without --prfaas-tier-* flags")
    mapping = alloc.full_to_swa_index_mapping
    return PoolBytes(alloc.get_kvcache(), None, cache.bs, to_window=lambda slots: mapping[slots.to(torch.int64)])


class WindowTiers(Tiers):
    loads_states = False
    loaded_windows = 0  # windows loaded back (and indexed) since start

    @property
    def window_blocks(self) -> int:
        return -(-(self.cache.cfg.swa_window - 1) // self.cache.bs)

    def _loads_for(self, params) -> bool:
        """Any request's own match (SGLang passes cow_mamba=False for a model without Mamba layers)."""
        return params.req is not None

    def _wanted(self, hashes: list[int], k0: int, limit: int) -> list[tuple[int, int]]:
        """KV and windows of [k0, limit) the device lacks (windows before k0 must be on the device)."""
        m = self.cache.mirror
        return [(KV, h) for h in hashes[k0:limit] if h not in m.kv_of] + \
            [(WINDOW, h) for h in hashes[k0:limit] if h not in m.swa_of]

    def _plan(self, hashes: list[int], k0: int, limit: int, present: set[tuple[int, int]]) -> int:
        m = self.cache.mirror
        return window_extension(hashes, k0, limit, self.window_blocks, lambda h: h in m.kv_of or (KV, h) in present,
                                m.swa_of.__contains__, lambda h: (WINDOW, h) in present)

    def _fill(self, load_id: str, hashes: list[int], k0: int, k: int) -> int:
        c, bs = self.cache, self.cache.bs
        full, pages = self._allocate_window(hashes, k0, k)
        row = torch.zeros(k * bs, dtype=torch.int64, device=c.device)
        kv_end, loaded = self._fill_kv(hashes, k0, k, row, full)
        windows, paired = self._fill_windows(hashes, k0, kv_end, row, pages)
        reached = self._reached(hashes, k0, kv_end, windows)
        try:
            if reached > k0:
                reached = self._index(load_id, hashes, k0, reached, row, loaded)
        finally:
            self._give_back(row, loaded, paired, reached, full, pages)
        # a window paired here and then rejected by the mirror would hold SWA pages nobody frees
        assert all(hashes[j] in c.mirror.swa_of for j in paired if j < reached), "a loaded window was not indexed"
        self.loaded_blocks += sum(1 for j in loaded if j < reached)
        self.loaded_windows += sum(1 for j in paired if j < reached)
        return reached

    def _allocate_window(self, hashes, k0: int, k: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Full slot blocks for the KV [k0, k) lacks, SWA page blocks for the windows of [k - w - 1, k) it
        lacks (one spare: a window fault at k - 1 then still reaches k - 1); fewer if the device cannot
        free enough. Lists of int64 [bs]."""
        c, bs, m = self.cache, self.cache.bs, self.cache.mirror
        n_kv = sum(1 for j in range(k0, k) if hashes[j] not in m.kv_of)
        n_win = sum(1 for j in range(max(k0, k - self.window_blocks - 1), k) if hashes[j] not in m.swa_of)
        alloc = c.token_to_kv_pool_allocator
        full_a, swa_a = alloc.full_attn_allocator, alloc.swa_attn_allocator
        if full_a.available_size() < n_kv * bs or swa_a.available_size() < n_win * bs:
            c.evict(EvictParams(num_tokens=n_kv * bs, swa_num_tokens=n_win * bs))
        return _blocks(full_a, n_kv, bs), _blocks(swa_a, n_win, bs)

    def _fill_kv(self, hashes, k0: int, k: int, row, full: list) -> tuple[int, dict[int, torch.Tensor]]:
        """Row positions of [k0, end): the device's slots, or fresh ones the KV entry was written into;
        end stops at the first block neither the device nor a tier (nor a free slot) gives."""
        m, bs, io = self.cache.mirror, self.cache.bs, self.io
        loaded: dict[int, torch.Tensor] = {}
        for j in range(k0, k):
            h = hashes[j]
            if h in m.kv_of:
                row[j * bs:(j + 1) * bs] = m.kv_slots([h])
                continue
            payload = self.stack.get(KV, h, io.kv_bytes) if full else None
            if payload is None:
                return j, loaded
            slots = loaded[j] = full.pop()
            io.write_kv(slots, payload)
            row[j * bs:(j + 1) * bs] = slots
        return k, loaded

    def _fill_windows(self, hashes, k0: int, end: int, row, pages: list) -> tuple[set[int], list[int]]:
        """Windows for a hit at `end`, nearest first; a window that cannot be had lowers the target to
        its block and asks for the windows before it. Returns the blocks whose window is on the device
        now (there before, or loaded) and those given fresh SWA pages here.

            target = end:  windows [end - w, end)      a fault at j: target = j, windows [j - w, j)
        """
        m, bs, io = self.cache.mirror, self.cache.bs, self.io
        have, paired, target, j = set(), [], end, end - 1
        while j >= max(k0, target - self.window_blocks):
            h = hashes[j]
            if h in m.swa_of:
                have.add(j)
            else:
                payload = self.stack.get(WINDOW, h, io.window_bytes) if pages else None
                if payload is None:
                    target = j
                else:
                    slots = row[j * bs:(j + 1) * bs]
                    self.cache.token_to_kv_pool_allocator.set_full_to_swa_mapping(slots, pages.pop())
                    io.write_window(slots, payload)
                    have.add(j)
                    paired.append(j)
            j -= 1
        return have, paired

    def _reached(self, hashes, k0: int, end: int, windows: set[int]) -> int:
        """The longest boundary in [k0, end] whose window blocks are all on the device (k0 if none)."""
        m, w = self.cache.mirror, self.window_blocks
        for b in range(end, k0, -1):
            if all(j in windows or (j < k0 and hashes[j] in m.swa_of) for j in range(max(0, b - w), b)):
                return b
        return k0

    def _index(self, load_id: str, hashes, k0: int, reached: int, row, loaded: dict) -> int:
        """Commit blocks [k0, reached) through the pool request; k0 if the pool has no room."""
        c, bs = self.cache, self.cache.bs
        insert = Insert(row, {hashes[j]: j for j in range(k0, reached)}, swa_limit=reached * bs)
        try:
            c.pool.grow(load_id, reached * bs)
        except PoolExhaustedError:
            return k0
        c._drain()
        c.pool.commit(load_id, reached * bs)
        c._drain(insert)
        assert sorted(insert.stored_blocks) == sorted(j for j in loaded if j < reached), \
            "a loaded entry was not indexed"
        return reached

    def _give_back(self, row, loaded: dict, paired: list[int], reached: int, full: list, pages: list) -> None:
        """Free what is not indexed: loaded blocks past `reached` (both sides if paired), the SWA pages paired
        with device blocks past it, and every slot never used."""
        c, bs, swa = self.cache, self.cache.bs, self.cache.mirror.swa
        unused = [row[j * bs:(j + 1) * bs] for j in sorted(set(loaded) | set(paired)) if j >= reached]
        spent = torch.cat(unused) if unused else torch.empty(0, dtype=torch.int64, device=c.device)
        live = swa.alive(spent)
        unloaded = {j for j in loaded if j >= reached}
        own_full = torch.cat([row[j * bs:(j + 1) * bs] for j in sorted(unloaded)]) if unloaded else spent[:0]
        swa.free_window(spent[live])  # SWA pages first: the full-only free expects its peers gone
        swa.free_full(own_full)
        alloc = c.token_to_kv_pool_allocator
        if full:
            alloc.full_attn_allocator.free(torch.cat(full))
        if pages:
            alloc.swa_attn_allocator.free(torch.cat(pages))
        full.clear()
        pages.clear()


def _blocks(allocator, n: int, bs: int) -> list[torch.Tensor]:
    """n blocks of bs slots from one of SGLang's sub-allocators (page size divides bs), as many as fit."""
    while n > 0:
        slots = allocator.alloc(n * bs)
        if slots is not None:
            return list(slots.to(torch.int64).view(-1, bs))
        n -= 1
    return []
