"""prfaas_zmq: every long-lived thread of ours drops one bad message and goes on, and a thread that ends
while its manager runs is recorded as a fatal source, which the watchdog turns into a server stop (so
/health fails) the way it does for a dead data-plane loop. Pinned bugs: the decode's status thread had no
try at all, so one status whose handling raised ended it and every later room on that decode waited out
its 330 s timeout while /health stayed 200; the prefill's control poll, receive and SGLang's bootstrap
handler ran unguarded too."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import zmq

pytest.importorskip("sglang", reason="the backend subclasses SGLang's KV manager")

from .backend_fake_pd import KVPoll, make_pd, until  # noqa: E402,F401 - make_pd is a fixture
from .backend_stubs import DataPlaneDead, ROOM, StubReceiver, make_decode, make_prefill  # noqa: E402

DST, SRC = np.array([9, 3, 12, 5], np.int32), np.array([1, 2, 7, 8], np.int32)


def _request(pd, room: int):
    tx, rx = pd.sender(room, 4), pd.receiver(room)
    rx.send_metadata(DST, aux_index=3)
    assert until(tx.poll, KVPoll.WaitingForInput) == KVPoll.WaitingForInput
    tx.send(SRC)
    return tx, rx


def _raise_once(real):
    calls = []

    def wrapper(*a, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("bug in one message")
        return real(*a, **kw)
    return wrapper


def test_a_status_whose_handling_raises_costs_one_room(make_pd):
    """The review's repro: apply_prefill_status raises once."""
    pd = make_pd()
    pd.d.apply_prefill_status = _raise_once(pd.d.apply_prefill_status)
    _, rx = _request(pd, ROOM)
    assert until(lambda: pd.d.dropped["failed_status"], 1) == 1
    _, rx2 = _request(pd, ROOM + 1)
    assert until(rx2.poll, KVPoll.Success) == KVPoll.Success  # timed out before: nobody heard it
    assert pd.d.deaths == {} and pd.d.fatal() is None


def test_a_control_message_whose_handling_raises_costs_one_message(make_pd):
    """SGLang's bootstrap handler ran before the prefill's try: its exception ended the thread."""
    pd = make_pd()
    tx = pd.sender(ROOM, 4)
    handle = pd.p._handle_bootstrap_message
    pd.p._handle_bootstrap_message = _raise_once(lambda frames: False)
    pd.p.deferred_bootstrap = object()  # SGLang's prefill_complete policy: its handler sees every frame
    push = pd.p._zmq_ctx.socket(zmq.PUSH)
    try:
        push.connect(f"tcp://127.0.0.1:{pd.p.rank_port}")
        push.send_multipart([b"BOOTSTRAP", b"not a room"])
        assert until(lambda: pd.p.dropped["failed_control"], 1) == 1
    finally:
        push.close(0)
    pd.p._handle_bootstrap_message, pd.p.deferred_bootstrap = handle, None
    rx = pd.receiver(ROOM)  # its Register and Metadata are still heard
    rx.send_metadata(DST, aux_index=3)
    assert until(lambda: ROOM in pd.p.transfer_infos, True) is True
    assert pd.p.deaths == {} and tx.poll() != KVPoll.Failed


def test_a_dead_control_thread_is_a_fatal_source_and_stops_the_server(monkeypatch):
    """A socket failure under the prefill's control loop (here: a closed socket) ends the thread; the
    watchdog then stops the server as for a dead data plane, and the scheduler thread refuses rooms."""
    import prfaas_sgl.srt.backend.manager as manager

    monkeypatch.setattr(manager, "_WATCHDOG_S", 0.01)
    m = make_prefill()
    ctx = zmq.Context()
    m.server_socket = ctx.socket(zmq.PULL)
    m.server_socket.close()
    stopped = threading.Event()
    m.stop_server = stopped.set
    try:
        m._start(m._control_loop, "prfaas-zmq-control").join(5)
        assert "prfaas-zmq-control" in m.deaths and "ZMQError" in m.deaths["prfaas-zmq-control"]
        assert m.fatal().startswith("thread prfaas-zmq-control died")
        m._start(m._watchdog, "prfaas-zmq-watchdog")
        assert stopped.wait(5)
        m.request_status[ROOM] = KVPoll.WaitingForInput
        with pytest.raises(DataPlaneDead, match="prfaas-zmq-control died"):
            m.add_transfer_request(ROOM, np.arange(4), slice(0, 4), is_last_chunk=True)
        assert m.request_status[ROOM] == KVPoll.Failed
    finally:
        m._stopped = True
        ctx.term()


def test_a_thread_that_returns_early_is_recorded_and_teardown_is_not():
    m = make_decode(StubReceiver())
    m._start(lambda: None, "early").join(5)
    m._stopped = True
    m._start(lambda: 1 // 0, "at-teardown").join(5)
    assert m.deaths == {"early": "returned"}


def test_another_component_adds_a_fatal_source(monkeypatch):
    """How the stager (or any thread outside this package) joins the watchdog: one callable."""
    import prfaas_sgl.srt.backend.manager as manager

    monkeypatch.setattr(manager, "_WATCHDOG_S", 0.01)
    m = make_decode(StubReceiver())
    stopped = threading.Event()
    m.stop_server = stopped.set
    box = {"why": None}
    m.fatal_sources.append(lambda: box["why"])
    m._start(m._watchdog, "prfaas-zmq-watchdog")
    try:
        time.sleep(0.05)
        assert not stopped.is_set()
        box["why"] = "stager thread died: OSError"
        assert stopped.wait(5)
        time.sleep(0.05)
        assert m.fatal() == "stager thread died: OSError" and m.deaths == {}  # the watchdog lives on
    finally:
        m._stopped = True
