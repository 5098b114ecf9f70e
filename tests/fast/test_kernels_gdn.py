"""Gated DeltaNet CPU kernels vs the token-by-token reference (fp32, max abs error <= 1e-5)."""

from __future__ import annotations

import pytest
import torch
from prfaas_sgl.kernels.gdn.cpu import (
    chunk_gated_delta_rule_cpu,
    fused_sigmoid_gating_delta_rule_update_cpu,
)
from prfaas_sgl.kernels.gdn.naive import (
    naive_chunk_gated_delta_rule,
    naive_fused_sigmoid_gating_delta_rule_update,
)

TOL = 1e-5


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _inputs(lengths, heads, v_heads, dk, dv, seed=0):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q = torch.randn(1, total, heads, dk, generator=gen)
    k = torch.randn(1, total, heads, dk, generator=gen)
    v = torch.randn(1, total, v_heads, dv, generator=gen)
    g = -torch.rand(1, total, v_heads, generator=gen) * 0.7
    beta = torch.rand(1, total, v_heads, generator=gen)
    return q, k, v, g, beta


def _pool(slots, v_heads, dv, dk, seed=1):
    return torch.randn(slots, v_heads, dv, dk, generator=torch.Generator().manual_seed(seed)) * 0.5


CASES = [
    # lengths, H, HV, K, V, slot per sequence
    ([1], 1, 1, 8, 8, [0]),
    ([64], 2, 2, 16, 16, [1]),
    ([100], 2, 4, 12, 10, [2]),  # T not a multiple of the chunk, grouped value heads
    ([1, 70, 5, 129, 64], 2, 4, 12, 10, [3, 0, 6, 2, 5]),  # mixed varlen, permuted slots
    ([7, 1, 33], 3, 6, 5, 7, [4, -1, 1]),  # non-power-of-2 dims, one padded (negative) slot
]


@pytest.mark.parametrize("lengths,heads,v_heads,dk,dv,slots", CASES)
def test_chunk_matches_token_by_token(lengths, heads, v_heads, dk, dv, slots):
    q, k, v, g, beta = _inputs(lengths, heads, v_heads, dk, dv)
    pool = _pool(8, v_heads, dv, dk)
    idx = torch.tensor(slots, dtype=torch.int32)
    ref_pool, got_pool = pool.clone(), pool.clone()
    ref_o, ref_final = naive_chunk_gated_delta_rule(q, k, v, g, beta, ref_pool, _cu(lengths), idx)
    got_o, got_final = chunk_gated_delta_rule_cpu(q, k, v, g, beta, got_pool, _cu(lengths), initial_state_indices=idx)
    assert got_o.shape == v.shape
    assert (got_o - ref_o).abs().max() <= TOL
    assert (got_final - ref_final).abs().max() <= TOL
    assert (got_pool - ref_pool).abs().max() <= TOL
    untouched = [s for s in range(8) if s not in slots]
    assert torch.equal(got_pool[untouched], pool[untouched])


def test_chunk_without_initial_state_starts_from_zeros():
    q, k, v, g, beta = _inputs([9, 3], 1, 2, 4, 4)
    pool = torch.zeros(2, 2, 4, 4)
    o, final = chunk_gated_delta_rule_cpu(q, k, v, g, beta, pool, _cu([9, 3]))
    ref_o, _ = naive_chunk_gated_delta_rule(q, k, v, g, beta, torch.zeros(2, 2, 4, 4), _cu([9, 3]))
    assert (o - ref_o).abs().max() <= TOL
    assert torch.equal(pool, final)  # slots 0, 1 by default


def test_rectangular_batch_without_cu_seqlens():
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(3, 20, 2, 8, generator=gen), torch.randn(3, 20, 2, 8, generator=gen)
    v, g = torch.randn(3, 20, 2, 8, generator=gen), -torch.rand(3, 20, 2, generator=gen)
    beta = torch.rand(3, 20, 2, generator=gen)
    got_pool, ref_pool = _pool(3, 2, 8, 8), _pool(3, 2, 8, 8)
    o, _ = chunk_gated_delta_rule_cpu(q, k, v, g, beta, got_pool, None)
    ref, _ = naive_chunk_gated_delta_rule(q, k, v, g, beta, ref_pool, None)
    assert (o - ref).abs().max() <= TOL and (got_pool - ref_pool).abs().max() <= TOL


@pytest.mark.parametrize("split", [1, 37, 64, 65])
def test_split_prefill_carries_state(split):
    """Two prefill chunks through the pool give the one-pass outputs and final state."""
    q, k, v, g, beta = _inputs([150], 2, 4, 12, 10)
    idx = torch.tensor([1], dtype=torch.int32)
    one_pool, two_pool = _pool(2, 4, 10, 12), _pool(2, 4, 10, 12)
    whole, _ = chunk_gated_delta_rule_cpu(q, k, v, g, beta, one_pool, _cu([150]), initial_state_indices=idx)
    parts = []
    for lo, hi in ((0, split), (split, 150)):
        piece = [x[:, lo:hi] for x in (q, k, v, g, beta)]
        parts.append(chunk_gated_delta_rule_cpu(*piece, two_pool, _cu([hi - lo]), initial_state_indices=idx)[0])
    assert (torch.cat(parts, dim=1) - whole).abs().max() <= 1e-6
    assert (two_pool - one_pool).abs().max() <= 1e-6


def _decode_inputs(num, heads, v_heads, dk, dv, seed=5):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, num, heads, dk, generator=gen)
    k = torch.randn(1, num, heads, dk, generator=gen)
    v = torch.randn(1, num, v_heads, dv, generator=gen)
    a = torch.randn(num, v_heads, generator=gen) * 3  # reaches the softplus threshold branch
    b = torch.randn(num, v_heads, generator=gen)
    A_log = torch.randn(v_heads, generator=gen) * 0.5
    dt_bias = torch.randn(v_heads, generator=gen)
    return A_log, dt_bias, q, k, v, a, b


