"""--prfaas-unified-pool: SGLang's KV pool and Mamba pool over ONE slab with one block free list.

Runs AFTER `KVCacheConfigurator.configure`: SGLang has sized and built its two pools (its fixed split,
`--mamba-full-memory-ratio`); the same bytes are re-laid as one slab of aligned blocks
(`cachepool.slab_layout`), and the request pool's Mamba pool + allocator and the token allocator are
swapped for the slab's (`slab_alloc`). Block 0 stays out of both allocators (SGLang's padding slot 0).

Serves colocated and as a PD prefill or decode under prfaas_zmq (the pools report their strided buffers
through `srt.buf_infos`; the wire stays per logical buffer, so a slab side pairs with a packed one), page
size 1, under `--radix-cache-backend prfaas_hybrid`; anything else is refused at start-up with the reason (docs/unified-memory.md section 6 says what remains). SGLang's
own tensors are allocated first and dropped here, so start-up briefly holds both.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import msgspec
import torch
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import (HybridLinearKVPool, HybridReqToTokenPool, MambaPool,
                                              MHATokenToKVPool)

from prfaas_sgl.cachepool.slab import Slab
from prfaas_sgl.cachepool.slab_blocks import SlabBlocks
from prfaas_sgl.cachepool.slab_layout import SlabLayout

from . import NAME
from .slab_admission import ADMISSION_RESERVE
from .slab_alloc import SlabMambaPool, SlabStateAllocator, SlabTokenAllocator
from .slab_pools import SlabMHATokenToKVPool, bind_mamba_pool, plan_layout
from .slab_rows import grow_rows, target_rows

log = logging.getLogger(__name__)
GRANULARITY = 16  # tokens per block is a multiple of the backend's hash block (config.from_server)


@dataclass(frozen=True, slots=True)
class UnifiedPools:
    slab: Slab
    blocks: SlabBlocks
    kv_pool: SlabMHATokenToKVPool
    token_allocator: SlabTokenAllocator
    mamba_pool: SlabMambaPool
    state_allocator: SlabStateAllocator


def build_pools(layout: SlabLayout, num_blocks: int, *, full: MHATokenToKVPool, cache_params,
                mamba_layer_ids: list[int], device: str, reserve, kvcache=None,
                price_states: bool = False) -> UnifiedPools:
    """The slab, its free list and SGLang's pools/allocators over it. `full`: a KV pool to copy the head
    geometry from; reserve(): free blocks the KV side leaves alone (see SlabBlocks); kvcache: what the
    token allocator hands SGLang as its KV cache (the hybrid pool; default the slab KV pool);
    price_states: states are charged at admission (slab_admission.py)."""
    slab = Slab(layout, num_blocks, device)
    blocks = SlabBlocks(num_blocks, reserve)
    kv_pool = SlabMHATokenToKVPool(slab, dtype=full.dtype, head_num=full.head_num, head_dim=full.head_dim,
                                   layer_num=full.layer_num, v_head_dim=full.v_head_dim)
    mamba = SlabMambaPool(size=num_blocks - 1, spec_state_size=0, cache_params=cache_params,
                          mamba_layer_ids=mamba_layer_ids, device=device)
    bind_mamba_pool(mamba, slab, cache_params.shape.conv, cache_params.shape.temporal)
    mamba.slab_blocks = blocks
    tokens = SlabTokenAllocator(blocks, layout.tokens_per_block, full.dtype, device,
                                kv_pool if kvcache is None else kvcache, price_states)
    return UnifiedPools(slab, blocks, kv_pool, tokens, mamba, SlabStateAllocator(blocks, device))


def admission(sa, req) -> tuple[bool, object, int]:
    """(price states at admission?, reserve(), blocks KV can never hold). A PD decode server
    pre-allocates transfers outside SGLang's PrefillAdder, so it cannot be priced there: every free row
    keeps a block for its state. Elsewhere states are charged when admitted (slab_admission.py)."""
    if (getattr(sa, "disaggregation_mode", "null") or "null") == "decode":
        return False, req.available_size, 1 + req.size
    # padding, the reserve, and the one state of a request running alone
    return True, lambda: ADMISSION_RESERVE, 2 + ADMISSION_RESERVE


def unify(result, configurator):
    """configure()'s result with the two pools replaced by one slab; raises ValueError naming what
    the server runs with that this path does not serve."""
    problems = refusals(result, configurator)
    if problems:
        raise ValueError("--prfaas-unified-pool: " + "; ".join(problems))
    req, kv, alloc = result.req_to_token_pool, result.token_to_kv_pool, result.token_to_kv_pool_allocator
    full, old = kv.full_kv_pool, req.mamba_pool
    params = configurator.mambaish_config.mamba2_cache_params
    layout = plan_layout(full.layer_num, full.head_num, full.head_dim, full.dtype, params,
                         len(old.mamba_layer_ids), GRANULARITY, v_head_dim=full.v_head_dim)
    # the bytes SGLang gave both pools (slot 0 of each included)
    budget = (alloc.size + 1) * layout.token_bytes + (old.size + 1) * layout.state_bytes
    num_blocks = budget // layout.block_bytes
    if num_blocks < req.size + 3:
        raise ValueError(f"--prfaas-unified-pool: SGLang's pools ({budget} B) make {num_blocks} blocks of "
                         f"{layout.block_bytes} B, fewer than --max-running-requests ({req.size}) + 3; give "
                         f"the server more memory or fewer running requests")
    rows = target_rows(_requested_rows(configurator.server_args), req.size, num_blocks)
    if rows > req.size:
        log.info("prfaas unified pool: %d request rows (SGLang's Mamba cap gave %d)", rows, req.size)
        grow_rows(req, rows)
    priced, reserve, kept = admission(configurator.server_args, req)
    pools = build_pools(layout, num_blocks, full=full, cache_params=params,
                        mamba_layer_ids=list(old.mamba_layer_ids), device=str(full.device),
                        reserve=reserve, kvcache=kv, price_states=priced)
    pools.kv_pool.model_layer_ids = getattr(full, "model_layer_ids", None)
    kv.full_kv_pool, kv.size = pools.kv_pool, pools.slab.num_token_slots - 1
    kv.mamba_pool = req.mamba_pool = pools.mamba_pool
    req.mamba_allocator = pools.state_allocator
    max_tokens = (num_blocks - kept) * layout.tokens_per_block  # the most KV can ever hold
    log.info("prfaas unified pool: %d blocks of %d B (%d tokens or one state, %.0f%% state padding), "
             "from SGLang's %d KV tokens + %d Mamba slots; states %s", num_blocks, layout.block_bytes,
             layout.tokens_per_block, 100 * layout.state_padding, alloc.size, old.size,
             "priced at admission" if priced else "reserved per free row")
    if getattr(result.memory_pool_config, "max_running_requests", None) is not None:
        result.memory_pool_config.max_running_requests = req.size
    return msgspec.structs.replace(result, token_to_kv_pool_allocator=pools.token_allocator,
                                   max_total_num_tokens=max_tokens, max_running_requests=req.size)


def _requested_rows(sa) -> int | None:
    """--max-running-requests per attention-DP worker, as SGLang reads it before its Mamba cap."""
    requested = getattr(sa, "max_running_requests", None)
    if requested is None:
        return None
    dp = int(getattr(sa, "dp_size", 1) or 1) if getattr(sa, "enable_dp_attention", False) else 1
    return max(1, int(requested) // dp)


def refusals(result, configurator) -> list[str]:
    sa = configurator.server_args
    req, kv = result.req_to_token_pool, result.token_to_kv_pool
    full = getattr(kv, "full_kv_pool", None)
    mamba = getattr(req, "mamba_pool", None)
    checks = (
        (getattr(sa, "radix_cache_backend", None) != NAME, f"needs --radix-cache-backend {NAME}"),
        ((getattr(sa, "disaggregation_mode", "null") or "null") != "null"
         and getattr(sa, "disaggregation_transfer_backend", None) != "prfaas_zmq",
         "serves PD only with --disaggregation-transfer-backend prfaas_zmq (it reads the slab's strided "
         "buffers; SGLang's backends assume packed ones)"),
        (configurator.is_draft_worker or not configurator.spec_algorithm.is_none(),
         "does not support speculative decoding"),
        (result.unified_memory_pool is not None, "conflicts with --enable-unified-memory"),
        (not isinstance(req, HybridReqToTokenPool) or not isinstance(kv, HybridLinearKVPool),
         "serves hybrid linear-attention (Mamba/GDN/KDA) models only"),
        (type(full) is not MHATokenToKVPool, f"needs a plain MHA KV pool, got {type(full).__name__}"),
        (full is not None and getattr(full, "store_dtype", full.dtype) != full.dtype,
         "does not support quantized KV caches"),
        (type(result.token_to_kv_pool_allocator) is not TokenToKVPoolAllocator, "needs --page-size 1"),
        (isinstance(req, HybridReqToTokenPool) and req.enable_mamba_extra_buffer,
         "needs --mamba-radix-cache-strategy no_buffer"),
        # per-slot side pools sized by SGLang's Mamba slot count would not follow the slab's blocks
        (getattr(getattr(req, "short_conv_pool", None), "enabled", False)
         or getattr(getattr(req, "ngram_pool", None), "enabled", False)
         or getattr(req, "mamba_ckpt_pool", None) is not None,
         "does not support PLE side states or int8 Mamba checkpoints"),
        (mamba is not None and (type(mamba) is not MambaPool or getattr(mamba, "enable_linear_replayssm", False)),
         "does not support this Mamba pool variant (replayssm / envelope layout)"),
    )
    return [msg for bad, msg in checks if bad]
