"""prfaas_zmq backend hardening (issue 12): forged Registers (H1), the watch thread (M4), blacklisted
prefills (M6), leaked rooms (L1), a dead data-plane loop (H5, decode side), keys by default (M3).

Managers are built without SGLang's constructor (no bootstrap server, no scheduler); their methods run
as SGLang calls them, against a stub sender/receiver that records what it is asked to do."""
from __future__ import annotations

import collections
import shutil
import threading
import time
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest

pytest.importorskip("sglang", reason="the backend subclasses SGLang's KV manager")

from sglang.srt.disaggregation.base.conn import KVPoll  # noqa: E402

from prfaas_sgl.backend import control  # noqa: E402
from prfaas_sgl.backend.admission import Admission, PeerBook  # noqa: E402
from prfaas_sgl.backend.decode import DecodeManager  # noqa: E402
from prfaas_sgl.backend.manager import DataPlaneDead  # noqa: E402
from prfaas_sgl.backend.memory import KVMemory  # noqa: E402
from prfaas_sgl.backend.prefill import PrefillManager, _Outgoing  # noqa: E402
from prfaas_sgl.backend.settings import insecure_problem  # noqa: E402
from prfaas_sgl.config import PrfaasConfig  # noqa: E402
from prfaas_sgl.transfer.config import TransferConfig  # noqa: E402
from prfaas_sgl.transfer.security import generate_keys, register_secret, server_public_key  # noqa: E402
from prfaas_sgl.transfer.states import TransferState as S, TransferStatus  # noqa: E402

DECODE_IP, ATTACKER_IP = "10.0.0.2", "10.6.6.6"
ROOM = 77
_BUFS = [np.zeros(4 * 256, np.uint8) for _ in range(3)]  # 2 K/V buffers of 4 pages, 1 aux buffer of 4 rows


def kv_args():
    ptrs = [b.ctypes.data for b in _BUFS]
    return SimpleNamespace(kv_data_ptrs=ptrs[:2], kv_data_lens=[1024, 1024], kv_item_lens=[256, 256],
                           aux_data_ptrs=ptrs[2:], aux_data_lens=[1024], aux_item_lens=[256], page_size=1)


class StubSender:
    def __init__(self):
        self.sent, self.released, self.fatal = [], [], None
        self.status: dict[int, TransferStatus] = {}
        self.on_release = None

    def send(self, tid, peer, regions, last=False):
        self.sent.append((tid, peer, last))

    def poll(self, tid):
        return self.status.get(tid, TransferStatus(S.TRANSFERRING))

    def release(self, tid):
        self.released.append(tid)
        if self.on_release:
            self.on_release(tid)


def _common(m, keys_dir):
    m.kv_args = kv_args()
    m.memory = KVMemory.of(m.kv_args)
    m.transfer_config = TransferConfig(keys_dir=keys_dir)
    m.register_secret = register_secret(keys_dir) if keys_dir else None
    m.request_status, m.failure_records, m.failure_lock = {}, {}, threading.Lock()
    m._deferred_ack_targets, m._deferred_ack_poisoned_rooms = {}, set()
    m._staging_outstanding, m.deferred_bootstrap = collections.defaultdict(int), None
    m.local_ip, m.rank_port, m.attn_tp_size, m._stopped = DECODE_IP, 5555, 1, False
    m.status_messages = []
    m.send_kv_status_message = lambda **kw: m.status_messages.append(kw)


def make_prefill(keys_dir=None) -> PrefillManager:
    m = object.__new__(PrefillManager)
    _common(m, keys_dir)
    m.sender = m.data_plane = StubSender()
    m.peers = PeerBook(Admission(m.register_secret, keys_dir))
    m.rejections, m._open, m._lock, m._wake = {}, {}, threading.Lock(), threading.Event()
    m.transfer_infos, m.req_to_decode_prefix_len, m._unstarted, m._room_ttl_s = {}, {}, {}, 600.0
    return m


def register(host=DECODE_IP, data_host=None, server_key=None, port=5555):
    return control.Register(endpoint=host, dst_port=port, data_host=data_host or host, data_port=7000,
                            server_key=server_key, layout=KVMemory.of(kv_args()).layout, page_size=1,
                            attn_tp_size=1, tp_rank=0)


