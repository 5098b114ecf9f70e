"""The prfaas_zmq backend on the staged path: SGLang's calls on a real PrefillManager and
DecodeManager (built without SGLang's constructor, as in backend_stubs.py) over real
ZmqSender/ZmqReceiver threads and SGLang-shaped host pools: K/V pages, a MAMBA state component, aux."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("sglang", reason="the backend subclasses SGLang's KV manager")

from sglang.srt.disaggregation.base.conn import KVPoll  # noqa: E402

from prfaas_sgl.srt.backend import control  # noqa: E402
from prfaas_sgl.srt.backend.memory import KVMemory, transfer_id  # noqa: E402
from prfaas_sgl.transfer.config import TransferConfig  # noqa: E402
from prfaas_sgl.transfer.receiver import ZmqReceiver  # noqa: E402
from prfaas_sgl.transfer.sender import ZmqSender  # noqa: E402
from prfaas_sgl.transfer.states import TransferState as S  # noqa: E402

from .backend_stubs import _common, make_decode, make_prefill  # noqa: E402

CFG = TransferConfig(connections=2, chunk_bytes=65536, window_bytes=1 << 20, timeout_s=10, stage_slots=8)
PAGE, PAGES, STATES, SLOTS = 2048, 300, (5000, 70000), 3  # the second state item is > one chunk
ROOM = 4242
DECODE_IP = "127.0.0.1"  # the Register must come from the address it names


def sglang_pools(seed: int | None):
    rng = np.random.default_rng(seed)
    sizes = [PAGE * PAGES] * 4 + [s * SLOTS for s in STATES] + [64 * 8]
    arrays = [rng.integers(0, 256, n, dtype=np.uint8) if seed is not None else np.zeros(n, np.uint8) for n in sizes]
    ptrs = [a.ctypes.data for a in arrays]
    args = SimpleNamespace(kv_data_ptrs=ptrs[:4], kv_data_lens=sizes[:4], kv_item_lens=[PAGE] * 4,
                           state_data_ptrs=[ptrs[4:6]], state_data_lens=[sizes[4:6]], state_item_lens=[list(STATES)],
                           state_types=["mamba"], aux_data_ptrs=ptrs[6:], aux_data_lens=sizes[6:],
                           aux_item_lens=[64], page_size=1, engine_rank=0)
    return args, arrays


@pytest.fixture()
def pd():
    src_args, src = sglang_pools(7)
    dst_args, dst = sglang_pools(None)
    p = make_prefill()
    p.kv_args, p.memory, p.transfer_config = src_args, KVMemory.of(src_args), CFG
    p.sender = p.data_plane = ZmqSender(p.memory.layout, p.memory.buffers, CFG, devices=p.memory.devices,
                                        on_terminal=lambda _tid: p._wake.set())
    d = make_decode(None)
    _common(d, None)
    d.kv_args, d.memory, d.transfer_config = dst_args, KVMemory.of(dst_args), CFG
    d.receiver = d.data_plane = ZmqReceiver(d.memory.layout, d.memory.buffers, CFG, devices=d.memory.devices)
    d.expected, d.peer_rejections, d.waiting_timeout, d.local_ip = {}, {}, 30.0, DECODE_IP
    reg = control.Register(endpoint=DECODE_IP, dst_port=5555, data_host=DECODE_IP,
                           data_port=d.receiver.address.port, server_key=None, layout=d.memory.layout,
                           page_size=1, attn_tp_size=1, tp_rank=0)
    p._on_control(control.encode(reg), DECODE_IP)
    yield SimpleNamespace(p=p, d=d, src=src, dst=dst)
    p.sender.close()
    d.receiver.close()


def open_room(pd, npages: int) -> None:
    meta = control.Metadata(room=ROOM, endpoint=DECODE_IP, dst_port=5555, npages=npages, aux_index=3,
                            state_indices=[[2]], decode_prefix_len=0, required_dst_info_num=1, is_dummy=False)
    pd.p.request_status[ROOM] = KVPoll.Bootstrapping
    pd.p._on_control(control.encode(meta), DECODE_IP)
    assert pd.p.request_status[ROOM] == KVPoll.WaitingForInput


def test_chunks_states_and_aux_land_and_both_sides_agree(pd):
    rng = np.random.default_rng(1)
    src_pages, dst_pages = rng.permutation(PAGES)[:200], rng.permutation(PAGES)[:200]
    open_room(pd, len(dst_pages))
    pd.d.request_status[ROOM] = KVPoll.WaitingForInput
    assert pd.d.expect(ROOM, dst_pages.astype(np.int32), 3, [np.array([2])]) is None
    pd.p.add_transfer_request(ROOM, src_pages[:120].astype(np.int32), slice(0, 120), False)
    pd.p.add_transfer_request(ROOM, src_pages[120:].astype(np.int32), slice(120, 200), True, aux_index=5,
                              state_indices=[np.array([1])])
    tid = transfer_id(ROOM, DECODE_IP, 5555)
    assert pd.d.receiver.wait(tid, 10).state is S.DONE
    assert pd.p.sender.wait(tid, 5).state is S.DONE
    pd.p._watch_step()
    assert pd.p.request_status[ROOM] == KVPoll.Success
    pd.d.update_status(ROOM, KVPoll.Success)
    assert pd.d.check_status(ROOM) == KVPoll.Success
    for b in range(4):
        assert np.array_equal(pd.dst[b].reshape(PAGES, PAGE)[dst_pages], pd.src[b].reshape(PAGES, PAGE)[src_pages])
    for b, item in zip((4, 5), STATES):
        assert np.array_equal(pd.dst[b].reshape(SLOTS, item)[2], pd.src[b].reshape(SLOTS, item)[1])
    assert np.array_equal(pd.dst[6].reshape(8, 64)[3], pd.src[6].reshape(8, 64)[5])


class _HeldEvent:
    """A stand-in for SGLang's `indices_event`: the page ids are not readable until it is set."""

    def __init__(self):
        self.released = threading.Event()

    def synchronize(self):
        assert self.released.wait(10)


