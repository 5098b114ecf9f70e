"""Shared stubs of the prfaas_zmq backend tests (test_backend_admission.py, test_backend_rooms.py).

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

from prfaas_sgl.srt.backend import control  # noqa: E402
from prfaas_sgl.srt.backend.admission import Admission, PeerBook  # noqa: E402
from prfaas_sgl.srt.backend.decode import DecodeManager  # noqa: E402
from prfaas_sgl.srt.backend.manager import DataPlaneDead  # noqa: E402
from prfaas_sgl.srt.backend.memory import KVMemory  # noqa: E402
from prfaas_sgl.srt.backend.prefill import PrefillManager, _Outgoing  # noqa: E402
from prfaas_sgl.srt.backend.rooms import Unstarted  # noqa: E402
from prfaas_sgl.srt.backend.settings import insecure_problem  # noqa: E402
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
    m._init_liveness()


def make_prefill(keys_dir=None) -> PrefillManager:
    m = object.__new__(PrefillManager)
    _common(m, keys_dir)
    m.sender = m.data_plane = StubSender()
    m.peers = PeerBook(Admission(m.register_secret, keys_dir), fit=m._fit)
    m._open, m._lock, m._wake = {}, threading.Lock(), threading.Event()
    m.transfer_infos, m.req_to_decode_prefix_len, m._unstarted, m._room_ttl_s = {}, {}, Unstarted(), 600.0
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


def _admitted_prefill(keys_dir=None):
    m = make_prefill(keys_dir)
    secret = register_secret(keys_dir) if keys_dir else None
    assert m.peers.admit(control.encode(register(), secret), register(), DECODE_IP)
    return m, secret


def control_tid(m):
    from prfaas_sgl.srt.backend.memory import transfer_id

    return transfer_id(ROOM, m.local_ip, m.rank_port)


def AbortNotification_frames():
    from sglang.srt.disaggregation.common.conn import ABORT_TAG

    return [ABORT_TAG, str(ROOM).encode(), DECODE_IP.encode(), b"5555"]
