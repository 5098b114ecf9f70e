"""Run a `ZmqReceiver` (or `ZmqSender`) in a spawned process, driven over a pipe — real bytes between
processes for tests. Commands are ("method", *args); replies are return values or raised exceptions."""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from prfaas_sgl.transfer.config import PeerInfo, TransferConfig
from prfaas_sgl.transfer.items import ItemBatch, Items, as_index
from prfaas_sgl.transfer.layout import MemoryLayout

_START_TIMEOUT_S = 30.0


def fill_random(layout: MemoryLayout, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, b.nbytes, dtype=np.uint8) for b in layout.buffers]


def batch(layout: MemoryLayout, pages: Sequence[int] = (), slot: int | None = None,
          aux: int | None = None) -> ItemBatch:
    """A request's items as the backend names them: `pages` of every K/V buffer, then (the last piece)
    state slot `slot` of every state buffer and aux row `aux`."""
    groups = [Items(tuple(layout.ids_of("kv")), np.asarray(list(pages), dtype=np.int64))] if len(pages) else []
    if slot is not None and layout.ids_of("state"):
        groups.append(Items(tuple(layout.ids_of("state")), np.array([slot])))
    if aux is not None:
        groups.append(Items(tuple(layout.ids_of("aux")), np.array([aux])))
    return ItemBatch(tuple(groups))


def stream_bytes(layout: MemoryLayout, what: ItemBatch) -> int:
    """Bytes `what` moves (whole items)."""
    return sum(layout.buffers[b].item_len * len(g) for g in what.groups for b in g.buffer_ids)


def read_items(views: Sequence[Any], layout: MemoryLayout, what: ItemBatch) -> bytes:
    """Concatenated bytes of `what`'s items, group by group, buffer by buffer (what a stream comparison
    needs). Whole items only."""
    out = []
    for g in what.groups:
        for b in g.buffer_ids:
            n, view = layout.buffers[b].item_len, memoryview(views[b]).cast("B")
            out += [bytes(view[i * n: (i + 1) * n]) for i in as_index(g.index).tolist()]
    return b"".join(out)


def _serve(conn: Any, role: str, layout: MemoryLayout, cfg: TransferConfig, kwargs: dict, seed: int) -> None:
    if role == "receiver":
        from prfaas_sgl.transfer.receiver import ZmqReceiver
        bufs = [np.zeros(b.nbytes, np.uint8) for b in layout.buffers]
        side: Any = ZmqReceiver(layout, bufs, cfg, **kwargs)
        conn.send(side.address)
    else:
        from prfaas_sgl.transfer.sender import ZmqSender
        bufs = fill_random(layout, seed)
        side = ZmqSender(layout, bufs, cfg, **kwargs)
        conn.send(None)
    try:
        while True:
            cmd, *args = conn.recv()
            if cmd == "stop":
                break
            try:
                result = read_items(bufs, layout, args[0]) if cmd == "read" else getattr(side, cmd)(*args)
                conn.send(("ok", result))
            except Exception as e:  # shipped to the test process
                conn.send(("err", repr(e)))
    finally:
        side.close()
        conn.send(("ok", None))


class Remote:
    """Handle on a transport side in a child process. `address` is set for receivers."""

    def __init__(self, role: str, layout: MemoryLayout, cfg: TransferConfig, seed: int = 0, **kwargs: Any):
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, role, layout, cfg, kwargs, seed), daemon=True)
        self._proc.start()
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not self._conn.poll(0.05):
            if not self._proc.is_alive() or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"{role} process failed to start (exit code {self._proc.exitcode})")
        self.address: PeerInfo | None = self._conn.recv()

    def call(self, cmd: str, *args: Any, timeout: float = 30.0) -> Any:
        self._conn.send((cmd, *args))
        if not self._conn.poll(timeout):
            raise TimeoutError(f"{cmd} got no reply within {timeout} s")
        status, value = self._conn.recv()
        if status == "err":
            raise RuntimeError(value)
        return value

    def stop(self) -> None:
        if self._proc.is_alive():
            try:
                self.call("stop", timeout=10.0)
            except (TimeoutError, EOFError, BrokenPipeError, OSError):
                pass
        self._proc.join(10.0)
        self.kill()

    def kill(self) -> None:
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5.0)

    def __enter__(self) -> "Remote":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def small_layout(page_bytes: int = 4096, num_pages: int = 64) -> MemoryLayout:
    """2 layers (4 KV buffers), one 1000-byte state per slot, one 64-byte aux row: KVArgs in miniature."""
    from prfaas_sgl.transfer.layout import kv_layout
    return kv_layout(2, page_bytes, num_pages, state_bytes=[1000], num_slots=4, aux_bytes=64, num_aux=4)
