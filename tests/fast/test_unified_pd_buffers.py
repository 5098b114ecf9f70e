"""prfaas_zmq from and into the unified slab: SGLang's pools after `unify` register
strided buffers (`srt.buf_infos`), `KVMemory.of` turns them into `transfer.buffers.Strided`, and the real
transport moves KV rows and GDN states between a slab side and a packed side over 127.0.0.1, byte-exact
per logical buffer, writing nothing else in the slab."""
from __future__ import annotations

import itertools
from types import SimpleNamespace as NS

import numpy as np
import pytest
import torch

from prfaas_sgl.srt.backend.memory import KVMemory
from prfaas_sgl.srt.cachepool_backend.unified import unify
from prfaas_sgl.transfer.buffers import Strided
from prfaas_sgl.transfer.config import TransferConfig
from prfaas_sgl.transfer.receiver import ZmqReceiver
from prfaas_sgl.transfer.sender import ZmqSender
from prfaas_sgl.transfer.states import TransferState as S
from tests.fast.test_cachepool_slab_backend import _configurator, _sglang_result
from tests.support.sglang_context import sglang_context  # noqa: F401 - autouse

CFG = TransferConfig(connections=2, chunk_bytes=4096, window_bytes=65536, timeout_s=10, stage_slots=4)
IDS = itertools.count(1)
AUX_ROW, AUX_ROWS = 16, 4


