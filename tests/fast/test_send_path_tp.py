"""Different attention TP on prefill and decode: SGLang's head-slice arithmetic restated in
`backend/tp.py`, checked against SGLang's own function, then real transfers between synthetic per-rank pools
cut from one global K/V tensor, so the truth is known: every decode rank must end up holding exactly its
heads of every page, each head crossing the wire once (replica dedupe)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from prfaas_sgl.srt.backend.tp import head_slice_params, layout_problem, pairing, sources
from prfaas_sgl.transfer.config import TransferConfig
from prfaas_sgl.transfer.items import ItemBatch, Items
from prfaas_sgl.transfer.layout import BufferSpec, MemoryLayout
from prfaas_sgl.transfer.receiver import ZmqReceiver
from prfaas_sgl.transfer.sender import ZmqSender
from prfaas_sgl.transfer.states import TransferState as S

TPS = (1, 2, 4, 8)


@pytest.mark.parametrize("total_heads", [1, 2, 4, 8, 16])
def test_head_slices_match_sglang(total_heads):
    staging = pytest.importorskip("sglang.srt.disaggregation.common.staging_buffer",
                                  reason="compares with SGLang's compute_head_slice_params")
    for src_tp, dst_tp in itertools.product(TPS, TPS):
        if src_tp == dst_tp:
            continue
        for src_rank, dst_rank in itertools.product(range(src_tp), range(dst_tp)):
            want = staging.compute_head_slice_params(src_attn_tp_size=src_tp, dst_attn_tp_size=dst_tp,
                                                     src_tp_rank=src_rank, dst_tp_rank=dst_rank,
                                                     total_kv_heads=total_heads)
            assert head_slice_params(src_tp, dst_tp, src_rank, dst_rank, total_heads) == want


def heads_of(rank: int, tp: int, total: int) -> list[int]:
    """Global KV heads a rank holds (SGLang: replicas hold head rank // replication)."""
    n = max(1, total // tp)
    unique = rank // max(1, tp // total)
    return [(unique * n + i) % total for i in range(n)]


PAGES, PAGE_SIZE, HEAD = 12, 2, 8  # bytes per head per token
CFG = TransferConfig(connections=1, chunk_bytes=4096, window_bytes=1 << 16, timeout_s=10, stage_slots=4)


def pool(global_kv: np.ndarray, heads: list[int]) -> np.ndarray:
    """A rank's K or V buffer: [pages, page_size, its heads, HEAD] cut from [pages, page_size, total, HEAD]."""
    return np.ascontiguousarray(global_kv[:, :, heads, :]).reshape(-1)


def run_room(src_tp: int, dst_tp: int, total: int, dst_rank: int) -> tuple[np.ndarray, np.ndarray, int]:
    rng = np.random.default_rng(src_tp * 100 + dst_tp * 10 + total)
    glob = [rng.integers(0, 256, (PAGES, PAGE_SIZE, total, HEAD), dtype=np.uint8) for _ in range(2)]  # K, V
    src_pages, dst_pages = rng.permutation(PAGES)[:7], rng.permutation(PAGES)[:7]

    def layout(tp):
        item = PAGE_SIZE * max(1, total // tp) * HEAD
        return MemoryLayout((BufferSpec("kv", item, PAGES), BufferSpec("kv", item, PAGES)))

    dst_heads = heads_of(dst_rank, dst_tp, total)
    dst = [np.zeros(PAGES * PAGE_SIZE * len(dst_heads) * HEAD, np.uint8) for _ in range(2)]
    rx = ZmqReceiver(layout(dst_tp), dst, CFG)
    sent_bytes, senders = 0, []
    assert layout_problem(layout(src_tp), layout(dst_tp), src_tp, dst_tp, total, PAGE_SIZE) is None
    try:
        for r in sources(src_tp, dst_tp, dst_rank):
            pair = pairing(src_tp, dst_tp, r, dst_rank, total, PAGE_SIZE, HEAD)
            if not pair.kv:
                continue
            rx.expect(r, ItemBatch((Items((0, 1), dst_pages, pair.dst),)))
            tx = ZmqSender(layout(src_tp), [pool(g, heads_of(r, src_tp, total)) for g in glob], CFG)
            senders.append(tx)
            tx.send(r, rx.address, ItemBatch((Items((0, 1), src_pages, pair.src),)), last=True)
            assert rx.wait(r, 10).state is S.DONE
            sent_bytes += tx.wait(r, 5).nbytes
    finally:
        for tx in senders:
            tx.close()
        rx.close()
    got = dst[0].reshape(PAGES, PAGE_SIZE, len(dst_heads), HEAD)[dst_pages]
    want = glob[0][src_pages][:, :, dst_heads, :]
    return got, want, sent_bytes


@pytest.mark.parametrize("src_tp, dst_tp, total", [
    (2, 1, 4),  # two prefill ranks feed one decode rank, each its half of the heads
    (1, 2, 4),  # one prefill rank feeds two decode ranks, each a slice of its heads
    (4, 1, 2),  # 2 heads on 4 prefill ranks: replicas; only ranks 0 and 2 send
    (8, 2, 2),  # 8 → 2 with 4 replicas per head: one source of each decode rank sends
    (2, 4, 1),  # one head, replicated on every decode rank: each decode rank gets its own copy
])
def test_every_decode_rank_holds_exactly_its_heads(src_tp, dst_tp, total):
    for dst_rank in range(dst_tp):
        got, want, sent = run_room(src_tp, dst_tp, total, dst_rank)
        assert np.array_equal(got, want)
        assert sent == 2 * want.nbytes  # K and V, each head once: no replica crossed the wire twice


def test_state_buffers_need_equal_tp():
    lay = MemoryLayout((BufferSpec("kv", 64, 4), BufferSpec("state", 100, 2)))
    half = MemoryLayout((BufferSpec("kv", 32, 4), BufferSpec("state", 50, 2)))
    assert "state buffers" in layout_problem(lay, half, 1, 2, 2, 1)
