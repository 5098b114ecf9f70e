"""SGLang's `KVArgs` (raw pool pointers) as a data-plane `MemoryLayout`, and page/slot ids → `ItemBatch`.

Buffer ids, identical on both sides of a transfer when both run the same model and page size:

    [kv 0 .. kv K-1 | state comp 0: ptr 0 .. | state comp 1: ... | aux 0 .. aux A-1]
     K/V of every full-attention layer (SGLang's order), item = one page
                      state component c (MAMBA: one slot per item; SWA: one window page per item)
                                                                    metadata rows (first token, ...)

A request's bytes per buffer form one stream: decode lists every page it allocated (suffix past its
cached prefix) up front; prefill sends the same pages chunk by chunk in request order, so page k of
the prefill's suffix lands on page k of the decode's suffix whatever the physical page ids are.

Both sides name what moves as item ids (`ItemBatch`, the staged path): the scheduler thread
hands SGLang's id arrays over as they are, and every byte computation runs on the transfer threads.
Devices: K/V and state buffers live where the server runs (`cuda:<gpu_id>` on GPUs), aux rows in host
memory always (SGLang's `MetadataBuffers` use device "cpu" unless Mooncake's NVLink pool is on). This is
local knowledge only: the wire layout has no devices, so a CPU prefill pairs with a GPU decode.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from prfaas_sgl.srt.buf_infos import item_stride
from prfaas_sgl.transfer.buffers import Strided
from prfaas_sgl.transfer.items import HeadSlice, ItemBatch, Items
from prfaas_sgl.transfer.layout import BufferSpec, MemoryLayout


@dataclass(frozen=True, slots=True)
class KVMemory:
    layout: MemoryLayout
    buffers: tuple[tuple[int, int] | Strided, ...]  # (address, nbytes), or Strided (slab views), per entry
    kv_ids: tuple[int, ...]
    state_ids: tuple[tuple[int, ...], ...]  # per state component (parallel to KVArgs.state_types)
    aux_ids: tuple[int, ...]
    devices: tuple[str, ...] = ()  # per layout entry: "cpu" or "cuda:N"

    @property
    def device(self) -> str:
        """Where the K/V pool lives ("cpu" or "cuda:N")."""
        return self.devices[self.kv_ids[0]] if self.kv_ids and self.devices else "cpu"

    @classmethod
    def of(cls, args: Any, device: str = "cpu") -> "KVMemory":
        """`device`: the server's --device ("cpu" or "cuda"; K/V and states live there, aux on the host)."""
        specs: list[BufferSpec] = []
        bufs: list[tuple[int, int]] = []

        def add(kind: str, ptrs: Sequence[int], lens: Sequence[int], items: Sequence[int]) -> tuple[int, ...]:
            start = len(specs)
            for ptr, nbytes, item in zip(ptrs, lens, items):
                buf = registered(int(ptr), int(nbytes), int(item))
                count = buf.num_items(int(item)) if isinstance(buf, Strided) else int(nbytes) // int(item)
                specs.append(BufferSpec(kind, int(item), count))
                bufs.append(buf)
            return tuple(range(start, len(specs)))

        kv = add("kv", args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens)
        states = tuple(add("state", p, n, i) for p, n, i in zip(getattr(args, "state_data_ptrs", []) or [],
                                                               getattr(args, "state_data_lens", []) or [],
                                                               getattr(args, "state_item_lens", []) or []))
        aux = add("aux", args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens)
        pool = f"cuda:{int(getattr(args, 'gpu_id', 0) or 0)}" if str(device).startswith("cuda") else "cpu"
        devices = tuple("cpu" if i in aux else pool for i in range(len(specs)))
        return cls(MemoryLayout(tuple(specs)), tuple(bufs), kv, states, aux, devices)

    def batch(self, pages: Any, state_indices: Sequence[Any] | None = None, aux_index: int | None = None,
              head: HeadSlice | None = None, **sync: Any) -> ItemBatch:
        """One piece of a request as item ids: `pages` (SGLang's page-id array, request order; kept as
        given: O(1)) of every K/V buffer, then, with the last piece, its slots of every state component and
        its aux row. `head` slices KV heads (different TP sizes); `sync` = ItemBatch's ready/events."""
        groups = [Items(self.kv_ids, pages, head)] if self.kv_ids and index_len(pages) else []
        for ids, indices in zip(self.state_ids, state_indices or ()):
            if indices is not None and ids:
                groups.append(Items(ids, np.asarray(flat(indices), dtype=np.int64)))
        if aux_index is not None and self.aux_ids:
            groups.append(Items(self.aux_ids, np.array([int(aux_index)], dtype=np.int64)))
        return ItemBatch(tuple(groups), **sync)

    def describe(self) -> str:
        return (f"{len(self.kv_ids)} kv buffers ({self.layout.buffers[0].item_len if self.kv_ids else 0} B/page), "
                f"{sum(map(len, self.state_ids))} state buffers in {len(self.state_ids)} components, "
                f"{len(self.aux_ids)} aux buffers")


def stager_sync(device: str, wait_event: Any = None, indices_event: Any = None) -> dict:
    """ItemBatch `events`/`ready` of a piece the scheduler thread queues: `wait_event` (the forward may
    still write it), an event on the current stream (defence in depth on CUDA: whatever the scheduler's
    stream still has queued) and `indices_event` (pinned page ids still being copied from the GPU)."""
    events = [wait_event] if wait_event is not None else []
    if device != "cpu":
        import torch

        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream())
        events.append(ev)
    return {"events": tuple(events), "ready": indices_event.synchronize if indices_event is not None else None}


def registered(ptr: int, nbytes: int, item_len: int) -> tuple[int, int] | Strided:
    """One of KVArgs' buffers as the transport takes it: strided where its pool recorded a row stride
    (`srt.buf_infos`: the unified pool's slab views), else packed (address, nbytes)."""
    stride = item_stride(ptr, nbytes, item_len)
    return (ptr, nbytes) if stride is None else Strided(ptr, nbytes, stride)


def index_len(indices: Any) -> int:
    """Number of page ids in SGLang's `kv_indices` (numpy array, torch tensor or list) without reading them."""
    if indices is None:
        return 0
    shape = getattr(indices, "shape", None)
    return int(shape[0]) if shape is not None and len(shape) == 1 else len(flat(indices))


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


def transfer_id(room: int, decode_ip: str, decode_port: int, src_rank: int = 0) -> int:
    """Data-plane transfer id of one (room, decode rank, prefill rank) triple; both sides derive it from
    the same facts, so one prefill rank can feed several decode ranks of a room, and several prefill
    ranks one decode rank (prefill TP > decode TP), without id clashes. Prefill rank 0 keeps the id of
    the single-source case."""
    tail = f"#{src_rank}" if src_rank else ""
    return xxhash.xxh3_64_intdigest(f"{room}@{decode_ip}:{decode_port}{tail}".encode()) >> 1
