"""The fake transport keeps the real one's interface, states and failure reasons."""

import numpy as np

from prfaas_sgl.transfer.states import TransferState as S
from tests.support.fake_transport import FakeTransport
from tests.support.transport import batch, fill_random, read_items, small_layout

LAYOUT = small_layout()


def pair(timeout_s=5.0):
    net = FakeTransport(timeout_s=timeout_s)
    src = fill_random(LAYOUT, seed=7)
    dst = [np.zeros(b.nbytes, np.uint8) for b in LAYOUT.buffers]
    return net, net.sender(LAYOUT, src), net.receiver(LAYOUT, dst), src, dst


def test_fake_moves_pages_and_tail_in_stream_order():
    net, tx, rx, src, dst = pair()
    rx.expect(1, batch(LAYOUT, [9, 8, 7], slot=1, aux=2))
    assert rx.poll(1).state is S.WAITING
    tx.send(1, rx.address, batch(LAYOUT, [0, 1]))
    assert tx.poll(1).state is S.TRANSFERRING
    tx.send(1, rx.address, batch(LAYOUT, [5], slot=0, aux=0), last=True)
    assert (tx.poll(1).state, rx.poll(1).state) == (S.DONE, S.DONE)
    tail_dst, tail_src = batch(LAYOUT, slot=1, aux=2), batch(LAYOUT, slot=0, aux=0)
    assert read_items(dst, LAYOUT, tail_dst) == read_items(src, LAYOUT, tail_src)
    # per-buffer stream order: src pages 0, 1 (piece 1) then 5 (piece 2) land on dst pages 9, 8, 7
    for b in LAYOUT.ids_of("kv"):
        assert np.array_equal(dst[b].reshape(64, -1)[[9, 8, 7]], src[b].reshape(64, -1)[[0, 1, 5]])


def test_fake_faults_timeouts_and_mismatches():
    net, tx, rx, _, _ = pair(timeout_s=0.05)
    rx.expect(1, batch(LAYOUT, [1]))
    net.fail(1, "link down")
    tx.send(1, rx.address, batch(LAYOUT, [1]), last=True)
    assert (tx.poll(1).reason, rx.poll(1).reason) == ("link down", "link down")
    rx.expect(2, batch(LAYOUT, [1, 2]))
    tx.send(2, rx.address, batch(LAYOUT, [1]), last=True)
    assert rx.poll(2).reason.startswith("buffer 0 stream length mismatch: sender sends 4096 B")
    rx.expect(3, batch(LAYOUT, [1]))
    net.hold(3)
    tx.send(3, rx.address, batch(LAYOUT, [1]), last=True)
    rx.abort(3, "decode preempted")
    assert rx.poll(3).state is S.ABORTED
    assert tx.wait(3, 1.0).state is S.TIMED_OUT
    tx.send(4, rx.address, batch(LAYOUT, [1]), last=True)
    assert tx.poll(4).reason == "receiver does not expect transfer 4"
