"""Layer-group streaming over real sockets (127.0.0.1): a chunk's KV sent as one ItemBatch per layer group,
each held back until its `LayerGate` opens, all under one transfer id; the decode completes the transfer only
once every group and the tail (states, aux) arrived. Faults: a group never written fails the transfer within
the transfer timeout, naming the group; a release mid-stream gives every ring slot back; a transfer waiting on
a closed gate does not hold back the next transfer on its link."""

import time

import numpy as np
import pytest

import prfaas_sgl.transfer.faults as F
from prfaas_sgl.srt.backend.layer_groups import kv_buffer_layers, layer_groups
from prfaas_sgl.transfer.config import TransferConfig
from prfaas_sgl.transfer.gates import LayerGate, layer_batches
from prfaas_sgl.transfer.layout import kv_layout
from prfaas_sgl.transfer.receiver import ZmqReceiver
from prfaas_sgl.transfer.sender import ZmqSender
from prfaas_sgl.transfer.states import TransferState as S
from tests.support.transport import batch, fill_random, read_items, stream_bytes

PAGE = 4096
LAYOUT = kv_layout(4, PAGE, 32, state_bytes=[1000], num_slots=4, aux_bytes=64, num_aux=4)  # 8 K/V buffers
KV = tuple(LAYOUT.ids_of("kv"))
GROUPS = [g.buffer_ids for g in layer_groups(KV, kv_buffer_layers((), len(KV), is_mla=False), 2)]
CFG = TransferConfig(connections=2, chunk_bytes=PAGE, window_bytes=256 << 10, timeout_s=5.0, stage_slots=8)
SRC = fill_random(LAYOUT, seed=29)
SRC_PAGES, DST_PAGES = [3, 9, 1, 20], [5, 6, 7, 30]


class Pair:
    def __init__(self, cfg=CFG, faults=()):
        self.dst = [np.zeros(b.nbytes, np.uint8) for b in LAYOUT.buffers]
        self.rx = ZmqReceiver(LAYOUT, self.dst, cfg, faults=faults)
        self.tx = ZmqSender(LAYOUT, SRC, cfg)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.tx.close()
        self.rx.close()


def until(cond, timeout=5.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.005)
    return False


def gates(n, timeout_s=30.0):
    return [LayerGate(f"g{g}", timeout_s) for g in range(n)]


def send_layered(tx, rx, tid, pieces):
    for i, piece in enumerate(pieces):
        tx.send(tid, rx.address, piece, last=i == len(pieces) - 1)


def group_bytes(g: int) -> int:
    return len(GROUPS[g]) * len(SRC_PAGES) * PAGE


def landed(pair, g: int) -> bool:
    return landed_pages(pair, GROUPS[g]) == len(GROUPS[g]) * len(SRC_PAGES)


def landed_pages(pair, buffers=KV) -> int:
    """(buffer, page) pairs of the request already holding the source's bytes on the decode."""
    return sum(read_items(pair.dst, LAYOUT, batch_of(b, [d])) == read_items(SRC, LAYOUT, batch_of(b, [s]))
               for b in buffers for s, d in zip(SRC_PAGES, DST_PAGES))


def batch_of(buffer_id, pages):
    from prfaas_sgl.transfer.items import ItemBatch, Items
    return ItemBatch((Items((buffer_id,), np.array(pages)),))


def test_the_four_layers_form_two_groups_of_k_and_v_buffers():
    assert GROUPS == [(0, 1, 4, 5), (2, 3, 6, 7)]


def test_each_group_leaves_when_its_gate_opens_and_done_waits_for_the_tail():
    with Pair() as p:
        p.rx.expect(1, batch(LAYOUT, DST_PAGES, slot=2, aux=1))
        g, tail = gates(2), LayerGate("tail", 30.0)
        send_layered(p.tx, p.rx, 1, layer_batches(batch(LAYOUT, SRC_PAGES, slot=0, aux=3), GROUPS, g, tail))
        time.sleep(0.2)
        assert landed_pages(p) == 0  # nothing leaves before its group is written
        g[0].open()
        assert until(lambda: landed(p, 0))
        time.sleep(0.1)
        assert landed_pages(p, GROUPS[1]) == 0
        g[1].open()
        assert until(lambda: landed(p, 1))
        time.sleep(0.1)
        assert p.rx.poll(1).state is S.TRANSFERRING  # every K/V byte is there, the tail is not
        tail.open()
        assert p.rx.wait(1, 5).state is S.DONE
        assert p.tx.wait(1, 5).state is S.DONE
        assert (read_items(p.dst, LAYOUT, batch(LAYOUT, DST_PAGES, slot=2, aux=1))
                == read_items(SRC, LAYOUT, batch(LAYOUT, SRC_PAGES, slot=0, aux=3)))


