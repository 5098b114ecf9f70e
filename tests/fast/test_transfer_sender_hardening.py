"""Sender hardening: no-progress deadlines, failures contained to one transfer and links that close,
links keyed by the CURVE server key. Receivers run in this process, real sockets over 127.0.0.1."""

import contextlib
import os
import shutil
import socket
import time

import numpy as np
import pytest
import zmq

from prfaas_sgl.transfer import faults as F
from prfaas_sgl.transfer.config import PeerInfo, TransferConfig
from prfaas_sgl.transfer.loop import LoopDead
from prfaas_sgl.transfer.messages import Codec, Open, OpenAck
from prfaas_sgl.transfer.receiver import ZmqReceiver
from prfaas_sgl.transfer.security import generate_keys
from prfaas_sgl.transfer.sender import ZmqSender
from prfaas_sgl.transfer.states import TransferState as S
from tests.support.transport import batch, fill_random, read_items, small_layout

LAYOUT = small_layout()  # 4 KV buffers of 64 pages × 4 KiB
# one chunk per page and buffer: 10 pages = 40 chunks
CFG = TransferConfig(connections=2, chunk_bytes=4096, window_bytes=16384, timeout_s=10)
SRC = fill_random(LAYOUT, seed=12)
TEN = batch(LAYOUT, list(range(10)))


@contextlib.contextmanager
def receiver(cfg=CFG, **kwargs):
    dst = [np.zeros(b.nbytes, np.uint8) for b in LAYOUT.buffers]
    rx = ZmqReceiver(LAYOUT, dst, cfg, **kwargs)
    try:
        yield rx, dst
    finally:
        rx.close()


@contextlib.contextmanager
def sender(cfg=CFG, max_sockets=None):
    tx = ZmqSender(LAYOUT, SRC, cfg)
    if max_sockets is not None:
        tx._ctx.set(zmq.MAX_SOCKETS, max_sockets)  # takes effect at the context's first socket
    try:
        yield tx
    finally:
        tx.close()


def transfer(tx, rx, tid, items=TEN, wait=10.0):
    rx.expect(tid, items, 30)
    tx.send(tid, rx.address, items, last=True)
    return tx.wait(tid, wait)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def until(cond, timeout=5.0):
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        time.sleep(0.01)
    return cond()


# -- the deadline is "no progress", not "since the first chunk" ---------------------------------------

def test_acks_keep_a_long_transfer_alive():
    """40 chunks at 100 ms take 4 s, twice the 2 s timeout; acks keep flowing, so it must end DONE
    (a 1.9 s stall between acks is still progress)."""
    with receiver(faults=(F.SlowReceiver(0.1),)) as (rx, dst), sender(CFG.replace(timeout_s=2.0)) as tx:
        s = transfer(tx, rx, 1, wait=20)
        assert s.state is S.DONE, s.reason
        assert rx.wait(1, 5).state is S.DONE
        assert read_items(dst, LAYOUT, TEN) == read_items(SRC, LAYOUT, TEN)


def test_a_transfer_queued_behind_another_stays_alive():
    """Transfer 3 waits ~4 s behind transfer 2 on the same link (oldest first) with a 2 s timeout."""
    small = batch(LAYOUT, [20, 21])
    with receiver(faults=(F.SlowReceiver(0.1),)) as (rx, _), sender(CFG.replace(timeout_s=2.0)) as tx:
        rx.expect(2, TEN, 30)
        rx.expect(3, small, 30)
        tx.send(2, rx.address, TEN, last=True)
        tx.send(3, rx.address, small, last=True)
        assert tx.wait(2, 20).state is S.DONE, tx.poll(2).reason
        assert tx.wait(3, 20).state is S.DONE, tx.poll(3).reason


def test_a_stalled_transfer_times_out_after_timeout_s():
    """No progress after OpenAck (a peer that never acks a chunk): TIMED_OUT about timeout_s later."""
    ctx = zmq.Context()
    stub = ctx.socket(zmq.ROUTER)
    stub.linger = 0
    port = stub.bind_to_random_port("tcp://127.0.0.1")
    codec = Codec()
    try:
        with sender(CFG.replace(timeout_s=1.0)) as tx:
            tx.send(4, PeerInfo("127.0.0.1", port), TEN, last=True)
            assert stub.poll(5000), "no Open arrived"
            ident, header = stub.recv_multipart()
            assert isinstance(codec.decode(header), Open)
            stub.send_multipart([ident, codec.encode(OpenAck(transfer_id=4))])
            acked_at = time.monotonic()
            s = tx.wait(4, 10)
            elapsed = time.monotonic() - acked_at
        assert s.state is S.TIMED_OUT
        assert s.reason.startswith("timed out after 1 s in state transferring, 0 bytes acknowledged (no progress")
        assert 0.9 <= elapsed <= 5.0  # not before timeout_s; the upper bound leaves room for a loaded machine
    finally:
        stub.close(0)
        ctx.term()


