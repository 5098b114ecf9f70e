"""The staged path with CUDA pools: real ZmqSender/ZmqReceiver threads over 127.0.0.1 with 4
connections, pools shaped like SGLang's (K/V buffers of `page_size` tokens × 2 heads × 256 B, a state
buffer whose item is larger than a chunk, aux rows in host memory as SGLang keeps them on GPUs).

Imports only prfaas_sgl.transfer (torch, pyzmq, msgspec, xxhash, numpy): no SGLang, so it runs on a GPU
machine that has none. Skipped without CUDA. Two ways to run it:

    .venv/bin/python -m pytest -q tests/gpu                  # with pytest
    python tests/gpu/test_staging_gpu.py [--json out.json]    # standalone: runs every check, prints results
"""
from __future__ import annotations

import itertools
import json
import os
import sys
import threading
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from prfaas_sgl.transfer import faults as F  # noqa: E402
from prfaas_sgl.transfer.config import TransferConfig  # noqa: E402
from prfaas_sgl.transfer.items import ItemBatch, Items  # noqa: E402
from prfaas_sgl.transfer.layout import BufferSpec, MemoryLayout  # noqa: E402
from prfaas_sgl.transfer.receiver import ZmqReceiver  # noqa: E402
from prfaas_sgl.transfer.sender import ZmqSender  # noqa: E402
from prfaas_sgl.transfer.states import TransferState as S  # noqa: E402

try:
    import pytest

    needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                    reason="needs a CUDA GPU (the staged path on device pools)")
except ImportError:  # standalone on a GPU machine without pytest
    pytest = None

    def needs_cuda(fn):
        return fn

CFG = TransferConfig(connections=4, chunk_bytes=1 << 20, window_bytes=128 << 20, timeout_s=30)
IDS = itertools.count(1)
TOKEN = 1024  # 2 KV heads × 256 B (128 dims of bf16) per token per K or V buffer
KV_BUFFERS, STATE = 8, 3 << 20  # the state item (3 MiB) is larger than a chunk


def layout(page_size: int, pages: int) -> MemoryLayout:
    kv = [BufferSpec("kv", page_size * TOKEN, pages) for _ in range(KV_BUFFERS)]
    return MemoryLayout(tuple(kv + [BufferSpec("state", STATE, 3), BufferSpec("aux", 64, 8)]))


def make_pools(lay: MemoryLayout, device: str, seed: int | None):
    """Per buffer: a uint8 tensor (K/V and state on `device`, aux on the host) and what the transport
    registers for it, as the backend does: (address, nbytes) plus a device name."""
    gen = torch.Generator().manual_seed(seed or 0)
    tensors, bufs, devices = [], [], []
    for spec in lay.buffers:
        dev = "cpu" if spec.kind == "aux" else device
        t = (torch.randint(0, 256, (spec.nbytes,), dtype=torch.uint8, generator=gen) if seed is not None
             else torch.zeros(spec.nbytes, dtype=torch.uint8)).to(dev)
        tensors.append(t)
        bufs.append((t.data_ptr(), t.numel()) if dev != "cpu" else t.numpy())
        devices.append(dev)
    return tensors, bufs, devices


def batch(kv_pages, slot=None, aux=None) -> ItemBatch:
    groups = [Items(tuple(range(KV_BUFFERS)), np.asarray(kv_pages))]
    if slot is not None:
        groups.append(Items((KV_BUFFERS,), np.array([slot])))
    if aux is not None:
        groups.append(Items((KV_BUFFERS + 1,), np.array([aux])))
    return ItemBatch(tuple(groups))


def items(t: torch.Tensor, item: int, ids) -> torch.Tensor:
    return t.view(-1, item)[torch.as_tensor(np.asarray(ids), device=t.device)].cpu()


class Pair:
    def __init__(self, src_dev: str, dst_dev: str, page_size: int, pages: int, faults=(), cfg=CFG):
        self.lay = layout(page_size, pages)
        self.src, sb, sd = make_pools(self.lay, src_dev, seed=1)
        self.dst, db, dd = make_pools(self.lay, dst_dev, seed=None)
        self.rx = ZmqReceiver(self.lay, db, cfg, devices=dd)
        self.tx = ZmqSender(self.lay, sb, cfg, devices=sd, faults=faults)

    def close(self):
        self.tx.close()
        self.rx.close()


