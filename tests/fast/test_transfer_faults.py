"""Faults and bad input: every failure ends in a named state with a reason, and both sides stay up."""

import itertools
import socket
import time

import pytest

from prfaas_sgl.transfer import faults as F
from prfaas_sgl.transfer.config import PeerInfo, TransferConfig
from prfaas_sgl.transfer.sender import ZmqSender
from prfaas_sgl.transfer.states import TransferState as S
from tests.support.transport import Remote, batch, fill_random, read_items, small_layout

LAYOUT = small_layout()
CFG = TransferConfig(connections=2, chunk_bytes=8192, window_bytes=32768, timeout_s=10)
IDS = itertools.count(100)
PAGES = list(range(8))


@pytest.fixture(scope="module")
def rx():
    with Remote("receiver", LAYOUT, CFG) as remote:
        yield remote


@pytest.fixture(scope="module")
def src():
    return fill_random(LAYOUT, seed=2)


def run_transfer(rx, tx, src_pages=PAGES, dst_pages=PAGES, rx_wait=10.0):
    tid = next(IDS)
    rx.call("expect", tid, batch(LAYOUT, dst_pages))
    tx.send(tid, rx.address, batch(tx.layout, src_pages), last=True)
    return tid, tx.wait(tid, 10), rx.call("wait", tid, rx_wait)


def assert_healthy(rx, src):
    """A clean transfer still works end to end after the fault."""
    tx = ZmqSender(LAYOUT, src, CFG)
    try:
        _, s, r = run_transfer(rx, tx)
        assert (s.state, r.state) == (S.DONE, S.DONE)
        assert rx.call("read", batch(LAYOUT, PAGES)) == read_items(src, LAYOUT, batch(LAYOUT, PAGES))
    finally:
        tx.close()


def test_corrupted_chunk_is_rejected(rx, src):
    tx = ZmqSender(LAYOUT, src, CFG, faults=(F.CorruptChunk(seq=3),))
    try:
        _, s, r = run_transfer(rx, tx)
    finally:
        tx.close()
    assert r.state is S.FAILED and r.reason.startswith("checksum mismatch in chunk 3 (buffer 0, offset ")
    assert s.state is S.FAILED and s.reason == f"receiver: {r.reason}"
    assert_healthy(rx, src)


def test_unknown_protocol_version_fails_with_both_versions(rx, src):
    tx = ZmqSender(LAYOUT, src, CFG, faults=(F.StampVersion(9),))
    try:
        _, s, r = run_transfer(rx, tx)
    finally:
        tx.close()
    assert r.state is S.FAILED and r.reason == "protocol version mismatch: peer speaks v9, this side speaks v1"
    assert s.state is S.FAILED and "peer speaks v9" in s.reason
    assert_healthy(rx, src)


def test_page_size_mismatch_names_buffer_and_sizes(rx):
    small = small_layout(page_bytes=2048)
    tx = ZmqSender(small, fill_random(small, 3), CFG)
    try:
        _, s, r = run_transfer(rx, tx)
    finally:
        tx.close()
    want = "layout mismatch: buffer 0 (kv) item_len (page/slot size) peer=2048 B here=4096 B"
    assert (r.state, r.reason) == (S.FAILED, want)
    assert (s.state, s.reason) == (S.FAILED, f"receiver: {want}")


def test_page_count_mismatch_fails_at_close(rx, src):
    tx = ZmqSender(LAYOUT, src, CFG)
    try:
        _, s, r = run_transfer(rx, tx, src_pages=PAGES[:5])
    finally:
        tx.close()
    assert r.state is S.FAILED
    assert r.reason == ("buffer 0 stream length mismatch: sender sends 20480 B, receiver expects 32768 B "
                        "(different page count or page size)")
    assert s.state is S.FAILED


def test_too_many_pages_are_refused_before_writing(rx, src):
    tx = ZmqSender(LAYOUT, src, CFG)
    try:
        _, s, r = run_transfer(rx, tx, src_pages=list(range(12)))
    finally:
        tx.close()
    assert r.state is S.FAILED and "exceed the 32768 bytes expected" in r.reason
    assert_healthy(rx, src)


