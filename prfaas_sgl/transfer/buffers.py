"""Turn registered memory (bytearray, numpy array, mmap, raw address) into flat byte memoryviews."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

from prfaas_sgl.transfer.layout import MemoryLayout


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