def test_scheduler_thread_never_waits_for_page_ids(pd):
    """add_transfer_request returns before the pinned page-id copy completed (indices_event): the
    stager waits for it, the scheduler thread does not."""
    open_room(pd, 16)
    pd.d.request_status[ROOM] = KVPoll.WaitingForInput
    assert pd.d.expect(ROOM, np.arange(16), 3, [np.array([2])]) is None
    held = _HeldEvent()
    t0 = time.perf_counter()
    pd.p.add_transfer_request(ROOM, np.arange(100, 116), slice(0, 16), True, aux_index=5,
                              state_indices=[np.array([1])], indices_event=held)
    returned_s = time.perf_counter() - t0
    tid = transfer_id(ROOM, DECODE_IP, 5555)
    time.sleep(0.3)
    assert pd.d.receiver._book.transfers[tid].nbytes == 0  # nothing moved while the ids were held
    held.released.set()
    assert pd.d.receiver.wait(tid, 10).state is S.DONE
    assert returned_s < 1.0


def test_watch_thread_concludes_on_the_signal(pd):
    """The sender's on_terminal wakes the watch thread: Success follows DONE without a polling period."""
    open_room(pd, 8)
    pd.d.request_status[ROOM] = KVPoll.WaitingForInput
    assert pd.d.expect(ROOM, np.arange(8), 3, [np.array([2])]) is None
    watch = threading.Thread(target=pd.p._watch_loop, daemon=True)
    watch.start()
    try:
        pd.p.add_transfer_request(ROOM, np.arange(8), slice(0, 8), True, aux_index=5, state_indices=[np.array([1])])
        end = time.monotonic() + 10
        while pd.p.request_status[ROOM] != KVPoll.Success:
            assert time.monotonic() < end
            time.sleep(0.005)
        assert ROOM not in pd.p._open
    finally:
        pd.p._stopped = True
        pd.p._wake.set()
        watch.join(5)


