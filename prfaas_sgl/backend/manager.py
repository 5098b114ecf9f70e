"""`PrfaasKVManager`: SGLang's common KV manager (bootstrap, registration, heartbeats, abort, status
messages) with the ZeroMQ data plane underneath. SGLang builds one manager per scheduler rank and role;
`PrfaasKVManager(...)` returns the role's subclass (`prefill.PrefillManager` / `decode.DecodeManager`).
"""
from __future__ import annotations

import logging
import threading

from sglang.srt.disaggregation.common.conn import CommonKVManager
from sglang.srt.disaggregation.utils import DisaggregationMode

from prfaas_sgl import compat
from prfaas_sgl.backend import control
from prfaas_sgl.backend.memory import KVMemory
from prfaas_sgl.backend.settings import transfer_config

log = logging.getLogger(__name__)


class PrfaasKVManager(CommonKVManager):
    # Prefill → decode status frames carry a tag and the failure reason, so decode can say why.
    kv_status_msg_tag = control.STATUS_TAG
    kv_status_msg_carries_reason = True
    reports_transfer_latency = True

    def __new__(cls, args, disaggregation_mode, *rest, **kw):
        if cls is PrfaasKVManager:
            if disaggregation_mode == DisaggregationMode.PREFILL:
                from prfaas_sgl.backend.prefill import PrefillManager as cls
            elif disaggregation_mode == DisaggregationMode.DECODE:
                from prfaas_sgl.backend.decode import DecodeManager as cls
            else:
                raise ValueError(f"prfaas_zmq: unsupported disaggregation mode {disaggregation_mode}")
        return super().__new__(cls)

    def __init__(self, args, disaggregation_mode, server_args, is_mla_backend=False):
        if getattr(server_args, "device", "cpu") != "cpu":
            # The data plane reads/writes pool memory through host pointers; device memory needs a
            # staging copy that is not written yet. Fail at start-up, not with a segfault later.
            raise ValueError(f"--disaggregation-transfer-backend prfaas_zmq needs --device cpu for now "
                             f"(got {server_args.device!r}); use mooncake on GPUs")
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        self.prfaas_config = compat.get_config(server_args)
        self.transfer_config = transfer_config(self.prfaas_config)
        self.memory = KVMemory.of(args)
        self._stopped = False
        log.info("prfaas_zmq %s rank %s: %s", disaggregation_mode.value, args.engine_rank, self.memory.describe())

    def _start(self, target, name: str) -> threading.Thread:
        t = threading.Thread(target=target, name=name, daemon=True)
        t.start()
        return t

    def record_first_failure(self, room: int, reason: str) -> None:
        """Record `reason` unless a root cause is already known (later failures are its symptoms)."""
        with self.failure_lock:
            self.failure_records.setdefault(room, reason)
