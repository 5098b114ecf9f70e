"""The staged data path: the same code on host memory (CI) and on CUDA pools.

Prefill (`Stager`, one thread per sender, never the scheduler's or the socket loop's):

    plans (loop thread) ─▶ wait SGLang's events ─▶ index_select items of one buffer into a slot
       (CUDA: on a side stream into device scratch, then D2H into a pinned ring slot) ─▶ event sync
       ─▶ xxh3 of the slot ─▶ STAGED: the loop sends the slot as ONE zero-copy frame (tracked)

A ring slot is free again only when ZeroMQ's tracker says libzmq let go of the frame, or when its plan
is dropped (transfer failed / released) before being sent — never while ZeroMQ still owns it.

Decode: `Lander` (landing.py) writes each verified chunk into the pools, with the `Pools` and `Ring` kept here.
"""
from __future__ import annotations

import collections
import ctypes
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import xxhash

from prfaas_sgl.transfer.buffers import Strided
from prfaas_sgl.transfer import slicing
from prfaas_sgl.transfer.items import ByteRuns, HeadSlice, StagePlan, as_index, check_items
from prfaas_sgl.transfer.layout import MemoryLayout

log = logging.getLogger(__name__)
PENDING, STAGING, STAGED, SENT, CANCELLED, FAILED = range(6)
STAGE_BATCH = 8  # plans staged per device sync (D2H of one batch overlaps the network of the last)


class _DevicePtr:
    """`__cuda_array_interface__` over a raw device pointer, so torch can view SGLang's pool in place."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


def pool_tensor(buf: Any, device: str = "cpu") -> torch.Tensor:
    """A flat uint8 tensor over registered memory, never a copy: `(address, nbytes)` (host or device,
    as `device` says), a torch tensor, a numpy array, or a writable buffer (bytearray, memoryview)."""
    if isinstance(buf, torch.Tensor):
        return buf.reshape(-1).view(torch.uint8)
    if isinstance(buf, tuple):
        ptr, nbytes = buf
        if device.startswith("cuda"):
            return torch.as_tensor(_DevicePtr(int(ptr), int(nbytes)), device=device)
        return torch.frombuffer((ctypes.c_ubyte * int(nbytes)).from_address(int(ptr)), dtype=torch.uint8)
    if isinstance(buf, np.ndarray):
        return torch.from_numpy(buf.reshape(-1).view(np.uint8))
    return torch.frombuffer(buf, dtype=torch.uint8)


def item_tensor(buf: Any, device: str, num_items: int, item_len: int) -> torch.Tensor:
    """Registered memory as [num_items, item_len] uint8, never a copy; a `Strided` buffer's rows are
    `stride` bytes apart (rows stay contiguous, so head slices and index_select/index_copy_ work as on
    packed pools)."""
    if isinstance(buf, Strided):
        span = (num_items - 1) * buf.stride + item_len if num_items else 0
        if buf.num_items(item_len) < num_items:
            raise ValueError(f"strided buffer spans {buf.nbytes} B, {num_items} items of {item_len} B "
                             f"every {buf.stride} B need {span} B")
        flat = pool_tensor((buf.address, buf.nbytes), device)
        return flat.as_strided((num_items, item_len), (buf.stride, 1))
    flat = pool_tensor(buf, device)
    if flat.numel() < num_items * item_len:
        raise ValueError(f"buffer has {flat.numel()} bytes, layout needs {num_items * item_len}")
    return flat[: num_items * item_len].view(num_items, item_len)


def item_view(items: torch.Tensor, head: HeadSlice | None) -> torch.Tensor:
    """[num_items, item_len] `items`, or with `head` as [num_items, rows, count, unit] (a strided view)."""
    if head is None:
        return items
    v = items.view(items.shape[0], head.rows, head.heads, head.unit)
    return v[:, :, head.start: head.start + head.count]


def is_cuda(device: str) -> bool:
    return device.startswith("cuda")


class Pools:
    """One side's registered buffers as tensors (`devices[b]`: "cpu" or "cuda:N" per buffer)."""

    def __init__(self, layout: MemoryLayout, buffers: Sequence[Any], devices: Sequence[str] | None) -> None:
        self.layout = layout
        self.devices = list(devices or ["cpu"] * len(buffers))
        if len(self.devices) != len(buffers):
            raise ValueError(f"{len(self.devices)} devices given for {len(buffers)} buffers")
        self.items = []  # per buffer: [num_items, item_len] uint8
        for i, (buf, dev, spec) in enumerate(zip(buffers, self.devices, layout.buffers)):
            try:
                self.items.append(item_tensor(buf, dev, spec.num_items, spec.item_len))
            except ValueError as e:
                raise ValueError(f"buffer {i}: {e}") from None
        self.cuda = sorted({d for d in self.devices if is_cuda(d)})

    def view(self, b: int, head: HeadSlice | None) -> torch.Tensor:
        return item_view(self.items[b], head)


