"""What SGLang's `KVArgs` cannot say about a pool buffer: that its items are not packed.

SGLang registers PD buffers from each pool's `get_contiguous_buf_infos()` as (ptrs, lens, item_lens), so
item i of a buffer is assumed at ptr + i * item_len. Under `--prfaas-unified-pool` every full layer's
K (or V) and every state tensor is a strided view of one slab (`cachepool.slab`): rows contiguous, a
token's or a block's envelope apart. Those pools report through `strided_infos`, which records each
buffer's row stride here; `backend.memory.KVMemory.of` reads it back and hands the transport
`transfer.buffers.Strided` buffers. A buffer recorded nowhere is packed.

The key is the whole (address, span, item_len) triple, not the address: in a slab, layer 0's K and the
first state part both start at the slab's first byte. Their spans differ whenever a block holds more
than one token (T tokens, N = T / bs blocks: (T - 1) * E + row vs (N - 1) * bs * E + row). The slab lives
as long as the process, so no other buffer is ever registered at a recorded address.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

_STRIDES: dict[tuple[int, int, int], int] = {}  # (ptr, span, item_len) -> bytes between items


def strided_infos(tensors: Iterable[Any]) -> tuple[list[int], list[int], list[int]]:
    """(ptrs, lens, item_lens) as SGLang's get_contiguous_buf_infos returns them, for [n, ...] item
    tensors whose rows are contiguous; lens is each buffer's span, (n - 1) * stride + item_len."""
    ptrs, lens, item_lens = [], [], []
    for t in tensors:
        if not t[0].is_contiguous():
            raise ValueError(f"item rows of a {tuple(t.shape)} buffer with strides {t.stride()} are not contiguous")
        item = t[0].numel() * t.element_size()
        stride = t.stride(0) * t.element_size()
        ptrs.append(t.data_ptr())
        item_lens.append(item)
        lens.append((t.shape[0] - 1) * stride + item if t.shape[0] else 0)
        if stride != item:
            _STRIDES[(ptrs[-1], lens[-1], item)] = stride
    return ptrs, lens, item_lens


def item_stride(address: int, nbytes: int, item_len: int) -> int | None:
    """The row stride recorded for this buffer of SGLang's KVArgs, or None (packed)."""
    return _STRIDES.get((int(address), int(nbytes), int(item_len)))