def test_unexpected_transfer_and_bad_peer_info(rx, src):
    tx = ZmqSender(LAYOUT, src, CFG)
    try:
        tx.send(999_999, rx.address, batch(LAYOUT, PAGES), last=True)
        s = tx.wait(999_999, 10)
        assert (s.state, s.reason) == (S.FAILED, "receiver: receiver does not expect transfer 999999")
        tx.send(5, PeerInfo("decode-0", 1234), batch(LAYOUT, PAGES), last=True)
        s = tx.wait(5, 5)
        assert (s.state, s.reason) == (S.FAILED, "bad peer host 'decode-0' (need a numeric IP address)")
    finally:
        tx.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_peer_times_out_with_hint(src):
    tx = ZmqSender(LAYOUT, src, CFG.replace(timeout_s=0.4))
    try:
        tx.send(1, PeerInfo("127.0.0.1", free_port()), batch(LAYOUT, PAGES), last=True)
        s = tx.wait(1, 5)
    finally:
        tx.close()
    assert s.state is S.TIMED_OUT
    assert s.reason.startswith("timed out after 0.4 s in state opening, 0 bytes acknowledged (no OpenAck")


def test_receiver_deadline(rx):
    tid = next(IDS)
    rx.call("expect", tid, batch(LAYOUT, PAGES), 0.3)
    r = rx.call("wait", tid, 5)
    assert (r.state, r.reason) == (S.TIMED_OUT, "timed out after 0.3 s in state waiting: 0 of 131072 bytes verified")


def slow_pair(rx_faults, window_chunks=4):
    cfg = CFG.replace(window_bytes=window_chunks * CFG.chunk_bytes)
    return Remote("receiver", LAYOUT, cfg, faults=rx_faults), cfg


def test_aborts_from_either_side_reach_the_other(src):
    remote, cfg = slow_pair((F.SlowReceiver(0.02),))
    tx = ZmqSender(LAYOUT, src, cfg)
    try:
        pages = list(range(32))  # 4 buffers × 32 pages × 4 KiB / 8 KiB chunks = 64 chunks ≈ 1.3 s
        for tid, who in ((1, "receiver"), (2, "sender")):
            remote.call("expect", tid, batch(LAYOUT, pages))
            tx.send(tid, remote.address, batch(LAYOUT, pages), last=True)
            time.sleep(0.2)
            if who == "receiver":
                remote.call("abort", tid, "decode preempted")
            else:
                tx.abort(tid, "prefill cancelled")
            s, r = tx.wait(tid, 5), remote.call("wait", tid, 5)
            assert (s.state, r.state) == (S.ABORTED, S.ABORTED)
        assert tx.poll(1).reason == "receiver: decode preempted"
        assert remote.call("poll", 2).reason == "aborted by sender: prefill cancelled"
    finally:
        tx.close()
        remote.stop()


def test_backpressure_bounds_bytes_in_flight(src):
    remote, cfg = slow_pair((F.SlowReceiver(0.01),), window_chunks=3)
    tx = ZmqSender(LAYOUT, src, cfg)
    try:
        pages = list(range(24))  # 48 chunks of 8 KiB through a 24 KiB window
        remote.call("expect", 1, batch(LAYOUT, pages))
        tx.send(1, remote.address, batch(LAYOUT, pages), last=True)
        assert tx.wait(1, 10).state is S.DONE
        link = tx.stats.snapshot()["links"][remote.address.key()]
        assert link["max_bytes_in_flight"] == 3 * cfg.chunk_bytes
        assert link["queue_delay_s"]["p90"] > 0.1  # chunks waited for credit instead of piling up
    finally:
        tx.close()
        remote.stop()


def test_receiver_restart_then_new_transfers_work(src):
    first = Remote("receiver", LAYOUT, CFG)
    port = first.address.port
    tx = ZmqSender(LAYOUT, src, CFG.replace(timeout_s=2))
    try:
        _, s, _ = run_transfer(first, tx)
        assert s.state is S.DONE
        tid = next(IDS)
        first.call("expect", tid, batch(LAYOUT, PAGES))
        first.kill()  # crash: no goodbye
        tx.send(tid, first.address, batch(LAYOUT, PAGES), last=True)
        assert tx.wait(tid, 5).state in (S.TIMED_OUT, S.FAILED)
        second = Remote("receiver", LAYOUT, CFG, port=port)
        try:
            _, s, r = run_transfer(second, tx)
            assert (s.state, r.state) == (S.DONE, S.DONE)
        finally:
            second.stop()
    finally:
        tx.close()
        first.stop()
