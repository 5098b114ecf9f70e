"""Request rows past SGLang's Mamba cap, for the unified slab (--prfaas-unified-pool).

With a radix cache on, SGLang caps --max-running-requests at max_mamba_cache_size / 3 (its fixed split
keeps two state slots per running request for the cache: `KVCacheConfigurator.resolve_max_num_reqs`),
whatever the KV side could hold. Over one slab a running request needs ONE state block, taken from the
same free list as KV, and cached states compete with KV in the index's one LRU; so the cap of the fixed
split does not apply. Rows grow back toward what the operator asked for, at most half the slab's blocks:
a row costs nothing until SGLang admits a request into it (its state is priced then, slab_admission.py),
but on a PD decode server every free row keeps one block in reserve for its working state
(`SlabBlocks`), and half the slab then stays reachable for KV when every row is free.

The request pool is grown in place, before SGLang sizes anything from it (the model runner reads
`max_running_requests` from configure()'s result, after this hook).
"""
from __future__ import annotations

import torch


def target_rows(requested: int | None, current: int, num_blocks: int) -> int:
    """Rows to run with: the operator's --max-running-requests where SGLang's Mamba cap cut it, at
    most half the slab's blocks (never fewer rows than SGLang gave)."""
    if requested is None:
        return current
    return max(current, min(int(requested), (num_blocks - 1) // 2))


def grow_rows(req, rows: int) -> None:
    """Give SGLang's (Hybrid, optionally Decode) request pool `rows` rows, keeping every existing row
    (its req_to_token row, generation and Mamba mapping) and its pre-allocation rows (decode)."""
    extra = rows - req.size
    if extra <= 0:
        return
    old = req._alloc_size
    req.req_to_token = _grow(req.req_to_token, extra)
    req.req_generation = _grow(req.req_generation, extra)
    req.req_index_to_mamba_index_mapping = _grow(req.req_index_to_mamba_index_mapping, extra)
    req.size, req._alloc_size = rows, old + extra
    req.free_slots.extend(range(old, old + extra))


def _grow(t: torch.Tensor, extra: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros((extra, *t.shape[1:]))])
