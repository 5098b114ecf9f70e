"""The sender's stats endpoint is bounded, prunable and optionally authenticated: idle clients cannot pin
threads or fds, a closed link's entry and Prometheus series go (its counts stay in the sums), a token
closes the endpoint, and clients not on this machine never see the decodes' data endpoints. Real
sockets on 127.0.0.1; the remote-client view is asked of `StatsServer.respond` directly (a test may not
reach a routable address)."""

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from prfaas_sgl.transfer.config import PeerInfo, TransferConfig
from prfaas_sgl.transfer.receiver import ZmqReceiver
from prfaas_sgl.transfer.sender import ZmqSender
from prfaas_sgl.transfer.states import TransferState as S
from prfaas_sgl.transfer.stats import StatsBook, StatsServer
from prfaas_sgl.transfer.stats_http import HttpServer, Request
from tests.support.transport import batch, fill_random, small_layout

LAYOUT = small_layout()
CFG = TransferConfig(connections=2, chunk_bytes=4096, window_bytes=65536, timeout_s=10)
SRC = fill_random(LAYOUT, seed=4)
PAGES = batch(LAYOUT, [1, 2])  # 32 KiB
TOKEN = "s3cret-stats-token-0123456789"


def book_with(peers: dict[str, int]) -> StatsBook:
    book = StatsBook()
    for peer, n in peers.items():
        s = book.link(peer)
        s.on_send(n, 0.01)
        s.on_ack(n, time.monotonic())
        s.on_done(0.5)
    return book


def get(url: str, token: str | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.fixture
def server():
    made = []

    def make(book=None, **kw):
        made.append(StatsServer(book or book_with({"10.0.0.2:7000": 4096}), **kw))
        return made[-1]

    yield make
    for s in made:
        s.close()


def test_300_idle_connections_do_not_pin_300_threads(server):
    """Before: 300 idle clients made 300 handler threads (302 after 6 s), each held until the client left.
    Now no thread per connection; beyond the cap the oldest idle ones are closed, and a real client
    is still answered at once."""
    srv = server()
    before = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(300)]
    try:
        time.sleep(0.5)
        assert threading.active_count() <= before
        assert srv.open_connections <= 64
        t0 = time.monotonic()
        code, body = get(f"http://127.0.0.1:{srv.port}/stats")
        assert code == 200 and json.loads(body)["links"]["10.0.0.2:7000"]["bytes_total"] == 4096
        assert time.monotonic() - t0 < 2.0
    finally:
        for c in idle:
            c.close()


def test_idle_and_trickling_connections_are_closed_after_the_timeout(server):
    """Before, a client that never finished its request held its handler thread for ever."""
    srv = server(timeout_s=0.5)
    quiet = socket.create_connection(("127.0.0.1", srv.port))
    slow = socket.create_connection(("127.0.0.1", srv.port))
    try:
        t0 = time.monotonic()
        slow.settimeout(0.1)
        closed = None
        for _ in range(50):  # one header byte every 100 ms: the deadline counts from accept, not the last byte
            try:
                slow.send(b"X")
                if slow.recv(1) == b"":
                    closed = time.monotonic() - t0
                    break
            except TimeoutError:
                continue
            except OSError:
                closed = time.monotonic() - t0
                break
        quiet.settimeout(5)
        assert quiet.recv(1) == b""  # closed by the server
        assert closed is not None and 0.4 <= closed <= 2.5
    finally:
        quiet.close()
        slow.close()


def test_a_token_closes_the_endpoint_and_stays_out_of_repr():
    cfg = CFG.replace(stats_token=TOKEN)
    assert TOKEN not in repr(cfg)
    with pytest.raises(ValueError, match="stats_token"):
        CFG.replace(stats_token="short")
    tx = ZmqSender(LAYOUT, SRC, cfg, stats_port=0)
    try:
        url = f"http://127.0.0.1:{tx.stats_server.port}"
        assert get(url + "/stats")[0] == 401
        assert get(url + "/metrics", "wrong-token-wrong-token")[0] == 401
        code, body = get(url + "/stats", TOKEN)
        assert code == 200 and "links" in json.loads(body)
        assert get(url + "/metrics", TOKEN)[0] == 200
    finally:
        tx.close()