def metadata(room=ROOM, npages=4, port=5555):
    return control.Metadata(room=room, endpoint=DECODE_IP, dst_port=port, npages=npages, aux_index=0,
                            state_indices=[], decode_prefix_len=0, required_dst_info_num=1, is_dummy=False)


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    good, attacker = tmp_path_factory.mktemp("keys"), tmp_path_factory.mktemp("attacker")
    generate_keys(str(good))
    generate_keys(str(attacker))
    return str(good), str(attacker)


# -- H1: a forged Register must not choose where KV goes or which key encrypts it -------------------------
def test_forged_register_cannot_redirect_kv(keys):
    """Before the fix, the last Register for a session won: the sender got the attacker's address and key."""
    good, attacker = keys
    m = make_prefill(good)
    secret = register_secret(good)
    legit = register(server_key=server_public_key(good))
    m._on_control(control.encode(legit, secret), DECODE_IP)
    forged = msgspec.structs.replace(legit, data_host=ATTACKER_IP, server_key=server_public_key(attacker))
    m._on_control(control.encode(forged), ATTACKER_IP)  # unsigned
    m._on_control(control.encode(forged, b"x" * 32), ATTACKER_IP)  # signed with a guessed secret
    m._on_control(control.encode(metadata(), secret), DECODE_IP)
    m.add_transfer_request(ROOM, np.arange(4), slice(0, 4), is_last_chunk=True, aux_index=0)
    (_, peer, _), = m.sender.sent
    assert (peer.host, peer.server_key) == (DECODE_IP, server_public_key(good))
    assert m.peers.refusals == {"unsigned": 1, "bad_mac": 1}


@pytest.mark.parametrize("case, counter", [
    ("data_host_elsewhere", "host_mismatch"), ("sent_from_elsewhere", "host_mismatch"),
    ("untrusted_key", "untrusted_key"), ("bad_port", "bad_address"),
])
def test_signed_register_is_still_checked(keys, case, counter):
    good, attacker = keys
    m = make_prefill(good)
    key, peer_ip, msg = server_public_key(good), DECODE_IP, None
    if case == "data_host_elsewhere":
        msg = register(data_host=ATTACKER_IP, server_key=key)
    elif case == "sent_from_elsewhere":
        msg, peer_ip = register(server_key=key), ATTACKER_IP
    elif case == "untrusted_key":
        msg = register(server_key=server_public_key(attacker))
    else:
        msg = msgspec.structs.replace(register(server_key=key), data_port=0)
    m._on_control(control.encode(msg, register_secret(good)), peer_ip)
    assert msg.session not in m.peers and m.peers.refusals == {counter: 1}
    m._on_control(control.encode(metadata(), register_secret(good)), DECODE_IP)
    m.add_transfer_request(ROOM, np.arange(4), slice(0, 4), is_last_chunk=True, aux_index=0)
    assert m.sender.sent == [] and m.request_status[ROOM] == KVPoll.Failed
    assert counter in m.failure_records[ROOM]  # the decode learns why


def test_loopback_sender_may_register_a_routable_endpoint(keys):
    """The demo's decode (10.x) reaches a prefill on 127.0.0.1 over loopback."""
    good, _ = keys
    m = make_prefill(good)
    assert m.peers.admit(control.encode(register(server_key=None), register_secret(good)), register(), "127.0.0.1")


def test_peer_book_is_bounded():
    book = PeerBook(Admission(None, None), cap=3)
    for port in range(10):
        msg = register(port=port + 1)
        book.admit(control.encode(msg), msg, DECODE_IP)
        if port == 1:
            book.touch(f"{DECODE_IP}:1")  # in use: survives the next evictions
    assert len(book) == 3 and f"{DECODE_IP}:1" not in book and f"{DECODE_IP}:10" in book


