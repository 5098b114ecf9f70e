"""`PrfaasKVManager`: SGLang's common KV manager (bootstrap, registration, heartbeats, abort, status
messages) with the ZeroMQ data plane underneath. SGLang builds one manager per scheduler rank and role;
`PrfaasKVManager(...)` returns the role's subclass (`prefill.PrefillManager` / `decode.DecodeManager`).
"""
from __future__ import annotations

import functools
import logging
import signal
import threading
import time

from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import CommonKVManager
from sglang.srt.disaggregation.utils import DisaggregationMode

from prfaas_sgl.srt import flags
from prfaas_sgl.srt.backend import control
from prfaas_sgl.srt.backend.memory import KVMemory
from prfaas_sgl.srt.backend.settings import insecure_problem, transfer_config
from prfaas_sgl.srt.backend.tp_state import StateTensor, local_states
from prfaas_sgl.transfer.api import Transport, ZmqTransport
from prfaas_sgl.transfer.security import register_secret

log = logging.getLogger(__name__)
_WATCHDOG_S = 1.0  # how often an idle server looks at its data-plane loop


class DataPlaneDead(RuntimeError):
    """The transport's loop thread died: this server can move no more KV. Raised on the scheduler thread,
    where SGLang's crash handling takes the whole server down, so /health fails and the router (and any
    supervisor) stop sending here instead of every request waiting out its timeout."""


class PrfaasKVManager(CommonKVManager):
    # Prefill → decode status frames carry a tag and the failure reason, so decode can say why.
    kv_status_msg_tag = control.STATUS_TAG
    kv_status_msg_carries_reason = True
    reports_transfer_latency = True

    def __new__(cls, args, disaggregation_mode, *rest, **kw):
        if cls is PrfaasKVManager:
            if disaggregation_mode == DisaggregationMode.PREFILL:
                from prfaas_sgl.srt.backend.prefill import PrefillManager as cls
            elif disaggregation_mode == DisaggregationMode.DECODE:
                from prfaas_sgl.srt.backend.decode import DecodeManager as cls
            else:
                raise ValueError(f"prfaas_zmq: unsupported disaggregation mode {disaggregation_mode}")
        return super().__new__(cls)

    def __init__(self, args, disaggregation_mode, server_args, is_mla_backend=False, *,
                 transport: Transport | None = None):
        """SGLang passes the first four; `transport` builds the data plane (tests pass a fake one)."""
        device = str(getattr(server_args, "device", "cpu") or "cpu")
        if device not in ("cpu", "cuda"):
            # the staged path gathers with torch on host memory or CUDA (issue 13); other devices' pool
            # pointers cannot be viewed: fail at start-up, not with a crash at the first transfer
            raise ValueError(f"--disaggregation-transfer-backend prfaas_zmq runs on --device cpu or cuda, "
                             f"got {device!r}; use mooncake there")
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
        log.info("prfaas_zmq %s rank %s: %s", disaggregation_mode.value, args.engine_rank, self.memory.describe())

    @functools.cached_property
    def state_shapes(self) -> dict[int, StateTensor] | str:
        """This rank's state slots as SGLang describes them (tp_state), for peers at another attention TP;
        or why they cannot be sliced (a peer at another TP is then refused with it)."""
        return local_states(self.kv_args, self.memory)

    @property
    def state_ids(self) -> tuple[int, ...]:
        return tuple(b for ids in self.memory.state_ids for b in ids)

    def _start(self, target, name: str) -> threading.Thread:
        t = threading.Thread(target=target, name=name, daemon=True)
        t.start()
        return t

    # -- data-plane liveness ---------------------------------------------------------------------------
    def data_plane_fatal(self) -> str | None:
        """Why the transport's loop thread died, or None while it runs (`fatal` of ZmqSender/ZmqReceiver)."""
        return getattr(self.data_plane, "fatal", None)

    def check_data_plane(self, room: int) -> None:
        """Scheduler thread: when the loop died, fail `room` with the reason and raise DataPlaneDead."""
        fatal = self.data_plane_fatal()
        if fatal is None:
            return
        reason = f"prfaas_zmq data plane is dead: {fatal}"
        self.record_first_failure(room, reason)
        self.update_status(room, KVPoll.Failed)
        log.critical("%s; stopping the server so that /health fails", reason)
        raise DataPlaneDead(reason)

    def _watchdog(self) -> None:
        """An idle server never polls a transfer: notice a dead loop here and take the server down the
        way SGLang's scheduler does when it crashes (SIGQUIT to the launcher, which kills the tree)."""
        while not self._stopped:
            time.sleep(_WATCHDOG_S)
            fatal = self.data_plane_fatal()
            if fatal is not None:
                log.critical("prfaas_zmq data plane is dead: %s; stopping the server so that /health fails", fatal)
                self.stop_server()
                return

    def stop_server(self) -> None:
        import psutil

        psutil.Process().parent().send_signal(signal.SIGQUIT)

    def record_first_failure(self, room: int, reason: str) -> None:
        """Record `reason` unless a root cause is already known (later failures are its symptoms)."""
        with self.failure_lock:
            self.failure_records.setdefault(room, reason)
