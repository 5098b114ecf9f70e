"""prfaas_zmq backend hardening, who may talk to it: forged Registers and Metadata that redirect KV, keys by
default on routable addresses, the TCP peer a control message came from, trusted key files."""
from __future__ import annotations

import shutil
import threading
import time

import msgspec
import numpy as np
import pytest

pytest.importorskip("sglang", reason="the backend subclasses SGLang's KV manager")

from .backend_stubs import (  # noqa: E402
    ATTACKER_IP, Admission, DECODE_IP, KVPoll, PeerBook, PrfaasConfig, ROOM, S, StubReceiver, TransferConfig,
    _admitted_prefill, control, insecure_problem, keys, make_decode, make_prefill, metadata, register,
    register_secret, server_public_key,
)


# -- a forged Register must not choose where KV goes or which key encrypts it -------------------------
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
    ("untrusted_key", "untrusted_key"), ("bad_port", "bad_register"),
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
    book = PeerBook(Admission(None, None), cap=3, hold_s=0)
    for port in range(10):
        msg = register(port=port + 1)
        book.admit(control.encode(msg), msg, DECODE_IP)
        if port == 1:
            book.touch(f"{DECODE_IP}:1")  # in use: survives the next evictions
    assert len(book) == 3 and f"{DECODE_IP}:1" not in book and f"{DECODE_IP}:10" in book


def test_secure_client_refuses_a_key_it_does_not_trust(keys):
    """Second redirection repro: a sender with keys_dir used to connect to whatever server key a Register named."""
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


# -- keys by default on routable addresses ----------------------------------------------------------
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
    """Redirection over real sockets: SGLang's PULL control socket, a legit decode and a forger on PUSH sockets."""
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
    """Second redirection repro, over real sockets: an attacker's CURVE receiver that even authorizes the
    prefill's client key. Before the fix the transfer completed into the attacker's memory."""
    from prfaas_sgl.transfer.receiver import ZmqReceiver
    from prfaas_sgl.transfer.sender import ZmqSender
    from tests.support.transport import batch, fill_random, small_layout

    good, attacker = keys
    evil = tmp_path / "evil"
    shutil.copytree(attacker, evil)
    shutil.copy(f"{good}/client.key", evil / "authorized_clients" / "victim.key")
    layout = small_layout()
    cfg = TransferConfig(connections=1, chunk_bytes=8192, window_bytes=32768, timeout_s=10.0)
    rx = ZmqReceiver(layout, fill_random(layout, seed=1), cfg.replace(keys_dir=str(evil)))
    tx = ZmqSender(layout, fill_random(layout, seed=2), cfg.replace(keys_dir=good))
    try:
        items = batch(layout, [1, 2])
        rx.expect(9, items)
        tx.send(9, rx.address, items, last=True)  # rx.address carries the attacker's server key
        status = tx.wait(9, 10)
        assert status.state is S.FAILED and "untrusted CURVE server key" in status.reason
        assert rx.poll(9).nbytes == 0
    finally:
        tx.close()
        rx.close()


# -- Metadata creates room state, so it is authenticated and bounded too ----------------
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
    assert (m.transfer_infos, m.request_status, len(m._unstarted)) == ({}, {}, 0)
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
    m, _ = _admitted_prefill()
    m._unstarted.cap = 3
    for room in range(5):
        m._on_control(control.encode(metadata(room)), DECODE_IP)
    assert sorted(m._unstarted) == [0, 1, 2] and sorted(m.transfer_infos) == [0, 1, 2]
    assert m.peers.refusals == {"metadata_too_many_rooms": 2}


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

    from prfaas_sgl.srt.backend.prefill import _peer_ip

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
