"""Turn registered memory (bytearray, numpy array, mmap, raw address) into flat byte memoryviews, and
`Strided`: registered memory whose items are not packed."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prfaas_sgl.transfer.layout import MemoryLayout


@dataclass(frozen=True, slots=True)
class Strided:
    """Raw memory whose item i is bytes [address + i * stride, + item_len): one logical buffer laid in a
    larger slab (the unified pool interleaves every layer's K/V rows, and states, in one buffer).
    The stride is local knowledge, never on the wire: the peer's layout sees item_len only, so a slab
    side pairs with a packed one. The staged path views it row by row (`staging.item_tensor`)."""

    address: int
    nbytes: int  # span: (num_items - 1) * stride + item_len at least
    stride: int

    def num_items(self, item_len: int) -> int:
        if self.stride < item_len:
            raise ValueError(f"stride {self.stride} B is below the item length {item_len} B: items overlap")
        return 0 if self.nbytes < item_len else (self.nbytes - item_len) // self.stride + 1


def is_packed(buf: Any) -> bool:
    """Whether byte offsets of `buf` are item * item_len (what `as_bytes` assumes)."""
    return not isinstance(buf, Strided)


def as_bytes(buf: Any, writable: bool) -> memoryview:
    """A 1-D unsigned-byte memoryview of `buf`; `(address, nbytes)` tuples wrap raw memory (e.g.
    `tensor.data_ptr()`); the caller keeps that memory alive and pinned in place."""
    if isinstance(buf, tuple):
        addr, nbytes = buf
        mv = memoryview((ctypes.c_ubyte * nbytes).from_address(addr))
    else:
        mv = memoryview(buf)
    mv = mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
    if writable and mv.readonly:
        raise ValueError("destination buffer is read-only")
    return mv


def register(layout: MemoryLayout, buffers: Sequence[Any], writable: bool) -> list[memoryview]:
    """Views of `buffers`, checked against `layout` (one buffer per spec, each large enough)."""
    if len(buffers) != len(layout.buffers):
        raise ValueError(f"{len(buffers)} buffers given for a layout of {len(layout.buffers)}")
    views = [as_bytes(b, writable) for b in buffers]
    for i, (mv, spec) in enumerate(zip(views, layout.buffers)):
        if mv.nbytes < spec.nbytes:
            raise ValueError(f"buffer {i} has {mv.nbytes} bytes, layout needs {spec.nbytes}")
    return views


def check_host(layout: MemoryLayout, buffers: Sequence[Any], devices: Sequence[str], writable: bool) -> None:
    """Raise ValueError now, not at the first transfer, when a packed host buffer is smaller than its spec
    (or read-only where `writable`). Device and strided buffers are checked when the staged path first
    views them (`staging.Pools`)."""
    for spec, buf, dev in zip(layout.buffers, buffers, devices):
        if dev == "cpu" and is_packed(buf):
            register(MemoryLayout((spec,)), [buf], writable)
