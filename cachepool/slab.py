"""Slab: the one uint8 buffer of a SlabLayout, and SGLang-shaped views of KV pages and states over it.

Views only, no copies: a full layer's K (or V) is `[num_blocks * bs, head_num, head_dim]`, the shape of
SGLang's `MHATokenToKVPool.k_buffer[layer]`, indexed by token slot t = block * bs + i; a state part is
`[num_layers, num_blocks, *shape]`, the shape of SGLang's `MambaPool` conv/temporal tensors, indexed by
block id. Which block holds which kind is the bookkeeping's business (`HybridCachePool`); the slab only
guarantees that block b's bytes are [b * B, (b+1) * B) under every view. torch is imported here only.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from .slab_layout import SlabLayout

if TYPE_CHECKING:
    import torch


class Slab:
    def __init__(self, layout: SlabLayout, num_blocks: int, device: str = "cpu") -> None:
        import torch

        self.layout, self.num_blocks = layout, num_blocks
        self.buffer = torch.zeros(num_blocks * layout.block_bytes, dtype=torch.uint8, device=device)
        self._torch = torch

    @property
    def num_token_slots(self) -> int:
        return self.num_blocks * self.layout.tokens_per_block

    # -- views ---------------------------------------------------------------------------------
    def kv_views(self, layer: int, dtype: "torch.dtype", head_num: int, head_dim: int,
                 v_head_dim: int | None = None) -> tuple["torch.Tensor", "torch.Tensor"]:
        """(K, V) of full layer `layer`: [num_token_slots, head_num, head_dim] each, slot stride E."""
        v_head_dim = head_dim if v_head_dim is None else v_head_dim
        k_row, v_row = self.layout.kv_rows[layer]
        k_off, v_off = self.layout.kv_offsets[layer]
        item = dtype.itemsize
        if (k_row, v_row) != (head_num * head_dim * item, head_num * v_head_dim * item):
            raise ValueError(f"layer {layer}: rows are {k_row}/{v_row} B, but {head_num} heads x "
                             f"{head_dim}/{v_head_dim} x {item} B were asked for")
        stride = self.layout.token_bytes
        return (self._typed(dtype, (self.num_token_slots, head_num, head_dim), stride, k_off),
                self._typed(dtype, (self.num_token_slots, head_num, v_head_dim), stride, v_off))

    def state_view(self, part: str, dtype: "torch.dtype", shape: Sequence[int]) -> "torch.Tensor":
        """State part `part`: [num_layers, num_blocks, *shape]; block b's state of layer l is [l, b]."""
        p = self.layout.part(part)
        n = 1
        for d in shape:
            n *= int(d)
        if n * dtype.itemsize != p.layer_bytes:
            raise ValueError(f"state part {part!r}: {p.layer_bytes} B per layer, but shape {tuple(shape)} "
                             f"of {dtype} is {n * dtype.itemsize} B")
        item = dtype.itemsize
        inner = _contiguous_strides(shape)
        size = (p.num_layers, self.num_blocks, *shape)
        strides = (p.layer_bytes // item, self.layout.block_bytes // item, *inner)
        return self._typed_strided(dtype, size, strides, p.offset)

    def block(self, block: int) -> "torch.Tensor":
        """Block `block`'s raw bytes [B] (a view)."""
        b = self.layout.block_bytes
        return self.buffer[block * b:(block + 1) * b]

    # -- helpers -------------------------------------------------------------------------------
    def _typed(self, dtype, size: tuple[int, ...], slot_stride_bytes: int, offset_bytes: int):
        item = dtype.itemsize
        return self._typed_strided(dtype, size, (slot_stride_bytes // item, *_contiguous_strides(size[1:])),
                                   offset_bytes)

    def _typed_strided(self, dtype, size, strides, offset_bytes: int):
        item = dtype.itemsize
        if offset_bytes % item or self.layout.block_bytes % item or self.layout.token_bytes % item:
            raise ValueError(f"{dtype} ({item} B) does not divide the slab's offsets/strides "
                             f"(offset {offset_bytes}, token {self.layout.token_bytes}, block "
                             f"{self.layout.block_bytes})")
        return self.buffer.view(dtype).as_strided(size, strides, offset_bytes // item)


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    out, acc = [], 1
    for d in reversed(list(shape)):
        out.append(acc)
        acc *= int(d)
    return tuple(reversed(out))
