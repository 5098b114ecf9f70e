"""No transfer times out while its link is moving: a transfer whose chunks all went out but wait behind
other transfers' bytes counts the link's acknowledgements as its progress until its own last byte is
acknowledged, and a dead link still ends every transfer on it within timeout_s. A real sender and
receiver over a rate-limited loopback TCP proxy (`throttle_proxy`)."""

import contextlib
import time

import numpy as np

from prfaas_sgl.transfer.config import PeerInfo, TransferConfig
from prfaas_sgl.transfer.receiver import ZmqReceiver
from prfaas_sgl.transfer.sender import ZmqSender
from prfaas_sgl.transfer.states import TransferState as S
from tests.fast.throttle_proxy import ThrottledProxy
from tests.support.transport import batch, fill_random, read_items, small_layout

LAYOUT = small_layout()  # 4 KV buffers of 64 pages × 4 KiB: one chunk per page and buffer
RATE = 64 * 1024  # bytes/s through the proxy: a chunk every 62 ms, a full window every 2 s
# The window (128 KiB) drains in 2 s through the proxy, twice the 1 s timeout; acks come every 62 ms.
CFG = TransferConfig(connections=2, chunk_bytes=4096, window_bytes=128 * 1024, timeout_s=1.0)
SRC = fill_random(LAYOUT, seed=25)
BIG = batch(LAYOUT, list(range(16)))  # 256 KiB: 4 s at RATE
SMALL = batch(LAYOUT, [30])  # 16 KiB, an eighth of the window


@contextlib.contextmanager
def slow_link(cfg=CFG):
    dst = [np.zeros(b.nbytes, np.uint8) for b in LAYOUT.buffers]
    rx = ZmqReceiver(LAYOUT, dst, cfg)
    proxy = ThrottledProxy((rx.address.host, rx.address.port), RATE)
    tx = ZmqSender(LAYOUT, SRC, cfg)
    try:
        yield tx, rx, dst, proxy
    finally:
        tx.close()
        proxy.close()
        rx.close()


def test_a_small_transfer_queued_behind_a_large_one_on_a_slow_link_completes():
    """The small transfer's chunks go out once the large one's last chunk has (oldest first), then wait
    ~2 s behind a window of its bytes: twice its 1 s timeout, with acks arriving all along. Before, it
    ended TIMED_OUT ('timed out after 1 s in state transferring, 0 bytes acknowledged') the moment its
    last chunk left the queue."""
    with slow_link() as (tx, rx, dst, proxy):
        via = PeerInfo("127.0.0.1", proxy.port)
        rx.expect(1, BIG, 60)
        rx.expect(2, SMALL, 60)
        tx.send(1, via, BIG, last=True)
        tx.send(2, via, SMALL, last=True)
        big, small = tx.wait(1, 30), tx.wait(2, 30)
        assert big.state is S.DONE, big.reason
        assert small.state is S.DONE, small.reason
        assert rx.wait(2, 5).state is S.DONE
        assert read_items(dst, LAYOUT, SMALL) == read_items(SRC, LAYOUT, SMALL)
        assert read_items(dst, LAYOUT, BIG) == read_items(SRC, LAYOUT, BIG)


def test_a_dead_link_still_times_out_within_timeout_s():
    """The proxy stops forwarding (no RST, nothing acknowledged) while the small transfer's chunks wait
    behind the large one's: both end TIMED_OUT about timeout_s after the link's last acknowledgement."""
    with slow_link() as (tx, rx, _, proxy):
        via = PeerInfo("127.0.0.1", proxy.port)
        rx.expect(3, BIG, 60)
        rx.expect(4, SMALL, 60)
        tx.send(3, via, BIG, last=True)
        tx.send(4, via, SMALL, last=True)
        time.sleep(2.5)  # the link moves (acks every 62 ms); 4's chunks went out at ~2 s, acked at ~4 s
        assert (tx.poll(3).state, tx.poll(4).state) == (S.TRANSFERRING, S.TRANSFERRING)
        proxy_frozen_at = time.monotonic()
        proxy.freeze()
        s3, s4 = tx.wait(3, 10), tx.wait(4, 10)
        elapsed = time.monotonic() - proxy_frozen_at
        assert (s3.state, s4.state) == (S.TIMED_OUT, S.TIMED_OUT), (s3.reason, s4.reason)
        assert 0.7 <= elapsed <= 3.0  # timeout_s after the last ack (those in the proxy: < 0.3 s later)