def test_the_absolute_cap_is_explicit_and_ends_a_trickle():
    """Acks trickle (2 s for 160 KiB) past a cap of 0.5 s + 160 KiB at 320 KiB/s = 1 s: TIMED_OUT, though
    progress never stops for the 3 s no-progress timeout (which only a 3 s stall would hit first)."""
    cfg = CFG.replace(timeout_s=3.0, cap_slack_s=0.5, min_rate_bytes_s=320 * 1024)
    with receiver(faults=(F.SlowReceiver(0.05),)) as (rx, _), sender(cfg) as tx:
        s = transfer(tx, rx, 5)
    assert s.state is S.TIMED_OUT
    assert s.reason.startswith("exceeded its cap of 1 s (cap_slack_s=0.5 + 163840 B at min_rate_bytes_s=327680) "
                               "in state transferring")


# -- one error fails one transfer; the loop survives; a dead loop is visible ---------------------------

def test_running_out_of_sockets_fails_only_the_new_links():
    """Socket exhaustion: 30 sockets = 2 links of 4 connections (3 sockets each); links 3 and 4 cannot open."""
    cfg = CFG.replace(connections=4)
    with contextlib.ExitStack() as stack:
        rxs = [stack.enter_context(receiver())[0] for _ in range(4)]
        tx = stack.enter_context(sender(cfg, max_sockets=30))
        states = [transfer(tx, rx, 10 + i) for i, rx in enumerate(rxs)]
        assert tx._thread.is_alive() and tx.fatal is None
        assert [s.state for s in states] == [S.DONE, S.DONE, S.FAILED, S.FAILED]
        assert states[2].reason.startswith(f"cannot connect to {rxs[2].address.key()}: ")
        assert transfer(tx, rxs[0], 20).state is S.DONE  # existing links still work


def test_idle_links_close_so_every_endpoint_gets_one():
    """With 1 idle link kept, 5 decode endpoints in turn all succeed within 30 sockets (12 per link;
    libzmq frees a closed socket's slot asynchronously, so room for two links is left)."""
    cfg = CFG.replace(connections=4, max_links=1)
    with contextlib.ExitStack() as stack:
        rxs = [stack.enter_context(receiver())[0] for _ in range(5)]
        tx = stack.enter_context(sender(cfg, max_sockets=30))
        states = [transfer(tx, rx, 30 + i) for i, rx in enumerate(rxs)]
        assert [s.state for s in states] == [S.DONE] * 5, [s.reason for s in states]
        assert tx.call_sync(lambda: len(tx._links)) == 1


def test_unused_links_close_after_link_idle_s():
    with receiver() as (rx, _), sender(CFG.replace(link_idle_s=0.2)) as tx:
        assert transfer(tx, rx, 40).state is S.DONE
        assert until(lambda: tx.call_sync(lambda: len(tx._links)) == 0, timeout=10.0)
        assert transfer(tx, rx, 41).state is S.DONE  # reopened on demand


def test_an_error_in_one_transfer_fails_only_that_transfer():
    """A handler raising for transfer 50 fails it (the receiver hears Abort); 51 and the loop go on."""
    with receiver() as (rx, _), sender() as tx:
        real = tx._frames.staged

        def broken(tid, seq, plan, data):
            if tid == 50:
                raise RuntimeError("injected bug")
            return real(tid, seq, plan, data)

        tx._frames.staged = broken
        s = transfer(tx, rx, 50)
        assert (s.state, s.reason) == (S.FAILED, "sender internal error in sending a chunk: RuntimeError: "
                                                  "injected bug")
        assert rx.wait(50, 5).state is S.ABORTED
        tx.call(lambda: 1 / 0)  # a queued call raising is contained too
        assert tx.call_sync(lambda: 42) == 42
        assert transfer(tx, rx, 51).state is S.DONE
        assert tx._thread.is_alive() and tx.fatal is None


