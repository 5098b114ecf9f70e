"""Receiver hardening: no write after release(), an error fails one transfer,
no-progress deadlines plus an explicit cap, and oversized frames dropped before any data. Real sockets:
the decode receiver runs in its own process or, where the test must write into its memory, in this one.
Who may write (sessions, coverage) is in test_transfer_receiver_sessions.py."""

import socket
import time
from types import SimpleNamespace

import numpy as np
import xxhash
import zmq
from zmq.utils.monitor import recv_monitor_message

from prfaas_sgl.transfer import faults as F
from prfaas_sgl.transfer import receiver as R
from prfaas_sgl.transfer.landing import Lander
from prfaas_sgl.transfer.messages import Abort, Ack, Chunk, Failed, Open, OpenAck
from prfaas_sgl.transfer.sender import ZmqSender
from prfaas_sgl.transfer.states import TransferState as S
from tests.support import fake_transport as fake
from tests.support.fake_transport import FakeTransport
from tests.support.transport import batch, read_items, stream_bytes

from .receiver_peers import CFG, CODEC, IDS, LAYOUT, PAGE, SRC_SEED, RawPeer, assert_serving, buffer0, payload

__all__ = ["CFG", "LAYOUT", "SRC_SEED"]  # read by the rx and src fixtures (conftest.py)


# -- release() is a write barrier ------------------------------------------------------------------------
def test_release_guarantees_no_write_after_it_returns():
    """SGLang frees a room's pages right after forget() → release(); a chunk landed after that
    would corrupt whichever request gets the pages next. One connection sends 64 chunks; release() comes
    with 63 of them queued behind a slow receiver (20 ms each). A marker sent after them on the same
    connection is answered only once all of them were handled (in order), so no fixed sleep is needed."""
    bufs = [np.zeros(b.nbytes, np.uint8) for b in LAYOUT.buffers]
    rx = R.ZmqReceiver(LAYOUT, bufs, CFG, faults=(F.SlowReceiver(0.02),))
    peer = RawPeer(rx)
    tid, marker, pages = next(IDS), next(IDS), range(16)
    items = batch(LAYOUT, list(pages))  # 4 buffers × 16 pages, one chunk each
    try:
        rx.expect(tid, items)
        peer.open(tid)
        assert isinstance(peer.replies(1)[0], OpenAck)
        chunks = [(b, p) for b in range(4) for p in pages]
        peer.chunk(tid, 0, 0, payload(0), buffer_id=0)
        assert isinstance(peer.replies(1)[0], Ack)  # the transfer is under way
        for seq, (b, p) in enumerate(chunks[1:], start=1):
            peer.chunk(tid, seq, p * PAGE, payload(seq), buffer_id=b)
        rx.release(tid)
        for b in range(4):  # the pages now belong to another request
            bufs[b].reshape(-1, PAGE)[list(pages)] = 0xAB
        peer.open(marker)  # refused (never expected): its answer comes after every queued chunk's
        replies = []
        while not replies or replies[-1].transfer_id != marker:
            replies += peer.replies(1)
        written = sum(isinstance(m, Ack) for m in replies)
        refused = sum(isinstance(m, Failed) and m.transfer_id == tid for m in replies)
        assert written + refused == 63 and refused > 0, replies  # late chunks did come and were refused
        assert {type(m) for m in replies} <= {Ack, Failed, Abort}
        assert all((bufs[b].reshape(-1, PAGE)[list(pages)] == 0xAB).all() for b in range(4))
        counts = rx.refusal_counts()
        assert counts.get("released", 0) + counts["unknown_transfer"] == refused + 1  # + the marker
    finally:
        peer.stop()
        rx.close()


def test_release_from_the_loop_thread_does_not_deadlock():
    rx = R.ZmqReceiver(LAYOUT, [np.zeros(b.nbytes, np.uint8) for b in LAYOUT.buffers], CFG)
    try:
        rx.expect(1, buffer0([0]))
        rx.call_sync(rx.release, 1, timeout=5)
        assert rx.call_sync(lambda: rx.poll(1).state, timeout=5) is S.UNKNOWN
    finally:
        rx.close()


def test_an_error_in_one_chunk_fails_only_its_transfer(monkeypatch, src):
    """On the receiver, an unexpected exception while handling a message ends that transfer FAILED
    with the error named; the loop thread goes on serving the next transfer."""
    real, calls = Lander.write, []

    def write_once_broken(*args):
        calls.append(1)
        if len(calls) == 1:
            raise MemoryError("simulated")
        real(*args)

    monkeypatch.setattr(Lander, "write", write_once_broken)
    bufs = [np.zeros(b.nbytes, np.uint8) for b in LAYOUT.buffers]
    rx = R.ZmqReceiver(LAYOUT, bufs, CFG)
    tx = ZmqSender(LAYOUT, src, CFG)
    try:
        for tid, want in ((1, S.FAILED), (2, S.DONE)):
            items = batch(LAYOUT, [tid])
            rx.expect(tid, items)
            tx.send(tid, rx.address, items, last=True)
            assert rx.wait(tid, 10).state is want and tx.wait(tid, 10).state is want
        assert rx.poll(1).reason == "receiver error handling Chunk: MemoryError('simulated')"
        assert read_items(bufs, LAYOUT, batch(LAYOUT, [2])) == read_items(src, LAYOUT, batch(LAYOUT, [2]))
        assert rx._thread.is_alive()
    finally:
        tx.close()
        rx.close()


