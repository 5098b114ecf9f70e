"""The staged path on host tensors, real sockets over 127.0.0.1: ItemBatch sends gathered into
ring slots, one frame per slot, landed with index_copy_. The GPU twins are in tests/gpu/."""
import itertools
import time

import numpy as np
import pytest

from prfaas_sgl.transfer import faults as F
from prfaas_sgl.transfer.config import TransferConfig
from prfaas_sgl.transfer.items import HeadSlice, ItemBatch, Items, spans
from prfaas_sgl.transfer.layout import BufferSpec, MemoryLayout
from prfaas_sgl.transfer.receiver import ZmqReceiver
from prfaas_sgl.transfer.sender import ZmqSender
from prfaas_sgl.transfer.states import TransferState as S

CHUNK = 16384
CFG = TransferConfig(connections=2, chunk_bytes=CHUNK, window_bytes=8 * CHUNK, timeout_s=10, stage_slots=4)
IDS = itertools.count(1)
PAGE = 1024  # 1 token × 2 heads × 256 B; page_size 64 → 64 KiB items (bigger than a chunk)
STATE = 40000  # state item larger than two chunks


def layout(page: int = PAGE, pages: int = 256) -> MemoryLayout:
    kv = [BufferSpec("kv", page, pages) for _ in range(4)]
    return MemoryLayout(tuple(kv + [BufferSpec("state", STATE, 4), BufferSpec("state", 3000, 4),
                                    BufferSpec("aux", 64, 8)]))


def pools(lay: MemoryLayout, seed: int | None) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, b.nbytes, dtype=np.uint8) if seed is not None else np.zeros(b.nbytes, np.uint8)
            for b in lay.buffers]


def batch(pages, slot=None, aux=None, head=None) -> ItemBatch:
    groups = [Items((0, 1, 2, 3), np.asarray(pages), head)]
    if slot is not None:
        groups.append(Items((4, 5), np.array([slot])))
    if aux is not None:
        groups.append(Items((6,), np.array([aux])))
    return ItemBatch(tuple(groups))


def items_of(buf: np.ndarray, item: int, ids) -> np.ndarray:
    return buf.reshape(-1, item)[np.asarray(ids)]


@pytest.fixture()
def pair():
    made = []

    def make(lay=None, faults=(), cfg=CFG):
        lay = lay or layout()
        src, dst = pools(lay, 1), pools(lay, None)
        rx = ZmqReceiver(lay, dst, cfg)
        tx = ZmqSender(lay, src, cfg, faults=faults)
        made.extend([tx, rx])
        return lay, src, dst, tx, rx

    yield make
    for side in made:
        side.close()


@pytest.mark.parametrize("page", [PAGE, 64 * PAGE])
def test_permuted_pages_states_and_aux_land_byte_exact(pair, page):
    lay, src, dst, tx, rx = pair(layout(page, 64 if page > PAGE else 256))
    n = lay.buffers[0].num_items
    rng = np.random.default_rng(page)
    src_pages, dst_pages = rng.permutation(n)[:40], rng.permutation(n)[:40]
    tid = next(IDS)
    rx.expect(tid, batch(dst_pages, slot=3, aux=7))
    tx.send(tid, rx.address, batch(src_pages[:25]))  # chunked prefill: pieces in request order
    tx.send(tid, rx.address, batch(src_pages[25:], slot=1, aux=2), last=True)
    assert rx.wait(tid, 10).state is S.DONE and tx.wait(tid, 5).state is S.DONE
    for b in range(4):
        assert np.array_equal(items_of(dst[b], page, dst_pages), items_of(src[b], page, src_pages))
    assert np.array_equal(items_of(dst[4], STATE, [3]), items_of(src[4], STATE, [1]))
    assert np.array_equal(items_of(dst[6], 64, [7]), items_of(src[6], 64, [2]))
    untouched = np.setdiff1d(np.arange(n), dst_pages)
    assert not items_of(dst[0], page, untouched).any()


def test_one_frame_per_staged_slot(pair):
    """Fragmented pages still leave as whole chunk-sized frames: 4 buffers × 160 KiB = 40 chunks of 16 KiB."""
    lay, src, dst, tx, rx = pair()
    pages = np.random.default_rng(0).permutation(256)[:160]
    tid = next(IDS)
    rx.expect(tid, batch(pages))
    tx.send(tid, rx.address, batch(pages), last=True)
    assert rx.wait(tid, 10).state is S.DONE
    assert tx._book.transfers[tid].next_seq == 4 * 160 * PAGE // CHUNK


def test_head_slices_land_in_their_heads(pair):
    """Prefill with 4 KV heads feeds a decode holding 2 of them: heads [2, 4) of each source page go to
    heads [0, 2) of the decode's page (SGLang's compute_head_slice_params, decode TP larger)."""
    src_lay = MemoryLayout(tuple(BufferSpec("kv", 4 * 256, 32) for _ in range(4)))
    dst_lay = MemoryLayout(tuple(BufferSpec("kv", 2 * 256, 32) for _ in range(4)))
    src, dst = pools(src_lay, 3), pools(dst_lay, None)
    rx, tx = ZmqReceiver(dst_lay, dst, CFG), ZmqSender(src_lay, src, CFG)
    try:
        tid, sp, dp = next(IDS), [5, 1, 9], [0, 30, 2]
        rx.expect(tid, ItemBatch((Items((0, 1, 2, 3), np.array(dp), HeadSlice(1, 2, 256, 0, 2)),)))
        tx.send(tid, rx.address, ItemBatch((Items((0, 1, 2, 3), np.array(sp), HeadSlice(1, 4, 256, 2, 2)),)),
                last=True)
        assert rx.wait(tid, 10).state is S.DONE
        for b in range(4):
            want = src[b].reshape(32, 4, 256)[sp][:, 2:4]
            assert np.array_equal(dst[b].reshape(32, 2, 256)[dp], want)
    finally:
        tx.close()
        rx.close()