class Side:
    """One server's pools as prfaas_zmq sees them: SGLang's KVArgs from the pools' buf infos."""

    def __init__(self, unified: bool, kv_tokens: int = 400) -> None:
        result = _sglang_result(kv_tokens=kv_tokens)
        self.result = unify(result, _configurator()) if unified else result
        self.kv = self.result.token_to_kv_pool
        self.aux = np.zeros(AUX_ROW * AUX_ROWS, np.uint8)
        kv_ptrs, kv_lens, kv_items = self.kv.get_contiguous_buf_infos()
        st_ptrs, st_lens, st_items = self.kv.get_state_buf_infos()
        args = NS(kv_data_ptrs=kv_ptrs, kv_data_lens=kv_lens, kv_item_lens=kv_items,
                  state_data_ptrs=[st_ptrs], state_data_lens=[st_lens], state_item_lens=[st_items],
                  aux_data_ptrs=[self.aux.ctypes.data], aux_data_lens=[self.aux.nbytes], aux_item_lens=[AUX_ROW])
        self.memory = KVMemory.of(args)

    @property
    def full(self):
        return self.kv.full_kv_pool

    @property
    def mamba(self):
        return self.kv.mamba_pool.mamba_cache

    def fill(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for buf in self.full.k_buffer + self.full.v_buffer:
            buf.copy_(torch.randn(buf.shape, generator=g))
        for t in [*self.mamba.conv, self.mamba.temporal]:
            t.copy_(torch.randn(t.shape, generator=g))
        self.aux[:] = np.arange(self.aux.size) % 251


def _move(src: Side, dst: Side, src_pages, dst_pages, src_slot: int, dst_slot: int) -> None:
    rx = ZmqReceiver(dst.memory.layout, dst.memory.buffers, CFG)
    tx = ZmqSender(src.memory.layout, src.memory.buffers, CFG)
    try:
        tid = next(IDS)
        rx.expect(tid, dst.memory.batch(np.asarray(dst_pages), [[dst_slot]], aux_index=2))
        half = len(src_pages) // 2  # chunked prefill: two pieces, the states with the last
        tx.send(tid, rx.address, src.memory.batch(np.asarray(src_pages[:half])))
        tx.send(tid, rx.address, src.memory.batch(np.asarray(src_pages[half:]), [[src_slot]], aux_index=1),
                last=True)
        assert rx.wait(tid, 10).state is S.DONE and tx.wait(tid, 5).state is S.DONE
    finally:
        tx.close()
        rx.close()


def _assert_landed(src: Side, dst: Side, src_pages, dst_pages, src_slot: int, dst_slot: int) -> None:
    for a, b in zip(src.full.k_buffer + src.full.v_buffer, dst.full.k_buffer + dst.full.v_buffer):
        assert torch.equal(b[list(dst_pages)], a[list(src_pages)])
    for a, b in zip([*src.mamba.conv, src.mamba.temporal], [*dst.mamba.conv, dst.mamba.temporal]):
        assert torch.equal(b[:, dst_slot], a[:, src_slot])
    assert np.array_equal(dst.aux[2 * AUX_ROW: 3 * AUX_ROW], src.aux[AUX_ROW: 2 * AUX_ROW])


def test_slab_pools_register_strided_buffers_with_the_packed_wire_layout():
    slab, packed = Side(unified=True), Side(unified=False)
    kinds = [type(b) for b in slab.memory.buffers]
    # 2 full layers' K and V, and conv + temporal of 2 GDN layers, are slab views; the aux row is not
    assert kinds[:-1] == [Strided] * (len(kinds) - 1) and kinds[-1] is tuple
    assert all(type(b) is tuple for b in packed.memory.buffers)
    # the wire sees item lengths and kinds only: the two pool kinds can pair
    assert slab.memory.layout.mismatch(packed.memory.layout) is None
    blocks = slab.result.token_to_kv_pool_allocator.slab_blocks.num_blocks
    tokens = blocks * slab.result.token_to_kv_pool_allocator.bs
    kv_items = [slab.memory.layout.buffers[i].num_items for i in slab.memory.kv_ids]
    state_items = [slab.memory.layout.buffers[i].num_items for i in slab.memory.state_ids[0]]
    assert kv_items == [tokens] * 4 and state_items == [blocks] * len(state_items)


@pytest.mark.parametrize("direction", ["slab->packed", "packed->slab", "slab->slab"])
def test_kv_rows_and_states_cross_between_pool_kinds(direction):
    src = Side(unified=direction.startswith("slab"))
    dst = Side(unified=direction.endswith("slab"))
    src.fill(1)
    rng = np.random.default_rng(7)
    src_pages = rng.permutation(np.arange(1, 300))[:40].tolist()
    dst_pages = rng.permutation(np.arange(1, 300))[:40].tolist()
    before = _raw(dst)
    _move(src, dst, src_pages, dst_pages, src_slot=3, dst_slot=5)
    _assert_landed(src, dst, src_pages, dst_pages, 3, 5)
    # nothing else of the destination changed: other tokens' rows, other blocks' states, the padding
    changed = _raw(dst) != before
    want = _expected_bytes(dst, dst_pages, 5)
    assert torch.equal(changed & ~want, torch.zeros_like(changed))


def test_a_short_span_is_refused_at_registration():
    from prfaas_sgl.transfer.staging import item_tensor

    buf = Strided(address=torch.zeros(100, dtype=torch.uint8).data_ptr(), nbytes=100, stride=40)
    assert buf.num_items(16) == 3
    with pytest.raises(ValueError, match="need"):
        item_tensor(buf, "cpu", 4, 16)
    with pytest.raises(ValueError, match="overlap"):
        Strided(0, 100, 8).num_items(16)


# -- byte-level view of a side ------------------------------------------------------------------------
def _buffers(side: Side) -> list[torch.Tensor]:
    return [*side.full.k_buffer, *side.full.v_buffer, *side.mamba.conv, side.mamba.temporal]


def _raw(side: Side) -> torch.Tensor:
    """Every byte the side's KV and state tensors can reach, one flat uint8 per distinct storage."""
    seen, out = set(), []
    for t in _buffers(side):
        st = t.untyped_storage()
        if st.data_ptr() in seen:
            continue
        seen.add(st.data_ptr())
        out.append(torch.frombuffer(bytearray(bytes(st)), dtype=torch.uint8))
    return torch.cat(out)


def _expected_bytes(side: Side, pages, slot: int) -> torch.Tensor:
    """Mask over _raw(side): the bytes the transfer should write (its rows and its state slot)."""
    marks, mask_of = [], {}
    for t in _buffers(side):
        st = t.untyped_storage()
        if st.data_ptr() not in mask_of:
            mask_of[st.data_ptr()] = torch.zeros(st.nbytes(), dtype=torch.bool)
            marks.append(mask_of[st.data_ptr()])
    for t in [*side.full.k_buffer, *side.full.v_buffer]:
        _mark(mask_of[t.untyped_storage().data_ptr()], t, list(pages))
    for t in [*side.mamba.conv, side.mamba.temporal]:
        for layer in range(t.shape[0]):
            _mark(mask_of[t.untyped_storage().data_ptr()], t[layer], [slot])
    return torch.cat(marks)


def _mark(mask: torch.Tensor, t: torch.Tensor, rows: list[int]) -> None:
    item = t[0].numel() * t.element_size()
    base = t.storage_offset() * t.element_size()
    stride = t.stride(0) * t.element_size()
    for r in rows:
        mask[base + r * stride: base + r * stride + item] = True
