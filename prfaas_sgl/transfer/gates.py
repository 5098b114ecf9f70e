"""Layer-group gates: a chunk's KV leaves group by group while later layers still compute.

The prefill queues a chunk's KV before (or while) its forward runs, as one `ItemBatch` per layer group,
each carrying the `LayerGate` of its group; the forward hook opens gate g once group g's layers were
launched (CPU: computed). Until then the sender keeps the group's chunk plans parked on its loop thread
(`Parking`), so neither the stager nor the link waits on a closed gate:

    forward:   [ layers of g0 ][ layers of g1 ][ layers of g2 ] ... [ last ] ─▶ result: states + aux
    gates:                    open(g0)        open(g1)        open(g2)      open(tail)
    sender:     park g0 g1 g2 │ stage+send g0 │ stage+send g1 │ ...          │ tail, Close ─▶ Done

A gate that is still closed at its deadline (`timeout_s` after it was made, i.e. after the forward
started) fails every transfer parked on it, with the group's name: a forward that died half-way ends its
transfers before their own no-progress deadline, which other transfers' acks on the link keep moving.

On GPUs a gate holds a `torch.cuda.Event` made up front; `open()` records it on the current (forward)
stream before opening, and the batch lists it in `ItemBatch.events`, so the stager's gather stream waits
for the group's kernels on the device. On CPU the hook runs after the group computed: the flag is enough.

No torch import here: the event is whatever the caller made.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from prfaas_sgl.transfer.items import ItemBatch, Items


class LayerGate:
    """Opens once, when layer group `name` of one forward has written its KV. Shared by every send of that
    group in that forward (all requests, all decode ranks). Any thread may open it; `subscribe` callbacks
    run on the opening thread (keep them O(1): a loop wake-up)."""

    def __init__(self, name: str, timeout_s: float, event: Any = None, now: float | None = None) -> None:
        if timeout_s <= 0:
            raise ValueError(f"gate {name}: timeout_s must be > 0, got {timeout_s}")
        self.name, self.timeout_s, self.event = name, timeout_s, event
        self.deadline = (time.monotonic() if now is None else now) + timeout_s
        self._lock = threading.Lock()
        self._open = False
        self._listeners: list[Callable[[], None]] = []
        # True until the forward that writes this group returned (set by its maker): the sender counts
        # the group sends it staged before then, the ones that overlapped with compute
        self.forward_running = True

    @property
    def is_open(self) -> bool:
        return self._open

    def open(self, record: bool = True) -> None:
        """Group written (CPU) or launched (GPU: `event` is recorded on the current stream first, unless
        `record` is False because the caller recorded it on another stream)."""
        with self._lock:
            if self._open:
                return  # recording again would move the point a queued gather waits for
            if self.event is not None and record:
                self.event.record()  # before the flag: whoever sees the gate open sees the event recorded
            self._open = True
            listeners, self._listeners = self._listeners, []
        for fn in listeners:
            fn()

    def subscribe(self, fn: Callable[[], None]) -> None:
        """Call `fn` once when the gate opens (now, if it is open already)."""
        with self._lock:
            if not self._open:
                if fn not in self._listeners:
                    self._listeners.append(fn)
                return
        fn()

    def __repr__(self) -> str:
        return f"LayerGate({self.name!r}, {'open' if self._open else 'closed'})"


@dataclass(slots=True)
class Parked:
    """Chunk plans of `tid` (one send) held until `gate` opens."""

    gate: LayerGate
    tid: int
    plans: list


class Parking:
    """The sender's parked plans (loop thread only, except `_on_open`, which any thread may call).

    `due` is O(1) unless a gate opened since the last call or the earliest deadline passed."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self._wake = wake
        self._parked: list[Parked] = []
        self._poked = False
        self._next: float | None = None

    def __len__(self) -> int:
        return len(self._parked)

    def park(self, gate: LayerGate, tid: int, plans: list) -> None:
        self._parked.append(Parked(gate, tid, plans))
        self._next = gate.deadline if self._next is None else min(self._next, gate.deadline)
        gate.subscribe(self._on_open)

    def next_deadline(self) -> float | None:
        return self._next

    def due(self, now: float) -> tuple[list[Parked], list[Parked]]:
        """(entries whose gate opened, entries whose gate passed its deadline closed); both leave."""
        if not self._parked or (not self._poked and (self._next is None or now < self._next)):
            return [], []
        self._poked = False
        opened, expired, keep = [], [], []
        for p in self._parked:
            (opened if p.gate.is_open else expired if now >= p.gate.deadline else keep).append(p)
        self._parked = keep
        self._next = min((p.gate.deadline for p in keep), default=None)
        return opened, expired

    def _on_open(self) -> None:
        self._poked = True  # a plain store: the loop reads it after the wake-up below
        self._wake()


def layer_batches(batch: ItemBatch, groups: Sequence[Sequence[int]], gates: Sequence[LayerGate],
                  tail_gate: LayerGate | None = None) -> list[ItemBatch]:
    """Split `batch` (one chunk, as `KVMemory.batch` names it) into one `ItemBatch` per layer group, then
    the tail. `groups[g]` are the buffer ids of layer group g (`srt.backend.layer_groups`); an `Items`
    group over K/V buffers splits into one `Items` per layer group (same ids, same head slice), gated on
    `gates[g]`; items over buffers of no layer group (states, aux) form the tail, gated on `tail_gate`
    (None: sent as soon as staged, e.g. with the last chunk after the forward's result). Empty batches
    are left out. Per buffer the stream order is unchanged, so the receiver's `expect` stays as it was.

        batch:  Items(kv 0..7, pages) | Items(states, slot) | Items(aux, row)
        groups: (0, 1, 4, 5), (2, 3, 6, 7)          (layers 0-1 and 2-3 of an MHA pool: K then V)
        out:    [Items((0, 1, 4, 5), pages)] gate 0 | [Items((2, 3, 6, 7), pages)] gate 1 | [states, aux] tail
    """
    if len(groups) != len(gates):
        raise ValueError(f"{len(groups)} layer groups but {len(gates)} gates")
    owner = {b: g for g, ids in enumerate(groups) for b in ids}
    if len(owner) != sum(len(ids) for ids in groups):
        raise ValueError("a buffer belongs to two layer groups")
    per_group: list[list[Items]] = [[] for _ in groups]
    tail: list[Items] = []
    for items in batch.groups:
        mine = [owner.get(b) for b in items.buffer_ids]
        if all(g is None for g in mine):
            tail.append(items)
            continue
        if any(g is None for g in mine):
            raise ValueError(f"items over buffers {items.buffer_ids} mix layer-group and other buffers")
        for g in sorted(set(mine)):
            ids = tuple(b for b, m in zip(items.buffer_ids, mine) if m == g)
            per_group[g].append(Items(ids, items.index, items.head))
    out = [_gated(batch, tuple(parts), gate) for parts, gate in zip(per_group, gates) if parts]
    if tail:
        out.append(_gated(batch, tuple(tail), tail_gate))
    return out


def _gated(batch: ItemBatch, parts: tuple[Items, ...], gate: LayerGate | None) -> ItemBatch:
    events = batch.events
    if gate is not None and gate.event is not None:
        events = (*events, gate.event)
    return replace(batch, groups=parts, gate=gate, events=events)