def test_secure_client_refuses_a_key_it_does_not_trust(keys):
    """Second H1 repro: a sender with keys_dir used to connect to whatever server key a Register named."""
    import zmq

    from prfaas_sgl.transfer.security import secure_client

    good, attacker = keys
    sock = zmq.Context.instance().socket(zmq.DEALER)
    try:
        with pytest.raises(ValueError, match="untrusted CURVE server key"):
            secure_client(sock, good, server_public_key(attacker))
        secure_client(sock, good, server_public_key(good))
        secure_client(sock, good, None)
    finally:
        sock.close(0)


def test_authorized_servers_extend_the_trusted_set(keys, tmp_path):
    from prfaas_sgl.transfer.security import server_key_problem, trusted_server_keys

    good, attacker = keys
    d = tmp_path / "k"
    shutil.copytree(good, d)
    assert server_key_problem(str(d), server_public_key(attacker))
    shutil.copy(f"{attacker}/server.key", d / "authorized_servers" / "decode-b.key")
    assert server_key_problem(str(d), server_public_key(attacker)) is None
    assert trusted_server_keys(str(d)) == {server_public_key(good), server_public_key(attacker)}


# -- M4: the watch thread survives a destination added while it looks ---------------------------------
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


# -- L1: rooms whose prefill never started are forgotten --------------------------------------------------
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
    assert 2 in m.transfer_infos and m._unstarted == {}


def test_metadata_carries_a_page_count_not_page_ids():
    assert "pages" not in control.Metadata.__struct_fields__  # 36 B per page per waiting room before


# -- H5 (decode side) and a dead loop ----------------------------------------------------------------------
class StubReceiver:
    def __init__(self, exc=None):
        self.exc, self.fatal, self.expected, self.released = exc, None, [], []

    def expect(self, tid, regions, timeout_s=None):
        if self.exc:
            raise self.exc
        self.expected.append(tid)

    def poll(self, tid):
        return TransferStatus(S.TRANSFERRING)

    def release(self, tid):
        self.released.append(tid)


def make_decode(receiver) -> DecodeManager:
    m = object.__new__(DecodeManager)
    _common(m, None)
    m.receiver = m.data_plane = receiver
    m.expected, m.peer_rejections, m.waiting_timeout = {}, {}, 300.0
    return m


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
    import prfaas_sgl.backend.manager as manager

    monkeypatch.setattr(manager, "_WATCHDOG_S", 0.01)
    m = make_decode(StubReceiver())
    stopped = threading.Event()
    m.stop_server = stopped.set
    t = threading.Thread(target=m._watchdog, daemon=True)
    t.start()
    m.receiver.fatal = "loop crashed"
    assert stopped.wait(2.0)


# -- M6: a prefill once incompatible is usable again ------------------------------------------------------
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


# -- M3: keys by default on routable addresses ----------------------------------------------------------
def test_routable_address_needs_keys_or_insecure(keys):
    good, _ = keys
    assert "prfaas keys DIR" in insecure_problem(PrfaasConfig(), "10.0.0.2")
    assert insecure_problem(PrfaasConfig(), "127.0.0.1") is None
    assert insecure_problem(PrfaasConfig(zmq_insecure=True), "10.0.0.2") is None
    assert insecure_problem(PrfaasConfig(zmq_curve_keys=good), "10.0.0.2") is None


def test_keys_command_makes_a_usable_directory(tmp_path, capsys):
    from prfaas_sgl.cli import main

    assert main(["keys", str(tmp_path / "k")]) == 0
    cfg = PrfaasConfig(zmq_curve_keys=str(tmp_path / "k"))
    assert len(register_secret(cfg.zmq_curve_keys)) >= 32
    assert "--prfaas-zmq-curve-keys" in capsys.readouterr().out


