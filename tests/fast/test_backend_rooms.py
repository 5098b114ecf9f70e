"""prfaas_zmq backend hardening, rooms and threads: the watch thread, leaked and expired rooms, a dead
data-plane loop (decode side), blacklisted prefills, timed-out expects."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

pytest.importorskip("sglang", reason="the backend subclasses SGLang's KV manager")

from .backend_stubs import (  # noqa: E402
    AbortNotification_frames, DECODE_IP, DataPlaneDead, KVPoll, ROOM, S, StubReceiver, TransferStatus,
    _Outgoing, _admitted_prefill, control, control_tid, make_decode, make_prefill, metadata, register,
)


# -- the watch thread survives a destination added while it looks ---------------------------------
def test_drop_survives_tids_inserted_during_release():
    m = make_prefill()
    out = _Outgoing(ROOM, {1: ("a", 1), 2: ("b", 2)})
    m._open[ROOM] = out
    m.sender.on_release = lambda tid: out.tids.setdefault(tid + 100, ("c", 3))  # the scheduler adds one
    m._drop(out)  # raised "dictionary changed size during iteration" before the fix
    assert m.sender.released == [1, 2] and ROOM not in m._open


def test_watch_step_failure_fails_only_that_room():
    m = make_prefill()
    m.request_status.update({1: KVPoll.Transferring, 2: KVPoll.Transferring})
    m.transfer_infos.update({1: {}, 2: {}})
    bad, good = _Outgoing(1, {11: ("a", 1)}, closed=True), _Outgoing(2, {22: ("a", 1)}, closed=True)
    m._open.update({1: bad, 2: good})
    m.sender.status[22] = TransferStatus(S.DONE)
    poll = m.sender.poll
    m.sender.poll = lambda tid: (_ for _ in ()).throw(RuntimeError("bug")) if tid == 11 else poll(tid)
    m._watch_step()
    assert m.request_status == {1: KVPoll.Failed, 2: KVPoll.Success} and m._open == {}
    assert "internal error" in m.failure_records[1]


# -- rooms whose prefill never started are forgotten --------------------------------------------------
def test_unstarted_rooms_expire():
    m = make_prefill()
    m.peers.admit(control.encode(register()), register(), DECODE_IP)
    for room in (1, 2):
        m._on_control(control.encode(metadata(room)), DECODE_IP)
    m.record_first_failure(1, "aborted by decode")
    m.add_transfer_request(2, np.arange(4), slice(0, 4), is_last_chunk=False)  # room 2 started
    m._expire_unstarted(time.monotonic() + 599)
    assert 1 in m.transfer_infos
    m._expire_unstarted(time.monotonic() + 601)
    assert (1 in m.transfer_infos, 1 in m.request_status, 1 in m.failure_records) == (False, False, False)
    assert 2 in m.transfer_infos and len(m._unstarted) == 0


def test_metadata_carries_a_page_count_not_page_ids():
    assert "pages" not in control.Metadata.__struct_fields__  # 36 B per page per waiting room before


# -- a dead data-plane loop (decode side) ----------------------------------------------------------------------
@pytest.mark.parametrize("exc", [TimeoutError(), RuntimeError("loop gone")])
def test_expect_fails_only_that_transfer(exc):
    m = make_decode(StubReceiver(exc))
    reason = m.expect(ROOM, np.arange(2), 0, None)  # raised into the scheduler before the fix
    assert reason.startswith(f"prfaas_zmq: cannot receive room {ROOM}") and ROOM not in m.expected


def test_dead_loop_fails_the_transfer_and_stops_the_server():
    rx = StubReceiver()
    m = make_decode(rx)
    m.request_status[ROOM] = KVPoll.WaitingForInput
    assert m.expect(ROOM, np.arange(2), 0, None) is None
    rx.fatal = "loop crashed: ZMQError(EMFILE)"
    assert "data plane is dead" in m.expect(ROOM + 1, np.arange(2), 0, None)
    with pytest.raises(DataPlaneDead, match="EMFILE"):  # SGLang's scheduler crash path: /health fails
        m.check_status(ROOM)
    assert m.request_status[ROOM] == KVPoll.Failed and "EMFILE" in m.failure_records[ROOM]


def test_prefill_dead_loop_fails_open_rooms():
    m = make_prefill()
    m.request_status[ROOM] = KVPoll.Transferring
    m.transfer_infos[ROOM] = {}
    m._open[ROOM] = _Outgoing(ROOM, {5: ("a", 1)})
    m.sender.fatal = "loop crashed"
    m._watch_step()
    assert m.request_status[ROOM] == KVPoll.Failed and "data plane is dead" in m.failure_records[ROOM]


def test_watchdog_stops_an_idle_server(monkeypatch):
    import prfaas_sgl.srt.backend.manager as manager

    monkeypatch.setattr(manager, "_WATCHDOG_S", 0.01)
    m = make_decode(StubReceiver())
    stopped = threading.Event()
    m.stop_server = stopped.set
    t = threading.Thread(target=m._watchdog, daemon=True)
    t.start()
    m.receiver.fatal = "loop crashed"
    assert stopped.wait(2.0)


# -- a prefill once incompatible is usable again ------------------------------------------------------
def test_peer_rejection_is_cleared_on_success(monkeypatch):
    from sglang.srt.disaggregation.common.conn import CommonKVManager

    answers = iter([RuntimeError("page size mismatch"), True])

    def base(self, addr):
        a = next(answers)
        if isinstance(a, Exception):
            raise a
        return a

    monkeypatch.setattr(CommonKVManager, "try_ensure_parallel_info", base)
    m = make_decode(StubReceiver())
    assert m.try_ensure_parallel_info("p:1") is False and "p:1" in m.peer_rejections
    assert m.try_ensure_parallel_info("p:1") is True
    assert m.peer_rejections == {}  # stayed forever before: every receiver of p:1 failed in init


# -- a timed-out expect() must not leave a live transfer on pages SGLang frees ----------------------------
def test_timed_out_expect_releases_its_transfer():
    rx = StubReceiver(TimeoutError())
    m = make_decode(rx)
    assert m.expect(ROOM, np.arange(2), 0, None) is not None
    assert rx.released == [control_tid(m)]  # queued after the add that call_sync gave up waiting for


# -- an expired room polled by the scheduler ---------------------------------------------------------------
def test_check_status_of_an_expired_room_is_failed():
    m, _ = _admitted_prefill()
    m._on_control(control.encode(metadata()), DECODE_IP)
    m._expire_unstarted(time.monotonic() + 601)  # between SGLang's `room in request_status` and its poll
    assert m.check_status(ROOM) == KVPoll.Failed  # KeyError on the scheduler thread before


def test_expiry_and_first_chunk_agree():
    """The first chunk and the expiry both take the lock: a started room is never half forgotten."""
    m, _ = _admitted_prefill()
    m._on_control(control.encode(metadata()), DECODE_IP)
    m._lock.acquire()
    t = threading.Thread(target=m._expire_unstarted, args=(time.monotonic() + 601,))
    t.start()
    time.sleep(0.05)
    assert ROOM in m.request_status  # the expiry waits for the lock
    m._unstarted.pop(ROOM)  # what the first chunk does under the lock
    m._lock.release()
    t.join(2)
    assert ROOM in m.request_status and ROOM in m.transfer_infos


# -- a room whose failure handling raises leaves the watch loop ------------------------------------------
def test_room_whose_failure_raises_is_dropped_once():
    m = make_prefill()
    m.request_status[ROOM] = KVPoll.Transferring
    m._open[ROOM] = _Outgoing(ROOM, {5: ("a", 1)})
    polls = []
    m.sender.poll = lambda tid: polls.append(tid) or (_ for _ in ()).throw(RuntimeError("bug"))
    m.conclude_failure = lambda **kw: (_ for _ in ()).throw(RuntimeError("bug in failing"))
    m._watch_step()
    m._watch_step()
    assert ROOM not in m._open and polls == [5] and m.sender.released == [5]
    assert m.request_status[ROOM] == KVPoll.Failed


# -- a room dropped between the status check and the send is not reopened ---------------------------------
def test_send_after_drop_opens_no_transfer():
    m, _ = _admitted_prefill()
    m._on_control(control.encode(metadata()), DECODE_IP)
    m.add_transfer_request(ROOM, np.arange(2), slice(0, 2), is_last_chunk=False)
    get = m.peers.get

    def abort_meanwhile(session):  # the decode aborts; the watch thread drops the room
        m._on_control(AbortNotification_frames(), DECODE_IP)
        m._watch_step()
        return get(session)

    m.peers.get = abort_meanwhile
    m.add_transfer_request(ROOM, np.arange(2), slice(2, 4), is_last_chunk=True, aux_index=0)
    assert len(m.sender.sent) == 1 and m.sender.released == [m.sender.sent[0][0]]
    assert ROOM not in m._open
