"""The unified slab on every device at hand: its SGLang-shaped views alias one buffer and stay inside
their block, and paged attention reads the slab's strided K/V views (K and V of every layer interleaved per
token, state blocks between KV blocks) exactly as it reads contiguous pages.

Attention is called as SGLang's flashinfer backend calls it: page size 1, the K/V buffer of a layer
`[token slots, Hkv, D]` unsqueezed to pages of one token, kv_indices = the requests' token slots; and once
more with the pool's own block pages (page size = tokens per block). On CPU the torch reference reads the
strided views; on CUDA FlashInfer does (through `kernels.paged_attention`'s runner). Both are checked
against the torch reference over contiguous copies of the same tokens. Imports no SGLang.
"""
from __future__ import annotations

import pytest
import torch

from prfaas_sgl.cachepool.slab import Slab
from prfaas_sgl.cachepool.slab_layout import SlabLayout
from prfaas_sgl.kernels.paged_attention import (AttentionSpec, FlashInferPagedAttention, build_paged_batch,
                                                naive_paged_attention, paged_decode, paged_prefill)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
BF16 = torch.bfloat16
HQ, HKV, D, LAYERS = 8, 2, 128, 2
ROW = HKV * D * 2  # bytes of one token's K (or V) in bf16
# two full layers (K, V rows) and a GDN-like state part: blocks are either 16 tokens of KV or one state
LAYOUT = SlabLayout.plan([(ROW, ROW)] * LAYERS, [("conv", 3 * 1024, 2), ("temporal", 8 * 1024, 2)], 16)
BS = LAYOUT.tokens_per_block
BLOCKS = 64


@pytest.fixture(scope="module")
def runner():
    return FlashInferPagedAttention("cuda") if torch.cuda.is_available() else None


@pytest.mark.parametrize("device", DEVICES)
def test_views_alias_one_buffer_and_writes_stay_in_their_block(device):
    slab = Slab(LAYOUT, BLOCKS, device=device)
    k1, v1 = slab.kv_views(1, BF16, HKV, D)
    conv = slab.state_view("conv", torch.float32, (3, 256))
    base = slab.buffer.untyped_storage().data_ptr()
    assert {t.untyped_storage().data_ptr() for t in (k1, v1, conv)} == {base}
    assert k1.shape == (BLOCKS * BS, HKV, D) and conv.shape == (2, BLOCKS, 3, 256)

    k1[5 * BS + 3] = 1.0  # token 3 of block 5, layer 1's K
    start = 5 * LAYOUT.block_bytes + 3 * LAYOUT.token_bytes + LAYOUT.kv_offsets[1][0]
    _only_bytes_changed(slab, start, ROW)
    slab.buffer.zero_()
    conv[1, 7] = 2.0  # layer 1's conv state in block 7
    p = LAYOUT.part("conv")
    _only_bytes_changed(slab, 7 * LAYOUT.block_bytes + p.offset + p.layer_bytes, p.layer_bytes)


def _only_bytes_changed(slab: Slab, start: int, n: int) -> None:
    buf = slab.buffer
    assert int(buf[start:start + n].count_nonzero()) > 0
    assert int(buf.count_nonzero()) == int(buf[start:start + n].count_nonzero())


