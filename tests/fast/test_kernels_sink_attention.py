"""Sink attention CPU kernel vs the token-by-token reference (fp32, max abs error <= 1e-5), and the
reference itself pinned against torch SDPA where SDPA can express the case."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from prfaas_sgl.kernels.sink_attention import cpu as sink_cpu
from prfaas_sgl.kernels.sink_attention.cpu import sink_attention
from prfaas_sgl.kernels.sink_attention.naive import naive_sink_attention

TOL = 1e-5


def _inputs(tq, tk, hq, hkv, d, dv, seed=0, sink_scale=2.0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tq, hq, d, generator=gen)
    k = torch.randn(tk, hkv, d, generator=gen)
    v = torch.randn(tk, hkv, dv, generator=gen)
    sinks = torch.randn(hq, generator=gen) * sink_scale
    return q, k, v, sinks


CASES = [
    # Tq, q_pos0, k_pos0, Hq, Hkv, D, Dv, window
    (1, 0, 0, 1, 1, 4, 4, -1),  # the first decode-free token: sees only itself
    (9, 0, 0, 4, 2, 16, 8, 3),  # prefill, GQA, Dv < D (MiMo's SWA shape), window < length
    (13, 5, 0, 4, 1, 16, 8, -1),  # chunk after a cached prefix, full attention, one KV head
    (7, 20, 17, 3, 3, 5, 7, 3),  # chunk whose keys start at the window's edge (the SWA read range)
    (1, 30, 26, 4, 2, 6, 3, 4),  # decode inside a window whose oldest keys were evicted
    (6, 2, 0, 6, 2, 5, 3, 0),  # window 0: each query sees only itself (the sink still takes weight)
    (11, 3, 0, 2, 1, 7, 9, 50),  # window wider than everything: same as causal
]


@pytest.mark.parametrize("tq,q_pos0,k_pos0,hq,hkv,d,dv,window", CASES)
@pytest.mark.parametrize("with_sinks", [True, False])
def test_cpu_matches_naive(tq, q_pos0, k_pos0, hq, hkv, d, dv, window, with_sinks):
    tk = q_pos0 + tq - k_pos0
    q, k, v, sinks = _inputs(tq, tk, hq, hkv, d, dv, seed=tq + window)
    kw = dict(scale=d**-0.5, sinks=sinks if with_sinks else None, window=window, q_pos0=q_pos0, k_pos0=k_pos0)
    got = sink_attention(q, k, v, **kw)
    want = naive_sink_attention(q, k, v, **kw)
    assert got.shape == (tq, hq, dv) and got.dtype == q.dtype
    assert (got - want).abs().max().item() <= TOL


def test_query_blocks_see_the_same_keys_as_one_block(monkeypatch):
    """Queries are processed in blocks; a block must read keys from its own first query's window edge."""
    q, k, v, sinks = _inputs(23, 23, 4, 2, 8, 8, seed=3)
    kw = dict(scale=0.3, sinks=sinks, window=5)
    whole = sink_attention(q, k, v, **kw)
    monkeypatch.setattr(sink_cpu, "Q_BLOCK", 4)
    blocked = sink_attention(q, k, v, **kw)
    assert (whole - blocked).abs().max().item() <= TOL
    assert (blocked - naive_sink_attention(q, k, v, **kw)).abs().max().item() <= TOL


def test_bf16_inputs_keep_their_dtype():
    q, k, v, sinks = _inputs(5, 5, 2, 1, 8, 4, seed=4)
    got = sink_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), scale=0.35, sinks=sinks, window=2)
    want = naive_sink_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), scale=0.35, sinks=sinks, window=2)
    assert got.dtype == torch.bfloat16
    assert (got.float() - want).abs().max().item() <= 1e-2


def test_reference_without_sinks_is_sdpa_with_a_window_mask():
    """The reference's window keeps window + 1 keys (self included): SGLang's `q_pos - k_pos <= window`."""
    tq, window = 12, 4
    q, k, v, _ = _inputs(tq, tq, 4, 2, 8, 6, seed=5)
    pos = torch.arange(tq)
    mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] >= pos[:, None] - window)
    sdpa = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                          attn_mask=mask, scale=0.4, enable_gqa=True).transpose(0, 1)
    assert mask.sum(1).max().item() == window + 1
    assert (naive_sink_attention(q, k, v, scale=0.4, window=window) - sdpa).abs().max().item() <= TOL


def test_reference_sink_is_an_extra_zero_value_key():
    """A sink logit s_h is the same as one more key scored s_h for every query, with an all-zero value."""
    q, k, v, sinks = _inputs(6, 6, 2, 2, 4, 3, seed=6)
    want = naive_sink_attention(q, k, v, scale=1.0, sinks=sinks)
    scores = torch.einsum("qhd,khd->hqk", q, k)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    scores = torch.cat([scores, sinks.view(2, 1, 1).expand(2, 6, 1)], dim=-1)
    values = torch.cat([v.transpose(0, 1), torch.zeros(2, 1, 3)], dim=1)
    by_hand = torch.matmul(torch.softmax(scores, -1), values).transpose(0, 1)
    assert (want - by_hand).abs().max().item() <= TOL
