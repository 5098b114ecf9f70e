"""Tiny, scattered chunks cannot cost a receiver quadratic CPU: on an item stream (the staged path) a
chunk shorter than min(4 KiB, one item) must end an item, and no stream holds more than `max_ranges`
separate received ranges (each one costs every later out-of-order chunk a list insert). Real sockets: a
hand-driven opener against a ZmqReceiver in this process."""

import numpy as np
import pytest

from prfaas_sgl.transfer.coverage import Coverage
from prfaas_sgl.transfer.items import ItemBatch, Items
from prfaas_sgl.transfer.layout import kv_layout
from prfaas_sgl.transfer.messages import Ack, Codec, Done, Failed, Open, OpenAck
from prfaas_sgl.transfer.receiver import ZmqReceiver
from prfaas_sgl.transfer.recv_checks import max_ranges
from prfaas_sgl.transfer.states import TransferState as S

from .receiver_peers import CFG, IDS, LAYOUT, PAGE, RawPeer, payload

TINY = kv_layout(1, 64, 16384, state_bytes=[], num_slots=0, aux_bytes=64, num_aux=1)  # 64 B pages


@pytest.fixture
def local_rx():
    made = []

    def make(layout):
        made.append(ZmqReceiver(layout, [np.zeros(b.nbytes, np.uint8) for b in layout.buffers], CFG))
        return made[-1]

    yield make
    for rx in made:
        rx.close()


def opened(rx, tid, dest, layout=LAYOUT) -> RawPeer:
    rx.expect(tid, dest)
    peer = RawPeer(rx)
    peer.sock.send(Codec().encode(Open(transfer_id=tid, layout=layout)))
    assert isinstance(peer.replies(1)[0], OpenAck)
    return peer


def test_a_tiny_chunk_inside_an_item_is_refused_by_name(local_rx):
    """Before, 10 bytes in the middle of a 4 KiB page were written and acknowledged."""
    rx = local_rx(LAYOUT)
    tid = next(IDS)
    peer = opened(rx, tid, ItemBatch((Items((0,), np.arange(4)),)))
    try:
        peer.chunk(tid, 0, 100, payload(1, 10))
        (reply,) = peer.replies(1)
        assert isinstance(reply, Failed)
        assert reply.reason == ("chunk 0 bytes [100, 110) of buffer 0: 10 B is shorter than a chunk may be "
                                "unless it ends an item (minimum 4096 B)")
        assert rx.wait(tid, 5).state is S.FAILED
    finally:
        peer.stop()


def test_short_chunks_that_end_an_item_and_whole_items_land(local_rx):
    """What a sender cuts: whole items (a 1000 B state slot is below 4 KiB and still whole), and the
    last piece of an item larger than a chunk, which ends the item."""
    rx = local_rx(LAYOUT)
    tid = next(IDS)
    peer = opened(rx, tid, ItemBatch((Items((0,), np.arange(2)), Items((4,), np.array([1])))))
    try:
        peer.chunk(tid, 0, 0, payload(2, PAGE))  # item 0 of buffer 0
        peer.chunk(tid, 1, 2 * PAGE - 96, payload(3, 96))  # the last 96 B of item 1
        peer.chunk(tid, 2, 0, payload(4, 1000), buffer_id=4)  # the state slot, whole
        assert [type(m) for m in peer.replies(3)] == [Ack, Ack, Ack]
        assert rx.poll(tid).state is S.TRANSFERRING
    finally:
        peer.stop()


def test_chunks_cut_anywhere_in_the_item_stream_land_in_their_items(local_rx):
    """The wire does not say where a sender cut its stream: chunks that split items (a head piece, whole
    items, a tail piece: items.spans) land byte k of the stream on byte k of the destination items.

        stream of buffer 0:  |p9     |p8     |p7     |p6     |p5     |     (4 KiB items)
        chunks:              [0, 6K)   [6K, 14K)       [14K, 20K)
    """
    rx = local_rx(LAYOUT)
    tid, pages = next(IDS), [9, 8, 7, 6, 5]
    stream = payload(7, len(pages) * PAGE)
    peer = opened(rx, tid, ItemBatch((Items((0,), np.array(pages)),)))
    try:
        cuts = [0, 6144, 14336, len(stream)]
        for seq, (a, z) in enumerate(zip(cuts, cuts[1:])):
            peer.chunk(tid, seq, a, stream[a:z])
        peer.close_transfer(tid, 3, len(stream))
        assert [type(m) for m in peer.replies(4)] == [Ack, Ack, Ack, Done]
    finally:
        peer.stop()
    got = rx._buffers[0].reshape(-1, PAGE)[pages]
    assert got.tobytes() == stream


def test_scattered_ranges_beyond_the_cap_fail_the_transfer(local_rx):
    """4096 one-byte chunks two pages apart (each the last byte of a 64 B item, so not too short) leave
    4096 separate ranges; the next one is refused. Before, every one was written, each insert costing
    O(ranges so far)."""
    rx = local_rx(TINY)
    tid, cap = next(IDS), max_ranges(CFG)
    assert cap == 4096
    peer = opened(rx, tid, ItemBatch((Items((0,), np.arange(2 * cap + 2)),)), layout=TINY)
    try:
        for seq in range(cap + 1):
            peer.chunk(tid, seq, (2 * seq + 1) * 64 - 1, b"\x01")
        replies = peer.replies(cap + 1, timeout=30)
        assert all(isinstance(m, Ack) for m in replies[:cap])
        assert isinstance(replies[cap], Failed)
        assert replies[cap].reason == (f"chunk {cap} bytes [{(2 * cap + 1) * 64 - 1}, {(2 * cap + 1) * 64}) of "
                                       f"buffer 0 would leave more than {cap} separate ranges received: "
                                       "chunks far out of order")
    finally:
        peer.stop()


def test_a_chunk_that_joins_a_range_is_taken_at_the_cap():
    cov = Coverage()
    for i in range(4):
        cov.add(10 * i, 10 * i + 5)
    assert len(cov) == 4
    assert not cov.isolated(5, 7) and not cov.isolated(8, 10) and cov.isolated(6, 8)

