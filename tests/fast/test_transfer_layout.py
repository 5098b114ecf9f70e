"""Pure parts of the data plane: page → region coalescing, chunk planning + scatter, wire codec, config."""

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from prfaas_sgl.transfer.chunking import dest_streams, plan_chunks, scatter
from prfaas_sgl.transfer.config import PeerInfo, TransferConfig
from prfaas_sgl.transfer.layout import (BufferSpec, MemoryLayout, Region, coalesce, kv_layout, page_regions,
                                        tail_regions)
from prfaas_sgl.transfer.messages import PROTOCOL_VERSION, Chunk, Codec, DecodeError, Open


def test_coalesce_keeps_order_and_merges_runs():
    assert coalesce(10, [3, 4, 5, 9, 1, 2]) == [(30, 30), (90, 10), (10, 20)]
    assert coalesce(10, []) == []
    assert coalesce(10, [5, 5]) == [(50, 10), (50, 10)]


def test_page_and_tail_regions_follow_kvargs_order():
    lay = kv_layout(2, 100, 8, state_bytes=[7, 9], num_slots=4, aux_bytes=5, num_aux=3)
    assert [b.kind for b in lay.buffers] == ["kv"] * 4 + ["state"] * 2 + ["aux"]
    assert page_regions(lay, [2, 3]) == [Region(b, 200, 200) for b in range(4)]
    assert tail_regions(lay, 1, 2) == [Region(4, 7, 7), Region(5, 9, 9), Region(6, 10, 5)]


def test_layout_mismatch_names_the_buffer_and_sizes():
    a = kv_layout(2, 4096, 8)
    assert a.mismatch(kv_layout(2, 4096, 99)) is None  # pool sizes may differ
    assert a.mismatch(kv_layout(2, 2048, 8)) == (
        "layout mismatch: buffer 0 (kv) item_len (page/slot size) peer=2048 B here=4096 B")
    assert "peer has 2 buffers, this side 4" in a.mismatch(kv_layout(1, 4096, 8))
    with pytest.raises(ValueError, match="outside buffer 0"):
        a.check_region(Region(0, 4096 * 7, 4097))


@settings(max_examples=60, deadline=None)
@given(
    item_len=st.integers(1, 64),
    pairs=st.lists(st.tuples(st.integers(0, 31), st.integers(0, 31)), min_size=1, max_size=24, unique_by=(
        lambda p: p[0], lambda p: p[1])),
    chunk=st.integers(1, 200),
    split=st.integers(0, 24),
)
def test_planned_chunks_scatter_src_pages_onto_dst_pages(item_len, pairs, chunk, split):
    """Any src/dst page lists, any chunk size, any split into two pieces: dst page k == src page k."""
    lay = MemoryLayout((BufferSpec("kv", item_len, 32),))
    src = np.random.default_rng(item_len).integers(0, 256, 32 * item_len, dtype=np.uint8)
    dst = np.zeros_like(src)
    src_pages, dst_pages = [p[0] for p in pairs], [p[1] for p in pairs]
    streams = dest_streams(page_regions(lay, dst_pages))
    pos: dict[int, int] = {}
    pieces = [src_pages[:split], src_pages[split:]]
    plans = [c for piece in pieces for c in plan_chunks(page_regions(lay, piece), pos, chunk)]
    assert all(c.length <= chunk for c in plans)
    assert pos == {0: len(pairs) * item_len}
    for c in reversed(plans):  # arrival order must not matter
        frames = [memoryview(src)[o: o + n] for o, n in c.segments]
        scatter(memoryview(dst), streams[0], c.offset, frames)
    got = dst.reshape(32, item_len)[dst_pages]
    assert np.array_equal(got, src.reshape(32, item_len)[src_pages])


def test_codec_roundtrip_and_version_mismatch_is_named():
    codec = Codec()
    msg = Chunk(transfer_id=5, seq=1, buffer_id=2, offset=0, length=10, nframes=1, checksum=99)
    assert codec.decode(codec.encode(msg)) == msg
    future = msgspec.msgpack.encode({"type": "Chunk", "transfer_id": 5, "v": 9, "new_field": [1]})
    with pytest.raises(DecodeError) as e:
        codec.decode(future)
    assert e.value.transfer_id == 5
    assert e.value.reason == f"protocol version mismatch: peer speaks v9, this side speaks v{PROTOCOL_VERSION}"
    stamped = codec.encode(msgspec.structs.replace(Open(transfer_id=3, layout=kv_layout(1, 8, 1)), v=2))
    with pytest.raises(DecodeError, match="peer speaks v2"):
        codec.decode(stamped)
    with pytest.raises(DecodeError, match="undecodable"):
        codec.decode(b"\xc1garbage")


def test_config_validation_says_what_to_change():
    with pytest.raises(ValueError, match="raise window_bytes"):
        TransferConfig(chunk_bytes=1 << 20, window_bytes=1 << 10)
    with pytest.raises(ValueError, match="connections=0"):
        TransferConfig(connections=0)
    assert PeerInfo("localhost", 5).problem() == "bad peer host 'localhost' (need a numeric IP address)"
    assert PeerInfo("127.0.0.1", 0).problem() == "bad peer port 0 (need 1..65535)"
    assert PeerInfo("10.77.0.2", 5555).problem() is None
