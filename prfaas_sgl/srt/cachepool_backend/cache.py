"""`build(ctx)`: SGLang's radix cache factory for `--radix-cache-backend prfaas_hybrid` (registered by
`__init__.register`). It refuses what no kind can serve, then picks the kind from what SGLang passes:

    SGLang's TreeCacheBuildContext                    kind                 file
    is_hybrid_swa, colocated or prefill               SlidingWindowCache   sliding.py
    is_hybrid_swa, --disaggregation-mode decode       DecodeWindowKvCache  decode_kv.py
    is_hybrid_ssm, --disaggregation-mode decode       DecodeKvCache        decode_kv.py
    is_hybrid_ssm, colocated or prefill               LinearStateCache     linear.py

All four are PrfaasHybridCache (base.py: the full-attention index, locks, row release, eviction); a
new family adds a kind file and a row here.
"""
from __future__ import annotations

from .base import Node, PrfaasHybridCache
from .config import BLOCK
from .decode_kv import DecodeKvCache, DecodeWindowKvCache
from .linear import LinearStateCache
from .sliding import SlidingWindowCache

__all__ = ["DecodeKvCache", "DecodeWindowKvCache", "LinearStateCache", "Node", "PrfaasHybridCache",
           "SlidingWindowCache", "build", "kind_for"]


def build(ctx) -> PrfaasHybridCache:
    """Factory for SGLang's registry (TreeCacheBuildContext -> cache); rejects what it cannot serve."""
    mode = getattr(ctx.server_args, "disaggregation_mode", "null") or "null"
    problems = _refusals(ctx, mode)
    if problems:
        raise ValueError("--radix-cache-backend prfaas_hybrid: " + "; ".join(problems))
    kind = kind_for(ctx, mode)
    cache = kind(ctx.params, kind.config_for(ctx, mode))
    from .tier_cache import attach  # the tier modules load only in a server that builds this cache

    return attach(cache, ctx, mode)


def kind_for(ctx, mode: str) -> type[PrfaasHybridCache]:
    """The cache class for a model and server role `build` accepts."""
    if ctx.is_hybrid_swa:
        return DecodeWindowKvCache if mode == "decode" else SlidingWindowCache
    return DecodeKvCache if mode == "decode" else LinearStateCache


def _page_fits(page_size: int, swa: bool) -> bool:
    """Linear kinds: page size 1 (state checkpoints land on any token). Sliding-window kind: a page
    size dividing the index block, so a cached block is whole pages (SGLang's SWA decode needs
    page size > 1 to preallocate only the window: disaggregation/decode.py _uses_swa_tail_prealloc)."""
    return page_size == 1 or (swa and BLOCK % page_size == 0)


def _page_problem(page_size: int, swa: bool) -> str:
    if swa:
        return f"needs a --page-size dividing {BLOCK} (the index block), got {page_size}"
    return f"needs --page-size 1 for a linear-attention model, got {page_size}"


def _refusals(ctx, mode: str) -> list[str]:
    p, swa = ctx.params, ctx.is_hybrid_swa
    return [msg for bad, msg in (
        (not (ctx.is_hybrid_ssm or swa), "serves hybrid linear-attention (Mamba/GDN/KDA/Lightning) and "
                                         "sliding-window hybrid models only; omit --radix-cache-backend"),
        (ctx.is_hybrid_ssm and swa, "does not handle a model with both sliding-window and linear-attention "
                                    "layers yet (docs/cachepool-swa.md)"),
        (swa and getattr(ctx, "full_tokens_per_layer", None) == 0,
         "needs full-attention layers (an all-sliding-window model has no prefix to index)"),
        (swa and not getattr(p, "sliding_window_size", None), "needs the model's sliding_window_size "
                                                             "(SGLang found none)"),
        (not _page_fits(p.page_size, swa), _page_problem(p.page_size, swa)),
        # at page size 1 SGLang's decode allocates window pages for the whole prompt and lets a hit
        # reach into the last window, whose pages DecodeWindowKvCache does not keep
        (swa and mode == "decode" and p.page_size == 1,
         f"on a sliding-window decode server needs --page-size > 1 (e.g. {BLOCK}): SGLang then "
         "preallocates only the window tail and matches before it"),
        (ctx.enable_hierarchical_cache, "does not support --enable-hierarchical-cache"),
        # no_buffer also means no overlap scheduler (sglang/srt/arg_groups/mamba_hook.py:157-160
        # asserts --disable-overlap-schedule), and SGLang's extra_buffer needs a CUDA/MUSA/NPU/HIP/XPU
        # platform (mamba_hook.py:102-121): a hybrid model on CPU never runs the overlap scheduler
        (getattr(p, "enable_mamba_extra_buffer", False), "needs --mamba-radix-cache-strategy no_buffer"),
        (ctx.disable_radix_cache and mode == "decode",
         "on a decode server needs --disaggregation-decode-enable-radix-cache (SGLang turns prefix "
         "caching off on decode servers otherwise)"),
        (ctx.disable_radix_cache and mode != "decode", "conflicts with --disable-radix-cache"),
    ) if bad]
