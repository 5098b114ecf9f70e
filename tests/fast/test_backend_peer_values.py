"""prfaas_zmq prefill: a decode's values never reach SGLang's scheduler thread as an exception. Register and
Metadata fields are range-checked, the layout is checked before a session is admitted, and whatever the
slicing of one room raises fails that room only. Pinned bug: a signed Register with attn_tp_size 0 was
admitted, its check raised ZeroDivisionError on the control thread, and the decode's first room raised it
again inside add_transfer_request, which SGLang does not catch: the prefill server died."""
from __future__ import annotations

import msgspec
import numpy as np
import pytest

pytest.importorskip("sglang", reason="the backend subclasses SGLang's KV manager")

from .backend_stubs import (  # noqa: E402
    DECODE_IP, KVPoll, ROOM, _admitted_prefill, control, keys, make_prefill, metadata, register,
    register_secret, server_public_key,
)
from prfaas_sgl.srt.backend.admission import metadata_problem, register_problem  # noqa: E402
from prfaas_sgl.transfer.layout import BufferSpec, MemoryLayout  # noqa: E402


def _first_room(m, secret) -> None:
    """The decode's Metadata and the prefill's first (and last) chunk, as SGLang's scheduler sends it."""
    m.request_status[ROOM] = KVPoll.Bootstrapping
    m._on_frames(control.encode(metadata(), secret), DECODE_IP)
    m.add_transfer_request(ROOM, np.arange(4), slice(0, 4), is_last_chunk=True, aux_index=0)


@pytest.mark.parametrize("field, value", [
    ("attn_tp_size", 0), ("attn_tp_size", -1), ("attn_tp_size", 10**6), ("tp_rank", 1), ("tp_rank", -1),
    ("page_size", 0),
])
def test_out_of_range_register_is_refused_and_its_rooms_fail(keys, field, value):
    good, _ = keys
    m, secret = make_prefill(good), register_secret(good)
    msg = msgspec.structs.replace(register(server_key=server_public_key(good)), **{field: value})
    m._on_frames(control.encode(msg, secret), DECODE_IP)
    assert msg.session not in m.peers and m.peers.refusals == {"bad_register": 1}
    _first_room(m, secret)  # raised ZeroDivisionError here for attn_tp_size 0
    assert m.sender.sent == [] and m.request_status[ROOM] == KVPoll.Failed
    assert f"{field}={value}" in m.failure_records[ROOM]
    assert m.deaths == {}


def test_bools_and_huge_ints_are_not_integers():
    """msgspec refuses a bool on the wire; a Register built in-process is checked the same way."""
    assert "attn_tp_size=True" in register_problem(msgspec.structs.replace(register(), attn_tp_size=True))
    assert "page_size" in register_problem(msgspec.structs.replace(register(), page_size=2**70))
    huge = msgspec.structs.replace(register(), layout=MemoryLayout((BufferSpec("kv", 2**70, 1),)))
    assert "item_len" in register_problem(huge)
    assert "dst_port=70000" in register_problem(msgspec.structs.replace(register(), dst_port=70000))
    with pytest.raises(msgspec.ValidationError):
        control.decode([control.TAG, msgspec.msgpack.encode(msgspec.structs.asdict(register()) | {
            "type": "Register", "attn_tp_size": True})])


def test_layout_is_checked_before_admission(keys):
    """Before: admitted with a note in `rejections`, so eviction, metadata and pairing all saw a session
    whose slices cannot work."""
    good, _ = keys
    m, secret = make_prefill(good), register_secret(good)
    theirs = MemoryLayout(tuple(BufferSpec(b.kind, b.item_len * 2, b.num_items) for b in m.memory.layout.buffers))
    msg = msgspec.structs.replace(register(server_key=server_public_key(good)), layout=theirs)
    m._on_frames(control.encode(msg, secret), DECODE_IP)
    assert msg.session not in m.peers and m.peers.refusals == {"incompatible": 1}
    _first_room(m, secret)
    assert m.request_status[ROOM] == KVPoll.Failed and "layout mismatch" in m.failure_records[ROOM]


