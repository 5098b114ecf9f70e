"""A prefill and a decode `prfaas_zmq` manager built by their real constructors over one `FakeTransport`
(`transport=`), with SGLang's own control plane between them (ZeroMQ on loopback: Register, Metadata,
status and abort messages, received by the managers' control threads). Only the bootstrap server's HTTP
answers are stood in, so tests drive SGLang's per-request objects the way its schedulers do and watch the
room/status logic in seconds, without a server. Used by test_backend_fake_rooms.py."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np
import pytest

pytest.importorskip("sglang", reason="the backend subclasses SGLang's KV manager")

from sglang.srt import runtime_context as sglang_rc  # noqa: E402
from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll  # noqa: E402
from sglang.srt.disaggregation.common.conn import (  # noqa: E402
    CommonKVManager, CommonKVReceiver, PrefillServerInfo,
)
from sglang.srt.disaggregation.utils import DisaggregationMode  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

from prfaas_sgl.config import PrfaasConfig  # noqa: E402
from prfaas_sgl.srt import flags  # noqa: E402
from prfaas_sgl.srt.backend import manager as manager_module  # noqa: E402
from prfaas_sgl.srt.backend.conn import PrfaasKVReceiver, PrfaasKVSender, kv_manager  # noqa: E402
from prfaas_sgl.srt.backend.manager import PrfaasKVManager  # noqa: E402
from prfaas_sgl.srt.backend.memory import transfer_id  # noqa: E402
from prfaas_sgl.transfer.config import TransferConfig  # noqa: E402
from tests.support.fake_transport import FakeTransport  # noqa: E402

ADDR = "127.0.0.1:1"  # the prefill's bootstrap address as the decode names it (nothing listens there)
PAGES, PAGE, ROWS, ROW = 16, 64, 8, 32  # two K/V buffers of PAGES pages, one aux buffer of ROWS rows


def kv_args(arrays: list[np.ndarray]) -> KVArgs:
    a = KVArgs()
    a.engine_rank, a.page_size, a.system_dp_rank, a.pp_rank = 0, 1, 0, 0
    a.kv_data_ptrs, a.kv_data_lens, a.kv_item_lens = [x.ctypes.data for x in arrays[:2]], [PAGES * PAGE] * 2, [PAGE] * 2
    a.aux_data_ptrs, a.aux_data_lens, a.aux_item_lens = [arrays[2].ctypes.data], [ROWS * ROW], [ROW]
    a.kv_cache_dtype_str, a.kv_layout, a.is_hybrid_mla_backend = "bfloat16", None, False
    a.state_types, a.state_data_ptrs, a.state_data_lens, a.state_item_lens = [], [], [], []
    return a


def pools(seed: int | None) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    sizes = [PAGES * PAGE] * 2 + [ROWS * ROW]
    return [rng.integers(0, 256, n, dtype=np.uint8) if seed is not None else np.zeros(n, np.uint8) for n in sizes]


@dataclass
class PD:
    net: FakeTransport
    p: PrfaasKVManager
    d: PrfaasKVManager
    src: list[np.ndarray]
    dst: list[np.ndarray]
    threads: list[threading.Thread] = field(default_factory=list)  # the managers' own (control, watch, ...)

    def tid(self, room: int) -> int:
        return transfer_id(room, self.d.local_ip, self.d.rank_port)

    def sender(self, room: int, npages: int) -> PrfaasKVSender:
        """The prefill scheduler's side of a request: bootstrapped, waiting for the decode's Metadata."""
        tx = PrfaasKVSender(self.p, ADDR, room)
        tx.init(npages, aux_index=1)
        return tx

    def receiver(self, room: int) -> PrfaasKVReceiver:
        """The decode scheduler's side: registered with the prefill, WaitingForInput."""
        rx = PrfaasKVReceiver(self.d, ADDR, room)
        rx.init(prefill_dp_rank=0)
        return rx

    def close(self) -> None:
        """Stop the managers' threads, then close their sockets: a ZeroMQ context left with open sockets
        blocks the interpreter's exit."""
        for m in (self.p, self.d):
            m._stopped = True
            m.data_plane.close()
        self.p._wake.set()
        self.d._heartbeat_shutdown.set()
        for t in self.threads:
            t.join(5)
        for m in (self.p, self.d):
            m._zmq_ctx.destroy(linger=0)


def until(poll, want, timeout: float = 5.0):
    """Poll (as SGLang's scheduler loop does) until it returns `want`; returns the last value."""
    end = time.monotonic() + timeout
    got = poll()
    while got != want and time.monotonic() < end:
        time.sleep(0.005)
        got = poll()
    return got


@pytest.fixture()
def make_pd(monkeypatch):
    """`make_pd(waiting_timeout_s=..., zmq_timeout_s=...)` → a connected PD over a fresh FakeTransport
    (`fake=False`: the managers' default transport; `keys_dir`: signed control messages)."""
    built: list[PD] = []
    monkeypatch.setenv("SGLANG_HOST_IP", "127.0.0.1")  # loopback: no keys needed (settings.insecure_problem)
    monkeypatch.setattr(CommonKVManager, "register_to_bootstrap", lambda self: None)  # no bootstrap server
    monkeypatch.setattr(manager_module, "_WATCHDOG_S", 0.05)  # its thread stops within a test's teardown
    threads: list[threading.Thread] = []
    start = PrfaasKVManager._start
    monkeypatch.setattr(PrfaasKVManager, "_start", lambda self, *a: threads.append(start(self, *a)) or threads[-1])

    def make(waiting_timeout_s: int = 300, zmq_timeout_s: float = 60.0, fake: bool = True,
             keys_dir: str = "") -> PD:
        monkeypatch.setenv("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", str(waiting_timeout_s))
        sa = ServerArgs(model_path="dummy", device="cpu", enable_pd_role_switch=True)  # polling control recv
        prfaas = PrfaasConfig(transfer=TransferConfig(timeout_s=zmq_timeout_s), zmq_curve_keys=keys_dir)
        setattr(sa, flags.CONFIG_ATTR, prfaas)
        sglang_rc.reset_context()
        sglang_rc.publish(sa, role="scheduler", ranks=sglang_rc.SpawnRanks(world_rank=0))
        sglang_rc.get_parallel().override_permanently(pp_group=None)  # pipeline size 1: never used
        net, src, dst, mark = FakeTransport(), pools(7), pools(None), len(threads)
        p = kv_manager(kv_args(src), DisaggregationMode.PREFILL, sa, transport=net if fake else None)
        d = kv_manager(kv_args(dst), DisaggregationMode.DECODE, sa, transport=net if fake else None)
        # what try_ensure_parallel_info and the bootstrap server's /route would tell the decode
        d.prefill_info_table[ADDR] = PrefillServerInfo(
            attn_tp_size=1, attn_cp_size=1, dp_size=1, pp_size=1, page_size=1, kv_cache_dtype="bfloat16",
            follow_bootstrap_room=True, target_tp_rank=0, target_tp_ranks=[0], target_cp_ranks=[0],
            target_pp_ranks=[0], required_dst_info_num=1, required_prefill_response_num=1)
        route = {"rank_ip": p.local_ip, "rank_port": p.rank_port}
        monkeypatch.setattr(CommonKVReceiver, "_get_bootstrap_info_from_server", lambda self, *a: dict(route))
        built.append(PD(net, p, d, src, dst, threads[mark:]))
        return built[-1]

    yield make
    for pd in built:
        pd.close()
    CommonKVReceiver.close_all_sockets()  # the decode's sockets to the prefills (class-wide cache)
    sglang_rc.reset_context()
