"""CurveZMQ: only senders holding an authorized client key can connect and deliver bytes."""

import shutil

import pytest

from prfaas_sgl.transfer.config import TransferConfig
from prfaas_sgl.transfer.security import generate_keys, server_public_key
from prfaas_sgl.transfer.sender import ZmqSender
from prfaas_sgl.transfer.states import TransferState as S
from tests.support.transport import Remote, batch, fill_random, read_items, small_layout, stream_bytes

LAYOUT = small_layout()
PAGES = [3, 4, 5, 9]


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    good = tmp_path_factory.mktemp("keys")
    generate_keys(str(good))
    intruder = tmp_path_factory.mktemp("intruder")
    generate_keys(str(intruder))  # a valid key pair, just not authorized by `good`
    shutil.copy(good / "server.key", intruder / "server.key")  # knows the server's public key
    return str(good), str(intruder)


def cfg(keys_dir):
    # timeout_s is only a liveness bound here: refusals are reported from the handshake, not by timing
    # out, and on a loaded 2-core CI machine an authorized CURVE handshake has taken over 1 s.
    return TransferConfig(connections=2, chunk_bytes=8192, window_bytes=32768, timeout_s=10.0, keys_dir=keys_dir)


def test_only_authorized_senders_deliver(keys):
    good, intruder = keys
    src = fill_random(LAYOUT, seed=5)
    with Remote("receiver", LAYOUT, cfg(good)) as rx:
        assert rx.address.server_key == server_public_key(good)
        items = batch(LAYOUT, PAGES)
        refused = ("CURVE authentication refused by", "handshake with")
        for tid, sender_cfg, reason in ((1, cfg(intruder), refused[0]), (2, cfg(None), refused[1])):
            rx.call("expect", tid, items, 5.0)
            tx = ZmqSender(LAYOUT, src, sender_cfg)
            try:
                tx.send(tid, rx.address, items, last=True)
                s = tx.wait(tid, 15)
            finally:
                tx.close()
            assert s.state is S.FAILED and s.reason.startswith(f"{reason} {rx.address.key()}")
            r = rx.call("poll", tid)
            assert (r.state, r.nbytes) == (S.WAITING, 0)
        assert rx.call("read", items) == bytes(stream_bytes(LAYOUT, items))  # nothing injected
        tx = ZmqSender(LAYOUT, src, cfg(good))
        try:
            tx.send(1, rx.address, items, last=True)
            assert tx.wait(1, 15).state is S.DONE
        finally:
            tx.close()
        assert rx.call("wait", 1, 15).state is S.DONE
        assert rx.call("read", items) == read_items(src, LAYOUT, items)
