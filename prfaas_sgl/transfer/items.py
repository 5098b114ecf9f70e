"""Item-indexed transfers (the staged path): what a side moves, named by item ids, not bytes.

A request's KV is "pages p0, p1, ... of every K/V buffer", its state "slot s of every state buffer", its
aux "row r of every aux buffer". `Items` says exactly that — one id array shared by a group of buffers —
so the scheduler thread hands over an array it already has (O(1)), and the byte math runs vectorised on
the transfer threads. Each buffer's stream is its items' bytes in id-array order (see layout.py); with a
`HeadSlice` only the selected KV heads of each item are in the stream:

    pool item (one page):  [rows = page_size tokens][heads][unit = head_dim × dtype bytes]
    stream item:           [rows][start : start + count][unit]          (rows × count × unit bytes)

A `ByteRuns` slice (Mamba/GDN/KDA state between TP sizes) is any list of byte runs of an item, in stream
order; a GDN conv-state slot [conv_dim = q | k | v][k-1] keeps one run per sub-block:

    pool item:    |q0 q1|k0 k1|v0 v1|          (this rank's shard of q, k and v; TP 1 here)
    runs:         (q1), (k1), (v1)             three (offset, length) runs for decode rank 1 of TP 2
    stream item:  |q1|k1|v1|                   (sum of the run lengths)

A stream is cut into chunks of whole stream items (as many as fit in `chunk_bytes`), or, for stream
items larger than a chunk (a Mamba temporal state), into pieces of one item:

    stream of b:  |item0|item1|item2|item3|item4| ...        S = stream item bytes, C = chunk_bytes
    S <= C:       [item0..item(k-1)] [item k..] ...           k = C // S items per chunk
    S >  C:       [item0 bytes 0..C) [item0 C..2C) ... [item1 0..C) ...

No torch here: `staging.py` does the copies.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from prfaas_sgl.transfer.coverage import Coverage
from prfaas_sgl.transfer.layout import MemoryLayout


@dataclass(frozen=True, slots=True)
class HeadSlice:
    """KV heads [start, start + count) of pool items laid out [rows, heads, unit] (unit in bytes)."""

    rows: int
    heads: int
    unit: int
    start: int
    count: int

    def __post_init__(self) -> None:
        if min(self.rows, self.heads, self.unit, self.count) <= 0 or not 0 <= self.start <= self.heads - self.count:
            raise ValueError(f"bad head slice {self}: need 0 <= start <= heads - count and positive sizes")

    @property
    def item_len(self) -> int:
        """Bytes of one pool item."""
        return self.rows * self.heads * self.unit

    @property
    def stream_len(self) -> int:
        """Bytes one item contributes to the stream."""
        return self.rows * self.count * self.unit


@dataclass(frozen=True, slots=True)
class ByteRuns:
    """Bytes `runs` ((offset, length) pairs, stream order, disjoint) of pool items of `item_len` bytes."""

    item_len: int
    runs: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        end = 0
        for off, n in sorted(self.runs):
            if n <= 0 or off < end or off + n > self.item_len:
                raise ValueError(f"bad byte runs {self}: need disjoint, non-empty runs inside the item")
            end = off + n
        if not self.runs:
            raise ValueError("byte runs: at least one run")

    @property
    def stream_len(self) -> int:
        return sum(n for _, n in self.runs)

    @property
    def whole(self) -> bool:
        """The runs are the whole item, in order (a destination that one source fills)."""
        return self.stream_len == self.item_len and self.runs[0][0] == 0 and all(
            a + n == b for (a, n), (b, _) in zip(self.runs, self.runs[1:]))

    def columns(self) -> np.ndarray:
        """Byte offsets within the item of the stream item's bytes, [stream_len] int64."""
        return np.concatenate([np.arange(off, off + n, dtype=np.int64) for off, n in self.runs])


Slice = HeadSlice | ByteRuns


@dataclass(frozen=True, slots=True)
class Items:
    """Items `index` (int array, stream order; a numpy array, a host torch tensor, or anything
    np.asarray reads) of every buffer in `buffer_ids`; `head` (a `Slice`: KV heads or byte runs) keeps
    part of each item."""

    buffer_ids: tuple[int, ...]
    index: Any
    head: Slice | None = None

    def __len__(self) -> int:
        return int(np.shape(self.index)[0]) if np.ndim(self.index) else 1


@dataclass(frozen=True, slots=True)
class ItemBatch:
    """One send() or expect(): groups of items. `ready` (prefill, optional) blocks until the pool and the
    index arrays may be read (SGLang's wait_event / indices_event); it runs on the stager thread. `gate`
    (prefill, optional, a `gates.LayerGate`): the sender holds the batch back until it opens (layer-group
    streaming), without blocking the stager or the link."""

    groups: tuple[Items, ...]
    ready: Callable[[], None] | None = None
    events: tuple[Any, ...] = ()  # device events the gather stream must wait for (CUDA only)
    gate: Any = None


def as_index(index: Any) -> np.ndarray:
    """Item ids as a flat int64 numpy array (torch tensors are read on the host: callers sync first)."""
    if hasattr(index, "numpy"):
        index = index.cpu().numpy() if getattr(index, "is_cuda", False) else index.numpy()
    return np.ascontiguousarray(np.ravel(np.asarray(index)), dtype=np.int64)


