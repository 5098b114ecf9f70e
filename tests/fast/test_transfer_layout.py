"""Pure parts of the data plane: the KVArgs-shaped layout, item chunk planning, wire codec, config."""

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from prfaas_sgl.transfer.config import PeerInfo, TransferConfig
from prfaas_sgl.transfer.items import ItemBatch, Items, plan_items
from prfaas_sgl.transfer.layout import BufferSpec, MemoryLayout, kv_layout
from prfaas_sgl.transfer.messages import PROTOCOL_VERSION, Chunk, Codec, DecodeError, Open


def test_kv_layout_follows_kvargs_order():
    lay = kv_layout(2, 100, 8, state_bytes=[7, 9], num_slots=4, aux_bytes=5, num_aux=3)
    assert [b.kind for b in lay.buffers] == ["kv"] * 4 + ["state"] * 2 + ["aux"]
    assert (lay.ids_of("kv"), lay.ids_of("state"), lay.ids_of("aux")) == ([0, 1, 2, 3], [4, 5], [6])
    assert [b.item_len for b in lay.buffers] == [100] * 4 + [7, 9, 5]


def test_layout_mismatch_names_the_buffer_and_sizes():
    a = kv_layout(2, 4096, 8)
    assert a.mismatch(kv_layout(2, 4096, 99)) is None  # pool sizes may differ
    assert a.mismatch(kv_layout(2, 2048, 8)) == (
        "layout mismatch: buffer 0 (kv) item_len (page/slot size) peer=2048 B here=4096 B")
    assert "peer has 2 buffers, this side 4" in a.mismatch(kv_layout(1, 4096, 8))


@settings(max_examples=60, deadline=None)
@given(
    item_len=st.integers(1, 64),
    pages=st.lists(st.integers(0, 31), min_size=1, max_size=24, unique=True),
    chunk=st.integers(1, 200),
    split=st.integers(0, 24),
)
def test_planned_item_chunks_tile_each_stream(item_len, pages, chunk, split):
    """Any page list, any chunk size, any split into two send()s: chunks no longer than `chunk_bytes` tile
    the stream [0, pages × item_len) in order, each naming the items whose bytes it carries."""
    lay = MemoryLayout((BufferSpec("kv", item_len, 32),))
    pos: dict[int, int] = {}
    plans = [c for piece in (pages[:split], pages[split:]) if piece
             for c in plan_items(lay, ItemBatch((Items((0,), np.array(piece)),)), pos, chunk)]
    assert pos == {0: len(pages) * item_len}
    assert all(0 < c.length <= chunk for c in plans)
    assert [c.offset for c in plans] == list(np.cumsum([0] + [c.length for c in plans[:-1]]))
    for c in plans:
        ids = [int(i) for i in c.group.index[c.first: c.first + c.count]]
        assert ids == pages[c.offset // item_len: (c.offset + c.length - 1) // item_len + 1]


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