def test_a_malformed_server_key_fails_its_transfer(tmp_path):
    generate_keys(str(tmp_path))
    with sender(CFG.replace(keys_dir=str(tmp_path))) as tx:
        tx.send(60, PeerInfo("127.0.0.1", free_port(), "not a key"), TEN, last=True)
        s = tx.wait(60, 10)
        assert s.state is S.FAILED and s.reason.startswith("bad peer server_key 'not a key'")
        assert tx.call_sync(lambda: len(tx._links)) == 0 and tx.fatal is None


def test_a_dead_loop_fails_pending_transfers_and_refuses_work():
    """If the loop thread itself dies, `fatal` says why, statuses go terminal, calls fail fast."""
    with sender() as tx, receiver() as (rx, _):
        assert tx.fatal is None and rx.fatal is None
        tx.send(70, PeerInfo("127.0.0.1", free_port()), TEN, last=True)  # waits for an OpenAck forever
        assert until(lambda: tx.poll(70).state is S.OPENING)

        def broken_poller():
            raise RuntimeError("poller broke")

        tx.poll_items = broken_poller
        assert until(lambda: tx.fatal is not None, timeout=10.0)
        assert tx.fatal == "RuntimeError: poller broke" and not tx._thread.is_alive()
        assert (tx.poll(70).state, tx.poll(70).reason) == (S.FAILED, "sender loop died: RuntimeError: poller broke")
        tx.send(71, rx.address, TEN, last=True)  # does not raise into the scheduler; poll says why
        assert tx.poll(71).state is S.FAILED
        t0 = time.monotonic()
        with pytest.raises(LoopDead, match="poller broke"):
            tx.call_sync(lambda: 1)
        with pytest.raises(LoopDead):
            tx.call(print)
        assert time.monotonic() - t0 < 5.0  # call_sync's own timeout is 10 s: these did not wait for it


# -- session tokens: another process on this host cannot speak for our links --------------------------

def test_each_link_names_its_connections_with_its_own_secret_token():
    """ROUTING_ID = 16-byte token (first byte non-zero: not a libzmq-generated id) + connection index;
    the receiver binds each transfer to it (receiver hardening tests show the refused intruder)."""
    with contextlib.ExitStack() as stack:
        rxs = [stack.enter_context(receiver())[0] for _ in range(2)]
        tx = stack.enter_context(sender(CFG.replace(connections=3)))
        assert [transfer(tx, rx, 90 + i).state for i, rx in enumerate(rxs)] == [S.DONE, S.DONE]
        ids = tx.call_sync(lambda: [[s.getsockopt(zmq.ROUTING_ID) for s in link.socks] for link in tx._links])
    tokens = {link_ids[0][:-1] for link_ids in ids}
    assert len(tokens) == 2
    for link_ids in ids:
        token = link_ids[0][:-1]
        assert len(token) == 16 and token[0] != 0
        assert link_ids == [token + bytes([i]) for i in range(3)]


# -- a decode restarted on its fixed port with a new CURVE key ------------------------------------------

def test_key_rotation_on_a_fixed_port(tmp_path):
    k1, k2 = str(tmp_path / "k1"), str(tmp_path / "k2")
    generate_keys(k1)
    generate_keys(k2)
    # the rotated decode admits the prefill's client key, and the prefill trusts the rotated server key
    shutil.copy(os.path.join(k1, "client.key"), os.path.join(k2, "authorized_clients", "prefill.key"))
    os.makedirs(os.path.join(k1, "authorized_servers"), exist_ok=True)
    shutil.copy(os.path.join(k2, "server.key"), os.path.join(k1, "authorized_servers", "rotated.key"))
    with sender(CFG.replace(keys_dir=k1)) as tx:
        with receiver(CFG.replace(keys_dir=k1)) as (rx, _):
            port, old_key = rx.address.port, rx.address.server_key
            assert transfer(tx, rx, 80, wait=15).state is S.DONE
        with receiver(CFG.replace(keys_dir=k2), port=port) as (rx, dst):
            assert rx.address.port == port and rx.address.server_key != old_key
            s = transfer(tx, rx, 81, wait=15)
            assert s.state is S.DONE, s.reason
            assert read_items(dst, LAYOUT, TEN) == read_items(SRC, LAYOUT, TEN)
            assert tx.call_sync(lambda: [link.peer for link in tx._links]) == [rx.address]
