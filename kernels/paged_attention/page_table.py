"""From the cache pool's bookkeeping to FlashInfer's page table, and the pool's bytes as K/V pages.

cachepool gives each request a block table: block_table[i] holds tokens [i*bs, (i+1)*bs). Only
the first ceil(kv_len / bs) entries are read; a table may run further (blocks allocated for tokens
not computed yet, e.g. the rest of a chunked prefill):

    block_table   [ b7 | b2 | b9 | b4 ]            bs = 4, kv_len = 10
    tokens          0-3  4-7  8-9                  kv_indices += [7, 2, 9]; last_page_len = 2

Every full-attention block is read in place: `pool_kv_cache` views one layer of the pool's uint8
buffer as FlashInfer's NHD (k_cache, v_cache) pair without copying.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from prfaas_sgl.cachepool.allocation import NULL_BLOCK, Allocation, PagedAllocation

from .spec import PagedBatch

if TYPE_CHECKING:
    from prfaas_sgl.cachepool.storage import BlockStorage


def build_paged_batch(block_tables: Sequence[Sequence[int]], kv_lens: Sequence[int],
                      q_lens: Sequence[int], page_size: int,
                      device: torch.device | str = "cpu") -> PagedBatch:
    """Page table for B requests. kv_lens[i]: tokens of context request i attends to (its new
    tokens included); q_lens[i]: its new tokens (1 for decode), at most kv_lens[i].
    Raises ValueError naming the request when a table is too short or holds a released block."""
    if not len(block_tables) == len(kv_lens) == len(q_lens):
        raise ValueError(f"{len(block_tables)} block tables, {len(kv_lens)} kv_lens, "
                         f"{len(q_lens)} q_lens: pass one of each per request")
    qo_indptr, kv_indptr, indices, last = [0], [0], [], []
    for i, (table, kv_len, q_len) in enumerate(zip(block_tables, kv_lens, q_lens)):
        pages = _used_pages(i, table, kv_len, q_len, page_size)
        indices.extend(pages)
        kv_indptr.append(len(indices))
        qo_indptr.append(qo_indptr[-1] + q_len)
        last.append(kv_len - (len(pages) - 1) * page_size)

    def i32(xs: list[int]) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.int32, device=device)

    return PagedBatch(i32(qo_indptr), i32(kv_indptr), i32(indices), i32(last), page_size,
                      tuple(int(n) for n in q_lens), tuple(int(n) for n in kv_lens))


def paged_batch_from_allocations(allocs: Sequence[Allocation], group: str, q_lens: Sequence[int],
                                 page_size: int, kv_lens: Sequence[int] | None = None,
                                 device: torch.device | str = "cpu") -> PagedBatch:
    """build_paged_batch over `HybridCachePool.admit()/grow()` results for one attention group.
    kv_lens defaults to each allocation's num_tokens (the tokens its blocks cover)."""
    tables = []
    for a in allocs:
        g = a.group(group)
        if not isinstance(g, PagedAllocation):
            raise TypeError(f"group {group!r} of {a.req_id!r} is a state group, not paged attention")
        tables.append(g.block_table)
    kv_lens = [a.num_tokens for a in allocs] if kv_lens is None else kv_lens
    return build_paged_batch(tables, kv_lens, q_lens, page_size, device)


def _used_pages(i: int, table: Sequence[int], kv_len: int, q_len: int, page_size: int) -> list[int]:
    if not 1 <= q_len <= kv_len:
        raise ValueError(f"request {i}: q_len={q_len}, kv_len={kv_len}; need 1 <= q_len <= kv_len")
    n = -(-kv_len // page_size)
    if len(table) < n:
        raise ValueError(f"request {i}: kv_len={kv_len} needs {n} pages of {page_size} tokens but "
                         f"its block table has {len(table)}; grow() the request first")
    pages = [int(b) for b in table[:n]]
    if NULL_BLOCK in pages:
        raise ValueError(f"request {i}: block table {pages} holds NULL_BLOCK (a block released by a "
                         f"sliding window); paged attention here reads full-attention groups only")
    return pages


def pool_kv_cache(storage: BlockStorage, group: str, layer: int, num_kv_heads: int,
                  head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(k_cache, v_cache), each [num_blocks, block_size, num_kv_heads, head_dim] of `dtype`, views
    (no copy) of one layer of a full-attention group in the pool's buffer. Page ids are block ids.

    A token's kv_bytes_per_token bytes are its K heads then its V heads: [2, Hkv, D] of `dtype`.
    Strides: page = block_bytes / itemsize, token = 2 * Hkv * D, head = D; K and V share them
    (FlashInfer requires identical K/V strides).
    """
    pages = storage.page_view(group)  # [num_blocks, num_layers, block_size, kv_bytes_per_token]
    per_token = 2 * num_kv_heads * head_dim * dtype.itemsize
    if pages.shape[-1] != per_token:
        raise ValueError(f"group {group!r} stores {pages.shape[-1]} bytes per token per layer but "
                         f"K+V of {num_kv_heads} heads x {head_dim} x {dtype} is {per_token}; "
                         f"set kv_bytes_per_token={per_token} in its GroupSpec")
    if storage.cfg.block_bytes % dtype.itemsize:
        raise ValueError(f"block_bytes={storage.cfg.block_bytes} is not a multiple of {dtype} size")
    kv = pages[:, layer].view(dtype).unflatten(-1, (2, num_kv_heads, head_dim))
    return kv[:, :, 0], kv[:, :, 1]
