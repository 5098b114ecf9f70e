"""Real bytes between processes over 127.0.0.1: the receiver runs in a spawned process."""

import itertools
import json
import urllib.request

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from prfaas_sgl.transfer.config import TransferConfig
from prfaas_sgl.transfer.sender import ZmqSender
from prfaas_sgl.transfer.states import TransferState as S
from tests.support.transport import Remote, batch, fill_random, read_items, small_layout

LAYOUT = small_layout()
CFG = TransferConfig(connections=2, chunk_bytes=8192, window_bytes=65536, timeout_s=10)
IDS = itertools.count(1)


@pytest.fixture(scope="module")
def rx():
    with Remote("receiver", LAYOUT, CFG) as remote:
        yield remote


@pytest.fixture(scope="module")
def src():
    return fill_random(LAYOUT, seed=1)


def test_chunked_pieces_then_tail_land_exactly(rx, src):
    tid = next(IDS)
    src_pages, dst_pages = [1, 2, 3, 10, 11, 40], [5, 6, 7, 8, 9, 20]
    dst = batch(LAYOUT, dst_pages, slot=2, aux=1)
    rx.call("expect", tid, dst)
    tx = ZmqSender(LAYOUT, src, CFG, stats_port=0)
    try:
        tx.send(tid, rx.address, batch(LAYOUT, src_pages[:4]))
        tx.send(tid, rx.address, batch(LAYOUT, src_pages[4:], slot=0, aux=3), last=True)
        assert rx.call("wait", tid, 10).state is S.DONE
        status = tx.wait(tid, 5)
        want = read_items(src, LAYOUT, batch(LAYOUT, src_pages, slot=0, aux=3))
        expected = len(want)
        assert (status.state, status.nbytes) == (S.DONE, expected)
        assert rx.call("read", dst) == want
        stats = json.load(urllib.request.urlopen(f"http://127.0.0.1:{tx.stats_server.port}/stats", timeout=5))
        link = stats["links"][rx.address.key()]
        assert (link["bytes_total"], link["bytes_in_flight"], link["transfers_done"]) == (expected, 0, 1)
        assert link["failures"] == {}
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{tx.stats_server.port}/metrics", timeout=5).read()
        assert f'prfaas_transfer_acked_bytes_total{{peer="{rx.address.key()}"}} {float(expected)}' in \
            metrics.decode()
    finally:
        tx.close()


pages = st.lists(st.integers(0, 63), min_size=1, max_size=20, unique=True)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), connections=st.sampled_from([1, 2, 3, 8]),
       chunk=st.sampled_from([4096, 6000, 65536]), with_tail=st.booleans())
def test_random_page_sets_sizes_and_connections(rx, src, data, connections, chunk, with_tail):
    src_pages = data.draw(pages)
    dst_pages = data.draw(st.lists(st.integers(0, 63), min_size=len(src_pages), max_size=len(src_pages),
                                   unique=True))
    split = data.draw(st.integers(0, len(src_pages)))
    tid = next(IDS)
    src_tail, dst_tail = ({"slot": 1, "aux": 0}, {"slot": 3, "aux": 2}) if with_tail else ({}, {})
    rx.call("expect", tid, batch(LAYOUT, dst_pages, **dst_tail))
    cfg = CFG.replace(connections=connections, chunk_bytes=chunk, window_bytes=4 * chunk)
    tx = ZmqSender(LAYOUT, src, cfg)
    try:
        tx.send(tid, rx.address, batch(LAYOUT, src_pages[:split]))
        tx.send(tid, rx.address, batch(LAYOUT, src_pages[split:], **src_tail), last=True)
        assert rx.call("wait", tid, 10).state is S.DONE
        assert tx.wait(tid, 5).state is S.DONE
        got = rx.call("read", batch(LAYOUT, dst_pages, **dst_tail))
        assert got == read_items(src, LAYOUT, batch(LAYOUT, src_pages, **src_tail))
    finally:
        tx.close()
