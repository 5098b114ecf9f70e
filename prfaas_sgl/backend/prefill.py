"""Prefill side: learns decode peers and request destinations from control messages, streams each
finished chunk with `ZmqSender`, and reports Success only once the decode's receiver verified it all."""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import msgspec
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import ABORT_TAG, AbortNotification

from prfaas_sgl.backend import control
from prfaas_sgl.backend.manager import PrfaasKVManager
from prfaas_sgl.backend.memory import flat, transfer_id
from prfaas_sgl.backend.settings import faults_from_env, offset_port
from prfaas_sgl.transfer.config import PeerInfo
from prfaas_sgl.transfer.sender import ZmqSender

log = logging.getLogger(__name__)
_WATCH_S = 0.002  # completion polling period while transfers are open (a dict lookup per transfer)


@dataclass(slots=True)
class _Outgoing:
    """One room's open transfers (one per non-dummy decode rank)."""

    room: int
    tids: dict[int, tuple[str, int]] = field(default_factory=dict)  # tid → decode control address
    closed: bool = False  # the last piece (states + aux) was queued


class PrefillManager(PrfaasKVManager):
    def __init__(self, args, disaggregation_mode, server_args, is_mla_backend=False):
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        stats = offset_port(self.prfaas_config.zmq_stats_port, args.engine_rank) or None
        self.sender = ZmqSender(self.memory.layout, self.memory.buffers, self.transfer_config,
                                faults=faults_from_env(), stats_port=stats)
        self.peers: dict[str, control.Register] = {}
        self.rejections: dict[str, str] = {}  # decode session → why we cannot send to it
        self._open: dict[int, _Outgoing] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._start(self._control_loop, "prfaas-zmq-control")
        self._start(self._watch_loop, "prfaas-zmq-watch")

    # -- scheduler thread ----------------------------------------------------------------------------
    def add_transfer_request(self, bootstrap_room, kv_indices, index_slice, is_last_chunk, aux_index=None,
                             state_indices=None, num_kv_tokens=None, **_ignored) -> None:
        """Queue one prefill chunk (`kv_indices`: page ids, request order; `index_slice`: their place in
        the pages sent for this request). The last chunk also carries state items and the aux row."""
        room = bootstrap_room
        if self.request_status.get(room) in (None, KVPoll.Failed):
            return
        infos = self.transfer_infos.get(room)
        if not infos:  # the scheduler only prefills bootstrapped rooms: this is a bookkeeping bug
            reason = f"prfaas_zmq: no decode destination for room {room}"
            self.conclude_failure(bootstrap_room=room, failure_reason=reason)
            return
        pages = flat(kv_indices)
        regions = self.memory.page_regions(pages)
        if is_last_chunk:
            regions += self.memory.tail_regions(state_indices, aux_index)
        for session, info in list(infos.items()):
            if info.is_dummy:
                continue
            problem = self._problem(session, info, index_slice, len(pages))
            if problem:
                self.conclude_failure(bootstrap_room=room, failure_reason=problem)
                return
            self._send(room, session, info, regions, is_last_chunk)
        if is_last_chunk and all(i.is_dummy for i in infos.values()):
            self.update_status(room, KVPoll.Success)  # nothing of ours goes to a dummy rank
        else:
            self.update_status(room, KVPoll.Transferring)

    def _problem(self, session: str, info: control.Metadata, index_slice: slice, npages: int) -> str | None:
        if session not in self.peers:
            return f"decode {session} sent metadata for room {info.room} without registering its data address"
        return self.rejections.get(session) or _overflow(info, index_slice, npages)

    def _send(self, room: int, session: str, info: control.Metadata, regions, last: bool) -> None:
        peer = self.peers[session]
        tid = transfer_id(room, info.endpoint, info.dst_port)
        with self._lock:
            out = self._open.setdefault(room, _Outgoing(room))
            out.tids[tid] = (info.endpoint, info.dst_port)
            out.closed = out.closed or last
        self.sender.send(tid, PeerInfo(peer.data_host, peer.data_port, peer.server_key), regions, last=last)
        self._wake.set()

    # -- control thread: decode → prefill messages ---------------------------------------------------
    def _control_loop(self) -> None:
        recv = self._make_worker_recv(self.server_socket)
        while not self._stopped:
            frames = recv()
            if frames is None:
                continue
            try:
                self._on_control(frames)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                log.error("prfaas_zmq: undecodable control message (peer of another version?): %s", e)

    def _on_control(self, frames: list[bytes]) -> None:
        if frames and frames[0] == ABORT_TAG:
            note = AbortNotification.from_zmq(frames)
            if note is not None and self.request_status.get(note.room) not in (None, KVPoll.Success):
                self.record_first_failure(note.room, "aborted by decode")
                self.update_status(note.room, KVPoll.Failed)
            return
        msg = control.decode(frames)
        if isinstance(msg, control.Register):
            self._on_register(msg)
        elif isinstance(msg, control.Metadata):
            self._on_metadata(msg)

    def _on_register(self, msg: control.Register) -> None:
        problem = self.memory.layout.mismatch(msg.layout)
        if msg.page_size != self.kv_args.page_size:
            problem = (f"page size mismatch: decode page_size={msg.page_size}, "
                       f"prefill page_size={self.kv_args.page_size}")
        self.peers[msg.session] = msg
        if problem:
            self.rejections[msg.session] = f"prfaas_zmq cannot send to decode {msg.session}: {problem}"
            log.error(self.rejections[msg.session])
        else:
            self.rejections.pop(msg.session, None)
            log.info("prfaas_zmq: decode %s registered (data %s:%s)", msg.session, msg.data_host, msg.data_port)

    def _on_metadata(self, msg: control.Metadata) -> None:
        infos = self.transfer_infos.setdefault(msg.room, {})
        infos[msg.session] = msg
        if len(infos) == msg.required_dst_info_num:
            self.req_to_decode_prefix_len[msg.room] = msg.decode_prefix_len
            self.update_status(msg.room, KVPoll.WaitingForInput)

    # -- watch thread: conclude rooms from data-plane status -----------------------------------------
    def _watch_loop(self) -> None:
        while not self._stopped:
            if not self._open:
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            time.sleep(_WATCH_S)
            with self._lock:
                rooms = list(self._open.values())
            for out in rooms:
                self._check(out)

    def _check(self, out: _Outgoing) -> None:
        status = self.request_status.get(out.room)
        if status in (None, KVPoll.Failed):  # cleared, aborted by decode, or failed elsewhere
            self._drop(out)
            return
        states = {tid: self.sender.poll(tid) for tid in out.tids}
        bad = next((s for s in states.values() if s.state.terminal and not s.ok), None)
        if bad is not None:
            self.conclude_failure(bootstrap_room=out.room, failure_reason=f"prfaas_zmq transfer failed: {bad.reason}",
                                  targets=list(out.tids.values()))
            self._drop(out)
        elif out.closed and all(s.ok for s in states.values()):
            self.conclude_transfer(bootstrap_room=out.room, status=KVPoll.Success, targets=list(out.tids.values()))
            self._drop(out)

    def _drop(self, out: _Outgoing) -> None:
        with self._lock:
            self._open.pop(out.room, None)
        for tid in out.tids:
            self.sender.release(tid)  # aborts a transfer that is still running, tells the receiver


def _overflow(info: control.Metadata, index_slice: slice, npages: int) -> str | None:
    """Pages [start, stop) of this chunk must exist among the decode's allocated pages."""
    start = index_slice.start or 0
    if start + npages > len(info.pages):
        return (f"prefill sends pages [{start}, {start + npages}) of room {info.room} but decode "
                f"{info.session} allocated {len(info.pages)} pages (different prompt length or page size?)")
    return None