# -- the receiver's deadline: no progress, plus the sender's size-derived cap -----------------------------
SLOW = CFG.replace(chunk_bytes=PAGE, window_bytes=16 * PAGE)  # one chunk per page and buffer
TEN = batch(LAYOUT, list(range(10)))  # 160 KiB


def paced_transfer(src, tid, rx_cfg, tx_cfg, expect_timeout_s, pace_s=0.2):
    """Ten pages sent one per send() every `pace_s` (a chunked prefill's pace); returns both ends'
    statuses, the time from expect() to the receiver's end, and whether the destination is exact."""
    bufs = [np.zeros(b.nbytes, np.uint8) for b in LAYOUT.buffers]
    rx = R.ZmqReceiver(LAYOUT, bufs, rx_cfg)
    tx = ZmqSender(LAYOUT, src, tx_cfg)
    try:
        t0 = time.monotonic()
        rx.expect(tid, TEN, timeout_s=expect_timeout_s)
        for p in range(10):
            tx.send(tid, rx.address, batch(LAYOUT, [p]), last=p == 9)
            time.sleep(pace_s)
        r = rx.wait(tid, 15)
        elapsed = time.monotonic() - t0
        return r, tx.wait(tid, 10), elapsed, read_items(bufs, LAYOUT, TEN) == read_items(src, LAYOUT, TEN)
    finally:
        tx.close()
        rx.close()


def test_a_slow_but_progressing_transfer_outlives_the_expect_timeout(src):
    """Before: the receiver's deadline was absolute from expect(), so a transfer still receiving a chunk
    every 0.3 s (3 s in all) timed out 2 s after expect(). Now each accepted Open/chunk refreshes it
    (a stall of up to 1.7 s between pieces is still progress)."""
    r, s, elapsed, exact = paced_transfer(src, 1, SLOW, SLOW, expect_timeout_s=2.0, pace_s=0.3)
    assert r.state is S.DONE, r.reason
    assert s.state is S.DONE and exact
    assert elapsed > 2.0  # it did outlive the expect() timeout


def test_the_receiver_cap_is_the_senders_formula_over_the_expected_bytes(src):
    """A trickle the sender tolerates (no cap there) still ends at the receiver's explicit cap:
    0.5 s + 160 KiB at 320 KiB/s = 1 s from the Open, while the trickle takes 2 s and its 5 s
    no-progress timeout never runs out."""
    rx_cfg = SLOW.replace(cap_slack_s=0.5, min_rate_bytes_s=320 * 1024)
    r, s, _, _ = paced_transfer(src, 2, rx_cfg, SLOW.replace(min_rate_bytes_s=None), expect_timeout_s=5.0)
    assert r.state is S.TIMED_OUT
    assert r.reason.startswith("exceeded its cap of 1 s (cap_slack_s=0.5 + 163840 B at min_rate_bytes_s=327680) "
                               "in state transferring: ")
    assert (s.state, s.reason) == (S.FAILED, f"receiver: {r.reason}")
    assert rx_cfg.cap_s(163840) == 1.0 and SLOW.replace(min_rate_bytes_s=None).cap_s(163840) is None


def test_the_fake_transport_keeps_the_same_no_progress_deadlines(monkeypatch, src):
    """Higher layers tested on FakeTransport must see the wire's semantics: a transfer sent in pieces
    0.1 s apart over 1 s with a 0.3 s timeout, polled all along (as the scheduler does), completes on both
    ends; a 0.31 s pause between pieces times both out. The fake's clock is the test's."""
    now = [0.0]
    monkeypatch.setattr(fake, "time", SimpleNamespace(monotonic=lambda: now[0], sleep=time.sleep))
    net = FakeTransport(timeout_s=0.3)
    rx = net.receiver(LAYOUT, [np.zeros(b.nbytes, np.uint8) for b in LAYOUT.buffers])
    tx = net.sender(LAYOUT, src)
    for tid, pause, want in ((1, 0.1, S.DONE), (2, 0.31, S.TIMED_OUT)):
        rx.expect(tid, TEN)
        for p in range(10):
            assert not rx.poll(tid).state.terminal and not tx.poll(tid).state.terminal, rx.poll(tid).reason
            tx.send(tid, rx.address, batch(LAYOUT, [p]), last=p == 9)
            now[0] += pause
            if want is S.TIMED_OUT:
                break
        assert (rx.poll(tid).state, tx.poll(tid).state) == (want, want)


