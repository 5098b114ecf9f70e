"""Memory layout of one side of a transfer, modelled on SGLang's `KVArgs`.

A side registers a list of buffers, indexed by buffer id:

    [K layer 0, ..., K layer L-1, V layer 0, ..., V layer L-1, state 0, ..., state S-1, aux]
     └──────────── kind "kv": item = one page ──────────────┘  └─ "state": one slot ─┘  └ one row

Buffer `b` holds `num_items` items of `item_len` bytes; item `i` is bytes [i·item_len, (i+1)·item_len).
A transfer names the items it moves (`items.ItemBatch`), and each buffer's items, in the order given,
form that buffer's byte stream. Sender stream and receiver stream of a buffer must have equal length;
byte k of one lands on byte k of the other. Chunked prefill therefore works piece by piece: the
receiver lists all its pages up front, the sender sends pages in the same request order as they finish.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import msgspec

BUFFER_KINDS = ("kv", "state", "aux")


class BufferSpec(msgspec.Struct, frozen=True):
    """One registered buffer: `kind` in BUFFER_KINDS, `item_len` bytes per page/slot/row."""

    kind: str
    item_len: int
    num_items: int = 0

    @property
    def nbytes(self) -> int:
        return self.item_len * self.num_items


class MemoryLayout(msgspec.Struct, frozen=True):
    """The buffers one side registered. Wire-visible (sent in `Open`), so plain msgspec."""

    buffers: tuple[BufferSpec, ...]

    def __post_init__(self) -> None:
        for i, b in enumerate(self.buffers):
            if b.kind not in BUFFER_KINDS:
                raise ValueError(f"buffer {i}: kind {b.kind!r} not in {BUFFER_KINDS}")
            if b.item_len <= 0 or b.num_items < 0:
                raise ValueError(f"buffer {i}: item_len {b.item_len} must be > 0, num_items >= 0")

    def ids_of(self, kind: str) -> list[int]:
        return [i for i, b in enumerate(self.buffers) if b.kind == kind]

    def mismatch(self, other: "MemoryLayout", sliced: Collection[int] = ()) -> str | None:
        """Why `other` (the peer's layout) cannot exchange data with this one, or None.

        Pool sizes (`num_items`) may differ between sides; count, kind and item_len may not, except the
        item_len of `sliced` buffers (KV head slices between different TP sizes: their streams carry
        slice bytes, which the per-stream totals of Close and every chunk's bounds check instead).
        """
        if len(self.buffers) != len(other.buffers):
            return f"layout mismatch: peer has {len(other.buffers)} buffers, this side {len(self.buffers)}"
        for i, (mine, theirs) in enumerate(zip(self.buffers, other.buffers)):
            if mine.kind != theirs.kind:
                return f"layout mismatch: buffer {i} kind peer={theirs.kind!r} here={mine.kind!r}"
            if mine.item_len != theirs.item_len and i not in sliced:
                return (f"layout mismatch: buffer {i} ({mine.kind}) item_len (page/slot size) "
                        f"peer={theirs.item_len} B here={mine.item_len} B")
        return None


def kv_layout(num_layers: int, page_bytes: int, num_pages: int, state_bytes: Sequence[int] = (),
              num_slots: int = 0, aux_bytes: int = 0, num_aux: int = 0) -> MemoryLayout:
    """SGLang-shaped layout: K buffers, V buffers (one per layer), state buffers, optional aux."""
    kv = [BufferSpec("kv", page_bytes, num_pages) for _ in range(2 * num_layers)]
    states = [BufferSpec("state", n, num_slots) for n in state_bytes]
    aux = [BufferSpec("aux", aux_bytes, num_aux)] if aux_bytes else []
    return MemoryLayout(tuple(kv + states + aux))
