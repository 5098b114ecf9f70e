"""The staged path over every pool shape a server registers, on every device at hand: packed pools (SGLang's
own K/V and state buffers) and strided ones (the unified slab: rows `stride` bytes apart, K/V of all layers
and states interleaved), page sizes 1 and 64, and state slots cut into byte runs (a TP 1 prefill feeding
decode rank 1 of TP 2). Real ZmqSender/ZmqReceiver threads over 127.0.0.1.

On CPU (every CI run) the host pairs run; with CUDA the same cases also run GPU -> GPU, GPU -> host and
host -> GPU, so the GPU call only adds the CUDA branches (side-stream gather, pinned rings, H2D landing,
byte-run slicing on device). Imports no SGLang, so it runs on a GPU machine without it.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from prfaas_sgl.transfer.buffers import Strided
from prfaas_sgl.transfer.config import TransferConfig
from prfaas_sgl.transfer.items import ByteRuns, ItemBatch, Items
from prfaas_sgl.transfer.layout import BufferSpec, MemoryLayout
from prfaas_sgl.transfer.receiver import ZmqReceiver
from prfaas_sgl.transfer.sender import ZmqSender
from prfaas_sgl.transfer.states import TransferState as S

CFG = TransferConfig(connections=2, chunk_bytes=64 << 10, window_bytes=1 << 20, timeout_s=30, stage_slots=8)
IDS = itertools.count(1)
TOKEN = 512  # 2 KV heads x 128 dims of bf16 per token per K or V buffer
KV_BUFFERS = 4
PAD = 48  # slab rows carry other layers' bytes between one buffer's items
# A GDN conv state of 16 channels x 6 steps (q | k | v sub-blocks of 4, 4, 8 channels) and a temporal
# state larger than a chunk; decode rank 1 of TP 2 holds channels [2:4], [6:8], [12:16] of the conv state
# and the second half of the temporal rows.
CONV, TEMPORAL = 16 * 6, 96 << 10
CONV_RUNS = (ByteRuns(CONV, ((12, 12), (36, 12), (72, 24))), ByteRuns(48, ((0, 48),)))
TEMPORAL_RUNS = (ByteRuns(TEMPORAL, ((TEMPORAL // 2, TEMPORAL // 2),)), ByteRuns(TEMPORAL // 2, ((0, TEMPORAL // 2),)))
SLOTS = 6

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
PAIRS = list(itertools.product(DEVICES, DEVICES))


class Pool:
    """One side's buffers as torch uint8 tensors on `device`, registered as a server registers them:
    host packed -> the tensor's numpy view; device packed -> (address, nbytes); strided -> `Strided`."""

    def __init__(self, items: list[int], counts: list[int], device: str, strided: bool, seed: int | None):
        gen = torch.Generator().manual_seed(seed or 0)
        self.items, self.strides = items, [n + PAD if strided else n for n in items]
        self.tensors, self.buffers = [], []
        for n, stride, count in zip(items, self.strides, counts):
            nbytes = stride * count
            t = (torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen) if seed is not None
                 else torch.full((nbytes,), 7, dtype=torch.uint8)).to(device)
            self.tensors.append(t)
            self.buffers.append(Strided(t.data_ptr(), nbytes, stride) if strided
                                else t.numpy() if device == "cpu" else (t.data_ptr(), nbytes))
        self.devices = [device if device == "cpu" else "cuda:0"] * len(items)
        self.layout = MemoryLayout(tuple(BufferSpec("kv" if i < KV_BUFFERS else "state", n, c)
                                         for i, (n, c) in enumerate(zip(items, counts))))

    def rows(self, b: int) -> np.ndarray:
        """Buffer b as [count, stride] bytes on the host."""
        return self.tensors[b].cpu().numpy().reshape(-1, self.strides[b])


