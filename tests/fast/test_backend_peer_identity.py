"""prfaas_zmq: who may fail, join or crowd out a room. Pinned bugs: an ABORT naming any return address
failed any room; a forged prefill status "Failed" from any host failed a decode's room; a Metadata from any
admitted session joined any room (and the prefill then sent that room's KV there too); one host could hold
all 16384 unstarted rooms; registering 4096 sessions evicted live decodes, and an evicted decode failed
every room until it restarted (SGLang registers once per prefill)."""
from __future__ import annotations

import msgspec
import numpy as np
import pytest
import zmq

pytest.importorskip("sglang", reason="the backend subclasses SGLang's KV manager")

from sglang.srt.disaggregation.common.conn import ABORT_TAG, KVTransferError  # noqa: E402

from .backend_fake_pd import make_pd, until  # noqa: E402,F401 - make_pd is a fixture
from .backend_stubs import (  # noqa: E402
    ATTACKER_IP, Admission, DECODE_IP, KVPoll, PeerBook, ROOM, _admitted_prefill, control, keys, make_prefill,
    metadata, register,
)

DST, SRC = np.array([9, 3, 12, 5], np.int32), np.array([1, 2, 7, 8], np.int32)


def _abort(room=ROOM, ip=DECODE_IP, port=5555) -> list[bytes]:
    return [ABORT_TAG, str(room).encode(), ip.encode(), str(port).encode()]


def _waiting_room(keys_dir=None):
    m, secret = _admitted_prefill(keys_dir)
    m.request_status[ROOM] = KVPoll.Bootstrapping
    m._on_frames(control.encode(metadata(), secret), DECODE_IP)
    assert m.request_status[ROOM] == KVPoll.WaitingForInput
    return m, secret


# -- ABORT: only from the room's own decode --------------------------------------------------------------
@pytest.mark.parametrize("case", ["other_session", "other_host", "unknown_room_stranger"])
def test_abort_from_a_stranger_is_dropped(keys, case):
    good, _ = keys
    m, _ = _waiting_room(good)
    frames, peer = {"other_session": (_abort(port=6666), DECODE_IP),
                    "other_host": (_abort(), ATTACKER_IP),  # names the room's session from elsewhere
                    "unknown_room_stranger": (_abort(ip=ATTACKER_IP), ATTACKER_IP)}[case]
    m._on_frames(frames, peer)
    assert m.request_status[ROOM] == KVPoll.WaitingForInput and ROOM not in m.failure_records
    assert m.dropped == {"foreign_abort": 1}


def test_abort_from_the_rooms_decode_fails_it():
    m, _ = _waiting_room()
    m._on_frames(_abort(), DECODE_IP)
    assert m.request_status[ROOM] == KVPoll.Failed and m.failure_records[ROOM] == "aborted by decode"


def test_abort_before_the_metadata_needs_a_registered_decode():
    m, _ = _admitted_prefill()
    m.request_status.update({ROOM: KVPoll.Bootstrapping, ROOM + 1: KVPoll.Bootstrapping})
    m._on_frames(_abort(ip=ATTACKER_IP), ATTACKER_IP)
    m._on_frames(_abort(room=ROOM + 1), DECODE_IP)
    assert m.request_status == {ROOM: KVPoll.Bootstrapping, ROOM + 1: KVPoll.Failed}


# -- prefill status: signed when keys are configured -----------------------------------------------------
def test_forged_prefill_failure_is_dropped_with_keys(make_pd, keys):
    good, _ = keys
    pd = make_pd(keys_dir=good)
    tx, rx = pd.sender(ROOM, 4), pd.receiver(ROOM)
    rx.send_metadata(DST, aux_index=3)
    assert until(tx.poll, KVPoll.WaitingForInput) == KVPoll.WaitingForInput
    push = pd.d._zmq_ctx.socket(zmq.PUSH)
    try:
        push.connect(f"tcp://127.0.0.1:{pd.d.rank_port}")
        status = [control.STATUS_TAG, str(ROOM).encode(), str(int(KVPoll.Failed)).encode(), b"0", b"forged"]
        push.send_multipart(status)  # no MAC
        push.send_multipart(status + [b"\0" * 32])  # a wrong one
        assert until(lambda: pd.d.dropped["forged_status"], 2) == 2
    finally:
        push.close(0)
    assert rx.poll() == KVPoll.WaitingForInput  # failed "forged" before
    tx.send(SRC)
    assert until(rx.poll, KVPoll.Success) == KVPoll.Success  # the prefill's signed status is heard


# -- a room is bound to the decode ranks of its first Metadata -------------------------------------------
def _two_sessions(tp=(1, 1), keys_dir=None):
    m, secret = _admitted_prefill(keys_dir)
    other = msgspec.structs.replace(register(port=6666), attn_tp_size=tp[1])
    first = msgspec.structs.replace(register(), attn_tp_size=tp[0])
    m._fit = lambda msg: None  # the TP math is tp.py's business here
    m.peers.fit = m._fit
    for msg in (first, other):
        assert m.peers.admit(control.encode(msg, secret), msg, DECODE_IP)
    return m, secret


def test_a_room_takes_no_session_past_its_first_metadata():
    """Before: the later session was added, and the prefill also sent the room's KV there."""
    m, secret = _two_sessions()
    m.request_status[ROOM] = KVPoll.Bootstrapping
    m._on_frames(control.encode(metadata()), DECODE_IP)
    m._on_frames(control.encode(metadata(port=6666)), DECODE_IP)
    assert list(m.transfer_infos[ROOM]) == [f"{DECODE_IP}:5555"]
    assert m.peers.refusals == {"metadata_foreign_room": 1}


