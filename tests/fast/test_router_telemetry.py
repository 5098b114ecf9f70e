"""Telemetry reaching the router: transport link stats and KV-event resync."""
from __future__ import annotations

import asyncio
import ctypes
import json
import multiprocessing as mp
import os
import time
import urllib.request

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio
from aiohttp import web

from prfaas_sgl.tools import netns
from prfaas_sgl.router.app import start_router
from prfaas_sgl.router.cluster import Cluster, LinkState, apply_link_stats, check_health, poll_loads, poll_loads_once
from prfaas_sgl.router.config import InstanceSpec, RouterConfig
from prfaas_sgl.router.kv_events import BlockStored, KVEventBatch, KVEventSubscriber
from prfaas_sgl.router.metrics import RouterMetrics
from prfaas_sgl.router.prefix_index import ExactIndex
from prfaas_sgl.transfer.config import TransferConfig
from prfaas_sgl.transfer.layout import kv_layout
from prfaas_sgl.transfer.stats import StatsBook, StatsServer
from tests.support.router_standin import RoomBoard, Standin, build_tiny_tokenizer
from tests.support.transport import Remote, batch, fill_random

pytestmark = pytest.mark.timeout(60)
MB = 1_000_000


def _book_with_traffic(per_peer: dict[str, int], queued_s: float = 0.02) -> StatsBook:
    book = StatsBook()
    now = time.monotonic()
    for peer, nbytes in per_peer.items():
        s = book.link(peer)
        s.on_send(nbytes, queued_s)
        s.on_ack(nbytes, now)
    return book


def test_transport_snapshot_gives_the_router_the_real_numbers():
    """The snapshot nests links under "links"; the router used to read 0 goodput and call it ok."""
    link = LinkState(1e9)
    apply_link_stats(link, _book_with_traffic({"10.0.0.2:7000": 5 * MB}).snapshot())
    assert link.stats_ok
    assert link.goodput_bps == pytest.approx(8 * 5 * MB)  # over the 1 s window
    assert link.queue_delay_s == pytest.approx(0.02)


def test_all_peers_of_the_prefill_add_up_on_the_one_inter_dc_link():
    book = _book_with_traffic({"10.0.0.2:7000": 3 * MB, "10.0.0.3:7000": 1 * MB})
    book.link("10.0.0.4:7000").on_send(MB, 0.5)  # one delayed chunk, not acknowledged yet
    link = LinkState(1e9)
    apply_link_stats(link, book.snapshot())
    assert link.goodput_bps == pytest.approx(8 * 4 * MB)
    assert link.queue_delay_s == pytest.approx((0.02 + 0.02 + 0.5) / 3)  # mean over all chunks


def test_a_transport_that_sent_nothing_yet_is_measured_zero():
    link = LinkState(1e9)
    apply_link_stats(link, StatsBook().snapshot())
    assert (link.goodput_bps, link.queue_delay_s, link.stats_ok) == (0.0, 0.0, True)


@pytest.mark.parametrize("payload", [
    [], None, "ok", {}, {"links": []}, {"links": {"p": None}}, {"links": {"p": {"queue_delay_s": 0.1}}},
    {"goodput_bps": None}, {"goodput_bps": "fast"}, {"goodput_bps": {}}, {"goodput_bps": {"abc": 1}},
    {"goodput_bps": -5.0}, {"goodput_bps": float("nan")}, {"goodput_bps": True},
    {"goodput_bps": 1e9, "queue_delay_s": {"n": 2}}, {"goodput_bps": 1e9, "queue_delay_s": [1]},
])
def test_missing_or_malformed_stats_are_not_trusted(payload):
    link = LinkState(1e9, goodput_bps=7e8, stats_ok=True)
    with pytest.raises(ValueError):
        apply_link_stats(link, payload)
    assert not link.stats_ok


def test_an_unanswered_poll_keeps_the_last_reading_briefly_a_malformed_one_does_not():
    """The stats poll crosses the link it measures: on a congested link one poll timing out dropped the
    router's trust in the link exactly while it was busy (seen over the tbf link below)."""
    link = LinkState(1e9, stale_after_s=1.0)
    link.measured((7e8, 0.01), now=100.0)
    link.missed(100.9)
    assert link.stats_ok and link.goodput_bps == 7e8
    link.missed(101.1)
    assert not link.stats_ok and link.goodput_bps == 0.0
    link.measured((7e8, 0.01), now=102.0)
    with pytest.raises(ValueError):
        apply_link_stats(link, {"goodput_bps": None})
    assert not link.stats_ok


