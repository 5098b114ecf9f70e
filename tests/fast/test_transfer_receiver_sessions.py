"""Receiver hardening, who may write: only the connection that opened a transfer feeds
or closes it (session tokens), a redialled connection takes its identity over, and a transfer completes
by coverage, not by byte count. Real sockets; the decode receiver runs in its own process."""

import itertools
import os
import time

from hypothesis import given, settings, strategies as st

from prfaas_sgl.transfer.coverage import Coverage
from prfaas_sgl.transfer.messages import Failed
from prfaas_sgl.transfer.sender import ZmqSender
from prfaas_sgl.transfer.states import TransferState as S
from tests.support.transport import Remote, batch, fill_random, read_items, stream_bytes

from .receiver_peers import CFG, IDS, LAYOUT, PAGE, SRC_SEED, RawPeer, assert_serving, buffer0, payload

__all__ = ["CFG", "LAYOUT", "SRC_SEED"]  # read by the rx and src fixtures (conftest.py)


# -- only the opener may feed a transfer ------------------------------------------------------------------
def test_chunk_from_another_host_is_refused_and_the_real_transfer_completes(rx, src):
    """A real sender (its session: host + its link's token) opens; a second DEALER on another address
    injects a well-formed chunk into pages the sender has not sent yet."""
    tid = next(IDS)
    first, rest, both = batch(LAYOUT, [30]), batch(LAYOUT, [31]), batch(LAYOUT, [30, 31])
    rx.call("expect", tid, both)
    tx = ZmqSender(LAYOUT, src, CFG)
    intruder = RawPeer(rx, source_ip="127.0.0.2")
    try:
        tx.send(tid, rx.address, first)
        end = time.monotonic() + 10
        while rx.call("read", first) != read_items(src, LAYOUT, first):
            assert time.monotonic() < end, "the first piece never landed"
            time.sleep(0.005)
        intruder.chunk(tid, seq=100, offset=PAGE, payload=payload(1))  # buffer 0's stream: page 31
        (failed,) = intruder.replies(1)
        assert failed.reason == f"chunk 100 for transfer {tid} arrived from a connection that did not open it"
        assert rx.call("read", rest) == bytes(stream_bytes(LAYOUT, rest))
        assert rx.call("poll", tid).state is S.TRANSFERRING
        tx.send(tid, rx.address, rest, last=True)
        assert tx.wait(tid, 10).state is S.DONE
    finally:
        intruder.stop()
        tx.close()
    assert rx.call("wait", tid, 10).state is S.DONE
    assert rx.call("read", both) == read_items(src, LAYOUT, both)
    assert rx.call("refusal_counts")["not_opener"] >= 1


def test_chunk_close_and_open_from_another_link_are_refused(rx, src):
    """A sender that names its connections `token + index` binds its transfers to the token: a second
    connection on the same host without it can neither write, close, nor re-open."""
    tid, items = next(IDS), buffer0([0, 1])
    rx.call("expect", tid, items)
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
        assert rx.call("read", items) == bytes(2 * PAGE)
        good = [payload(3), payload(4)]
        for seq, data in enumerate(good):
            owner.chunk(tid, seq, seq * PAGE, data)
        owner.close_transfer(tid, nchunks=2, total=2 * PAGE)
        assert [type(m).__name__ for m in owner.replies(3)] == ["Ack", "Ack", "Done"]
    finally:
        owner.stop()
        intruder.stop()
    assert rx.call("read", items) == b"".join(good)
    assert_serving(rx, src)


def test_a_same_host_intruder_cannot_feed_a_real_senders_transfer(rx):
    """Session tokens: a real ZmqSender in its own process opens a transfer; processes on the same host
    (so same address and, in plaintext, same empty key) inject a chunk into pages not sent yet, one with
    libzmq's own routing id, one with a token of its own. Before the sender named its connections
    `token + index`, its session was just "this host" and the bare intruder's chunk was written."""
    tid, seed = next(IDS), 21
    first, rest, both = batch(LAYOUT, [32]), batch(LAYOUT, [33]), batch(LAYOUT, [32, 33])
    held = fill_random(LAYOUT, seed)  # what the sender process holds
    want_first, want = read_items(held, LAYOUT, first), read_items(held, LAYOUT, both)
    rx.call("expect", tid, both)
    bare, forged = RawPeer(rx), RawPeer(rx, routing_id=b"\x01" * 16 + b"\x00")
    try:
        with Remote("sender", LAYOUT, CFG, seed=seed) as tx:
            tx.call("send", tid, rx.address, first, False)
            end = time.monotonic() + 10
            while rx.call("read", first) != want_first:
                assert time.monotonic() < end, "the first piece never landed"
                time.sleep(0.005)
            for seq, intruder in ((100, bare), (101, forged)):
                intruder.chunk(tid, seq=seq, offset=PAGE, payload=payload(seq))  # buffer 0's stream: page 33
                reply = intruder.replies(1)[0]
                assert isinstance(reply, Failed), reply
                assert reply.reason == (f"chunk {seq} for transfer {tid} arrived from a connection that did "
                                        "not open it")
            assert rx.call("read", rest) == bytes(stream_bytes(LAYOUT, rest))
            assert rx.call("poll", tid).state is S.TRANSFERRING
            tx.call("send", tid, rx.address, rest, True)
            assert tx.call("wait", tid, 10).state is S.DONE
    finally:
        bare.stop()
        forged.stop()
    assert rx.call("wait", tid, 10).state is S.DONE
    assert rx.call("read", both) == want


def test_a_connection_redialled_under_the_same_routing_id_takes_over(rx):
    """Fixed routing ids (token + index) meet a half-open connection: the sender's side dropped and
    redialled while the receiver still holds the old pipe. libzmq's default refuses the duplicate
    identity until the old pipe dies (minutes, with no traffic); ROUTER_HANDOVER gives it the new one."""
    tid, items = next(IDS), buffer0([2])
    rx.call("expect", tid, items)
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
    assert rx.call("read", items) == payload(8)


# -- completion by coverage ---------------------------------------------------------------------------
def test_overlapping_chunks_with_distinct_seqs_fail_instead_of_done(rx, src):
    """Three 4 KiB chunks for a 12 KiB stream, the second a rewrite of the first: their byte count adds
    up (before: DONE with [8192, 12288) stale), their coverage does not."""
    tid, items = next(IDS), buffer0([10, 11, 12])
    rx.call("expect", tid, items)
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
    written = rx.call("read", items)
    assert written == payload(5) + bytes(2 * PAGE)  # chunk 1 wrote nothing; chunk 2 came after FAILED
    assert_serving(rx, src)


def test_a_gap_at_close_fails_naming_the_unwritten_bytes(rx):
    """Close says 2 chunks, both came and verified, yet page 2 of 3 was never written."""
    items = buffer0([13, 14, 15])
    tid = next(IDS)
    rx.call("expect", tid, items)
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