def test_remote_clients_get_sums_without_the_decodes_addresses(server):
    """Without a token a client on another machine gets one link "*" and metrics without the peer label:
    the sums the router (link goodput, bytes_total) and the dashboards (sum by instance) read."""
    srv = server(book_with({"10.0.0.2:7000": 4096, "10.0.0.3:7000": 8192}))
    remote = json.loads(srv.respond(Request("GET", "/stats", {}, local=False)).body)
    (link,) = remote["links"].values()
    assert remote["links"].keys() == {"*"}
    assert (link["bytes_total"], link["transfers_done"], link["queue_delay_s"]["n"]) == (12288, 2, 2)
    metrics = srv.respond(Request("GET", "/metrics", {}, local=False)).body.decode()
    assert "10.0.0." not in json.dumps(remote) and "10.0.0." not in metrics
    assert "prfaas_transfer_acked_bytes_total 12288.0" in metrics
    local = json.loads(srv.respond(Request("GET", "/stats", {}, local=True)).body)
    assert local["links"].keys() == {"10.0.0.2:7000", "10.0.0.3:7000"}


def test_a_closed_links_entry_and_series_go_and_the_sums_keep_them():
    """Before, every decode endpoint ever met kept its entry and its Prometheus series for ever."""
    dst = [np.zeros(b.nbytes, np.uint8) for b in LAYOUT.buffers]
    rx = ZmqReceiver(LAYOUT, dst, CFG)
    tx = ZmqSender(LAYOUT, SRC, CFG.replace(link_idle_s=0.3), stats_port=0)
    try:
        rx.expect(1, PAGES)
        tx.send(1, rx.address, PAGES, last=True)
        assert tx.wait(1, 10).state is S.DONE
        tx.send(2, PeerInfo("not-an-ip", 1), PAGES, last=True)  # refused before any link
        assert tx.wait(2, 5).state is S.FAILED
        assert set(tx.stats.snapshot()["links"]) == {rx.address.key(), "not-an-ip"}
        end = time.monotonic() + 5
        while tx.stats.snapshot()["links"] and time.monotonic() < end:
            time.sleep(0.05)
        assert tx.stats.snapshot()["links"] == {}
        metrics = get(f"http://127.0.0.1:{tx.stats_server.port}/metrics")[1].decode()
        assert rx.address.key() not in metrics and "not-an-ip" not in metrics
        (link,) = tx.stats.aggregate_snapshot()["links"].values()
        assert (link["bytes_total"], link["transfers_done"], link["failures"]) == (32768, 1, {"bad_peer": 1})
        assert "prfaas_transfer_acked_bytes_total 32768.0" in tx.stats.metrics.aggregate_exposition().decode()
    finally:
        tx.close()
        rx.close()


def test_a_bug_answering_one_request_fails_only_that_request(server, monkeypatch):
    book = book_with({"10.0.0.2:7000": 4096})
    srv = server(book)
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("snapshot broke")
        return {"links": {}}

    monkeypatch.setattr(book, "snapshot", flaky)
    assert get(f"http://127.0.0.1:{srv.port}/stats")[0] == 500
    assert get(f"http://127.0.0.1:{srv.port}/stats") == (200, b'{"links": {}}')
    assert srv.fatal is None


def test_a_dead_stats_thread_is_reported(monkeypatch):
    def broken(self):
        raise RuntimeError("selector broke")

    monkeypatch.setattr(HttpServer, "_iterate", broken)
    tx = ZmqSender(LAYOUT, SRC, CFG, stats_port=0)
    try:
        end = time.monotonic() + 5
        while tx.worker_fatal is None and time.monotonic() < end:
            time.sleep(0.01)
        assert tx.worker_fatal == "transfer-stats thread died: RuntimeError: selector broke"
        assert tx.fatal is None
    finally:
        tx.close()
