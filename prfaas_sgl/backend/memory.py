"""SGLang's `KVArgs` (raw pool pointers) as a data-plane `MemoryLayout`, and page/slot → region math.

Buffer ids, identical on both sides of a transfer when both run the same model and page size:

    [kv 0 .. kv K-1 | state comp 0: ptr 0 .. | state comp 1: ... | aux 0 .. aux A-1]
     K/V of every full-attention layer (SGLang's order), item = one page
                      state component c (MAMBA: one slot per item; SWA: one window page per item)
                                                                    metadata rows (first token, ...)

A request's bytes per buffer form one stream: decode lists every page it allocated (suffix past its
cached prefix) up front; prefill sends the same pages chunk by chunk in request order, so page k of
the prefill's suffix lands on page k of the decode's suffix whatever the physical page ids are.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from prfaas_sgl.transfer.layout import BufferSpec, MemoryLayout, Region, item_regions


@dataclass(frozen=True, slots=True)
class KVMemory:
    layout: MemoryLayout
    buffers: tuple[tuple[int, int], ...]  # (address, nbytes) per layout entry
    kv_ids: tuple[int, ...]
    state_ids: tuple[tuple[int, ...], ...]  # per state component (parallel to KVArgs.state_types)
    aux_ids: tuple[int, ...]

    @classmethod
    def of(cls, args: Any) -> "KVMemory":
        specs: list[BufferSpec] = []
        bufs: list[tuple[int, int]] = []

        def add(kind: str, ptrs: Sequence[int], lens: Sequence[int], items: Sequence[int]) -> tuple[int, ...]:
            start = len(specs)
            for ptr, nbytes, item in zip(ptrs, lens, items):
                specs.append(BufferSpec(kind, int(item), int(nbytes) // int(item)))
                bufs.append((int(ptr), int(nbytes)))
            return tuple(range(start, len(specs)))

        kv = add("kv", args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens)
        states = tuple(add("state", p, n, i) for p, n, i in zip(getattr(args, "state_data_ptrs", []) or [],
                                                               getattr(args, "state_data_lens", []) or [],
                                                               getattr(args, "state_item_lens", []) or []))
        aux = add("aux", args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens)
        return cls(MemoryLayout(tuple(specs)), tuple(bufs), kv, states, aux)

    def page_regions(self, pages: Sequence[int]) -> list[Region]:
        """Regions of `pages` (page ids, request order) in every K/V buffer."""
        return item_regions(self.layout, self.kv_ids, pages) if len(pages) else []

    def tail_regions(self, state_indices: Sequence[Any] | None, aux_index: int | None) -> list[Region]:
        """The last piece of a request: its items of every state component, then its aux row."""
        out: list[Region] = []
        for ids, indices in zip(self.state_ids, state_indices or ()):
            if indices is not None:
                out += item_regions(self.layout, ids, flat(indices))
        if aux_index is not None:
            out += item_regions(self.layout, self.aux_ids, [int(aux_index)])
        return out

    def describe(self) -> str:
        return (f"{len(self.kv_ids)} kv buffers ({self.layout.buffers[0].item_len if self.kv_ids else 0} B/page), "
                f"{sum(map(len, self.state_ids))} state buffers in {len(self.state_ids)} components, "
                f"{len(self.aux_ids)} aux buffers")


def flat(indices: Any) -> list[int]:
    """Page/slot ids as a flat int list: SGLang hands numpy arrays, torch tensors, or lists of arrays
    (the MAMBA payload is `[array([slot])]`)."""
    if indices is None:
        return []
    if hasattr(indices, "cpu"):
        return flat(indices.cpu().numpy())
    if isinstance(indices, (list, tuple)):
        return [v for x in indices for v in flat(x)]
    return [int(v) for v in np.ravel(np.asarray(indices))]


def flat_states(state_indices: Iterable[Any] | None) -> list[list[int] | None]:
    """Per state component: flat ids, or None where SGLang sends nothing for that component."""
    return [None if s is None else flat(s) for s in (state_indices or ())]


def transfer_id(room: int, decode_ip: str, decode_port: int) -> int:
    """Data-plane transfer id of one (room, decode rank) pair; both sides derive it from the same facts,
    so one prefill rank can feed several decode ranks of the same room without id clashes."""
    return xxhash.xxh3_64_intdigest(f"{room}@{decode_ip}:{decode_port}".encode()) >> 1
