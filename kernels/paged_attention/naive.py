"""Causal paged attention in plain torch, fp32 accumulate: the reference for FlashInfer and the CPU path.

Per request: gather its pages from the cache (in place: only the page ids it owns are indexed),
cut the context to kv_len tokens, then one masked softmax over [Hkv, group, q_len, kv_len].
GQA: query head h reads KV head h // group, so q is viewed as [q_len, Hkv, group, D].
"""

from __future__ import annotations

import torch

from .spec import AttentionSpec, PagedBatch


def naive_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          batch: PagedBatch, spec: AttentionSpec) -> torch.Tensor:
    """q: [total_q, Hq, D] packed by batch.qo_indptr. k_cache, v_cache: [num_pages, page_size,
    Hkv, D] (any strides, e.g. `pool_kv_cache` views). Returns out [total_q, Hq, D] in q.dtype."""
    _check_shapes(q, k_cache, v_cache, batch, spec)
    out = torch.empty_like(q)
    qo = batch.qo_indptr.tolist()
    kv_ptr = batch.kv_indptr.tolist()
    for i, kv_len in enumerate(batch.kv_lens):
        pages = batch.kv_indices[kv_ptr[i]:kv_ptr[i + 1]].to(device=k_cache.device, dtype=torch.long)
        k = _gather(k_cache, pages, kv_len)
        v = _gather(v_cache, pages, kv_len)
        out[qo[i]:qo[i + 1]] = attend(q[qo[i]:qo[i + 1]].float(), k, v, spec).to(q.dtype)
    return out


def _gather(cache: torch.Tensor, pages: torch.Tensor, kv_len: int) -> torch.Tensor:
    """The request's first kv_len tokens [kv_len, Hkv, D] fp32, in token order."""
    return cache[pages].flatten(0, 1)[:kv_len].float()


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec) -> torch.Tensor:
    """One request. q: [q_len, Hq, D]; k, v: [kv_len, Hkv, D] (fp32). Returns [q_len, Hq, D] fp32."""
    q_len, kv_len = q.shape[0], k.shape[0]
    qg = q.view(q_len, spec.num_kv_heads, spec.group_size, spec.head_dim)
    logits = torch.einsum("qhgd,khd->hgqk", qg, k) * spec.scale
    if spec.logits_soft_cap > 0:
        logits = spec.logits_soft_cap * torch.tanh(logits / spec.logits_soft_cap)
    logits = logits.masked_fill(~visible(q_len, kv_len, spec.window_left, q.device), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.einsum("hgqk,khd->qhgd", probs, v).reshape(q_len, spec.num_qo_heads, spec.head_dim)


def visible(q_len: int, kv_len: int, window_left: int, device: torch.device) -> torch.Tensor:
    """[q_len, kv_len] bool: query row r sits at position kv_len - q_len + r and sees key j iff
    j <= pos (causal) and, with a window, j >= pos - window_left. The diagonal is always visible,
    so no row is fully masked."""
    pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    key = torch.arange(kv_len, device=device)[None, :]
    mask = key <= pos
    if window_left >= 0:
        mask &= key >= pos - window_left
    return mask


def _check_shapes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  batch: PagedBatch, spec: AttentionSpec) -> None:
    want_q = (sum(batch.q_lens), spec.num_qo_heads, spec.head_dim)
    if tuple(q.shape) != want_q:
        raise ValueError(f"q has shape {tuple(q.shape)}; the batch and spec need {want_q}")
    want_kv = (spec.page_size, spec.num_kv_heads, spec.head_dim)
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() != 4 or tuple(c.shape[1:]) != want_kv:
            raise ValueError(f"{name} has shape {tuple(c.shape)}; need [num_pages, *{want_kv}]")
    if batch.page_size != spec.page_size:
        raise ValueError(f"batch page_size={batch.page_size} but spec page_size={spec.page_size}")