def test_control_socket_refuses_forged_register_over_tcp(keys):
    """H1 over real sockets: SGLang's PULL control socket, a legit decode and a forger on PUSH sockets."""
    import zmq

    good, attacker = keys
    m = make_prefill(good)
    ctx = zmq.Context()
    m.server_socket = ctx.socket(zmq.PULL)
    port = m.server_socket.bind_to_random_port("tcp://127.0.0.1")
    thread = threading.Thread(target=m._control_loop, daemon=True)
    thread.start()
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    try:
        legit = register("127.0.0.1", server_key=server_public_key(good))
        forged = msgspec.structs.replace(legit, server_key=server_public_key(attacker))
        push.send_multipart(control.encode(legit, register_secret(good)))
        push.send_multipart(control.encode(forged))
        push.send_multipart(control.encode(forged, register_secret(attacker)))
        deadline = time.monotonic() + 10
        while sum(m.peers.refusals.values()) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert m.peers.refusals == {"unsigned": 1, "bad_mac": 1}
        assert m.peers.get(legit.session).server_key == server_public_key(good)
        assert thread.is_alive()
    finally:
        m._stopped = True
        thread.join(2)
        push.close(0)
        m.server_socket.close(0)
        ctx.term()


def test_sender_will_not_encrypt_kv_for_an_announced_untrusted_key(keys, tmp_path):
    """Second H1 repro, over real sockets: an attacker's CURVE receiver that even authorizes the
    prefill's client key. Before the fix the transfer completed into the attacker's memory."""
    from prfaas_sgl.transfer.layout import page_regions
    from prfaas_sgl.transfer.receiver import ZmqReceiver
    from prfaas_sgl.transfer.sender import ZmqSender
    from prfaas_sgl.transfer.testing import fill_random, small_layout

    good, attacker = keys
    evil = tmp_path / "evil"
    shutil.copytree(attacker, evil)
    shutil.copy(f"{good}/client.key", evil / "authorized_clients" / "victim.key")
    layout = small_layout()
    cfg = TransferConfig(connections=1, chunk_bytes=8192, window_bytes=32768, timeout_s=10.0)
    rx = ZmqReceiver(layout, fill_random(layout, seed=1), cfg.replace(keys_dir=str(evil)))
    tx = ZmqSender(layout, fill_random(layout, seed=2), cfg.replace(keys_dir=good))
    try:
        regions = page_regions(layout, [1, 2])
        rx.expect(9, regions)
        tx.send(9, rx.address, regions, last=True)  # rx.address carries the attacker's server key
        status = tx.wait(9, 10)
        assert status.state is S.FAILED and "untrusted CURVE server key" in status.reason
        assert rx.poll(9).nbytes == 0
    finally:
        tx.close()
        rx.close()


# -- issue 12 review: Metadata creates room state, so it is authenticated and bounded too ----------------
def _admitted_prefill(keys_dir=None):
    m = make_prefill(keys_dir)
    secret = register_secret(keys_dir) if keys_dir else None
    assert m.peers.admit(control.encode(register(), secret), register(), DECODE_IP)
    return m, secret


@pytest.mark.parametrize("case, counter", [
    ("unsigned", "metadata_unsigned"), ("bad_mac", "metadata_bad_mac"),
    ("sent_from_elsewhere", "metadata_host_mismatch"), ("no_tcp_peer", "metadata_host_mismatch"),
    ("huge_state", "metadata_bad_metadata"), ("negative_pages", "metadata_bad_metadata"),
])
def test_forged_metadata_creates_no_room(keys, case, counter):
    """Before the fix any host that reached the control socket created a room for ~10 min per Metadata."""
    good, _ = keys
    m, secret = _admitted_prefill(good)
    msg, peer_ip = metadata(), DECODE_IP
    frames = None
    if case == "unsigned":
        frames = control.encode(msg)
    elif case == "bad_mac":
        frames = control.encode(msg, b"y" * 32)
    elif case == "sent_from_elsewhere":
        peer_ip = ATTACKER_IP
    elif case == "no_tcp_peer":
        peer_ip = None
    elif case == "huge_state":
        msg = msgspec.structs.replace(msg, state_indices=[list(range(70000))])
    else:
        msg = msgspec.structs.replace(msg, npages=-1)
    m._on_control(frames or control.encode(msg, secret), peer_ip)
    assert (m.transfer_infos, m.request_status, m._unstarted) == ({}, {}, {})
    assert m.peers.refusals == {counter: 1}


