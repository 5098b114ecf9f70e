"""`PrfaasKVManager`: SGLang's common KV manager (bootstrap, registration, heartbeats, abort, status
messages) with the ZeroMQ data plane underneath, the part both roles share. SGLang builds one manager per
scheduler rank and role: the role's subclass (`prefill.PrefillManager` / `decode.DecodeManager`), picked by
`conn.kv_manager`, which sits above all three so that this base never imports its subclasses.
"""
from __future__ import annotations

import collections
import functools
import logging
import signal
import threading
import time
from collections.abc import Callable

import zmq
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import CommonKVManager
from sglang.srt.utils.network import config_socket, is_valid_ipv6_address

from prfaas_sgl.srt import flags
from prfaas_sgl.srt.backend import control
from prfaas_sgl.srt.backend.idle_park import Waker
from prfaas_sgl.srt.backend.memory import KVMemory
from prfaas_sgl.srt.backend.settings import insecure_problem, transfer_config
from prfaas_sgl.srt.backend.tp_state import StateShapes, local_states
from prfaas_sgl.transfer.api import Transport, ZmqTransport
from prfaas_sgl.transfer.security import register_secret

log = logging.getLogger(__name__)
_WATCHDOG_S = 1.0  # how often an idle server looks at its fatal sources
# Complete messages queued per control connection: a decode's PUSH socket holds the rest (SGLang's
# SNDHWM is 0), so this only bounds what one connection can park here (RCVHWM x MAX_FRAME).
_CONTROL_HWM = 64


class DataPlaneDead(RuntimeError):
    """The transport's loop thread died: this server can move no more KV. Raised on the scheduler thread,
    where SGLang's crash handling takes the whole server down, so /health fails and the router (and any
    supervisor) stop sending here instead of every request waiting out its timeout."""