# ---------------------------------------------------------------- the poller survives bad answers


class Answers:
    """A tiny server whose /v1/loads and /stats answer with whatever bytes the test puts there."""

    def __init__(self) -> None:
        self.loads: bytes = b"[]"
        self.stats: bytes = b"[]"

    async def _loads(self, _: web.Request) -> web.Response:
        return web.Response(body=self.loads)

    async def _stats(self, _: web.Request) -> web.Response:
        return web.Response(body=self.stats)

    async def _health(self, _: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/v1/loads", self._loads)
        app.router.add_get("/stats", self._stats)
        app.router.add_get("/health", self._health)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        return f"http://127.0.0.1:{self.runner.addresses[0][1]}"


GOOD_LOADS = {"loads": [{"num_running_reqs": 2, "num_waiting_reqs": 1, "num_waiting_uncached_tokens": 300,
                         "num_used_tokens": 50}]}
BAD = [b"[]", b"null", b"not json", b'{"loads": 5}', b'{"loads": [null]}', b'{"loads": [{"num_used_tokens": "x"}]}',
       b'{"links": {"p": {"goodput_bps": {"abc": 1}}}}', b'{"goodput_bps": null}', b'"x"']


async def _until(cond, timeout_s: float = 10.0) -> None:
    """Waits for the poller's next good round; a fixed sleep flaked on a loaded 2-core machine."""
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)


async def _poller_scenario(tmp_path) -> None:
    srv = Answers()
    url = await srv.start()
    (tmp_path / "tokenizer.json").write_text("{}")
    spec = InstanceSpec(url, bootstrap_port=1)
    cluster = Cluster(RouterConfig(prfaas=(spec,), decode=(InstanceSpec(url),), tokenizer_path=str(tmp_path),
                                   loads_interval_s=0.02, transport_stats_url=f"{url}/stats"))
    async with aiohttp.ClientSession() as session:
        await check_health(cluster, session)  # loads are polled on instances in rotation only
        task = asyncio.create_task(poll_loads(cluster, session))
        try:
            for body in BAD:
                seen = dict(cluster.poll_errors)
                srv.loads = srv.stats = body
                # two more failed rounds: the first may have read the previous body
                await _until(lambda: task.done() or cluster.poll_errors["link_stats"] >= seen["link_stats"] + 2)
                assert not task.done(), f"poller died on {body!r}: {task.exception() if task.done() else ''}"
                assert not cluster.link.stats_ok
            errors = dict(cluster.poll_errors)
            assert errors["loads"] >= len(BAD) and errors["link_stats"] >= len(BAD)
            text = RouterMetrics().render(cluster, threshold=0, budget_s=1.0).decode()
            assert f'prfaas_router_poll_errors{{kind="link_stats"}} {float(errors["link_stats"])}' in text
            assert "prfaas_router_link_stats_ok 0.0" in text
            srv.loads = json.dumps(GOOD_LOADS).encode()
            srv.stats = json.dumps(_book_with_traffic({"10.0.0.2:7000": MB}).snapshot()).encode()
            await _until(lambda: cluster.link.stats_ok and cluster.instances["decode0"].server_reqs == 3)
            assert cluster.link.stats_ok and cluster.link.goodput_bps > 0
            assert "prfaas_router_link_stats_ok 1.0" in RouterMetrics().render(cluster, 0, 1.0).decode()
            assert cluster.instances["prfaas0"].server_queued_tokens == 300
            assert cluster.instances["decode0"].server_queued_tokens == 50
            assert cluster.instances["decode0"].server_reqs == 3
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    await srv.runner.cleanup()


def test_poller_survives_garbage_answers_and_counts_them(tmp_path):
    """A JSON array at the stats URL used to end load polling for every instance, silently."""
    asyncio.run(_poller_scenario(tmp_path))


