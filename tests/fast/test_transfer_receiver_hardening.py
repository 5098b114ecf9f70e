"""Receiver hardening (issue 12: H6, M3): no write after release(), and hostile peers on the data
listener are refused with a named reason while nothing reaches decode memory and the receiver keeps
serving. Real sockets throughout: the decode receiver runs in its own process (or, where the test must
write into its memory, the sender does)."""

import itertools
import os
import socket
import time

import numpy as np
import pytest
import xxhash
import zmq
from hypothesis import given, settings, strategies as st
from zmq.utils.monitor import recv_monitor_message

from prfaas_sgl.transfer import faults as F
from prfaas_sgl.transfer import receiver as R
from prfaas_sgl.transfer.chunking import Coverage
from prfaas_sgl.transfer.config import TransferConfig
from prfaas_sgl.transfer.fake import FakeTransport
from prfaas_sgl.transfer.layout import item_regions, page_regions
from prfaas_sgl.transfer.messages import Chunk, Close, Codec, Failed, Open
from prfaas_sgl.transfer.sender import ZmqSender
from prfaas_sgl.transfer.states import TransferState as S
from prfaas_sgl.transfer.testing import Remote, fill_random, read_regions, small_layout

LAYOUT = small_layout()  # kv buffers 0..3 of 64 pages × 4 KiB
PAGE = 4096
CFG = TransferConfig(connections=2, chunk_bytes=8192, window_bytes=65536, timeout_s=10)
IDS = itertools.count(1)
CODEC = Codec()


@pytest.fixture(scope="module")
def rx():
    with Remote("receiver", LAYOUT, CFG) as remote:
        yield remote


@pytest.fixture(scope="module")
def src():
    return fill_random(LAYOUT, seed=11)


def assert_serving(rx, src, pages=(40, 41, 42)):
    """The receiver is alive and a legitimate transfer after the attack lands exactly."""
    tid, regions = next(IDS), page_regions(LAYOUT, list(pages))
    rx.call("expect", tid, regions)
    tx = ZmqSender(LAYOUT, src, CFG)
    try:
        tx.send(tid, rx.address, regions, last=True)
        assert tx.wait(tid, 10).state is S.DONE
    finally:
        tx.close()
    assert rx.call("wait", tid, 10).state is S.DONE
    assert rx.call("read", regions) == read_regions(src, regions)