# -- oversized frames -------------------------------------------------------------------------------------
def zmtp_dealer(rx) -> socket.socket:
    """A raw TCP peer past the ZMTP 3.0 NULL handshake (greeting + READY), speaking as a DEALER."""
    s = socket.create_connection((rx.address.host, rx.address.port), timeout=5)
    greeting = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\x00" + bytes(31)
    ready = b"\x05READY" + b"\x0bSocket-Type" + (6).to_bytes(4, "big") + b"DEALER"
    s.sendall(greeting + bytes([0x04, len(ready)]) + ready)
    return s


def closed_by_peer(s: socket.socket, within: float) -> bool:
    end = time.monotonic() + within
    while time.monotonic() < end:
        try:
            if s.recv(65536) == b"":
                return True
        except socket.timeout:
            continue
        except ConnectionResetError:
            return True
    return False


def test_a_4gib_frame_header_drops_the_connection_before_any_data(rx, src):
    """MAXMSGSIZE makes libzmq drop a peer on the frame header announcing 4 GiB, so no peer can
    make decode buffer a huge frame (before, it took the bytes and RSS grew at line rate)."""
    s = zmtp_dealer(rx)
    try:
        s.sendall(bytes([0x02]) + (4 << 30).to_bytes(8, "big") + b"x" * 4096)  # LONG frame, 4 GiB
        assert closed_by_peer(s, within=5.0)
    finally:
        s.close()
    assert_serving(rx, src)


def test_an_oversized_chunk_frame_writes_nothing_and_the_transfer_survives(rx, src):
    tid, items = next(IDS), batch(LAYOUT, [20, 21])
    rx.call("expect", tid, items)
    peer = RawPeer(rx)
    mon = peer.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        big = b"\x01" * (R.max_frame_bytes(LAYOUT, CFG) + 1)
        header = Chunk(transfer_id=tid, seq=0, buffer_id=0, offset=0, length=len(big), nframes=1,
                       checksum=xxhash.xxh3_64_intdigest(big))
        peer.sock.send_multipart([CODEC.encode(header), big])
        assert mon.poll(5000) and recv_monitor_message(mon)["event"] == zmq.EVENT_DISCONNECTED
    finally:
        mon.close(0)
        peer.stop()
    assert rx.call("poll", tid).state is S.WAITING
    assert rx.call("read", items) == bytes(stream_bytes(LAYOUT, items))
    tx = ZmqSender(LAYOUT, src, CFG)  # the transfer the attacker aimed at still completes exactly
    try:
        tx.send(tid, rx.address, items, last=True)
        assert tx.wait(tid, 10).state is S.DONE
    finally:
        tx.close()
    assert rx.call("read", items) == read_items(src, LAYOUT, items)


def test_frame_limit_fits_chunks_and_the_open_header():
    limit = R.max_frame_bytes(LAYOUT, CFG)
    assert CFG.chunk_bytes < limit <= CFG.chunk_bytes + (64 << 10)
    assert len(CODEC.encode(Open(transfer_id=(1 << 64) - 1, layout=LAYOUT))) < limit


def test_an_open_announcing_bigger_chunks_fails_fast_with_a_named_reason(rx, src):
    """Prefill and decode disagree on chunk_bytes. Before: OpenAck, then the first 80 KiB chunk frame
    exceeded the receiver's MAXMSGSIZE, libzmq dropped the connection without a word and the transfer
    only timed out. Now the Open carries the sender's chunk_bytes and is refused at once."""
    tid, items = next(IDS), batch(LAYOUT, list(range(44, 64)))  # 80 KiB per buffer stream
    rx.call("expect", tid, items)
    big = CFG.replace(chunk_bytes=128 << 10, window_bytes=1 << 20)
    assert 80 << 10 > R.max_frame_bytes(LAYOUT, CFG)  # the chunk's one data frame would be dropped
    tx = ZmqSender(LAYOUT, src, big)
    try:
        tx.send(tid, rx.address, items, last=True)
        s = tx.wait(tid, 5)
    finally:
        tx.close()
    limit = R.max_frame_bytes(LAYOUT, CFG)
    reason = (f"sender chunk_bytes={128 << 10} exceeds this receiver's frame limit of {limit} B (chunk_bytes="
              f"{CFG.chunk_bytes} + slack): run prefill and decode with the same chunk_bytes "
              "(--prfaas-zmq-chunk-bytes)")
    assert (s.state, s.reason) == (S.FAILED, f"receiver: {reason}")
    r = rx.call("poll", tid)
    assert (r.state, r.reason) == (S.FAILED, reason)
    assert rx.call("read", items) == bytes(stream_bytes(LAYOUT, items))
    assert_serving(rx, src)