def test_a_fanned_out_room_takes_its_decode_ranks_only():
    """Decode TP 2 → prefill TP 1: both decode ranks join room R (required_dst_info_num 2); a third may not."""
    m, secret = _two_sessions()
    third = register(port=7777)
    assert m.peers.admit(control.encode(third), third, DECODE_IP)
    m.request_status[ROOM] = KVPoll.Bootstrapping
    for port in (5555, 6666, 7777):
        m._on_frames(control.encode(msgspec.structs.replace(metadata(port=port), required_dst_info_num=2)),
                     DECODE_IP)
    assert sorted(m.transfer_infos[ROOM]) == [f"{DECODE_IP}:5555", f"{DECODE_IP}:6666"]
    assert m.request_status[ROOM] == KVPoll.WaitingForInput and m.peers.refusals == {"metadata_foreign_room": 1}


def test_a_room_refuses_a_decode_at_another_tp_or_count():
    m, _ = _two_sessions(tp=(2, 4))
    m._on_frames(control.encode(msgspec.structs.replace(metadata(), required_dst_info_num=2)), DECODE_IP)
    m._on_frames(control.encode(msgspec.structs.replace(metadata(port=6666), required_dst_info_num=2)), DECODE_IP)
    m._on_frames(control.encode(msgspec.structs.replace(metadata(port=6666), required_dst_info_num=3)), DECODE_IP)
    assert list(m.transfer_infos[ROOM]) == [f"{DECODE_IP}:5555"] and m.peers.refusals == {"metadata_foreign_room": 2}


# -- quotas: unstarted rooms per host, sessions per host, live sessions kept -----------------------------
def test_one_host_cannot_take_every_unstarted_room():
    m, _ = _admitted_prefill()
    m._unstarted.per_host = 2
    other = register(host="10.0.0.3")
    assert m.peers.admit(control.encode(other), other, "10.0.0.3")
    for room in range(3):
        m._on_frames(control.encode(metadata(room)), DECODE_IP)
    meta = msgspec.structs.replace(metadata(9), endpoint="10.0.0.3")
    m._on_frames(control.encode(meta), "10.0.0.3")
    assert sorted(m._unstarted) == [0, 1, 9] and m.peers.refusals == {"metadata_too_many_rooms_of_host": 1}
    m.add_transfer_request(0, np.arange(4), slice(0, 4), is_last_chunk=False)  # room 0 starts: a slot frees
    m._on_frames(control.encode(metadata(2)), DECODE_IP)
    assert sorted(m._unstarted) == [1, 2, 9] and m._unstarted.of_host(DECODE_IP) == 2


class _Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_live_sessions_are_not_evicted():
    """Before: the 4097th Register evicted the least recently used session, rooms in flight or not."""
    clock = _Clock()
    book = PeerBook(Admission(None, None), cap=2, hold_s=600, clock=clock)
    a, b, c = (register(port=p) for p in (1, 2, 3))
    assert book.admit(control.encode(a), a, DECODE_IP) and book.admit(control.encode(b), b, DECODE_IP)
    assert not book.admit(control.encode(c), c, DECODE_IP)
    assert a.session in book and b.session in book and book.refusals == {"too_many_sessions": 1}
    assert control.REREGISTER in book.unregistered(c.session)  # its decode will try again
    clock.now += 300
    book.touch(b.session)
    clock.now += 301  # a idle for 601 s, b for 301 s
    assert book.admit(control.encode(c), c, DECODE_IP)
    assert a.session not in book and b.session in book and c.session in book


def test_one_host_cannot_fill_the_book():
    book = PeerBook(Admission(None, None), cap=100, per_host=2, clock=_Clock())
    mine = [register(port=p) for p in (1, 2, 3)]
    assert [book.admit(control.encode(r), r, DECODE_IP) for r in mine] == [True, True, False]
    other = register(host="10.0.0.3")
    assert book.admit(control.encode(other), other, "10.0.0.3")


def test_an_evicted_decode_registers_again(make_pd, keys):
    """The prefill forgot the decode's session (evicted, or the prefill restarted): that room fails with a
    reason telling the decode to register again, and the next request does. Before: every later room
    failed "without registering its data address" until the decode restarted."""
    good, _ = keys
    pd = make_pd(keys_dir=good)
    session = f"{pd.d.local_ip}:{pd.d.rank_port}"
    tx, rx = pd.sender(ROOM, 4), pd.receiver(ROOM)
    rx.send_metadata(DST, aux_index=3)
    assert until(tx.poll, KVPoll.WaitingForInput) == KVPoll.WaitingForInput and session in pd.p.peers
    pd.p.peers._forget(session)
    tx.send(SRC)
    assert until(rx.poll, KVPoll.Failed) == KVPoll.Failed
    with pytest.raises(KVTransferError, match=control.REREGISTER):
        rx.failure_exception()
    tx, rx = pd.sender(ROOM + 1, 4), pd.receiver(ROOM + 1)
    assert until(lambda: session in pd.p.peers, True) is True
    rx.send_metadata(DST, aux_index=3)
    assert until(tx.poll, KVPoll.WaitingForInput) == KVPoll.WaitingForInput
    tx.send(SRC)
    assert until(rx.poll, KVPoll.Success) == KVPoll.Success