def run(src: Pool, dst: Pool, send: ItemBatch, expect: ItemBatch) -> None:
    rx = ZmqReceiver(dst.layout, dst.buffers, CFG, devices=dst.devices)
    tx = ZmqSender(src.layout, src.buffers, CFG, devices=src.devices)
    try:
        tid = next(IDS)
        rx.expect(tid, expect)
        tx.send(tid, rx.address, send, last=True)
        status = rx.wait(tid, 60)
        assert status.state is S.DONE, status
    finally:
        tx.close()
        rx.close()


@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize("strided", [False, True], ids=["packed", "strided"])
@pytest.mark.parametrize(("src_dev", "dst_dev"), PAIRS, ids=[f"{a}-{b}" for a, b in PAIRS])
def test_pages_and_a_state_slot_land_byte_exact(src_dev, dst_dev, strided, page_size):
    pages = 1024 if page_size == 1 else 48
    item = page_size * TOKEN
    items, counts = [item] * KV_BUFFERS + [TEMPORAL], [pages] * KV_BUFFERS + [SLOTS]
    src = Pool(items, counts, src_dev, strided, seed=page_size)
    dst = Pool(items, counts, dst_dev, not strided, seed=None)  # the peer is the other shape
    rng = np.random.default_rng(page_size)
    sp, dp = rng.permutation(pages)[: pages // 2], rng.permutation(pages)[: pages // 2]
    kv = tuple(range(KV_BUFFERS))
    run(src, dst, ItemBatch((Items(kv, sp), Items((KV_BUFFERS,), np.array([1])))),
        ItemBatch((Items(kv, dp), Items((KV_BUFFERS,), np.array([4])))))
    for b in range(KV_BUFFERS):
        got, want = dst.rows(b), src.rows(b)
        assert np.array_equal(got[dp, :item], want[sp, :item]), (b, src_dev, dst_dev)
        untouched = np.setdiff1d(np.arange(pages), dp)
        assert (got[untouched] == 7).all() and (got[:, item:] == 7).all()  # nothing outside the items
    assert np.array_equal(dst.rows(KV_BUFFERS)[4, :TEMPORAL], src.rows(KV_BUFFERS)[1, :TEMPORAL])


@pytest.mark.parametrize(("src_dev", "dst_dev"), PAIRS, ids=[f"{a}-{b}" for a, b in PAIRS])
def test_state_byte_runs_land_in_their_shard_on_strided_slabs(src_dev, dst_dev):
    """TP 1 -> decode rank 1 of TP 2: the q, k and v channel halves of a conv slot (three runs) and half the
    rows of a temporal slot (larger than a chunk) arrive as one shard; the slab bytes between rows and the
    other slots stay as they were."""
    src = Pool([CONV, TEMPORAL], [SLOTS, SLOTS], src_dev, strided=True, seed=9)
    dst = Pool([CONV_RUNS[1].item_len, TEMPORAL_RUNS[1].item_len], [SLOTS, SLOTS], dst_dev, strided=True, seed=None)
    src.layout = MemoryLayout(tuple(BufferSpec("state", n, SLOTS) for n in src.items))
    dst.layout = MemoryLayout(tuple(BufferSpec("state", n, SLOTS) for n in dst.items))
    pairs = [CONV_RUNS, TEMPORAL_RUNS]
    run(src, dst, ItemBatch(tuple(Items((b,), np.array([0]), p[0]) for b, p in enumerate(pairs))),
        ItemBatch(tuple(Items((b,), np.array([3]), p[1]) for b, p in enumerate(pairs))))
    for b, (s_runs, d_runs) in enumerate(pairs):
        rows, m = dst.rows(b), d_runs.item_len
        assert np.array_equal(rows[3, :m], src.rows(b)[0, :src.items[b]][s_runs.columns()]), (b, src_dev, dst_dev)
        assert (np.delete(rows, 3, axis=0) == 7).all() and (rows[3, m:] == 7).all()
    conv = src.rows(0)[0, :CONV].reshape(16, 6)
    assert np.array_equal(dst.rows(0)[3, :48].reshape(8, 6), conv[[2, 3, 6, 7, 12, 13, 14, 15]])  # q1 | k1 | v1