def test_groups_queued_in_any_order_land_byte_exact():
    """The decode's expect() is unchanged: each buffer's stream is its own, so the tail first, then group 1,
    then group 0 (gates open from the start) lands the same bytes."""
    with Pair() as p:
        p.rx.expect(2, batch(LAYOUT, DST_PAGES, slot=2, aux=1))
        g = gates(2)
        for gate in g:
            gate.open()
        pieces = layer_batches(batch(LAYOUT, SRC_PAGES, slot=0, aux=3), GROUPS, g)
        send_layered(p.tx, p.rx, 2, pieces[::-1])
        assert p.rx.wait(2, 5).state is S.DONE
        assert (read_items(p.dst, LAYOUT, batch(LAYOUT, DST_PAGES, slot=2, aux=1))
                == read_items(SRC, LAYOUT, batch(LAYOUT, SRC_PAGES, slot=0, aux=3)))


def test_a_group_never_written_fails_the_transfer_within_the_timeout_naming_the_group():
    """Gate and transfer share the 1 s timeout; the gate, made before the sends, ends the transfer first,
    with the group's name (the transfer's own deadline moves with every ack of group 0)."""
    cfg = TransferConfig(connections=2, chunk_bytes=PAGE, window_bytes=256 << 10, timeout_s=1.0)
    with Pair(cfg) as p:
        p.rx.expect(3, batch(LAYOUT, DST_PAGES, slot=2, aux=1), timeout_s=30)
        t0 = time.monotonic()
        g = gates(2, timeout_s=1.0)
        send_layered(p.tx, p.rx, 3, layer_batches(batch(LAYOUT, SRC_PAGES, slot=0, aux=3), GROUPS, g))
        g[0].open()
        status = p.tx.wait(3, 5)
        elapsed = time.monotonic() - t0
        assert status.state is S.FAILED and "layer group g1" in status.reason, status
        assert elapsed < 1.0 + 0.25, elapsed
        assert status.nbytes == group_bytes(0)
        rx = p.rx.wait(3, 5)
        assert rx.state is S.ABORTED and "layer group g1" in rx.reason, rx


def test_a_release_mid_stream_returns_every_ring_slot_and_the_sender_goes_on():
    """Group 0 is half-way out over a slow receiver (ring full of staged slots, the window in flight) and
    group 1 parked when the prefill releases the transfer: every slot comes back, the parked plans are
    never staged, and the next transfer on the same sender completes."""
    cfg = TransferConfig(connections=1, chunk_bytes=PAGE, window_bytes=4 * PAGE, timeout_s=5.0, stage_slots=4)
    with Pair(cfg, faults=(F.SlowReceiver(0.02),)) as p:
        p.rx.expect(4, batch(LAYOUT, DST_PAGES, slot=2, aux=1))
        g = gates(2)
        g[0].open()
        send_layered(p.tx, p.rx, 4, layer_batches(batch(LAYOUT, SRC_PAGES, slot=0, aux=3), GROUPS, g))
        assert until(lambda: landed_pages(p) >= 2)
        ring = p.tx._stager.ring
        assert ring.in_use > 0 and landed_pages(p) < len(GROUPS[0]) * len(SRC_PAGES)  # really mid-stream
        p.tx.release(4)
        assert until(lambda: ring.in_use == 0, 3.0), ring.in_use
        g[1].open()  # a late hook on the released transfer stages nothing
        time.sleep(0.1)
        assert ring.in_use == 0
        p.rx.expect(5, batch(LAYOUT, [0], slot=1))
        p.tx.send(5, p.rx.address, batch(LAYOUT, [11], slot=3), last=True)
        assert p.tx.wait(5, 10).state is S.DONE
        assert read_items(p.dst, LAYOUT, batch(LAYOUT, [0], slot=1)) == read_items(SRC, LAYOUT, batch(LAYOUT, [11], slot=3))


