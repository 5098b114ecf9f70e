"""Prefill side: learns decode peers and request destinations from control messages, streams each
finished chunk with `ZmqSender`, and reports Success only once the decode's receiver verified it all.

Threads: SGLang's scheduler calls `add_transfer_request`, which does O(1) work per chunk (the page-id
array goes to the sender as it is); the sender's loop and stager threads plan, gather and send;
the watch thread concludes rooms when the sender signals a terminal transfer (no polling period)."""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import msgspec
import zmq
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import ABORT_TAG, AbortNotification
from sglang.srt.environ import envs

from prfaas_sgl.srt.backend import control, optimistic
from prfaas_sgl.srt.backend.admission import Admission, PeerBook, same_host
from prfaas_sgl.srt.backend.layerwise import make_streamer
from prfaas_sgl.srt.backend.manager import PrfaasKVManager
from prfaas_sgl.srt.backend.memory import index_len, stager_sync, transfer_id
from prfaas_sgl.srt.backend.rooms import Unstarted, join_problem, page_overflow
from prfaas_sgl.srt.backend.tp import (WHOLE, Pairing, layout_problem, pairing, pool_head_bytes, total_kv_heads,
                                      with_state_runs)
from prfaas_sgl.srt.backend.tp_state import Side
from prfaas_sgl.srt.backend.settings import faults_from_env, offset_port
from prfaas_sgl.transfer.config import PeerInfo
from prfaas_sgl.transfer.states import TransferState, TransferStatus, first_failure

log = logging.getLogger(__name__)
# Fallback wake-up of the watch thread while rooms are open: transfers signal their end (on_terminal) and
# failures from other threads set the wake too; this only bounds a missed signal.
_WATCH_S = 0.1


@dataclass(slots=True)
class _Outgoing:
    """One room's open transfers (one per non-dummy decode rank)."""

    room: int
    tids: dict[int, tuple[str, int]] = field(default_factory=dict)  # tid → decode control address
    closed: bool = False  # the last piece (states + aux) was queued
    dropped: bool = False  # concluded and released: a watch step holding a stale snapshot skips it


