"""SGLang's KV pool and Mamba state pool laid over ONE `cachepool.slab.Slab` (a building block of
--prfaas-unified-pool).

    SGLang KV slot t (page size 1)  ->  slab token slot t, i.e. block t // bs     (SlabMHATokenToKVPool)
    SGLang Mamba slot s             ->  slab block s                              (bind_mamba_pool)

Only the storage is shared here: a KV slot in block b and Mamba slot b alias, so these pools serve only
under the slab's one free list (`slab_alloc.py`, wired by `unified.py` behind --prfaas-unified-pool).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from sglang.srt.mem_cache.memory_pool import MambaPool, MHATokenToKVPool

from prfaas_sgl.cachepool.slab import Slab
from prfaas_sgl.cachepool.slab_layout import SlabLayout
from prfaas_sgl.srt.buf_infos import strided_infos


def plan_layout(num_full_layers: int, head_num: int, head_dim: int, dtype: torch.dtype, cache_params,
                num_linear_layers: int, granularity: int, v_head_dim: int | None = None) -> SlabLayout:
    """The slab layout for a hybrid model: `cache_params` is SGLang's Mamba2/GDN cache params
    (`.shape.conv` list of per-layer conv shapes, `.shape.temporal`, `.dtype.conv/.temporal`)."""
    item = dtype.itemsize
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    rows = [(head_num * head_dim * item, head_num * v_head_dim * item)] * num_full_layers
    parts = [(f"conv{i}", _nbytes(s, cache_params.dtype.conv), num_linear_layers)
             for i, s in enumerate(cache_params.shape.conv)]
    parts.append(("temporal", _nbytes(cache_params.shape.temporal, cache_params.dtype.temporal),
                  num_linear_layers))
    return SlabLayout.plan(rows, parts, granularity)


class SlabMHATokenToKVPool(MHATokenToKVPool):
    """MHATokenToKVPool whose per-layer k_buffer/v_buffer are slab views [num_blocks * bs, H, D] (slot
    stride = one token's envelope over all full layers), as SGLang's UnifiedMHATokenToKVPool does for
    its own buffer. Slot 0 (padding writes) lies in block 0, which the block allocator must keep."""

    def __init__(self, slab: Slab, *, dtype: torch.dtype, head_num: int, head_dim: int,
                 layer_num: int, v_head_dim: int | None = None, **kwargs) -> None:
        self._slab = slab
        super().__init__(size=slab.num_token_slots - 1, page_size=1, dtype=dtype, head_num=head_num,
                         head_dim=head_dim, layer_num=layer_num, device=str(slab.buffer.device),
                         enable_memory_saver=False, v_head_dim=v_head_dim, **kwargs)

    def _create_buffers(self) -> None:
        views = [self._slab.kv_views(i, self.dtype, self.head_num, self.head_dim, self.v_head_dim)
                 for i in range(self.layer_num)]
        self.k_buffer = [k for k, _ in views]
        self.v_buffer = [v for _, v in views]
        self._init_data_ptrs_and_strides()  # pointers/strides HiCache and transfers read

    def _clear_buffers(self) -> None:
        pass  # the slab owns the memory

    def get_contiguous_buf_infos(self):
        """PD registration (prfaas_zmq): each layer's K then V rows, one token's envelope apart."""
        return strided_infos(self.k_buffer + self.v_buffer)


def bind_mamba_pool(pool: MambaPool, slab: Slab, conv_shapes: Sequence[Sequence[int]],
                    temporal_shape: Sequence[int]) -> None:
    """Point a MambaPool built with size = slab.num_blocks - 1 at the slab: its conv/temporal tensors
    become [layers, num_blocks, ...] views with block stride (slot s = block s). Mutates pool."""
    conv0 = pool.mamba_cache.conv[0]
    if conv0.shape[1] != slab.num_blocks:
        raise ValueError(f"MambaPool has {conv0.shape[1]} slots, the slab {slab.num_blocks} blocks; "
                         f"build it with size={slab.num_blocks - 1}")
    conv = [slab.state_view(f"conv{i}", c.dtype, s) for i, (c, s) in
            enumerate(zip(pool.mamba_cache.conv, conv_shapes))]
    temporal = slab.state_view("temporal", pool.mamba_cache.temporal.dtype, temporal_shape)
    pool.mamba_cache = MambaPool.State(conv=conv, temporal=temporal)


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= int(d)
    return n
