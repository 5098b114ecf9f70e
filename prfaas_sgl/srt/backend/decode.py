"""Decode side: one `ZmqReceiver` over the rank's KV pool writes incoming pages in place (on GPUs through
its receive ring and a copy stream); a request's status turns Success only when the prefill reported
Success *and* our receiver verified every byte and finished every copy into the pool."""
from __future__ import annotations

import logging

from sglang.srt.disaggregation.base.conn import KVPoll

from prfaas_sgl.srt.backend import control
from prfaas_sgl.srt.backend.manager import PrfaasKVManager
from prfaas_sgl.srt.backend.memory import flat_states, index_len, transfer_id
from prfaas_sgl.srt.backend.tp import WHOLE, Pairing, pairing, with_state_runs
from prfaas_sgl.srt.backend.tp_state import Side
from prfaas_sgl.srt.backend.settings import faults_from_env, offset_port
from prfaas_sgl.transfer.states import first_failure

log = logging.getLogger(__name__)


class DecodeManager(PrfaasKVManager):
    def __init__(self, args, disaggregation_mode, server_args, is_mla_backend=False, *, transport=None):
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend, transport=transport)
        port = offset_port(self.prfaas_config.zmq_data_port, args.engine_rank)
        self.receiver = self.transport.receiver(self.memory.layout, self.memory.buffers, self.transfer_config,
                                                host=self.local_ip, port=port, faults=faults_from_env(),
                                                devices=self.memory.devices)
        self.expected: dict[int, list[int]] = {}  # room → data-plane transfer ids (one per sending prefill rank)
        self.peer_rejections: dict[str, str] = {}  # prefill bootstrap address → why it is incompatible
        self.data_plane = self.receiver
        self._start(self._control_loop, "prfaas-zmq-control")
        self._start(self._watchdog, "prfaas-zmq-watchdog")
        self._start_heartbeat_checker_thread()
        log.info("prfaas_zmq decode receiver on %s", self.receiver.address.endpoint)

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """SGLang raises on a page-size/dtype/layout mismatch, which would kill this scheduler; keep
        the reason instead so the receivers of that prefill fail with it and the server stays up."""
        try:
            ok = super().try_ensure_parallel_info(bootstrap_addr)
        except Exception as e:  # RuntimeError for a mismatch; anything a bootstrap server's values break
            reason = f"prfaas_zmq: prefill {bootstrap_addr} is incompatible: {e}"
            if self.peer_rejections.get(bootstrap_addr) != reason:  # SGLang retries once a second
                log.error(reason)
            self.peer_rejections[bootstrap_addr] = reason
            return False
        if ok:  # a prefill fixed and restarted at the same address is usable again
            self.peer_rejections.pop(bootstrap_addr, None)
        return ok

    # -- control messages (built here, sent by CommonKVReceiver) --------------------------------------
    def build_receiver_registration_message(self) -> list[bytes]:
        addr = self.receiver.address
        return control.encode(control.Register(
            endpoint=self.local_ip, dst_port=self.rank_port, data_host=addr.host, data_port=addr.port,
            server_key=addr.server_key, layout=self.memory.layout, page_size=self.kv_args.page_size,
            attn_tp_size=self.attn_tp_size, tp_rank=self.kv_args.engine_rank,
        ), self.register_secret)

    def build_receiver_metadata_message(self, *, bootstrap_room, required_dst_info_num, kv_indices, aux_index,
                                        state_indices, decode_prefix_len, is_dummy,
                                        device_kv_indices=None) -> list[bytes]:
        return control.encode(control.Metadata(
            room=int(bootstrap_room), endpoint=self.local_ip, dst_port=self.rank_port,
            npages=0 if is_dummy else index_len(kv_indices),
            aux_index=None if is_dummy or aux_index is None else int(aux_index),
            state_indices=[] if is_dummy else flat_states(state_indices),
            decode_prefix_len=int(decode_prefix_len or 0), required_dst_info_num=int(required_dst_info_num),
            is_dummy=bool(is_dummy),
        ), self.register_secret)  # signed like Register: a prefill refuses unsigned room state

    # -- data plane -----------------------------------------------------------------------------------
    def expect(self, room: int, kv_indices, aux_index, state_indices, src_tp: int | None = None,
               srcs: list[int] | None = None) -> str | None:
        """Register the request's destinations before telling prefill where to send: one transfer per
        prefill rank that sends to us (`srcs`: SGLang's target_tp_ranks at prefill attention TP `src_tp`;
        default: one source, rank 0). Returns a failure reason, or None."""
        fatal = self.data_plane_fatal()
        if fatal is not None:  # expect() would wait 10 s for a loop that is gone; check_status stops the server
            return f"prfaas_zmq: cannot receive room {room}: data plane is dead: {fatal}"
        # The deadline covers the prefill's queueing and compute too, hence SGLang's waiting timeout;
        # a dead prefill is caught sooner by the heartbeat.
        timeout_s = self.waiting_timeout + self.transfer_config.timeout_s
        tids: list[int] = []
        problem = None
        for src in srcs or [0]:
            try:
                pair = self._pairing(src_tp, src)
            except Exception as e:  # ValueError for states that do not shard; anything the prefill's TP breaks
                problem = f"prfaas_zmq: cannot receive room {room} from prefill TP {src_tp}: {type(e).__name__}: {e}"
                break
            if pair.empty:
                continue  # a replica: another source sends these heads (tp.sends_kv) and has no state shard
            batch = self.memory.batch(kv_indices if pair.kv else (), state_indices, aux_index if pair.aux else None,
                                      head=pair.dst)  # checked vectorised by expect()
            batch = with_state_runs(batch, pair, self.state_ids, Side.DECODE)
            tid = transfer_id(room, self.local_ip, self.rank_port, src)
            problem = self._expect_one(room, tid, batch, timeout_s)
            if problem:
                break
            tids.append(tid)
        if problem:
            for done in tids:
                self.receiver.release(done)
            return problem
        self.expected[room] = tids
        return None

    def _pairing(self, src_tp: int | None, src: int) -> Pairing:
        my_tp = int(self.attn_tp_size)
        if src_tp is None or src_tp == my_tp or getattr(self, "is_mla_backend", False):
            return WHOLE
        total = int(getattr(self.kv_args, "total_kv_head_num", 0) or 0) or \
            int(getattr(self.kv_args, "kv_head_num", 0) or 0) * my_tp
        item = self.memory.layout.buffers[self.memory.kv_ids[0]].item_len
        unit = item // (self.kv_args.page_size * max(1, total // my_tp))
        shapes = self.state_shapes
        if shapes.problem and self.state_ids:
            raise ValueError(shapes.problem)  # expect() fails the room with it
        return pairing(src_tp, my_tp, src, int(getattr(self, "attn_tp_rank", 0) or 0), total,
                       self.kv_args.page_size, unit, shapes.tensors, me=Side.DECODE)

    def _expect_one(self, room: int, tid: int, batch, timeout_s: float) -> str | None:
        try:
            self.receiver.expect(tid, batch, timeout_s=timeout_s)
        except ValueError as e:
            return f"prfaas_zmq: cannot receive room {room}: {e}"
        except Exception as e:  # a stalled or dead loop (TimeoutError, RuntimeError, ZMQError) fails this room only
            log.exception("prfaas_zmq: expect(room %s) failed", room)
            # a timed-out call_sync leaves its add queued: release after it (the loop is FIFO), or a live
            # transfer would later write into pages SGLang frees with this failed request
            self.receiver.release(tid)
            return f"prfaas_zmq: cannot receive room {room}: {type(e).__name__}: {e}"
        return None

    def check_status(self, bootstrap_room: int) -> int:
        status = self.request_status[bootstrap_room]
        tids = self.expected.get(bootstrap_room)
        if tids is None or status == KVPoll.Failed:
            return status
        self.check_data_plane(bootstrap_room)
        data = [self.receiver.poll(tid) for tid in tids]
        bad = first_failure(data)
        if bad is not None:
            self.record_first_failure(bootstrap_room, f"prfaas_zmq transfer failed on decode: {bad.reason}")
            self.update_status(bootstrap_room, KVPoll.Failed)
            return KVPoll.Failed
        if status == KVPoll.Success and not all(d.ok for d in data):
            return KVPoll.Transferring  # the prefill's word alone is not enough: wait for our verification
        return status

    def forget(self, room: int) -> None:
        """Stop receiving for `room`: its pages may be reused from now on."""
        for tid in self.expected.pop(room, ()):
            self.receiver.release(tid)

    def _control_loop(self) -> None:
        """Until teardown; a socket failure ends the thread (recorded by manager._guarded)."""
        recv = self._make_worker_recv(self.server_socket)
        while not self._stopped:
            frames = recv()
            if frames is not None:
                self._on_frames(frames)

    def _on_frames(self, frames: list[bytes]) -> None:
        """One prefill → decode message. Any error is this message's: logged, dropped, the thread goes on
        (without it no prefill status is heard and every room waits out its timeout)."""
        try:
            if self.handle_abort_ack_message(frames):
                return
            parsed = self.parse_kv_status_message(frames)  # None for a forgery when keys are configured
            if parsed is not None:
                room, status, rank, reason = parsed
                self.apply_prefill_status(bootstrap_room=room, status=status, prefill_rank=rank,
                                          failure_reason=reason)
        except Exception as e:
            log.exception("prfaas_zmq: prefill status message failed")
            self.note_dropped("failed_status", f"{type(e).__name__}: {e}")