def test_two_prefill_ranks_feed_one_decode_rank():
    """Prefill TP 2 → decode TP 1 (dense K/V, 2 heads): one transfer per source rank (their ids differ:
    they used to collide), each rank's head lands in its slice of the decode's pages."""
    heads, head_bytes, pages = 2, 256, 40
    glob = np.random.default_rng(3).integers(0, 256, (2, pages, heads, head_bytes), dtype=np.uint8)  # K, V

    def args(arrays, tp):
        ptrs = [a.ctypes.data for a in arrays]
        n = arrays[0].nbytes
        return SimpleNamespace(kv_data_ptrs=ptrs[:2], kv_data_lens=[n, n], kv_item_lens=[n // pages] * 2,
                               aux_data_ptrs=ptrs[2:], aux_data_lens=[512], aux_item_lens=[64], page_size=1,
                               engine_rank=0, total_kv_head_num=heads)

    dst = [np.zeros(pages * heads * head_bytes, np.uint8) for _ in range(2)] + [np.zeros(512, np.uint8)]
    d = make_decode(None)
    d.kv_args = args(dst, 1)
    d.memory, d.transfer_config = KVMemory.of(d.kv_args), CFG
    d.receiver = d.data_plane = ZmqReceiver(d.memory.layout, d.memory.buffers, CFG)
    d.expected, d.peer_rejections, d.waiting_timeout, d.local_ip, d.attn_tp_size = {}, {}, 30.0, DECODE_IP, 1
    prefills, srcs = [], []
    try:
        for rank in range(2):
            src = [np.ascontiguousarray(glob[i][:, rank]).reshape(-1) for i in range(2)]
            src.append(np.full(512, rank + 1, np.uint8))  # aux rows: 1 on rank 0, 2 on rank 1
            srcs.append(src)
            p = make_prefill()
            p.kv_args, p.attn_tp_size, p.attn_tp_rank, p.is_mla_backend = args(src, 2), 2, rank, False
            p.memory, p.transfer_config = KVMemory.of(p.kv_args), CFG
            p.sender = p.data_plane = ZmqSender(p.memory.layout, p.memory.buffers, CFG)
            reg = control.Register(endpoint=DECODE_IP, dst_port=5555, data_host=DECODE_IP,
                                   data_port=d.receiver.address.port, server_key=None, layout=d.memory.layout,
                                   page_size=1, attn_tp_size=1, tp_rank=0)
            p._on_control(control.encode(reg), DECODE_IP)
            assert not p.rejections
            prefills.append(p)
        dst_pages, src_pages = np.arange(30, 10, -1), np.arange(20)
        assert d.expect(ROOM, dst_pages, 3, None, src_tp=2, srcs=[0, 1]) is None
        assert len(set(d.expected[ROOM])) == 2
        for p in prefills:
            meta = control.Metadata(room=ROOM, endpoint=DECODE_IP, dst_port=5555, npages=20, aux_index=3,
                                    state_indices=[], decode_prefix_len=0, required_dst_info_num=1, is_dummy=False)
            p.request_status[ROOM] = KVPoll.Bootstrapping
            p._on_control(control.encode(meta), DECODE_IP)
            p.add_transfer_request(ROOM, src_pages, slice(0, 20), True, aux_index=1)
        for tid in d.expected[ROOM]:
            assert d.receiver.wait(tid, 10).state is S.DONE
        got = dst[0].reshape(pages, heads, head_bytes)[dst_pages]
        assert np.array_equal(got, glob[0][src_pages])
        assert (dst[2].reshape(8, 64)[3] == 1).all()  # the aux row came from the first source (rank 0) only
    finally:
        for p in prefills:
            p.sender.close()
        d.receiver.close()