@needs_cuda
def test_round_trips_are_byte_exact():
    for (src_dev, dst_dev), page_size in itertools.product(
            [("cuda", "cuda"), ("cuda", "cpu"), ("cpu", "cuda")], (1, 64)):
        pages = 4096 if page_size == 1 else 128
        p = Pair(src_dev, dst_dev, page_size, pages)
        try:
            rng = np.random.default_rng(page_size)
            sp, dp = rng.permutation(pages)[: pages // 2], rng.permutation(pages)[: pages // 2]
            tid, half = next(IDS), len(sp) // 2
            p.rx.expect(tid, batch(dp, slot=2, aux=5))
            p.tx.send(tid, p.rx.address, batch(sp[:half]))
            p.tx.send(tid, p.rx.address, batch(sp[half:], slot=0, aux=1), last=True)
            status = p.rx.wait(tid, 60)
            assert status.state is S.DONE, (src_dev, dst_dev, page_size, status)
            item = page_size * TOKEN
            for b in range(KV_BUFFERS):
                assert torch.equal(items(p.dst[b], item, dp), items(p.src[b], item, sp)), (src_dev, dst_dev, b)
            assert torch.equal(items(p.dst[KV_BUFFERS], STATE, [2]), items(p.src[KV_BUFFERS], STATE, [0]))
            assert torch.equal(items(p.dst[-1], 64, [5]), items(p.src[-1], 64, [1]))
        finally:
            p.close()


@needs_cuda
def test_corrupt_chunk_is_caught():
    p = Pair("cuda", "cuda", 1, 2048, faults=(F.CorruptChunk(5),))
    try:
        tid = next(IDS)
        p.rx.expect(tid, batch(range(2048)))
        p.tx.send(tid, p.rx.address, batch(range(2048)), last=True)
        status = p.rx.wait(tid, 30)
        assert status.state is S.FAILED and "checksum mismatch in chunk 5" in status.reason, status
    finally:
        p.close()


@needs_cuda
def test_abort_recycles_buffers_and_nothing_lands_after_release():
    """Released mid-transfer (a slow receiver keeps chunks queued): the sender's ring and the receiver's
    ring come back whole, and the decode pool does not change after release() returned."""
    lay = layout(1, 4096)
    src, sb, sd = make_pools(lay, "cuda", seed=1)
    dst, db, dd = make_pools(lay, "cuda", seed=None)
    cfg = CFG.replace(stage_slots=8)
    rx = ZmqReceiver(lay, db, cfg, devices=dd, faults=(F.SlowReceiver(0.005),))
    tx = ZmqSender(lay, sb, cfg, devices=sd)
    try:
        tid = next(IDS)
        rx.expect(tid, batch(range(4096)))
        tx.send(tid, rx.address, batch(range(4096)))
        _until(lambda: rx._book.transfers[tid].nbytes > (4 << 20))
        rx.release(tid)
        snapshot = [t.clone() for t in dst[:KV_BUFFERS]]
        tx.release(tid)
        time.sleep(0.5)
        assert all(torch.equal(a, b) for a, b in zip(snapshot, dst[:KV_BUFFERS])), "written after release()"
        _until(lambda: tx._stager.ring.in_use == 0)
        if rx._lander.ring is not None:  # device pools: every receive-ring slot's copy completed
            rx._lander.reclaim()
            assert rx._lander.ring.in_use == 0
    finally:
        tx.close()
        rx.close()


def goodput(busy: bool, nbytes: int = 512 << 20) -> dict:
    """GPU → GPU over loopback: one request of `nbytes` K/V (page size 1, fragmented pages), with or without
    bf16 matmuls running on another stream meanwhile (copy/compute overlap)."""
    pages = nbytes // (KV_BUFFERS * TOKEN)
    p = Pair("cuda", "cuda", 1, pages)
    stop, done_gemms = threading.Event(), [0]

    def gemms():
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        with torch.cuda.stream(torch.cuda.Stream()):
            while not stop.is_set():
                for _ in range(8):
                    a = (a @ a).clamp_(-1, 1)
                torch.cuda.current_stream().synchronize()
                done_gemms[0] += 8

    worker = threading.Thread(target=gemms, daemon=True)
    try:
        if busy:
            worker.start()
            time.sleep(0.5)
        ids = np.random.default_rng(0).permutation(pages)
        tid = next(IDS)
        p.rx.expect(tid, batch(ids))
        t0 = time.perf_counter()
        p.tx.send(tid, p.rx.address, batch(ids), last=True)
        status = p.rx.wait(tid, 120)
        dt = time.perf_counter() - t0
        assert status.state is S.DONE, status
        return {"busy_matmul": busy, "bytes": pages * KV_BUFFERS * TOKEN, "seconds": dt,
                "gbit_s": pages * KV_BUFFERS * TOKEN * 8 / dt / 1e9, "gemms": done_gemms[0]}
    finally:
        stop.set()
        if busy:
            worker.join(10)
        p.close()


@needs_cuda
def test_goodput_with_and_without_a_busy_stream():
    results = [goodput(False), goodput(True)]
    print(json.dumps(results))
    assert all(r["gbit_s"] > 0 for r in results)


def _until(cond, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.01)


def main() -> int:
    """Run every check without pytest; print one line each, and the goodput figures."""
    if not torch.cuda.is_available():
        print("SKIP: needs a CUDA GPU")
        return 0
    out, failed = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "checks": {}}, 0
    checks = [("round_trips", test_round_trips_are_byte_exact), ("corrupt_chunk", test_corrupt_chunk_is_caught),
              ("abort_recycles", test_abort_recycles_buffers_and_nothing_lands_after_release)]
    for name, fn in checks:
        t0 = time.perf_counter()
        try:
            fn()
            out["checks"][name] = f"ok ({time.perf_counter() - t0:.1f} s)"
        except Exception as e:  # noqa: BLE001 - reported, the other checks still run
            failed += 1
            out["checks"][name] = f"FAILED: {type(e).__name__}: {e}"
        print(name, out["checks"][name], flush=True)
    out["goodput"] = [goodput(False), goodput(True)]
    print(json.dumps(out, indent=1))
    if "--json" in sys.argv:
        with open(sys.argv[sys.argv.index("--json") + 1], "w") as f:
            json.dump(out, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