class RawPeer:
    """A hand-driven DEALER speaking the wire protocol, as an attacker (or a minimal sender) would."""

    def __init__(self, rx, routing_id: bytes | None = None, source_ip: str | None = None) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if routing_id is not None:
            self.sock.setsockopt(zmq.ROUTING_ID, routing_id)
        source = f"{source_ip}:0;" if source_ip else ""
        self.sock.connect(f"tcp://{source}{rx.address.host}:{rx.address.port}")

    def open(self, tid: int) -> None:
        self.sock.send(CODEC.encode(Open(transfer_id=tid, layout=LAYOUT)))

    def chunk(self, tid: int, seq: int, offset: int, payload: bytes, buffer_id: int = 0) -> None:
        header = Chunk(transfer_id=tid, seq=seq, buffer_id=buffer_id, offset=offset, length=len(payload),
                       nframes=1, checksum=xxhash.xxh3_64_intdigest(payload))
        self.sock.send_multipart([CODEC.encode(header), payload])

    def close_transfer(self, tid: int, nchunks: int, total: int) -> None:
        self.sock.send(CODEC.encode(Close(transfer_id=tid, nchunks=nchunks, totals={0: total})))

    def replies(self, n: int, timeout: float = 10.0) -> list:
        out = []
        for _ in range(n):
            assert self.sock.poll(int(timeout * 1000)), f"no reply after {out}"
            out.append(CODEC.decode(self.sock.recv()))
        return out

    def stop(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def buffer0(pages) -> list:
    return item_regions(LAYOUT, [0], list(pages))


def payload(seed: int, n: int = PAGE) -> bytes:
    return np.random.default_rng(seed).integers(1, 256, n, dtype=np.uint8).tobytes()


# -- H6: release() is a write barrier --------------------------------------------------------------------
def test_release_guarantees_no_write_after_it_returns():
    """H6: SGLang frees a room's pages right after forget() → release(); a chunk scattered after that
    would corrupt whichever request gets the pages next. 64 chunks are queued behind a slow receiver."""
    cfg = CFG.replace(chunk_bytes=PAGE, window_bytes=64 * PAGE)
    bufs = [np.zeros(b.nbytes, np.uint8) for b in LAYOUT.buffers]
    rx = R.ZmqReceiver(LAYOUT, bufs, cfg, faults=(F.SlowReceiver(0.005),))
    tx = Remote("sender", LAYOUT, cfg, seed=3)
    try:
        tid, regions = next(IDS), page_regions(LAYOUT, list(range(16)))  # 4 buffers × 16 pages = 64 chunks
        rx.expect(tid, regions)
        tx.call("send", tid, rx.address, regions, True)
        end = time.monotonic() + 10
        while not bufs[0][:16 * PAGE].any():  # the first chunk has landed; the rest are queued
            assert time.monotonic() < end, "no chunk arrived"
            time.sleep(0.001)
        rx.release(tid)
        for r in regions:  # the pages now belong to another request
            bufs[r.buffer_id][r.offset: r.offset + r.length] = 0xAB
        assert tx.call("wait", tid, 10).state in (S.ABORTED, S.FAILED)
        time.sleep(0.3)  # whatever was still queued has been handled by now
        assert all((bufs[r.buffer_id][r.offset: r.offset + r.length] == 0xAB).all() for r in regions)
        refused = rx.refusal_counts()
        assert refused.get("released", 0) + refused.get("unknown_transfer", 0) > 0
    finally:
        tx.stop()
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
    """H5 on the receiver: an unexpected exception while handling a message ends that transfer FAILED
    with the error named; the loop thread goes on serving the next transfer."""
    real, calls = R.scatter, []

    def scatter_once_broken(*args):
        calls.append(1)
        if len(calls) == 1:
            raise MemoryError("simulated")
        real(*args)

    monkeypatch.setattr(R, "scatter", scatter_once_broken)
    bufs = [np.zeros(b.nbytes, np.uint8) for b in LAYOUT.buffers]
    rx = R.ZmqReceiver(LAYOUT, bufs, CFG)
    tx = ZmqSender(LAYOUT, src, CFG)
    try:
        for tid, want in ((1, S.FAILED), (2, S.DONE)):
            regions = page_regions(LAYOUT, [tid])
            rx.expect(tid, regions)
            tx.send(tid, rx.address, regions, last=True)
            assert rx.wait(tid, 10).state is want and tx.wait(tid, 10).state is want
        assert rx.poll(1).reason == "receiver error handling Chunk: MemoryError('simulated')"
        assert read_regions(bufs, page_regions(LAYOUT, [2])) == read_regions(src, page_regions(LAYOUT, [2]))
        assert rx._thread.is_alive()
    finally:
        tx.close()
        rx.close()


# -- the receiver's deadline: no progress, plus the sender's size-derived cap -----------------------------
SLOW = CFG.replace(chunk_bytes=PAGE, window_bytes=16 * PAGE)  # one chunk per page and buffer
TEN = page_regions(LAYOUT, list(range(10)))  # 160 KiB


def paced_transfer(src, tid, rx_cfg, tx_cfg, expect_timeout_s):
    """Ten pages sent one per send() every 0.2 s (~2 s, a chunked prefill's pace); returns both ends'
    statuses, the time from expect() to the receiver's end, and whether the destination is exact."""
    bufs = [np.zeros(b.nbytes, np.uint8) for b in LAYOUT.buffers]
    rx = R.ZmqReceiver(LAYOUT, bufs, rx_cfg)
    tx = ZmqSender(LAYOUT, src, tx_cfg)
    try:
        t0 = time.monotonic()
        rx.expect(tid, TEN, timeout_s=expect_timeout_s)
        for p in range(10):
            tx.send(tid, rx.address, page_regions(LAYOUT, [p]), last=p == 9)
            time.sleep(0.2)
        r = rx.wait(tid, 15)
        elapsed = time.monotonic() - t0
        return r, tx.wait(tid, 10), elapsed, read_regions(bufs, TEN) == read_regions(src, TEN)
    finally:
        tx.close()
        rx.close()


def test_a_slow_but_progressing_transfer_outlives_the_expect_timeout(src):
    """Before: the receiver's deadline was absolute from expect(), so a transfer still receiving a chunk
    every 0.2 s timed out 1 s after expect(). Now each accepted Open/chunk refreshes it."""
    r, s, elapsed, exact = paced_transfer(src, 1, SLOW, SLOW, expect_timeout_s=1.0)
    assert r.state is S.DONE, r.reason
    assert s.state is S.DONE and exact
    assert elapsed > 1.0  # it did outlive the expect() timeout


def test_the_receiver_cap_is_the_senders_formula_over_the_expected_bytes(src):
    """A trickle the sender tolerates (no cap there) still ends at the receiver's explicit cap:
    0.5 s + 160 KiB at 320 KiB/s = 1 s from the Open, while progress never stops for 5 s."""
    rx_cfg = SLOW.replace(cap_slack_s=0.5, min_rate_bytes_s=320 * 1024)
    r, s, _, _ = paced_transfer(src, 2, rx_cfg, SLOW.replace(min_rate_bytes_s=None), expect_timeout_s=5.0)
    assert r.state is S.TIMED_OUT
    assert r.reason.startswith("exceeded its cap of 1 s (cap_slack_s=0.5 + 163840 B at min_rate_bytes_s=327680) "
                               "in state transferring: ")
    assert (s.state, s.reason) == (S.FAILED, f"receiver: {r.reason}")
    assert rx_cfg.cap_s(163840) == 1.0 and SLOW.replace(min_rate_bytes_s=None).cap_s(163840) is None


def test_the_fake_transport_keeps_the_same_no_progress_deadlines(src):
    """Higher layers tested on FakeTransport must see the wire's semantics: a transfer sent in pieces over
    ~1 s with a 0.3 s timeout, polled all along (as the scheduler does), completes on both ends."""
    net = FakeTransport(timeout_s=0.3)
    rx = net.receiver(LAYOUT, [np.zeros(b.nbytes, np.uint8) for b in LAYOUT.buffers])
    tx = net.sender(LAYOUT, src)
    rx.expect(1, TEN)
    for p in range(10):
        assert not rx.poll(1).state.terminal and not tx.poll(1).state.terminal, rx.poll(1).reason
        tx.send(1, rx.address, page_regions(LAYOUT, [p]), last=p == 9)
        time.sleep(0.1)
    assert (rx.poll(1).state, tx.poll(1).state) == (S.DONE, S.DONE)


# -- M3: oversized frames ---------------------------------------------------------------------------------
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
    """M3: MAXMSGSIZE makes libzmq drop a peer on the frame header announcing 4 GiB, so no peer can
    make decode buffer a huge frame (before, it took the bytes and RSS grew at line rate)."""
    s = zmtp_dealer(rx)
    try:
        s.sendall(bytes([0x02]) + (4 << 30).to_bytes(8, "big") + b"x" * 4096)  # LONG frame, 4 GiB
        assert closed_by_peer(s, within=5.0)
    finally:
        s.close()
    assert_serving(rx, src)


def test_an_oversized_chunk_frame_writes_nothing_and_the_transfer_survives(rx, src):
    tid, regions = next(IDS), page_regions(LAYOUT, [20, 21])
    rx.call("expect", tid, regions)
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
    assert rx.call("read", regions) == bytes(sum(r.length for r in regions))
    tx = ZmqSender(LAYOUT, src, CFG)  # the transfer the attacker aimed at still completes exactly
    try:
        tx.send(tid, rx.address, regions, last=True)
        assert tx.wait(tid, 10).state is S.DONE
    finally:
        tx.close()
    assert rx.call("read", regions) == read_regions(src, regions)


def test_frame_limit_fits_chunks_and_the_open_header():
    limit = R.max_frame_bytes(LAYOUT, CFG)
    assert CFG.chunk_bytes < limit <= CFG.chunk_bytes + (64 << 10)
    assert len(CODEC.encode(Open(transfer_id=(1 << 64) - 1, layout=LAYOUT))) < limit


def test_an_open_announcing_bigger_chunks_fails_fast_with_a_named_reason(rx, src):
    """Prefill and decode disagree on chunk_bytes. Before: OpenAck, then the first 80 KiB chunk frame
    exceeded the receiver's MAXMSGSIZE, libzmq dropped the connection without a word and the transfer
    only timed out. Now the Open carries the sender's chunk_bytes and is refused at once."""
    tid, regions = next(IDS), page_regions(LAYOUT, list(range(44, 64)))  # 80 KiB per buffer stream
    rx.call("expect", tid, regions)
    big = CFG.replace(chunk_bytes=128 << 10, window_bytes=1 << 20)
    assert 80 << 10 > R.max_frame_bytes(LAYOUT, CFG)  # the chunk's one data frame would be dropped
    tx = ZmqSender(LAYOUT, src, big)
    try:
        tx.send(tid, rx.address, regions, last=True)
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
    assert rx.call("read", regions) == bytes(sum(r.length for r in regions))
    assert_serving(rx, src)


# -- M3: only the opener may feed a transfer --------------------------------------------------------------
def test_chunk_from_another_host_is_refused_and_the_real_transfer_completes(rx, src):
    """A real sender (its session: host + its link's token) opens; a second DEALER on another address
    injects a well-formed chunk into pages the sender has not sent yet."""
    tid = next(IDS)
    first, rest = page_regions(LAYOUT, [30]), page_regions(LAYOUT, [31])
    rx.call("expect", tid, first + rest)
    tx = ZmqSender(LAYOUT, src, CFG)
    intruder = RawPeer(rx, source_ip="127.0.0.2")
    try:
        tx.send(tid, rx.address, first)
        end = time.monotonic() + 10
        while rx.call("read", first) != read_regions(src, first):
            assert time.monotonic() < end, "the first piece never landed"
            time.sleep(0.005)
        intruder.chunk(tid, seq=100, offset=PAGE, payload=payload(1))  # buffer 0's stream: page 31
        (failed,) = intruder.replies(1)
        assert failed.reason == f"chunk 100 for transfer {tid} arrived from a connection that did not open it"
        assert rx.call("read", rest) == bytes(sum(r.length for r in rest))
        assert rx.call("poll", tid).state is S.TRANSFERRING
        tx.send(tid, rx.address, rest, last=True)
        assert tx.wait(tid, 10).state is S.DONE
    finally:
        intruder.stop()
        tx.close()
    assert rx.call("wait", tid, 10).state is S.DONE
    assert rx.call("read", first + rest) == read_regions(src, first + rest)
    assert rx.call("refusal_counts")["not_opener"] >= 1


def test_chunk_close_and_open_from_another_link_are_refused(rx, src):
    """A sender that names its connections `token + index` binds its transfers to the token: a second
    connection on the same host without it can neither write, close, nor re-open."""
    tid, regions = next(IDS), buffer0([0, 1])
    rx.call("expect", tid, regions)
    owner, intruder = RawPeer(rx, routing_id=b"L" + os.urandom(8) + b"\x00"), RawPeer(rx)
    try:
        owner.open(tid)
        assert type(owner.replies(1)[0]).__name__ == "OpenAck"
        before = rx.call("refusal_counts").get("not_opener", 0)
        intruder.chunk(tid, seq=0, offset=0, payload=payload(2))
        intruder.close_transfer(tid, nchunks=1, total=2 * PAGE)
        intruder.open(tid)
        reasons = [m.reason for m in intruder.replies(3)]
        assert reasons == [f"chunk 0 for transfer {tid} arrived from a connection that did not open it",
                           f"Close for transfer {tid} arrived from a connection that did not open it",
                           f"transfer {tid} is already open from another connection"]
        assert rx.call("refusal_counts")["not_opener"] == before + 3
        assert rx.call("read", regions) == bytes(2 * PAGE)
        good = [payload(3), payload(4)]
        for seq, data in enumerate(good):
            owner.chunk(tid, seq, seq * PAGE, data)
        owner.close_transfer(tid, nchunks=2, total=2 * PAGE)
        assert [type(m).__name__ for m in owner.replies(3)] == ["Ack", "Ack", "Done"]
    finally:
        owner.stop()
        intruder.stop()
    assert rx.call("read", regions) == b"".join(good)
    assert_serving(rx, src)


def test_a_same_host_intruder_cannot_feed_a_real_senders_transfer(rx):
    """Session tokens: a real ZmqSender in its own process opens a transfer; processes on the same host
    (so same address and, in plaintext, same empty key) inject a chunk into pages not sent yet, one with
    libzmq's own routing id, one with a token of its own. Before the sender named its connections
    `token + index`, its session was just "this host" and the bare intruder's chunk was written."""
    tid, seed = next(IDS), 21
    first, rest = page_regions(LAYOUT, [32]), page_regions(LAYOUT, [33])
    want = read_regions(fill_random(LAYOUT, seed), first + rest)  # what the sender process holds
    rx.call("expect", tid, first + rest)
    bare, forged = RawPeer(rx), RawPeer(rx, routing_id=b"\x01" * 16 + b"\x00")
    try:
        with Remote("sender", LAYOUT, CFG, seed=seed) as tx:
            tx.call("send", tid, rx.address, first, False)
            end = time.monotonic() + 10
            while rx.call("read", first) != want[:len(want) // 2]:
                assert time.monotonic() < end, "the first piece never landed"
                time.sleep(0.005)
            for seq, intruder in ((100, bare), (101, forged)):
                intruder.chunk(tid, seq=seq, offset=PAGE, payload=payload(seq))  # buffer 0's stream: page 33
                reply = intruder.replies(1)[0]
                assert isinstance(reply, Failed), reply
                assert reply.reason == (f"chunk {seq} for transfer {tid} arrived from a connection that did "
                                        "not open it")
            assert rx.call("read", rest) == bytes(sum(r.length for r in rest))
            assert rx.call("poll", tid).state is S.TRANSFERRING
            tx.call("send", tid, rx.address, rest, True)
            assert tx.call("wait", tid, 10).state is S.DONE
    finally:
        bare.stop()
        forged.stop()
    assert rx.call("wait", tid, 10).state is S.DONE
    assert rx.call("read", first + rest) == want


def test_a_connection_redialled_under_the_same_routing_id_takes_over(rx):
    """Fixed routing ids (token + index) meet a half-open connection: the sender's side dropped and
    redialled while the receiver still holds the old pipe. libzmq's default refuses the duplicate
    identity until the old pipe dies (minutes, with no traffic); ROUTER_HANDOVER gives it the new one."""
    tid, regions = next(IDS), buffer0([2])
    rx.call("expect", tid, regions)
    ident = b"\x07" * 16 + b"\x00"
    old, new = RawPeer(rx, routing_id=ident), None
    try:
        old.open(tid)
        assert type(old.replies(1)[0]).__name__ == "OpenAck"
        new = RawPeer(rx, routing_id=ident)  # same identity while `old` is still connected
        new.chunk(tid, 0, 0, payload(8))
        new.close_transfer(tid, nchunks=1, total=PAGE)
        assert [type(m).__name__ for m in new.replies(2, timeout=5)] == ["Ack", "Done"]
    finally:
        old.stop()
        if new is not None:
            new.stop()
    assert rx.call("read", regions) == payload(8)


# -- M3: completion by coverage -----------------------------------------------------------------------
def test_overlapping_chunks_with_distinct_seqs_fail_instead_of_done(rx, src):
    """Three 4 KiB chunks for a 12 KiB stream, the second a rewrite of the first: their byte count adds
    up (before: DONE with [8192, 12288) stale), their coverage does not."""
    tid, regions = next(IDS), buffer0([10, 11, 12])
    rx.call("expect", tid, regions)
    peer = RawPeer(rx)
    try:
        peer.open(tid)
        peer.replies(1)
        peer.chunk(tid, 0, 0, payload(5))
        peer.chunk(tid, 1, 0, payload(6))
        peer.chunk(tid, 2, PAGE, payload(7))
        peer.close_transfer(tid, nchunks=3, total=3 * PAGE)
        r = rx.call("wait", tid, 10)
    finally:
        peer.stop()
    assert (r.state, r.reason) == (S.FAILED,
                                   "chunk 1 bytes [0, 4096) of buffer 0 overlap bytes already received")
    written = rx.call("read", regions)
    assert written == payload(5) + bytes(2 * PAGE)  # chunk 1 wrote nothing; chunk 2 came after FAILED
    assert_serving(rx, src)


def test_a_gap_at_close_fails_naming_the_unwritten_bytes(rx):
    """Close says 2 chunks, both came and verified, yet page 2 of 3 was never written."""
    regions = buffer0([13, 14, 15])
    tid = next(IDS)
    rx.call("expect", tid, regions)
    peer = RawPeer(rx)
    try:
        peer.open(tid)
        peer.replies(1)
        peer.chunk(tid, 0, 0, payload(11, PAGE))
        peer.chunk(tid, 1, 2 * PAGE, payload(12, PAGE))
        peer.close_transfer(tid, nchunks=2, total=3 * PAGE)
        r = rx.call("wait", tid, 10)
    finally:
        peer.stop()
    assert (r.state, r.reason) == (S.FAILED, "all 2 chunks arrived but bytes [4096, 8192) of buffer 0 were "
                                             "never written")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=30), st.randoms(use_true_random=False),
       st.integers(0, 30))
def test_coverage_matches_a_byte_map(lengths, rnd, drop):
    """Coverage against a bytearray of written flags: chunks in any order, some missing, some repeated."""
    total = sum(lengths)
    cuts = list(itertools.accumulate([0] + lengths))
    chunks = [(cuts[i], cuts[i + 1]) for i in range(len(lengths))]
    chunks = [c for i, c in enumerate(chunks) if i != drop] + rnd.sample(chunks, min(2, len(chunks)))
    rnd.shuffle(chunks)
    cov, written = Coverage(), bytearray(total)
    for a, b in chunks:
        assert cov.overlaps(a, b) == any(written[a:b])
        if not cov.overlaps(a, b):
            cov.add(a, b)
            written[a:b] = b"\x01" * (b - a)
    gap = cov.gap(total)
    assert (gap is None) == all(written)
    if gap is not None:
        assert not any(written[gap[0]:gap[1]]) and (gap[0] == 0 or written[gap[0] - 1])
        assert gap[1] == total or written[gap[1]]
    assert len(cov.starts) == len(cov.ends) <= len(lengths)