class PrfaasKVManager(CommonKVManager):
    # Prefill → decode status frames carry a tag and the failure reason, so decode can say why.
    kv_status_msg_tag = control.STATUS_TAG
    kv_status_msg_carries_reason = True
    reports_transfer_latency = True
    idle_waker: Waker | None = None  # set first thing in __init__ (tests build managers without it)

    def __new__(cls, *args, **kw):
        if cls is PrfaasKVManager:  # the base alone serves neither role: it would fail at the first request
            raise TypeError("PrfaasKVManager is the roles' shared base: build a manager with conn.kv_manager(...) "
                            "(or PrefillManager / DecodeManager)")
        return super().__new__(cls)

    def __init__(self, args, disaggregation_mode, server_args, is_mla_backend=False, *,
                 transport: Transport | None = None):
        """SGLang passes the first four; `transport` builds the data plane (tests pass a fake one)."""
        device = str(getattr(server_args, "device", "cpu") or "cpu")
        if device not in ("cpu", "cuda"):
            # the staged path gathers with torch on host memory or CUDA (transfer/staging.py); other devices' pool
            # pointers cannot be viewed: fail at start-up, not with a crash at the first transfer
            raise ValueError(f"--disaggregation-transfer-backend prfaas_zmq runs on --device cpu or cuda, "
                             f"got {device!r}; use mooncake there")
        self.idle_waker = Waker()  # wakes a scheduler parked on our rooms (idle_park) at every status change
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        self.prfaas_config = flags.get_config(server_args)
        problem = insecure_problem(self.prfaas_config, self.local_ip)
        if problem:
            raise ValueError(problem)
        self.transfer_config = transfer_config(self.prfaas_config)
        keys = self.transfer_config.keys_dir
        self.register_secret = register_secret(keys) if keys else None  # HMAC key of Register messages
        self.memory = KVMemory.of(args, device)
        self.transport = transport or ZmqTransport()
        self.data_plane = None  # the role's sender / receiver, built by self.transport
        self._stopped = False
        self._init_liveness()
        self._bound_control_socket()  # the decode's (a prefill's was rebound before it was published)
        log.info("prfaas_zmq %s rank %s: %s", disaggregation_mode.value, args.engine_rank, self.memory.describe())

    @functools.cached_property
    def state_shapes(self) -> StateShapes:
        """This rank's state slots as SGLang describes them (tp_state), for peers at another attention TP;
        or why they cannot be sliced (a peer at another TP is then refused with it)."""
        return local_states(self.kv_args, self.memory)

    def update_status(self, bootstrap_room: int, status: KVPoll):
        super().update_status(bootstrap_room, status)
        if self.idle_waker is not None:
            self.idle_waker.wake()

    @property
    def state_ids(self) -> tuple[int, ...]:
        return tuple(b for ids in self.memory.state_ids for b in ids)

    # -- the control socket ------------------------------------------------------------------------------
    def register_to_bootstrap(self):
        """Prefill: publishes `rank_port` to the bootstrap server; bound it first."""
        self._bound_control_socket()
        super().register_to_bootstrap()

    def _bound_control_socket(self) -> None:
        """Replace SGLang's control PULL socket (no MAXMSGSIZE: a 4 GiB frame declared by any host that
        reaches the port was buffered whole) with a bounded one, before its port is published (the
        prefill's bootstrap registration; the decode's Register and ABORT frames read `rank_port`)."""
        old = self.server_socket
        if old.getsockopt(zmq.MAXMSGSIZE) == control.MAX_FRAME:
            return
        self.rank_port, self.server_socket = bounded_pull(self._zmq_ctx, self.local_ip)
        old.close(linger=0)

    def _encode_kv_status_message(self, **kw) -> list[bytes]:
        return control.sign_status(super()._encode_kv_status_message(**kw), self.register_secret)

    def parse_kv_status_message(self, msg: list[bytes]):
        """SGLang's parser, after the MAC check when keys are configured: a forged Failed is dropped."""
        frames = control.status_frames(msg, self.register_secret)
        if frames is None:
            self.note_dropped("forged_status", "prefill status frame without a valid MAC")
            return None
        return super().parse_kv_status_message(frames)

    def note_dropped(self, name: str, why: str) -> None:
        """Count a dropped control frame; log at powers of two (a flood must not flood the log)."""
        self.dropped[name] += 1
        n = self.dropped[name]
        if n & (n - 1) == 0:
            log.error("prfaas_zmq: dropped %s (%d so far): %s", name, n, why)

    # -- liveness: every thread of ours and the data plane ----------------------------------------------
    def _init_liveness(self) -> None:
        self.deaths: dict[str, str] = {}  # thread name → why it ended while the manager was running
        self.dropped: collections.Counter[str] = collections.Counter()
        # What the watchdog and the scheduler thread check; a component with its own thread adds one
        # callable returning why it died (or None while it lives).
        self.fatal_sources: list[Callable[[], str | None]] = [self._data_plane_death, self._thread_death]

    def _start(self, target, name: str) -> threading.Thread:
        t = threading.Thread(target=self._guarded, args=(target, name), name=name, daemon=True)
        t.start()
        return t

    def _guarded(self, target, name: str) -> None:
        """Run a long-lived thread; its end while the manager runs is recorded for the watchdog (the loops
        drop one bad message themselves, so reaching here means the loop itself is broken)."""
        try:
            target()
            why = "returned"
        except BaseException as e:  # noqa: BLE001 - whatever ended it, /health must say so
            why = f"{type(e).__name__}: {e}"
            if not self._stopped:
                log.critical("prfaas_zmq: thread %s died", name, exc_info=True)
        if not self._stopped:
            self.deaths.setdefault(name, why)

    def _data_plane_death(self) -> str | None:
        fatal = self.data_plane_fatal()
        return None if fatal is None else f"data plane is dead: {fatal}"

    def _thread_death(self) -> str | None:
        name = next(iter(self.deaths), None)
        return None if name is None else f"thread {name} died: {self.deaths[name]}"

    def fatal(self) -> str | None:
        """Why this server can move no more KV (the first fatal source that reports), or None."""
        return next((why for why in (source() for source in self.fatal_sources) if why is not None), None)

    def data_plane_fatal(self) -> str | None:
        """Why the transport's loop thread died, or None while it runs (`fatal` of ZmqSender/ZmqReceiver)."""
        return getattr(self.data_plane, "fatal", None)

    def check_data_plane(self, room: int) -> None:
        """Scheduler thread: when a fatal source reports, fail `room` with the reason and raise DataPlaneDead."""
        fatal = self.fatal()
        if fatal is None:
            return
        reason = f"prfaas_zmq {fatal}"
        self.record_first_failure(room, reason)
        self.update_status(room, KVPoll.Failed)
        log.critical("%s; stopping the server so that /health fails", reason)
        raise DataPlaneDead(reason)

    def _watchdog(self) -> None:
        """An idle server never polls a transfer: notice a death here and take the server down the way
        SGLang's scheduler does when it crashes (SIGQUIT to the launcher, which kills the tree)."""
        signalled = False  # once: the launcher is taking the tree down; this thread lives on until then
        while not self._stopped:
            time.sleep(_WATCHDOG_S)
            fatal = None if signalled else self.fatal()
            if fatal is not None:
                log.critical("prfaas_zmq %s; stopping the server so that /health fails", fatal)
                self.stop_server()
                signalled = True

    def stop_server(self) -> None:
        import psutil

        psutil.Process().parent().send_signal(signal.SIGQUIT)

    def record_first_failure(self, room: int, reason: str) -> None:
        """Record `reason` unless a root cause is already known (later failures are its symptoms)."""
        with self.failure_lock:
            self.failure_records.setdefault(room, reason)


def bounded_pull(ctx: zmq.Context, host: str) -> tuple[int, zmq.Socket]:
    """(port, socket): a PULL socket like SGLang's `get_zmq_socket_on_host`, with frames capped at
    control.MAX_FRAME (libzmq then drops a connection at a larger frame's header) and a per-connection
    queue bound. Both are copied at bind time, so they are set before it."""
    sock = ctx.socket(zmq.PULL)
    config_socket(sock, zmq.PULL)
    sock.setsockopt(zmq.MAXMSGSIZE, control.MAX_FRAME)
    sock.setsockopt(zmq.RCVHWM, _CONTROL_HWM)
    if is_valid_ipv6_address(host):
        sock.setsockopt(zmq.IPV6, 1)
        return sock.bind_to_random_port(f"tcp://[{host}]"), sock
    return sock.bind_to_random_port(f"tcp://{host}"), sock