async def _two_prefills_scenario(tmp_path) -> list[tuple[float, bool]]:
    a, b = Answers(), Answers()
    urls = [await a.start(), await b.start()]
    a.loads = b.loads = json.dumps(GOOD_LOADS).encode()
    a.stats = json.dumps(_book_with_traffic({"10.0.0.2:7000": 3 * MB}).snapshot()).encode()
    b.stats = json.dumps(_book_with_traffic({"10.0.0.2:7000": MB}).snapshot()).encode()
    (tmp_path / "tokenizer.json").write_text("{}")
    cluster = Cluster(RouterConfig(prfaas=(InstanceSpec(urls[0], bootstrap_port=1),), decode=(InstanceSpec(urls[1]),),
                                   tokenizer_path=str(tmp_path), transport_stats_url=f"{urls[0]}/stats, {urls[1]}/stats"))
    seen = []
    async with aiohttp.ClientSession() as session:
        await check_health(cluster, session)
        await poll_loads_once(cluster, session)
        seen.append((cluster.link.goodput_bps, cluster.link.stats_ok))
        b.stats = b"{}"
        await poll_loads_once(cluster, session)
        seen.append((cluster.link.goodput_bps, cluster.link.stats_ok))
    for srv in (a, b):
        await srv.runner.cleanup()
    return seen


def test_several_stats_urls_add_up_and_all_must_answer(tmp_path):
    """One endpoint per PrfaaS prefill (or TP rank) all feed the one link; a partial sum is not trusted."""
    seen = asyncio.run(_two_prefills_scenario(tmp_path))
    assert seen[0][1] and seen[0][0] == pytest.approx(8 * 4 * MB)
    assert seen[1] == (0.0, False)


# ---------------------------------------------------------------- KV events resync after a gap


def _batch(*hashes: int, parent: int | None = None) -> bytes:
    ev = BlockStored(block_hashes=list(hashes), parent_block_hash=parent,
                     token_ids=list(range(4 * len(hashes))), block_size=4)
    return msgspec.msgpack.encode(KVEventBatch(0.0, [ev]))


async def _gap_scenario() -> tuple[int, int]:
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    index = ExactIndex(4)
    sub = KVEventSubscriber(ctx, f"tcp://127.0.0.1:{port}", index)
    sub.start()
    seq = 100

    async def publish(payload: bytes, step: int = 1) -> None:
        nonlocal seq
        seq += step
        await pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
        await asyncio.sleep(0.05)

    try:
        while len(index) == 0:  # PUB drops until the SUB has joined: repeat a root block until one lands
            await publish(_batch(1))
        await publish(_batch(2, parent=1))
        before = len(index)
        await publish(msgspec.msgpack.encode(KVEventBatch(0.0, [])), step=3)  # seq jumps: 2 batches lost
        return before, len(index)
    finally:
        await sub.close()
        pub.close(linger=0)
        ctx.term()


def test_a_sequence_gap_clears_the_exact_index():
    """After lost events (possibly BlockRemoved) the mirror cannot be trusted: start over."""
    before, after = asyncio.run(_gap_scenario())
    assert (before, after) == (2, 0)


# ---------------------------------------------------------------- proof over a real rate-limited link

RATE_MBIT = 200
LINK_LAYOUT = (2, 1 << 20, 32)  # kv_layout(layers, page bytes, pages): 4 x 32 MiB = 128 MiB, ~5.6 s at 200 Mbit/s
LINK_CFG = TransferConfig(connections=4, chunk_bytes=256 << 10, window_bytes=32 << 20, timeout_s=60)


def _enter_netns(name: str) -> None:
    """setns(2) this (still single-threaded) process into ``name``; threads it starts later inherit it."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            raise OSError(ctypes.get_errno(), f"setns into {name}")
    finally:
        os.close(fd)


def _remote_prefill(conn, netns: str, host: str) -> None:
    """The remote datacenter's sending side: ZmqSender + its StatsServer bound to the routable address."""
    _enter_netns(netns)
    from prfaas_sgl.transfer.sender import ZmqSender
    from prfaas_sgl.transfer.stats import StatsServer

    layout = kv_layout(*LINK_LAYOUT)
    tx = ZmqSender(layout, fill_random(layout, seed=1), LINK_CFG)
    stats = StatsServer(tx.stats, host=host, port=0)
    try:
        conn.send(stats.port)
        tid, peer = conn.recv()
        tx.send(tid, peer, batch(layout, range(LINK_LAYOUT[2])), last=True)
        status = tx.wait(tid, 60)
        conn.send((status.state.value, status.nbytes, tx.stats.snapshot()))
        conn.recv()
    finally:
        stats.close()
        tx.close()


async def _watch_router_goodput(router, done) -> list[tuple[float, float]]:
    """(seconds since start, router's link goodput bits/s or -1 when not ok) every 50 ms, until ``done()``
    and then 1.5 s more: the router's 1 s window plus one poll interval still hold the last bytes."""
    t0, samples, end = time.monotonic(), [], float("inf")
    while time.monotonic() < end:
        link = router.cluster.link
        samples.append((time.monotonic() - t0, link.goodput_bps if link.stats_ok else -1.0))
        if end == float("inf") and done():
            end = time.monotonic() + 1.5
        await asyncio.sleep(0.05)
    return samples


