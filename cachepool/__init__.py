"""prfaas_sgl.cachepool: hybrid prefix cache pool bookkeeping (no torch, no sglang here).

Tensors live in `storage.BlockStorage` or, for one pool shared by KV pages and linear states with
SGLang-shaped views, `slab.Slab` over a `slab_layout.SlabLayout` (both import torch lazily); everything
else is plain Python.
"""
from .allocation import NULL_BLOCK, Allocation, PagedAllocation, PoolUsage, StateAllocation
from .config import PoolConfig
from .events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from .hashing import block_hashes
from .managers import REGISTRY, manager_class
from .pool import HybridCachePool
from .specs import GroupSpec, PoolExhaustedError, PoolLayoutError, RequestTooLongError

__all__ = [
    "NULL_BLOCK", "Allocation", "PagedAllocation", "PoolUsage", "StateAllocation", "GroupSpec",
    "PoolConfig", "PoolExhaustedError", "PoolLayoutError", "RequestTooLongError", "AllBlocksCleared",
    "BlockRemoved", "BlockStored", "EventBatch", "block_hashes", "REGISTRY", "manager_class",
    "HybridCachePool",
]
