"""What every paged-attention path takes: a frozen per-layer-type spec and the per-batch page table.

FlashInfer's paged layout (one batch of B requests, page_size P):

    request i owns pages kv_indices[kv_indptr[i] : kv_indptr[i+1]]      (in token order)
    its kv_len = (kv_indptr[i+1] - kv_indptr[i] - 1) * P + kv_last_page_len[i]
    its queries q[qo_indptr[i] : qo_indptr[i+1]] are the LAST q_len positions of that context:

        kv positions   0 1 2 ............................ kv_len-1
        query rows                          [kv_len-q_len ... kv_len-1]

A query at position p sees keys j with  p - window_left <= j <= p  (window_left = -1: j <= p only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class AttentionSpec:
    """Fixed per attention layer type (one model, one spec; shared by prefill and decode).

    head_dim: D of Q, K and V. sm_scale: logits multiplier (None: 1 / sqrt(head_dim)).
    window_left: FlashInfer's left window in tokens, the query's own position excluded
        (-1: no window). A cachepool "swa" group of window W (current token included) is W - 1.
    logits_soft_cap: 0 disables; else logits = cap * tanh(sm_scale * q.k / cap) (Gemma-2 style).
    """

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    sm_scale: float | None = None
    window_left: int = -1
    logits_soft_cap: float = 0.0

    def __post_init__(self) -> None:
        if min(self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size) < 1:
            raise ValueError(f"{self}: heads, head_dim and page_size must all be >= 1")
        if self.num_qo_heads % self.num_kv_heads:
            raise ValueError(f"num_qo_heads={self.num_qo_heads} is not a multiple of num_kv_heads="
                             f"{self.num_kv_heads}; grouped-query attention needs Hq = k * Hkv")
        if self.window_left < -1:
            raise ValueError(f"window_left={self.window_left}; use -1 for no window or >= 0 tokens")
        if self.logits_soft_cap < 0:
            raise ValueError(f"logits_soft_cap={self.logits_soft_cap}; use 0 to disable, > 0 to cap")

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim) if self.sm_scale is None else self.sm_scale

    @property
    def group_size(self) -> int:
        """Query heads per KV head; query head h reads KV head h // group_size."""
        return self.num_qo_heads // self.num_kv_heads


@dataclass(frozen=True, slots=True)
class PagedBatch:
    """Per-batch metadata, built once per forward pass and shared by every layer (int32 tensors).

    qo_indptr: [B + 1] query offsets into the packed token axis of q / out.
    kv_indptr: [B + 1] offsets into kv_indices.  kv_indices: [kv_indptr[-1]] page ids.
    kv_last_page_len: [B] tokens used in each request's last page, 1..page_size.
    q_lens, kv_lens: the same lengths as Python ints (host bookkeeping; no device sync to read).
    """

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    page_size: int
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]

    @property
    def batch_size(self) -> int:
        return len(self.q_lens)

    @property
    def is_decode(self) -> bool:
        """One query per request (what the decode kernels require)."""
        return all(n == 1 for n in self.q_lens)

    def to(self, device: torch.device | str) -> PagedBatch:
        move = {n: getattr(self, n).to(device, non_blocking=True)
                for n in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len")}
        return PagedBatch(**move, page_size=self.page_size, q_lens=self.q_lens, kv_lens=self.kv_lens)