def test_a_transfer_waiting_on_a_closed_gate_does_not_hold_back_the_next_on_its_link():
    """Request A's next group still computes (its gate closed); request B's last chunk, queued after it on
    the same link, goes at once. Before, the link served transfers strictly oldest first and stopped at A's
    unstaged chunk: B timed out behind it."""
    cfg = TransferConfig(connections=2, chunk_bytes=PAGE, window_bytes=256 << 10, timeout_s=1.0)
    with Pair(cfg) as p:
        p.rx.expect(6, batch(LAYOUT, DST_PAGES, slot=2, aux=1), timeout_s=30)
        p.rx.expect(7, batch(LAYOUT, [0, 1], slot=1))
        g = gates(2, timeout_s=10.0)
        send_layered(p.tx, p.rx, 6, layer_batches(batch(LAYOUT, SRC_PAGES, slot=0, aux=3), GROUPS, g))
        p.tx.send(7, p.rx.address, batch(LAYOUT, [11, 12], slot=3), last=True)
        status = p.tx.wait(7, 3)
        assert status.state is S.DONE, status
        assert p.tx.poll(6).state is S.TRANSFERRING and landed_pages(p) == 0
        for gate in g:
            gate.open()
        assert p.rx.wait(6, 5).state is S.DONE


def test_a_gate_opened_before_the_send_stages_at_once():
    with Pair() as p:
        p.rx.expect(8, batch(LAYOUT, DST_PAGES))
        gate = LayerGate("early", 30.0)
        gate.open()
        pieces = layer_batches(batch(LAYOUT, SRC_PAGES), [KV], [gate])
        assert len(pieces) == 1 and pieces[0].gate is gate
        send_layered(p.tx, p.rx, 8, pieces)
        assert p.rx.wait(8, 5).state is S.DONE
        assert len(p.tx._parking) == 0


def test_layer_batches_split_kv_items_and_keep_the_tail_whole():
    from prfaas_sgl.transfer.items import HeadSlice, ItemBatch, Items
    head = HeadSlice(1, 4, 1024, 2, 2)
    b = ItemBatch((Items(KV, np.array([1, 2]), head), Items((8,), np.array([0])), Items((9,), np.array([3]))))
    g = gates(2)
    pieces = layer_batches(b, GROUPS, g)
    assert [p.gate for p in pieces] == [g[0], g[1], None]
    assert [p.groups[0].buffer_ids for p in pieces[:2]] == GROUPS
    assert all(p.groups[0].head is head and p.groups[0].index is b.groups[0].index for p in pieces[:2])
    assert pieces[2].groups == b.groups[1:]
    assert sum(stream_bytes(LAYOUT, p) for p in pieces) == stream_bytes(LAYOUT, b)
    with pytest.raises(ValueError, match="mix layer-group"):
        layer_batches(ItemBatch((Items((0, 8), np.array([0])),)), GROUPS, g)
    with pytest.raises(ValueError, match="2 layer groups but 1 gates"):
        layer_batches(b, GROUPS, g[:1])


def test_a_gate_on_a_device_event_records_it_and_lists_it_for_the_gather():
    class Event:
        recorded = 0

        def record(self):
            self.recorded += 1

    ev = Event()
    gate = LayerGate("g0", 1.0, event=ev)
    (piece,) = layer_batches(batch(LAYOUT, [1]), [KV], [gate])
    assert piece.events == (ev,)
    calls = []
    gate.subscribe(lambda: calls.append(1))
    gate.subscribe(lambda: calls.append(2))
    gate.open()
    gate.open()  # once only: a second record would move what a queued gather waits for
    assert ev.recorded == 1 and calls == [1, 2]
    gate.subscribe(lambda: calls.append(3))  # already open: at once
    assert calls == [1, 2, 3]