def _filled_slab(device: str, reqs: list[tuple[int, int]]):
    """A slab whose KV blocks are handed out shuffled among state blocks (as after churn), each request's
    K/V written through the views; returns the slab, per-request block tables and each layer's dense
    K/V [kv_len, Hkv, D] per request (the contiguous truth)."""
    gen = torch.Generator().manual_seed(11)
    slab = Slab(LAYOUT, BLOCKS, device=device)
    slab.buffer.copy_(torch.randint(0, 256, (slab.buffer.numel(),), dtype=torch.uint8, generator=gen))
    blocks = torch.randperm(BLOCKS - 1, generator=gen)[: BLOCKS // 2] + 1  # block 0 is padding
    tables, dense, at = [], [], 0
    for _, kv_len in reqs:
        n = -(-kv_len // BS)
        tables.append([int(b) for b in blocks[at:at + n]])
        at += n
    for layer in range(LAYERS):
        k, v = slab.kv_views(layer, BF16, HKV, D)
        per_req = []
        for (_, kv_len), table in zip(reqs, tables):
            kd, vd = (torch.randn(kv_len, HKV, D, generator=gen).to(BF16) for _ in range(2))
            slots = _slots(table, kv_len).to(device)
            k[slots], v[slots] = kd.to(device), vd.to(device)
            per_req.append((kd, vd))
        dense.append(per_req)
    return slab, tables, dense


def _slots(table: list[int], kv_len: int) -> torch.Tensor:
    return (torch.tensor(table)[:, None] * BS + torch.arange(BS)).reshape(-1)[:kv_len]


def _truth(q: torch.Tensor, dense, reqs, spec_heads) -> torch.Tensor:
    """The torch reference over contiguous pages holding the same tokens (page size 1)."""
    k = torch.cat([kd for kd, _ in dense])[:, None]
    v = torch.cat([vd for _, vd in dense])[:, None]
    kv_lens = [n for _, n in reqs]
    starts = torch.tensor([0] + kv_lens).cumsum(0)
    tables = [list(range(int(starts[i]), int(starts[i + 1]))) for i in range(len(reqs))]
    batch = build_paged_batch(tables, kv_lens, [n for n, _ in reqs], 1)
    return naive_paged_attention(q, k, v, batch, AttentionSpec(*spec_heads, 1)).float()


@pytest.mark.parametrize("paging", ["sglang-page1", "block-pages"])
@pytest.mark.parametrize("device", DEVICES)
def test_paged_attention_reads_strided_slab_views(device, paging, runner):
    reqs = [(20, 37), (1, 70), (16, 16), (9, 50)]  # (q_len, kv_len): a decode row among prefills
    slab, tables, dense = _filled_slab(device, reqs)
    gen = torch.Generator().manual_seed(5)
    for layer in range(LAYERS):
        k, v = slab.kv_views(layer, BF16, HKV, D)
        if paging == "sglang-page1":
            k_cache, v_cache, page = k.unsqueeze(1), v.unsqueeze(1), 1
            pages = [_slots(t, n).tolist() for t, (_, n) in zip(tables, reqs)]
        else:
            k_cache, v_cache, page = k.view(BLOCKS, BS, HKV, D), v.view(BLOCKS, BS, HKV, D), BS
            pages = tables
        assert not k_cache.is_contiguous()  # the strided slab, not a copy
        batch = build_paged_batch(pages, [n for _, n in reqs], [q for q, _ in reqs], page, device=device)
        q = torch.randn(sum(q for q, _ in reqs), HQ, D, generator=gen).to(BF16)
        got = paged_prefill(q.to(device), k_cache, v_cache, batch, AttentionSpec(HQ, HKV, D, page), runner)
        want = _truth(q, dense[layer], reqs, (HQ, HKV, D))
        torch.testing.assert_close(got.float().cpu(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("device", DEVICES)
def test_paged_decode_reads_strided_slab_views(device, runner):
    reqs = [(1, 37), (1, 70), (1, 16), (1, 5)]
    slab, tables, dense = _filled_slab(device, reqs)
    k, v = slab.kv_views(0, BF16, HKV, D)
    pages = [_slots(t, n).tolist() for t, (_, n) in zip(tables, reqs)]
    batch = build_paged_batch(pages, [n for _, n in reqs], [1] * len(reqs), 1, device=device)
    q = torch.randn(len(reqs), HQ, D, generator=torch.Generator().manual_seed(6)).to(BF16)
    got = paged_decode(q.to(device), k.unsqueeze(1), v.unsqueeze(1), batch, AttentionSpec(HQ, HKV, D, 1), runner)
    torch.testing.assert_close(got.float().cpu(), _truth(q, dense[0], reqs, (HQ, HKV, D)), atol=2e-2, rtol=2e-2)