class Ring:
    """`nslots` host slots of `slot_bytes` (pinned when a GPU reads or writes them)."""

    def __init__(self, nslots: int, slot_bytes: int, pinned: bool) -> None:
        self.slot_bytes = slot_bytes
        self.host = torch.empty(nslots * slot_bytes, dtype=torch.uint8, pin_memory=pinned)
        self.arrays = self.host.numpy().reshape(nslots, slot_bytes)  # zero-copy frames come from here
        self.free: collections.deque[int] = collections.deque(range(nslots))
        self.nslots = nslots

    def slot(self, i: int, n: int) -> torch.Tensor:
        return self.host[i * self.slot_bytes: i * self.slot_bytes + n]

    @property
    def in_use(self) -> int:
        return self.nslots - len(self.free)


class Stager:
    """Prefill: stages `StagePlan`s into ring slots on its own thread; `wake()` tells the socket loop."""

    def __init__(self, pools: Pools, slot_bytes: int, nslots: int, wake: Callable[[], None]) -> None:
        self.pools = pools
        self.ring = Ring(nslots, slot_bytes, pinned=bool(pools.cuda))
        self._wake = wake
        self._lock = threading.Condition()
        self._todo: collections.deque[StagePlan] = collections.deque()
        self._zmq: collections.deque[tuple[int, Any]] = collections.deque()  # (slot, tracker) owned by ZeroMQ
        self._stop = False
        self._fatal: str | None = None
        self._cuda = _CudaSide(pools.cuda[0], STAGE_BATCH * slot_bytes) if pools.cuda else None
        self._thread = threading.Thread(target=self._run, name="transfer-stage", daemon=True)
        self._thread.start()

    @property
    def fatal(self) -> str | None:
        """None while the stager thread runs; why it died once it has (a health check reads this).
        After that every plan, queued or submitted, reads FAILED, so its transfer fails at once."""
        return self._fatal

    # -- loop thread -----------------------------------------------------------------------------------
    def submit(self, plans: Sequence[StagePlan]) -> None:
        with self._lock:
            if self._fatal is not None:
                _mark_failed(plans, f"stager thread died: {self._fatal}")
                return
            self._todo.extend(plans)
            self._lock.notify_all()

    def cancel(self, plan: StagePlan) -> None:
        """`plan` will never be sent: its slot returns now, or when the stager is done with it."""
        with self._lock:
            if plan.state == STAGED:
                self.ring.free.append(plan.slot)
                self._lock.notify_all()
            if plan.state != SENT:
                plan.state, plan.slot = CANCELLED, None

    def sent(self, plan: StagePlan, tracker: Any) -> None:
        """ZeroMQ took `plan`'s frame: the slot is free once `tracker` (None = copied) says it let go."""
        with self._lock:
            if tracker is None or tracker.done:
                self.ring.free.append(plan.slot)
                self._lock.notify_all()
            else:
                self._zmq.append((plan.slot, tracker))
            plan.state, plan.slot = SENT, None

    def frame(self, plan: StagePlan) -> memoryview:
        return memoryview(self.ring.arrays[plan.slot, : plan.length])

    def close(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        self._thread.join(5.0)

    # -- stager thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        # Thread-local: one intra-op thread for our gathers. With the default (all cores) a 1 MiB
        # index_select took 4.9 ms instead of 0.35 ms on a busy 2-core host (OpenMP workers waiting for
        # cores the server's own threads hold); SGLang's threads keep their setting.
        torch.set_num_threads(1)
        batch: list[tuple[StagePlan, int]] = []
        try:
            while True:
                batch = self._take() or []
                if not batch:
                    return
                try:
                    self._stage(batch)
                except Exception as e:  # one bad batch fails its transfers, not the thread
                    log.exception("staging failed")
                    self._fail(batch, f"staging failed: {type(e).__name__}: {e}")
                batch = []
                self._wake()
        except BaseException as e:  # the machinery itself broke: fail everything now, not at the deadlines
            log.exception("transfer-stage thread died; every staged send fails")
            self._die(f"{type(e).__name__}: {e}", batch)

    def _die(self, reason: str, batch: list[tuple[StagePlan, int]]) -> None:
        with self._lock:
            self._fatal = reason
            why = f"stager thread died: {reason}"
            _mark_failed([plan for plan, _ in batch if plan.state == STAGING], why)
            _mark_failed([plan for plan in self._todo if plan.state == PENDING], why)
            self._todo.clear()
        try:
            self._wake()  # the loop fails their transfers now
        except Exception:
            log.exception("transfer-stage: waking the loop failed")

    def _take(self) -> list[tuple[StagePlan, int]] | None:
        """Up to STAGE_BATCH pending plans with a free slot each (waits for work and for slots)."""
        with self._lock:
            while not self._stop:
                while self._todo and self._todo[0].state == CANCELLED:
                    self._todo.popleft()
                self._reclaim()
                if self._todo and self.ring.free:
                    out = []
                    while self._todo and self.ring.free and len(out) < STAGE_BATCH:
                        plan = self._todo.popleft()
                        if plan.state == PENDING:
                            plan.state = STAGING
                            out.append((plan, self.ring.free.popleft()))
                    if out:
                        return out
                    continue
                # ring full: slots come back as libzmq lets go of frames (trackers), so poll briefly
                self._lock.wait(0.001 if self._todo else 0.5)
            return None

    def _reclaim(self) -> None:
        """Slots whose frames libzmq has let go of are free again (caller holds the lock)."""
        keep: collections.deque[tuple[int, Any]] = collections.deque()
        for slot, tracker in self._zmq:
            if tracker.done:
                self.ring.free.append(slot)
            else:
                keep.append((slot, tracker))
        self._zmq = keep

    def _stage(self, batch: list[tuple[StagePlan, int]]) -> None:
        ok = []
        for plan, slot in batch:  # a send whose ids are bad fails alone, not the plans staged beside it
            try:
                _prepare(plan, self.pools)
                ok.append((plan, slot))
            except Exception as e:
                self._fail([(plan, slot)], f"staging failed: {type(e).__name__}: {e}")
        batch[:] = ok
        if self._cuda is not None:
            self._cuda.stage(self.pools, self.ring, batch)
        else:
            for plan, slot in batch:
                _gather(self.pools, plan, self.ring.slot(slot, plan.length))
        sums = [xxhash.xxh3_64_intdigest(self.ring.arrays[slot, : plan.length]) for plan, slot in batch]
        with self._lock:
            for (plan, slot), checksum in zip(batch, sums):
                if plan.state == CANCELLED:
                    self.ring.free.append(slot)
                else:
                    plan.slot, plan.checksum, plan.state = slot, checksum, STAGED

    def _fail(self, batch: list[tuple[StagePlan, int]], reason: str) -> None:
        with self._lock:
            for plan, slot in batch:
                self.ring.free.append(slot)
                if plan.state != CANCELLED:
                    plan.state, plan.slot = FAILED, None
                    plan.prep.error = plan.prep.error or reason


def _mark_failed(plans: Sequence[StagePlan], reason: str) -> None:
    """Plans that will never be staged (caller holds the stager's lock, or they are not shared yet)."""
    for plan in plans:
        plan.state, plan.slot = FAILED, None
        plan.prep.error = plan.prep.error or reason


def _prepare(plan: StagePlan, pools: Pools) -> None:
    """First plan of a send(): wait for SGLang's events, read and check its item ids (once per send)."""
    prep = plan.prep
    if prep.error:
        raise RuntimeError(prep.error)
    if prep.indices is not None:
        return
    try:
        if prep.batch.ready is not None:
            prep.ready_s = _timed(prep.batch.ready)
        indices = []
        for g in prep.batch.groups:
            index = as_index(g.index)
            check_items(pools.layout, g, index)
            indices.append(index)
        prep.indices = indices
    except Exception as e:
        prep.error = f"{type(e).__name__}: {e}"
        raise


def _timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _device_index(plan: StagePlan, device: str) -> torch.Tensor:
    prep = plan.prep
    key = (plan.group_pos, device)
    t = prep.device_indices.get(key)
    if t is None:
        t = torch.from_numpy(prep.indices[plan.group_pos]).to(device)
        prep.device_indices[key] = t
    return t


def _gather(pools: Pools, plan: StagePlan, out: torch.Tensor) -> None:
    """Stream bytes of `plan` into `out` (flat uint8, plan.length bytes, on the pool's device)."""
    b, g = plan.buffer_id, plan.group
    runs = g.head if isinstance(g.head, ByteRuns) else None
    view = pools.view(b, None if runs else g.head)
    if plan.piece:
        item = int(plan.prep.indices[plan.group_pos][plan.first])
        if runs:
            slicing.read_piece(view, item, runs, plan.start, out)
        else:
            out.copy_(view[item].reshape(-1)[plan.start: plan.start + plan.length])
        return
    index = _device_index(plan, pools.devices[b])[plan.first: plan.first + plan.count]
    if runs:
        slicing.gather(view, index, runs, out)
    else:
        torch.index_select(view, 0, index, out=out.view(plan.count, *view.shape[1:]))


class _CudaSide:
    """The device half of a Stager: a low-priority side stream and device scratch for one batch."""

    def __init__(self, device: str, nbytes: int) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device, priority=0)
        self.scratch = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def stage(self, pools: Pools, ring: Ring, batch: list[tuple[StagePlan, int]]) -> None:
        with torch.cuda.stream(self.stream):
            for ev in {id(e): e for plan, _ in batch for e in plan.prep.batch.events}.values():
                self.stream.wait_event(ev)  # SGLang's early-send wait_event: the forward may still write
            pos = 0
            for plan, slot in batch:
                host = ring.slot(slot, plan.length)
                if is_cuda(pools.devices[plan.buffer_id]):
                    dev = self.scratch[pos: pos + plan.length]
                    _gather(pools, plan, dev)
                    host.copy_(dev, non_blocking=True)
                    pos += plan.length
                else:  # aux rows live in host memory on GPU servers too
                    _gather(pools, plan, host)
            done = torch.cuda.Event()
            done.record(self.stream)
        done.synchronize()  # releases the GIL; the checksum needs the bytes on the host
