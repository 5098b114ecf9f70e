"""Tiers under a PD decode server's KV-only caches (decode_kv.DecodeKvCache for hybrid linear attention,
DecodeWindowKvCache for sliding-window hybrids: WindowKvTiers).

A decode hit is SGLang's decode_prefix_len: the prefill sends only the KV past it, plus the request's
state (linear attention) or the window pages of its tail (sliding window) whatever the hit. So a decode
hit needs KV alone, at any block boundary, and the tiers extend it with a KV-only plan: what the decode's
device pool evicted (demoted as KV entries by Tiers.demote: a prefill's entry format, CRC and MAC; the
layout fingerprint names the decode's own block size) is loaded back into fresh KV slots and indexed
before SGLang locks the match.

    blocks   [0 ...... k0)[k0 ................................ k)      limit = (prompt - 1) // bs
    device   the pool's hit
    tiers                  KV of each block the device lacks, in order; the first missing or refused
                           entry ends the hit there (reached), the rest is sent by the prefill

What a tier gives the decode is link bytes, never compute: the prefill computes the prompt from its own
cache either way. The host-to-device copy runs on the scheduler thread, in the prealloc pass that
matches the request; storage entries are read ahead on a worker from the request's arrival
(tier_prefetch: DecodePreallocQueue.add / pop_preallocated, SGLang's decode path having neither
_prefetch_kvcache nor get_new_batch_prefill).
"""
from __future__ import annotations

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams

from prfaas_sgl.cachepool.tiers import KV
from prfaas_sgl.cachepool.tiers.plan import extension

from .mirror import Insert
from .tier_cache import Tiers


class KvTiers(Tiers):
    loads_states = False

    def _loads_for(self, params) -> bool:
        """The prealloc queue's match of a request (SGLang passes cow_mamba = supports_mamba())."""
        return params.req is not None

    @property
    def _step(self) -> int:
        return 1  # no state grid: any block boundary is a hit

    def _wanted(self, hashes: list[int], k0: int, limit: int) -> list[tuple[int, int]]:
        m = self.cache.mirror
        return [(KV, h) for h in hashes[k0:limit] if h not in m.kv_of]

    def _plan(self, hashes: list[int], k0: int, limit: int, present: set[tuple[int, int]]) -> int:
        m = self.cache.mirror
        return extension(hashes, k0, limit, 1, lambda h: h in m.kv_of or (KV, h) in present, lambda h: True)

    def _missing(self, hashes: list[int], k0: int, k: int, step: int) -> tuple[list[int], list[int]]:
        m = self.cache.mirror
        return [j for j in range(k0, k) if hashes[j] not in m.kv_of], []

    def _fill(self, load_id: str, hashes: list[int], k0: int, k: int) -> int:
        """Fetch and write the KV of [k0, k) the device lacks, then index [k0, reached) in one commit."""
        c, bs = self.cache, self.cache.bs
        kv_slots, _ = self._allocate(hashes, k0, k, 1)
        row = torch.zeros(k * bs, dtype=torch.int64, device=c.device)
        pos_of, taken, reached = {}, 0, k0
        try:
            # every block written lies before `reached` (the walk stops at the first failure): the commit
            # hands all `taken` slot blocks to the tree, as Tiers' interval commit does
            reached, taken = self._fill_kv(hashes, k0, k, row, kv_slots, pos_of)
            if reached > k0:
                insert = Insert(row, pos_of)
                c.pool.grow(load_id, reached * bs)
                c._drain()
                c.pool.commit(load_id, reached * bs)
                c._drain(insert)
                assert len(insert.stored_blocks) == len(pos_of), "a loaded entry was not indexed"
        finally:
            if taken < len(kv_slots):  # slot blocks never written: no entry, or a refused one
                self._free_slots(torch.cat(kv_slots[taken:]))
        self.loaded_blocks += reached - k0
        return reached

    def _fill_kv(self, hashes, k0, k, row, kv_slots, pos_of) -> tuple[int, int]:
        """Write each missing block's KV into the next free slot block, in order; (blocks reached,
        slot blocks used). Stops at the first block with no entry, no slots or a refused entry."""
        m, bs, io, taken = self.cache.mirror, self.cache.bs, self.io, 0
        for j in range(k0, k):
            h = hashes[j]
            if h in m.kv_of:
                continue
            payload = self.stack.get(KV, h, io.kv_bytes) if taken < len(kv_slots) else None
            if payload is None:
                return j, taken
            io.write_kv(kv_slots[taken], payload)
            row[j * bs:(j + 1) * bs] = kv_slots[taken]
            pos_of[h], taken = j, taken + 1
        return k, taken

    def _free_slots(self, slots: torch.Tensor) -> None:
        self.cache.token_to_kv_pool_allocator.free(slots)


class WindowKvTiers(KvTiers):
    """A sliding-window decode (DecodeWindowKvCache): its tree holds full-attention pages without window
    pages (SGLang's decode allocates the request's SWA tail fresh and matches before it), so a load takes
    full slots only, from the full side of SGLang's SWA allocator, and gives unused ones back there."""

    def _allocate(self, hashes, k0, k, step) -> tuple[list[torch.Tensor], list]:
        from .tier_window import _blocks

        c, bs = self.cache, self.cache.bs
        n = len(self._missing(hashes, k0, k, step)[0])
        full = c.token_to_kv_pool_allocator.full_attn_allocator
        if full.available_size() < n * bs:
            c.evict(EvictParams(num_tokens=n * bs))
        return _blocks(full, n, bs), []

    def _free_slots(self, slots: torch.Tensor) -> None:
        self.cache.mirror.swa.free_full(slots)