def test_a_layout_check_that_raises_refuses_the_session(monkeypatch):
    import prfaas_sgl.srt.backend.prefill as prefill

    m = make_prefill()
    m.attn_tp_size = 2  # a decode at TP 1: layout_problem runs
    monkeypatch.setattr(prefill, "layout_problem", lambda *a: 1 // 0)
    m._on_frames(control.encode(register()), DECODE_IP)
    assert register().session not in m.peers and m.peers.refusals == {"incompatible": 1}
    assert "ZeroDivisionError" in m.rejections[register().session]


def test_an_authentic_bad_register_forgets_the_old_session(keys):
    """The decode at that address now has values we cannot serve: its old Register must not be used."""
    good, _ = keys
    m, secret = _admitted_prefill(good)
    m._on_frames(control.encode(msgspec.structs.replace(register(), page_size=2), secret), DECODE_IP)
    assert register().session not in m.peers and m.peers.refusals == {"incompatible": 1}
    m._on_frames(control.encode(msgspec.structs.replace(register(), page_size=2)), DECODE_IP)  # unsigned
    assert m.peers.refusals["unsigned"] == 1


@pytest.mark.parametrize("field, value", [
    ("room", -1), ("npages", -1), ("decode_prefix_len", -4), ("decode_prefix_len", 3),
    ("required_dst_info_num", 0), ("required_dst_info_num", 10**6), ("aux_index", -1), ("aux_index", 4),
    ("state_indices", [[-1]]), ("state_indices", [[2**63]]), ("dst_port", 0),
])
def test_out_of_range_metadata_creates_no_room(keys, field, value):
    good, _ = keys
    m, secret = _admitted_prefill(good)
    m.kv_args.page_size = 2  # decode_prefix_len 3 is not page-aligned
    m.peers._peers[register().session] = msgspec.structs.replace(register(), page_size=2)
    msg = msgspec.structs.replace(metadata(), **{field: value})
    m._on_frames(control.encode(msg, secret), DECODE_IP)
    assert (m.transfer_infos, len(m._unstarted), m.req_to_decode_prefix_len) == ({}, 0, {})
    assert m.peers.refusals == {"metadata_bad_metadata": 1}


def test_metadata_indices_are_bounded_by_the_decode_pools():
    peer = register()  # 4 aux rows (backend_stubs._BUFS)
    assert metadata_problem(msgspec.structs.replace(metadata(), aux_index=3), peer) is None
    assert "aux_index=4" in metadata_problem(msgspec.structs.replace(metadata(), aux_index=4), peer)
    assert metadata_problem(msgspec.structs.replace(metadata(), decode_prefix_len=True), peer)


def test_slicing_error_fails_only_that_room():
    """Any exception while pairing or slicing for one decode becomes that room's failure."""
    m, _ = _admitted_prefill()
    m.request_status[ROOM] = KVPoll.Bootstrapping
    m._on_frames(control.encode(metadata()), DECODE_IP)
    m._pairing = lambda session: 1 // 0
    m.add_transfer_request(ROOM, np.arange(4), slice(0, 4), is_last_chunk=True, aux_index=0)  # raised before
    assert m.request_status[ROOM] == KVPoll.Failed and "ZeroDivisionError" in m.failure_records[ROOM]
    assert m.status_messages[-1]["status"] == KVPoll.Failed  # the decode learns it


def test_decode_survives_a_prefill_tp_of_zero():
    """The decode side of the same bug: a bootstrap server announcing attention TP 0."""
    from .backend_stubs import StubReceiver, make_decode

    d = make_decode(StubReceiver())
    d.attn_tp_size = 1
    d.kv_args.total_kv_head_num = 2
    problem = d.expect(ROOM, np.arange(2), 0, None, src_tp=0, srcs=[0])
    assert "ZeroDivisionError" in problem and d.expected == {}
