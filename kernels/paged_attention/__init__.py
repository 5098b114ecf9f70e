"""Paged attention over the cache pool's full-attention blocks: FlashInfer on CUDA, torch on CPU.

    pool = HybridCachePool(cfg); storage = BlockStorage(cfg, device)
    allocs = [pool.admit(...), ...]                                   # bookkeeping
    batch = paged_batch_from_allocations(allocs, "full", q_lens, cfg.block_size)   # once per batch
    runner = FlashInferPagedAttention(device)                         # once per process (CUDA only)
    for layer in layers:
        k_cache, v_cache = pool_kv_cache(storage, "full", layer, Hkv, D, torch.bfloat16)  # views
        out = paged_prefill(q, k_cache, v_cache, batch, spec, runner)

Shapes: q, out [total_q, Hq, D] (tokens packed by batch.qo_indptr); k_cache, v_cache [num_pages,
page_size, Hkv, D] ("NHD", any page/token stride, K and V strides equal). Page ids are pool block ids.
"""

from __future__ import annotations

import torch

from .flashinfer import FlashInferPagedAttention
from .naive import naive_paged_attention
from .page_table import build_paged_batch, paged_batch_from_allocations, pool_kv_cache
from .spec import AttentionSpec, PagedBatch

__all__ = [
    "AttentionSpec",
    "FlashInferPagedAttention",
    "PagedBatch",
    "build_paged_batch",
    "naive_paged_attention",
    "paged_batch_from_allocations",
    "paged_decode",
    "paged_prefill",
    "pool_kv_cache",
]


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: PagedBatch,
                  spec: AttentionSpec, runner: FlashInferPagedAttention | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of each request's q_len new tokens over its kv_len-token paged context
    (the queries are the context's last q_len positions), with GQA, optional window and soft cap.

    q: [sum(q_lens), Hq, D]. Returns [sum(q_lens), Hq, D] in q.dtype (fp32 accumulation), written
    into `out` when given. Reads the caches, mutates nothing else.
    CUDA tensors go to FlashInfer through `runner` (required there: it owns the workspace and the
    plan, so build it once); CPU tensors go to the torch reference.
    """
    if q.is_cuda:
        return _need_runner(runner).prefill(q, k_cache, v_cache, batch, spec, out)
    return _into(out, naive_paged_attention(q, k_cache, v_cache, batch, spec))


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: PagedBatch,
                 spec: AttentionSpec, runner: FlashInferPagedAttention | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """paged_prefill with one query per request: q [B, Hq, D] at position kv_len - 1 of each
    context; batch.q_lens must all be 1. Uses FlashInfer's decode kernels on CUDA."""
    if not batch.is_decode:
        raise ValueError(f"paged_decode needs q_len 1 per request, got q_lens={batch.q_lens}; "
                         f"use paged_prefill for longer queries")
    if q.is_cuda:
        return _need_runner(runner).decode(q, k_cache, v_cache, batch, spec, out)
    return _into(out, naive_paged_attention(q, k_cache, v_cache, batch, spec))


def _need_runner(runner: FlashInferPagedAttention | None) -> FlashInferPagedAttention:
    if runner is None:
        raise ValueError("CUDA tensors need runner=FlashInferPagedAttention(device), built once per "
                         "process (it owns the workspace); a per-call runner would allocate each step")
    return runner


def _into(out: torch.Tensor | None, result: torch.Tensor) -> torch.Tensor:
    return result if out is None else out.copy_(result)