def test_corrupt_staged_chunk_is_caught(pair):
    lay, src, dst, tx, rx = pair(faults=(F.CorruptChunk(3),))
    tid = next(IDS)
    rx.expect(tid, batch(range(64)))
    tx.send(tid, rx.address, batch(range(64)), last=True)
    status = rx.wait(tid, 10)
    assert status.state is S.FAILED and "checksum mismatch in chunk 3" in status.reason
    assert tx.wait(tid, 5).state is S.FAILED


def test_failed_transfer_returns_every_ring_slot(pair):
    """A transfer that fails with chunks still staged (no Open answered: nobody expects it) gives all its
    slots back, and the next transfer still goes through the small ring."""
    lay, src, dst, tx, rx = pair()
    tid = next(IDS)
    tx.send(tid, rx.address, batch(range(200)), last=True)  # 50 chunks through a 4-slot ring
    assert tx.wait(tid, 10).state is S.FAILED
    _until(lambda: tx._stager.ring.in_use == 0)
    tid = next(IDS)
    rx.expect(tid, batch(range(200)))
    tx.send(tid, rx.address, batch(range(200)), last=True)
    assert rx.wait(tid, 10).state is S.DONE
    _until(lambda: tx._stager.ring.in_use == 0)


def test_release_mid_transfer_recycles_slots():
    """Released while chunks are staged, queued in ZeroMQ and in flight (a slow receiver): every slot
    comes back, and only once libzmq let go of its frame."""
    lay = layout()
    src, dst = pools(lay, 1), pools(lay, None)
    rx = ZmqReceiver(lay, dst, CFG, faults=(F.SlowReceiver(0.02),))
    tx = ZmqSender(lay, src, CFG)
    try:
        tid = next(IDS)
        rx.expect(tid, batch(range(200)))
        tx.send(tid, rx.address, batch(range(200)))  # not closed: the transfer stays open
        _until(lambda: tx._stager is not None and tx._stager.ring.in_use == CFG.stage_slots)  # ring full
        tx.release(tid)
        _until(lambda: tx._stager.ring.in_use == 0)
    finally:
        tx.close()
        rx.close()


def test_bad_item_id_fails_the_transfer_not_the_caller(pair):
    lay, src, dst, tx, rx = pair()
    tid = next(IDS)
    rx.expect(tid, batch([1]))
    tx.send(tid, rx.address, batch([10_000]), last=True)  # returns at once: ids are read off-thread
    status = tx.wait(tid, 10)
    assert status.state is S.FAILED and "outside buffer 0" in status.reason


def test_bad_ids_fail_only_their_transfer(pair):
    """Plans of a bad send and a good one staged in the same batch: only the bad transfer fails."""
    lay, src, dst, tx, rx = pair()
    bad, good = next(IDS), next(IDS)
    rx.expect(good, batch([4, 5]))
    tx.send(bad, rx.address, batch([1, 99_999]), last=True)
    tx.send(good, rx.address, batch([6, 7]), last=True)
    assert rx.wait(good, 10).state is S.DONE
    assert tx.wait(bad, 10).state is S.FAILED


def test_a_dead_stager_fails_its_transfers_at_once_and_says_why(pair, monkeypatch):
    """The stager thread's own machinery raises (not one batch): every staged send fails now with the
    cause, later sends too, and `worker_fatal` names it for the health check. Before, the thread died
    silently and each transfer waited out its timeout."""
    from prfaas_sgl.transfer import staging

    def broken(self):
        raise RuntimeError("ring bookkeeping broke")

    monkeypatch.setattr(staging.Stager, "_reclaim", broken)
    lay, src, dst, tx, rx = pair()
    for tid in (next(IDS), next(IDS)):
        rx.expect(tid, batch([1, 2]))
        t0 = time.monotonic()
        tx.send(tid, rx.address, batch([3, 4]), last=True)
        s = tx.wait(tid, 5)
        assert s.state is S.FAILED
        assert s.reason == f"transfer {tid}: stager thread died: RuntimeError: ring bookkeeping broke"
        assert time.monotonic() - t0 < CFG.timeout_s / 2
    assert tx.worker_fatal == "transfer-stage thread died: RuntimeError: ring bookkeeping broke"
    assert tx.fatal is None  # the socket loop itself is fine


@pytest.mark.parametrize("offset, length, s, want", [
    (0, 30, 10, (None, (0, 3), None)),
    (5, 20, 10, ((0, 5, 10), (1, 2), (2, 5))),
    (12, 3, 10, ((1, 2, 5), (2, 2), None)),
    (10, 5, 10, (None, (1, 1), (1, 5))),
])
def test_spans(offset, length, s, want):
    assert tuple(spans(offset, length, s).__getattribute__(f) for f in ("head", "whole", "tail")) == want


def _until(cond, timeout=5.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.01)