class PrefillManager(PrfaasKVManager):
    layerwise = None  # layerwise.LayerwiseStreamer when layer-group streaming is on; None: the chunk path
    def __init__(self, args, disaggregation_mode, server_args, is_mla_backend=False, *, transport=None):
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend, transport=transport)
        stats = offset_port(self.prfaas_config.zmq_stats_port, args.engine_rank) or None
        self._wake = threading.Event()
        self.sender = self.transport.sender(self.memory.layout, self.memory.buffers, self.transfer_config,
                                            faults=faults_from_env(), stats_port=stats,
                                            stats_host=self.prfaas_config.zmq_stats_host,
                                            devices=self.memory.devices, on_terminal=lambda _tid: self._wake.set())
        self.data_plane = self.sender
        self._room_ttl_s = envs.SGLANG_DISAGGREGATION_WAITING_TIMEOUT.get() + self.bootstrap_timeout
        self.peers = PeerBook(Admission(self.register_secret, self.transfer_config.keys_dir), fit=self._fit,
                              hold_s=self._room_ttl_s)
        self._open: dict[int, _Outgoing] = {}
        self._lock = threading.Lock()
        self._unstarted = Unstarted()
        self.layerwise = make_streamer(self.prfaas_config.layerwise, args, self.memory, bool(is_mla_backend),
                                       self.transfer_config.timeout_s, getattr(self.sender, "stats", None),
                                       cp_split=bool(getattr(self, "enable_all_cp_ranks_for_transfer", False)))
        self.fatal_sources.append(lambda: self.sender.worker_fatal)  # the stager and stats threads
        optimistic.book_of(self)  # /stats has `optimistic` from start-up, not from the first scheduler pass
        self._start(self._control_loop, "prfaas-zmq-control")
        self._start(self._watch_loop, "prfaas-zmq-watch")
        self._start(self._watchdog, "prfaas-zmq-watchdog")

    # -- scheduler thread ----------------------------------------------------------------------------
    def add_transfer_request(self, bootstrap_room, kv_indices, index_slice, is_last_chunk, aux_index=None,
                             state_indices=None, num_kv_tokens=None, *, wait_event=None, indices_event=None,
                             **_ignored) -> None:
        """Queue one prefill chunk (`kv_indices`: page ids, request order; `index_slice`: their place in
        the pages sent for this request). The last chunk also carries state items and the aux row.

        O(1) in the number of pages: the id array is handed over unread. `wait_event` (early send of a
        cached prefix: the forward may still write it) is waited for on the gather stream; `indices_event`
        guards a pinned page-id tensor still being copied from the GPU, so the stager syncs it first."""
        room = bootstrap_room
        with self._lock:  # _expire_unstarted forgets a room under the lock, never halfway
            self._unstarted.pop(room)
            if self.request_status.get(room) in (None, KVPoll.Failed):
                return
        self.check_data_plane(room)
        infos = self.transfer_infos.get(room)
        if not infos:  # the scheduler only prefills bootstrapped rooms: this is a bookkeeping bug
            reason = f"prfaas_zmq: no decode destination for room {room}"
            self.conclude_failure(bootstrap_room=room, failure_reason=reason)
            return
        if self.layerwise is not None:  # pages its layer groups queued before the forward go no second time
            kv_indices, index_slice = self.layerwise.trim(room, kv_indices, index_slice)
            if not index_len(kv_indices) and not is_last_chunk:
                return
        sync = stager_sync(self.memory.device, wait_event, indices_event)
        sent = self._send_pieces(room, infos, kv_indices, index_slice, sync, (state_indices, aux_index), is_last_chunk)
        if sent is None:
            return
        if self.layerwise is not None and not is_last_chunk:  # after the last, the watch thread forgets the room
            self.layerwise.note_queued(room, index_slice.stop)
        if is_last_chunk and not sent and room not in self._open:
            self.update_status(room, KVPoll.Success)  # nothing of ours goes to these decode ranks
        else:
            self.update_status(room, KVPoll.Transferring)

    def stream_groups(self, room: int, pages, page_from: int, split, indices_event=None) -> None:
        """Queue transfer pages [page_from, page_from + len(pages)) of `room` before the forward that
        writes them, `split` into layer-group batches behind their gates (layerwise_hooks)."""
        infos = self.transfer_infos.get(room)
        if not infos or self.request_status.get(room) in (None, KVPoll.Failed):
            return
        n = index_len(pages)
        sync = stager_sync(self.memory.device, None, indices_event)
        if self._send_pieces(room, infos, pages, slice(page_from, page_from + n), sync, (None, None), False,
                             split) is not None:
            self.layerwise.note_queued(room, page_from + n)
            self.layerwise.streamed(n)

    def _send_pieces(self, room: int, infos: dict, kv_indices, index_slice: slice, sync: dict, tail: tuple,
                     last: bool, split=None) -> bool | None:
        """Send a piece of `room` to each of its decode ranks: pages, and with `last` the `tail` (state
        indices, aux row). Whether anything went; None when the room failed here."""
        npages, sent = index_len(kv_indices), False
        for session, info in list(infos.items()):
            if info.is_dummy:
                continue
            problem = self._problem(session, info, index_slice, npages)  # before pairing: a refused peer's
            if problem:                                                  # state shapes need not shard
                self.conclude_failure(bootstrap_room=room, failure_reason=problem)
                return None
            try:  # peer values drive the slicing: whatever they break fails this room, not the scheduler
                batch = self._plan(session, kv_indices, *tail, last, sync)
                for part in () if batch is None else split(batch) if split else (batch,):
                    self._send(room, session, info, part, last)
                    sent = True
            except Exception as e:
                log.exception("prfaas_zmq: room %s to decode %s failed", room, session)
                self.conclude_failure(bootstrap_room=room, failure_reason=f"prfaas_zmq: cannot send room {room} "
                                      f"to decode {session}: {type(e).__name__}: {e}")
                return None
        return sent

    def _plan(self, session: str, kv_indices, state_indices, aux_index, last: bool, sync: dict):
        """The items of this chunk that go to decode `session`, or None when nothing does (a KV replica
        another rank of ours sends, tp.sends_kv; states come with the last chunk)."""
        pair = self._pairing(session)
        if not pair.sends(last):
            return None
        batch = self.memory.batch(kv_indices if pair.kv else (), state_indices if last else None,
                                  aux_index if last and pair.aux else None, head=pair.src, **sync)
        return with_state_runs(batch, pair, self.state_ids, Side.PREFILL)

    def _pairing(self, session: str) -> Pairing:
        """What this rank sends to decode `session` (whole items if it is not registered; _send fails it)."""
        peer = self.peers.get(session)
        if peer is None:
            return WHOLE
        my_tp = int(self.attn_tp_size)
        if peer.attn_tp_size == my_tp or getattr(self, "is_mla_backend", False):
            return WHOLE
        # states that cannot be sliced (`problem`) have no tensors: such a peer was refused at Register
        return pairing(my_tp, peer.attn_tp_size, self._src_rank, peer.tp_rank, total_kv_heads(self.kv_args, my_tp),
                       self.kv_args.page_size, pool_head_bytes(self.memory, self.kv_args, my_tp), self.state_shapes.tensors)

    @property
    def _src_rank(self) -> int:
        return int(getattr(self, "attn_tp_rank", 0) or 0)

    def _problem(self, session: str, info: control.Metadata, index_slice: slice, npages: int) -> str | None:
        if session not in self.peers:
            return f"decode {session} sent metadata for room {info.room} {self.peers.unregistered(session)}"
        return page_overflow(info, index_slice, npages)

    @property
    def rejections(self) -> dict[str, str]:
        """Decode session → why its last Register was refused (layout, values, signer)."""
        return self.peers.refused

    def check_status(self, bootstrap_room: int) -> KVPoll:
        if bootstrap_room in self._open:
            self.check_data_plane(bootstrap_room)
        # the watch thread may have forgotten an expired room since SGLang's poll saw it
        return self.request_status.get(bootstrap_room, KVPoll.Failed)

    def _send(self, room: int, session: str, info: control.Metadata, batch, last: bool) -> None:
        peer = self.peers.get(session)
        if peer is None:  # evicted from the book since _problem looked
            self.conclude_failure(bootstrap_room=room, failure_reason=f"decode {session} is no longer registered")
            return
        tid = transfer_id(room, info.endpoint, info.dst_port, self._src_rank)
        with self._lock:
            if self.request_status.get(room) in (None, KVPoll.Failed):
                return  # aborted and dropped since add_transfer_request looked: its pages may be freed
            out = self._open.setdefault(room, _Outgoing(room))
            out.tids[tid] = (info.endpoint, info.dst_port)
            out.closed = out.closed or last
        # no wake-up of the watch thread here: the sender signals the transfer's end (on_terminal), and
        # waking a Python thread from the scheduler thread only invites a GIL hand-off mid-call
        self.sender.send(tid, PeerInfo(peer.data_host, peer.data_port, peer.server_key), batch, last=last)

    # -- control thread: decode → prefill messages ---------------------------------------------------
    def _control_loop(self) -> None:
        """Until teardown; a socket or poller failure ends the thread (recorded by manager._guarded)."""
        poller = zmq.Poller()
        poller.register(self.server_socket, zmq.POLLIN)
        while not self._stopped:
            if not poller.poll(500):  # a timeout lets teardown (role switch) stop this thread
                continue
            parts = self.server_socket.recv_multipart(copy=False)
            self._on_frames([p.bytes for p in parts], _peer_ip(parts[0]))

    def _on_frames(self, frames: list[bytes], peer_ip: str | None) -> None:
        """One control message. Any error is this message's: logged, dropped, the thread goes on (it is
        the only one that hears decodes)."""
        try:
            if frames and frames[0] == ABORT_TAG and not self._abort_allowed(frames, peer_ip):
                return  # before SGLang's deferred-bootstrap handler, which would fail the room too
            if self.deferred_bootstrap is not None and self._handle_bootstrap_message(frames):
                return
            self._on_control(frames, peer_ip)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self.note_dropped("undecodable", f"undecodable control message (peer of another version?): {e}")
        except Exception as e:
            log.exception("prfaas_zmq: control message failed")
            self.note_dropped("failed_control", f"{type(e).__name__}: {e}")

    def _on_control(self, frames: list[bytes], peer_ip: str | None = None) -> None:
        if frames and frames[0] == ABORT_TAG:
            note = AbortNotification.from_zmq(frames)
            if note is None or not self._abort_allowed(frames, peer_ip):
                return
            if self.request_status.get(note.room) not in (None, KVPoll.Success):
                self.record_first_failure(note.room, "aborted by decode")
                self.update_status(note.room, KVPoll.Failed)
                self._wake.set()  # the watch thread drops the room and releases its transfers now
            return
        msg = control.decode(frames)
        if isinstance(msg, control.Register):
            self._on_register(frames, msg, peer_ip)
        elif isinstance(msg, control.Metadata):
            self._on_metadata(frames, msg, peer_ip)

    def _abort_allowed(self, frames: list[bytes], peer_ip: str | None) -> bool:
        """An ABORT fails a room, so only that room's decode may send it: its return address must be a
        session of the room (before the room's Metadata: any admitted session), and the TCP peer that
        address's host (ABORT carries no MAC: SGLang builds it)."""
        note = AbortNotification.from_zmq(frames)
        if note is None:
            return False
        session = f"{note.decode_ip}:{note.decode_port}"
        infos = self.transfer_infos.get(note.room)
        owner = session in infos if infos else session in self.peers
        if owner and note.decode_ip is not None and same_host(peer_ip, note.decode_ip,
                                                              strict=self.register_secret is not None):
            return True
        self.note_dropped("foreign_abort", f"ABORT of room {note.room} from {peer_ip} naming {session}, "
                                           "not a decode session of that room")
        return False

    def _on_register(self, frames: list[bytes], msg: control.Register, peer_ip: str | None) -> None:
        if self.peers.admit(frames, msg, peer_ip):
            log.info("prfaas_zmq: decode %s registered (data %s:%s)", msg.session, msg.data_host, msg.data_port)

    def _fit(self, msg: control.Register) -> str | None:
        """Why this rank cannot send to a decode with `msg`'s layout (checked before admission; the
        values are range-checked already, so the TP math divides by nothing below 1)."""
        if msg.page_size != self.kv_args.page_size:
            return f"page size mismatch: decode page_size={msg.page_size}, prefill page_size={self.kv_args.page_size}"
        my_tp = int(self.attn_tp_size)
        if msg.attn_tp_size == my_tp or getattr(self, "is_mla_backend", False):
            return self.memory.layout.mismatch(msg.layout)
        # K/V head slices and state byte runs between TP sizes (tp.py)
        return layout_problem(self.memory.layout, msg.layout, my_tp, msg.attn_tp_size, total_kv_heads(self.kv_args, my_tp),
                              self.kv_args.page_size, self.state_shapes)

    def _on_metadata(self, frames: list[bytes], msg: control.Metadata, peer_ip: str | None) -> None:
        # every Metadata creates room state for ~10 min: only admitted decodes (or, to learn why it
        # failed, a refused one holding the secret) may, only into a room that is theirs (rooms.py), and
        # only so many rooms at a time per decode host
        if not self.peers.admit_metadata(frames, msg, peer_ip):
            return
        infos = self.transfer_infos.get(msg.room, {})
        problem = join_problem(infos, msg, {s: self.peers.get(s) for s in (*infos, msg.session)})
        if problem:
            self.peers.count("metadata_foreign_room", msg.session, f"room {msg.room}: {problem}")
            return
        refusal = None if infos else self._unstarted.refusal(msg.room, msg.endpoint)
        if refusal:
            self.peers.count(f"metadata_{refusal[0]}", msg.session, refusal[1])
            return
        self.peers.touch(msg.session)
        if not infos:
            self._unstarted.add(msg.room, msg.endpoint, time.monotonic())
        infos = self.transfer_infos.setdefault(msg.room, {})
        infos[msg.session] = msg
        if len(infos) == msg.required_dst_info_num:
            self.req_to_decode_prefix_len[msg.room] = msg.decode_prefix_len
            self.update_status(msg.room, KVPoll.WaitingForInput)

    # -- watch thread: conclude rooms from data-plane status -----------------------------------------
    def _watch_loop(self) -> None:
        last_expiry = time.monotonic()
        while not self._stopped:
            self._wake.wait(_WATCH_S if self._open else 0.5)
            self._wake.clear()  # before the step: a signal during it wakes the next wait at once
            try:
                self._watch_step()
                if time.monotonic() - last_expiry > 1.0:
                    last_expiry = time.monotonic()
                    self._expire_unstarted(last_expiry)
            except Exception:  # the only thread that concludes rooms must outlive any bug in one step
                log.exception("prfaas_zmq: watch step failed")
                time.sleep(_WATCH_S)

    def _watch_step(self) -> None:
        """One pass over the open rooms: conclude those whose transfers all ended (or one failed)."""
        with self._lock:
            rooms = list(self._open.values())
        for out in rooms:
            try:
                self._check(out)
            except Exception as e:
                log.exception("prfaas_zmq: checking room %s failed", out.room)
                self._fail_broken(out, e)

    def _fail_broken(self, out: _Outgoing, error: Exception) -> None:
        """Fail a room whose check raised. It leaves _open whatever happens here: one still open would
        fail again, with a traceback, every watch period."""
        try:
            self.conclude_failure(bootstrap_room=out.room, failure_reason=f"prfaas_zmq: internal error: {error!r}")
        except Exception:
            log.exception("prfaas_zmq: failing room %s failed too; dropping it", out.room)
            self.request_status[out.room] = KVPoll.Failed
        finally:
            self._drop(out)

    def _tids(self, out: _Outgoing) -> dict[int, tuple[str, int]]:
        # the scheduler thread adds a room's second destination while we look (MLA, decode TP > prefill TP)
        with self._lock:
            return dict(out.tids)

    def _check(self, out: _Outgoing) -> None:
        if out.dropped:
            return
        status = self.request_status.get(out.room)
        if status in (None, KVPoll.Failed):  # cleared, aborted by decode, or failed elsewhere
            self._drop(out)
            return
        tids = self._tids(out)
        states = {tid: self.sender.poll(tid) for tid in tids}
        bad = first_failure(states.values())
        if bad is None and self.data_plane_fatal() is not None:
            bad = TransferStatus(TransferState.FAILED, f"data plane is dead: {self.data_plane_fatal()}")
        if bad is not None:
            self.conclude_failure(bootstrap_room=out.room, failure_reason=f"prfaas_zmq transfer failed: {bad.reason}",
                                  targets=list(tids.values()))
            self._drop(out)
        elif out.closed and all(s.ok for s in states.values()):
            self.conclude_transfer(bootstrap_room=out.room, status=KVPoll.Success, targets=list(tids.values()))
            self._drop(out)

    def _drop(self, out: _Outgoing) -> None:
        with self._lock:
            if self._open.get(out.room) is out:
                self._open.pop(out.room)
            out.dropped = True
            tids = list(out.tids)
        if self.layerwise is not None:
            self.layerwise.forget(out.room)  # the watch thread; the scheduler thread is done with the room
        for tid in tids:
            try:
                self.sender.release(tid)  # aborts a transfer that is still running, tells the receiver
            except Exception:
                log.exception("prfaas_zmq: releasing transfer %x of room %s failed", tid, out.room)

    def _expire_unstarted(self, now: float) -> None:
        """Forget rooms whose prefill never started: the decode gave up on them long ago."""
        for room in self._unstarted.expired(now, self._room_ttl_s):
            with self._lock:  # add_transfer_request pops _unstarted and reads the status under it
                if not self._unstarted.pop(room) or room in self._open:
                    continue  # started meanwhile
                self.transfer_infos.pop(room, None)
                self.req_to_decode_prefix_len.pop(room, None)
                self.request_status.pop(room, None)
            with self.failure_lock:
                self.failure_records.pop(room, None)



def _peer_ip(frame) -> str | None:
    """The TCP peer a control message came from (libzmq's Peer-Address), None when not known."""
    try:
        return frame.get("Peer-Address")
    except (zmq.ZMQError, AttributeError):
        return None