def stream_item_len(layout: MemoryLayout, buffer_id: int, head: Slice | None) -> int:
    spec = layout.buffers[buffer_id]
    if head is not None and head.item_len != spec.item_len:
        raise ValueError(f"slice {head} does not describe buffer {buffer_id}'s {spec.item_len} B items")
    return spec.item_len if head is None else head.stream_len


def check_items(layout: MemoryLayout, group: Items, index: np.ndarray) -> None:
    """Raise ValueError if `group` names a buffer or an item outside `layout` (vectorised)."""
    for b in group.buffer_ids:
        if not 0 <= b < len(layout.buffers):
            raise ValueError(f"buffer id {b} not in 0..{len(layout.buffers) - 1}")
        n = layout.buffers[b].num_items
        if index.size and (int(index.min()) < 0 or int(index.max()) >= n):
            raise ValueError(f"item ids [{int(index.min())}, {int(index.max())}] outside buffer {b} of {n} items")


@dataclass(slots=True)
class BatchPrep:
    """What the stager learns once per send(): the id arrays read (after `ready`) and checked, the same
    arrays on each device, or why they could not be read. Shared by the send's plans."""

    batch: ItemBatch
    indices: list[np.ndarray] | None = None
    device_indices: dict = field(default_factory=dict)
    error: str = ""
    ready_s: float = 0.0


@dataclass(slots=True)
class StagePlan:
    """One chunk of the staged path: stream bytes [offset, offset + length) of `buffer_id`, i.e. items
    group.index[first : first + count] (whole stream items), or bytes [start, start + length) of the one
    stream item group.index[first] when a stream item is larger than a chunk (count == 1, piece=True).
    `state`/`slot`/`checksum` belong to the stager and the loop thread (see staging.py)."""

    buffer_id: int
    offset: int
    length: int
    group: Items
    group_pos: int
    first: int
    count: int
    prep: BatchPrep
    start: int = 0
    piece: bool = False
    state: int = 0  # staging.PENDING ...
    slot: Any = None
    checksum: int = 0


def plan_items(layout: MemoryLayout, batch: ItemBatch, stream_pos: dict[int, int], chunk_bytes: int) -> list[StagePlan]:
    """Cut `batch` into chunks; advances `stream_pos[buffer_id]` (mutated). O(chunks), never O(items)."""
    plans: list[StagePlan] = []
    prep = BatchPrep(batch)
    for pos_g, g in enumerate(batch.groups):
        n = len(g)
        if n == 0:
            continue
        for b in g.buffer_ids:
            s = stream_item_len(layout, b, g.head)
            pos = stream_pos.get(b, 0)
            if s <= chunk_bytes:
                per = chunk_bytes // s
                for first in range(0, n, per):
                    count = min(per, n - first)
                    plans.append(StagePlan(b, pos, count * s, g, pos_g, first, count, prep))
                    pos += count * s
            else:
                for first in range(n):
                    for start in range(0, s, chunk_bytes):
                        length = min(chunk_bytes, s - start)
                        plans.append(StagePlan(b, pos, length, g, pos_g, first, 1, prep, start, True))
                        pos += length
            stream_pos[b] = pos
    return plans


# -- receiver side ----------------------------------------------------------------------------------------
@dataclass(slots=True)
class ItemStream:
    """A receiver's destination of one buffer: items `index` (int64, stream order) of `item_len`-byte pool
    items, each contributing `stream_len` bytes (all of it, or `head`'s slice)."""

    index: np.ndarray
    item_len: int
    head: Slice | None
    total: int
    covered: Coverage = field(default_factory=Coverage)
    tensor_index: Any = None  # the index on the pool's device, made on first use (staging.py)

    @property
    def stream_len(self) -> int:
        return self.item_len if self.head is None else self.head.stream_len


def item_streams(layout: MemoryLayout, batch: ItemBatch) -> dict[int, ItemStream]:
    """Per-buffer destinations of `batch` (validated; a buffer may appear in one group only)."""
    out: dict[int, ItemStream] = {}
    for g in batch.groups:
        index = as_index(g.index)
        check_items(layout, g, index)
        for b in g.buffer_ids:
            if b in out:
                raise ValueError(f"buffer {b} appears in two item groups of one transfer")
            s = stream_item_len(layout, b, g.head)
            out[b] = ItemStream(index, layout.buffers[b].item_len, g.head, s * index.size)
    return out


@dataclass(frozen=True, slots=True)
class Spans:
    """Stream bytes [offset, offset + length) in stream items of `s` bytes:

        offset                                                offset + length
          |--head: item h, bytes [a, s)--|--whole items [w0, w1)--|--tail: item w1, bytes [0, z)--|
    Any part may be empty; a range inside one item is a head with a < s (and no whole/tail part)."""

    head: tuple[int, int, int] | None  # (item position, byte start, byte end) within the stream item
    whole: tuple[int, int]  # item positions [w0, w1)
    tail: tuple[int, int] | None  # (item position, byte end)


def spans(offset: int, length: int, s: int) -> Spans:
    end = offset + length
    first, a = divmod(offset, s)
    head = None
    if a:
        head = (first, a, min(s, a + length))
        first += 1
    last, z = divmod(end, s)
    if head is not None and last < first:  # inside one item
        return Spans(head, (first, first), None)
    return Spans(head, (first, last), (last, z) if z else None)

