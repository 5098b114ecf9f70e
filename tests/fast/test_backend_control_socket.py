"""prfaas_zmq control sockets: SGLang binds each manager's PULL socket without ZMQ_MAXMSGSIZE, and libzmq
buffers a whole frame before any MAC check runs. Pinned bug: a raw TCP client that completed a ZMTP NULL
handshake and declared a 4 GiB frame grew the receiving process by every byte it sent (measured by the
review: 18 → 275 MiB RSS after 256 MiB). The managers now rebind that socket bounded, before its port is
published, and it goes on serving legitimate frames."""
from __future__ import annotations

import socket
import struct
import time

import numpy as np
import psutil
import pytest
import zmq

pytest.importorskip("sglang", reason="the backend subclasses SGLang's KV manager")

from prfaas_sgl.srt.backend import control  # noqa: E402
from prfaas_sgl.srt.backend.admission import MAX_STATE_ITEMS  # noqa: E402

from .backend_fake_pd import KVPoll, make_pd, until  # noqa: E402,F401 - make_pd is a fixture

DECLARED, SENT = 4 << 30, 256 << 20
ROOM = 4711


def _zmtp_push(port: int) -> socket.socket:
    """A raw TCP client that speaks just enough ZMTP 3.0 (NULL mechanism) to be a PUSH peer."""
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\x00" + bytes(31))
    props = b"\x0bSocket-Type" + struct.pack(">I", 4) + b"PUSH"
    ready = b"\x05READY" + props
    s.sendall(b"\x04" + bytes([len(ready)]) + ready)
    return s


def _flood(port: int) -> int:
    """Declare a DECLARED-byte frame and send up to SENT bytes of it; the bytes the peer took."""
    s = _zmtp_push(port)
    s.sendall(b"\x02" + struct.pack(">Q", DECLARED))  # one long final frame
    chunk, sent = bytes(1 << 20), 0
    try:
        while sent < SENT:
            s.sendall(chunk)
            sent += len(chunk)
        time.sleep(0.5)  # let libzmq's I/O thread take what the kernel buffered
    except OSError:  # reset by the peer: what a bounded socket does at the header
        pass
    finally:
        s.close()
    return sent


def _rss() -> int:
    return psutil.Process().memory_info().rss


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_a_huge_declared_frame_does_not_grow_memory(make_pd, side):
    pd = make_pd()
    m = pd.p if side == "prefill" else pd.d
    assert m.server_socket.getsockopt(zmq.MAXMSGSIZE) == control.MAX_FRAME
    before = _rss()
    _flood(m.rank_port)
    grown = _rss() - before
    assert grown < 32 << 20, f"{grown >> 20} MiB more after a {SENT >> 20} MiB flood"
    # the socket still serves: a whole request over it (Register, Metadata, abort / status frames)
    tx, rx = pd.sender(ROOM, 4), pd.receiver(ROOM)
    rx.send_metadata(np.arange(4, dtype=np.int32), aux_index=1)
    assert until(tx.poll, KVPoll.WaitingForInput) == KVPoll.WaitingForInput
    tx.send(np.arange(4, dtype=np.int32))
    assert until(rx.poll, KVPoll.Success) == KVPoll.Success


def test_the_bounded_port_is_the_published_one(make_pd):
    """The prefill rebinds before SGLang's bootstrap registration reads rank_port; the decode before its
    Register (and its ABORTs) name it."""
    pd = make_pd()
    for m in (pd.p, pd.d):
        endpoint = m.server_socket.getsockopt(zmq.LAST_ENDPOINT).decode()
        assert endpoint.endswith(f":{m.rank_port}")
    assert f":{pd.d.rank_port}" in control.decode(pd.d.build_receiver_registration_message()).session


def test_the_largest_legitimate_control_frame_fits():
    """A Metadata with every state index it may carry, each a full 64-bit value."""
    meta = control.Metadata(room=2**64 - 1, endpoint="255.255.255.255", dst_port=65535, npages=1 << 24,
                            aux_index=2**63 - 1, state_indices=[[2**63 - 1] * MAX_STATE_ITEMS],
                            decode_prefix_len=2**40, required_dst_info_num=1024, is_dummy=False)
    assert max(len(f) for f in control.encode(meta, b"k" * 32)) < control.MAX_FRAME