def _start_remote_prefill(link) -> tuple[mp.Process, object]:
    """Forked before any event loop or ZMQ context exists here: no import cost, no inherited sockets."""
    conn, child = mp.get_context("fork").Pipe()
    proc = mp.get_context("fork").Process(target=_remote_prefill, args=(child, link.netns, link.remote_ip),
                                          daemon=True)
    proc.start()
    return proc, conn


async def _link_scenario(tmp_path, link, conn) -> tuple[list[tuple[float, float]], dict]:
    """The router's goodput samples and the sender's own stats of the link after the transfer."""
    board = RoomBoard()
    standins = [Standin("prefill", board), Standin("prefill", board), Standin("decode", board)]
    urls = [await s.start() for s in standins]
    try:
        with Remote("receiver", kv_layout(*LINK_LAYOUT), LINK_CFG, host=link.local_ip) as rx:
            assert conn.poll(30), "remote prefill process did not start"
            stats_url = f"http://{link.remote_ip}:{conn.recv()}/stats"
            cfg = RouterConfig(port=0, prfaas=(InstanceSpec(urls[0], 1),), local_prefill=(InstanceSpec(urls[1], 2),),
                               decode=(InstanceSpec(urls[2]),), tokenizer_path=build_tiny_tokenizer(str(tmp_path)),
                               link_gbps=RATE_MBIT / 1000, loads_interval_s=0.25, transport_stats_url=stats_url)
            handle = await start_router(cfg)
            try:
                rx.call("expect", 1, batch(kv_layout(*LINK_LAYOUT), range(LINK_LAYOUT[2])))
                conn.send((1, rx.address))
                samples = await _watch_router_goodput(handle.router, lambda: conn.poll(0))
                state, nbytes, snap = conn.recv()
                assert (state, rx.call("wait", 1, 10).state.value) == ("done", "done")
            finally:
                await handle.close()
            conn.send("stop")
    finally:
        for s in standins:
            await s.close()
    return samples, snap["links"][rx.address.key()]


@pytest.mark.netns
@pytest.mark.skipif(netns.root_problem() is not None, reason=f"{netns.root_problem()}")
def test_router_measures_the_goodput_the_transport_measured_over_a_tbf_link(tmp_path):
    """Proof over a real link: remote prefill (a netns) -> tc tbf 200 Mbit/s veth -> decode receiver on the
    host; the router, on the host, polls the sender's /stats across the link.

    The transport's figure: bytes / (first send -> Done). The router's: its goodput readings averaged over
    the same transfer (the integral of a 1 s-window rate counts every acknowledged bit once, so stalls of a
    loaded machine weigh the same on both sides)."""
    with netns.emulated_link(rate=f"{RATE_MBIT}mbit") as link:
        proc, conn = _start_remote_prefill(link)
        try:
            samples, peer = asyncio.run(_link_scenario(tmp_path, link, conn))
        finally:
            proc.join(20)
            if proc.is_alive():
                proc.kill()
    duration = peer["transfer_latency_s"]["mean"]
    transport_bps = 8 * peer["bytes_total"] / duration
    bits = sum(g * (t1 - t0) for (t0, g), (t1, _) in zip(samples, samples[1:]))
    router_bps = bits / duration
    assert duration > 4, f"transfer too short to judge: {duration:.1f} s"
    assert 0.5 * RATE_MBIT * 1e6 <= transport_bps <= RATE_MBIT * 1e6  # the link really limited it
    assert router_bps == pytest.approx(transport_bps, rel=0.10), (router_bps, transport_bps)
    busy = [g for t, g in samples if samples[0][0] + 1.5 <= t <= duration]
    assert min(busy) > 0, "the router lost the stats (stats_ok False or 0) while the link was busy"


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0", "::1", "::"])
def test_stats_server_binds_the_configured_address(host):
    """The endpoint was loopback-only; the router in the other datacenter must be able to reach it."""
    server = StatsServer(_book_with_traffic({"10.0.0.2:7000": MB}), host=host, port=0)
    try:
        url = server.url.replace("0.0.0.0", "127.0.0.1").replace("[::]", "[::1]")
        snap = json.load(urllib.request.urlopen(url, timeout=5))
        assert snap["links"]["10.0.0.2:7000"]["bytes_total"] == MB
    finally:
        server.close()
