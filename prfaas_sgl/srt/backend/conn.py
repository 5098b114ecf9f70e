"""The classes SGLang asks `prfaas_zmq` for (`CLASSES`): the KV manager of a role, the per-request
sender/receiver and the bootstrap server (SGLang's common ones, plus the data-plane hand-offs of the decode
receiver)."""
from __future__ import annotations

from sglang.srt.disaggregation.base.conn import KVPoll, KVTransferDestination
from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer, CommonKVReceiver, CommonKVSender
from sglang.srt.disaggregation.utils import DisaggregationMode

from prfaas_sgl.srt.backend import control
from prfaas_sgl.srt.backend.decode import DecodeManager
from prfaas_sgl.srt.backend.manager import PrfaasKVManager
from prfaas_sgl.srt.backend.prefill import PrefillManager

ROLE_MANAGERS: dict[DisaggregationMode, type[PrfaasKVManager]] = {
    DisaggregationMode.PREFILL: PrefillManager, DisaggregationMode.DECODE: DecodeManager}


def kv_manager(args, disaggregation_mode, server_args, is_mla_backend=False, **kw) -> PrfaasKVManager:
    """SGLang's KV manager constructor for `prfaas_zmq` (one per scheduler rank and role): the role's
    subclass, built with SGLang's four arguments (``kw``: ``transport``, tests pass a fake one)."""
    role = ROLE_MANAGERS.get(disaggregation_mode)
    if role is None:
        raise ValueError(f"prfaas_zmq: unsupported disaggregation mode {disaggregation_mode}")
    return role(args, disaggregation_mode, server_args, is_mla_backend, **kw)


class PrfaasKVSender(CommonKVSender):
    """All the work is in `PrefillManager.add_transfer_request`.

    `supports_host_tensor_indices` on GPUs: SGLang's prefill then copies page ids into a pinned tensor
    asynchronously and hands over an `indices_event` (our stager syncs it), so the scheduler thread never
    waits for the forward. False on CPU, where that path would allocate pinned memory and CUDA events."""

    @property
    def supports_host_tensor_indices(self) -> bool:
        return self.kv_mgr.memory.device != "cpu"


class PrfaasKVReceiver(CommonKVReceiver):
    def init(self, prefill_dp_rank: int):
        reason = self.kv_mgr.peer_rejections.get(self.bootstrap_addr)
        if reason is not None:
            self._fail(reason)
            return
        super().init(prefill_dp_rank)

    def poll(self) -> KVPoll:
        """SGLang's poll; a room the prefill failed because it does not know this decode's session (it
        evicted an idle one, or restarted) also drops the cached registration, so that the next request
        registers again instead of every room failing until this decode restarts."""
        status = super().poll()
        if status == KVPoll.Failed and self.bootstrap_infos_cached():
            with self.kv_mgr.failure_lock:
                reason = self.kv_mgr.failure_records.get(self.bootstrap_room) or ""
            if control.REREGISTER in reason:
                self.invalidate_cached_bootstrap_infos()
        return status

    def bootstrap_infos_cached(self) -> bool:
        return bool(getattr(self, "_connection_pool_entries", None))

    def send_metadata(self, kv_indices, aux_index=None, state_indices=None, decode_prefix_len=None,
                      destination=KVTransferDestination.DEVICE, device_kv_indices=None):
        if getattr(self, "bootstrap_infos", None) is not None and self.conclude_state != KVPoll.Failed:
            info = getattr(self, "prefill_info", None)
            # prefill ranks that send to us: MLA pulls from one real rank (the others are dummies), unless
            # its KV is sharded over all of them (target_tp_rank None); other models from all targets
            one = getattr(self, "target_tp_rank", None)
            targets = list(getattr(self, "target_tp_ranks", None) or [one or 0])
            srcs = [one] if self.kv_mgr.is_mla_backend and one is not None else targets
            problem = self.kv_mgr.expect(self.bootstrap_room, kv_indices, aux_index, state_indices,
                                         src_tp=getattr(info, "attn_tp_size", None), srcs=srcs)
            if problem is not None:
                self._fail(problem)
                self.ensure_abort_notified()
                return
        super().send_metadata(kv_indices, aux_index, state_indices, decode_prefix_len, destination,
                              device_kv_indices)

    def abort(self):
        reason = self.kv_mgr.peer_rejections.get(self.bootstrap_addr)
        if reason is not None and self.conclude_state != KVPoll.Failed:
            self._fail(reason)  # SGLang aborts receivers of a prefill it could not use; say why
        super().abort()
        self.kv_mgr.forget(self.bootstrap_room)

    def clear(self) -> None:
        super().clear()
        self.kv_mgr.forget(self.bootstrap_room)

    def _fail(self, reason: str) -> None:
        self.kv_mgr.record_first_failure(self.bootstrap_room, reason)
        self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
        self.conclude_state = KVPoll.Failed


class PrfaasKVBootstrapServer(CommonKVBootstrapServer):
    pass


CLASSES = {"manager": kv_manager, "sender": PrfaasKVSender, "receiver": PrfaasKVReceiver,
           "bootstrap_server": PrfaasKVBootstrapServer}