@pytest.mark.parametrize("lengths,slots", [([1], [2]), ([1, 1, 1, 1], [3, -1, 0, 5]), ([3, 1, 2], [1, 4, 0])])
def test_decode_matches_token_by_token(lengths, slots):
    A_log, dt_bias, q, k, v, a, b = _decode_inputs(sum(lengths), 2, 4, 6, 5)
    pool = _pool(6, 4, 5, 6)
    idx, cu = torch.tensor(slots, dtype=torch.int32), _cu(lengths)
    got_pool, ref_pool = pool.clone(), pool.clone()
    got = fused_sigmoid_gating_delta_rule_update_cpu(A_log, dt_bias, q, k, v, a, b, got_pool, idx, cu, True)
    ref = naive_fused_sigmoid_gating_delta_rule_update(A_log, dt_bias, q, k, v, a, b, ref_pool, idx, cu, True)
    assert got.shape == (sum(lengths), 1, 4, 5)
    assert (got - ref).abs().max() <= TOL
    assert (got_pool - ref_pool).abs().max() <= TOL
    if -1 in slots:
        assert torch.equal(got_pool[[1, 2, 4]], pool[[1, 2, 4]])


def test_prefill_then_decode_equals_longer_prefill():
    """Prefill 20 tokens, decode 1: same as prefilling 21 (gates computed the same way)."""
    A_log, dt_bias, q, k, v, a, b = _decode_inputs(21, 1, 2, 8, 8)
    from prfaas_sgl.kernels.gating import fused_gdn_gating_cpu

    g, beta = fused_gdn_gating_cpu(A_log, a, b, dt_bias)
    idx = torch.tensor([0], dtype=torch.int32)
    long_pool, step_pool = torch.zeros(1, 2, 8, 8), torch.zeros(1, 2, 8, 8)
    whole, _ = chunk_gated_delta_rule_cpu(q, k, v, g, beta, long_pool, _cu([21]), initial_state_indices=idx)
    chunk_gated_delta_rule_cpu(q[:, :20], k[:, :20], v[:, :20], g[:, :20], beta[:, :20], step_pool, _cu([20]), initial_state_indices=idx)
    last = fused_sigmoid_gating_delta_rule_update_cpu(
        A_log, dt_bias, q[:, 20:], k[:, 20:], v[:, 20:], a[20:], b[20:], step_pool, idx, _cu([1]), True
    )
    assert (last[0, 0] - whole[0, 20]).abs().max() <= 1e-6
    assert (step_pool - long_pool).abs().max() <= 1e-6


def test_strided_pool_view_is_updated_in_place():
    """The pool is a per-layer view of a [layers, slots, ...] buffer, as in SGLang's MambaPool."""
    q, k, v, g, beta = _inputs([5, 9], 1, 2, 4, 3)
    buffer = torch.zeros(3, 4, 2, 3, 4)
    layer_pool = buffer[1]
    idx = torch.tensor([2, 0], dtype=torch.int32)
    _, final = chunk_gated_delta_rule_cpu(q, k, v, g, beta, layer_pool, _cu([5, 9]), initial_state_indices=idx)
    assert torch.equal(buffer[1, 2], final[0]) and torch.equal(buffer[1, 0], final[1])
    assert buffer[0].abs().sum() == 0 and buffer[2].abs().sum() == 0


def test_verify_caches_per_step_states_without_touching_pool():
    A_log, dt_bias, q, k, v, a, b = _decode_inputs(6, 1, 2, 4, 4)
    pool = _pool(4, 2, 4, 4)
    idx, cu = torch.tensor([3, 1], dtype=torch.int32), _cu([3, 3])
    inter = torch.zeros(4, 3, 2, 4, 4)
    rows = torch.tensor([2, 0], dtype=torch.int32)
    got = fused_sigmoid_gating_delta_rule_update_cpu(
        A_log, dt_bias, q, k, v, a, b, pool.clone(), idx, cu, True,
        disable_state_update=True, intermediate_states_buffer=inter, intermediate_state_indices=rows,
        cache_steps=3, retrieve_parent_token=torch.tensor([[0, 0, 1], [0, 0, 1]]),
    )
    for n, (slot, row) in enumerate(((3, 2), (1, 0))):
        for t in range(3):
            ref_pool = pool.clone()
            sl = slice(3 * n, 3 * n + t + 1)
            ref = naive_fused_sigmoid_gating_delta_rule_update(
                A_log, dt_bias, q[:, sl], k[:, sl], v[:, sl], a[sl], b[sl], ref_pool,
                torch.tensor([slot]), _cu([t + 1]), True,
            )
            assert (inter[row, t] - ref_pool[slot]).abs().max() <= TOL
            assert (got[3 * n + t] - ref[-1]).abs().max() <= TOL


def test_bf16_inputs_stay_close_to_fp32():
    q, k, v, g, beta = _inputs([40, 3], 2, 2, 16, 16)
    pool32, pool16 = torch.zeros(2, 2, 16, 16), torch.zeros(2, 2, 16, 16, dtype=torch.bfloat16)
    o32, _ = chunk_gated_delta_rule_cpu(q, k, v, g, beta, pool32, _cu([40, 3]))
    args16 = [x.bfloat16() for x in (q, k, v)] + [g, beta.bfloat16()]
    o16, _ = chunk_gated_delta_rule_cpu(*args16, pool16, _cu([40, 3]))
    assert o16.dtype == torch.bfloat16 and pool16.dtype == torch.bfloat16
    assert (o16.float() - o32).abs().max() < 0.05