def test_decode_signs_its_metadata(keys):
    good, _ = keys
    d = make_decode(StubReceiver())
    d.register_secret = register_secret(good)
    frames = d.build_receiver_metadata_message(
        bootstrap_room=ROOM, required_dst_info_num=1, kv_indices=np.arange(4), aux_index=0, state_indices=None,
        decode_prefix_len=0, is_dummy=False)
    m, _ = _admitted_prefill(good)
    m._on_control(frames, DECODE_IP)
    assert m.request_status[ROOM] == KVPoll.WaitingForInput and m.peers.refusals == {}


def test_metadata_of_an_unknown_session_is_refused_without_keys():
    m, _ = _admitted_prefill()
    m._on_control(control.encode(metadata(port=6666)), DECODE_IP)
    assert m.transfer_infos == {} and m.peers.refusals == {"metadata_unregistered": 1}


def test_unstarted_rooms_are_bounded(monkeypatch):
    import prfaas_sgl.backend.prefill as prefill

    monkeypatch.setattr(prefill, "MAX_UNSTARTED", 3)
    m, _ = _admitted_prefill()
    for room in range(5):
        m._on_control(control.encode(metadata(room)), DECODE_IP)
    assert sorted(m._unstarted) == [0, 1, 2] and sorted(m.transfer_infos) == [0, 1, 2]
    assert m.peers.refusals == {"metadata_too_many_rooms": 2}


# -- a timed-out expect() must not leave a live transfer on pages SGLang frees ----------------------------
def test_timed_out_expect_releases_its_transfer():
    rx = StubReceiver(TimeoutError())
    m = make_decode(rx)
    assert m.expect(ROOM, np.arange(2), 0, None) is not None
    assert rx.released == [control_tid(m)]  # queued after the add that call_sync gave up waiting for


def control_tid(m):
    from prfaas_sgl.backend.memory import transfer_id

    return transfer_id(ROOM, m.local_ip, m.rank_port)


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


def AbortNotification_frames():
    from sglang.srt.disaggregation.common.conn import ABORT_TAG

    return [ABORT_TAG, str(ROOM).encode(), DECODE_IP.encode(), b"5555"]


# -- the TCP peer a control message came from -------------------------------------------------------------
def test_unknown_tcp_peer_is_a_mismatch_with_keys(keys):
    good, _ = keys
    msg = register()
    assert Admission(register_secret(good), None).refusal(control.encode(msg, register_secret(good)), msg, None)[0] \
        == "host_mismatch"
    assert Admission(None, None).refusal(control.encode(msg), msg, None) is None  # no keys: nothing to check


def test_peer_ip_is_the_connecting_address():
    """Over TCP from source address 127.0.0.2: the value is the connecting host, not a loopback default."""
    import zmq

    from prfaas_sgl.backend.prefill import _peer_ip

    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    try:
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        push.connect(f"tcp://127.0.0.2:0;127.0.0.1:{port}")
        push.send_multipart([b"a", b"b"])
        assert pull.poll(5000)
        parts = pull.recv_multipart(copy=False)
        assert _peer_ip(parts[0]) == "127.0.0.2"
    finally:
        push.close(0)
        pull.close(0)
        ctx.term()


# -- trusted keys: parsed once per file version, a bad file skipped ----------------------------------------
def test_bad_trusted_key_file_is_skipped_and_files_are_cached(keys, tmp_path, monkeypatch):
    import zmq.auth

    from prfaas_sgl.transfer.security import server_key_problem, trusted_server_keys

    good, attacker = keys
    d = tmp_path / "k"
    shutil.copytree(good, d)
    shutil.copy(f"{attacker}/server.key", d / "authorized_servers" / "decode-b.key")
    (d / "authorized_servers" / "broken.key").write_text("not a certificate")
    assert trusted_server_keys(str(d)) == {server_public_key(good), server_public_key(attacker)}
    assert server_key_problem(str(d), server_public_key(attacker)) is None  # raised before: every link refused
    loads = []
    real = zmq.auth.load_certificate
    monkeypatch.setattr(zmq.auth, "load_certificate", lambda p: loads.append(p) or real(p))
    trusted_server_keys(str(d))
    assert loads == []  # parsed on every Register before
