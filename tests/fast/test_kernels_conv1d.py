"""Causal conv1d CPU kernels vs the token-by-token reference."""

from __future__ import annotations

import pytest
import torch
from prfaas_sgl.kernels.conv1d.cpu import (
    causal_conv1d_fwd_cpu,
    causal_conv1d_update_cpu,
)
from prfaas_sgl.kernels.conv1d.naive import (
    naive_causal_conv1d_fwd,
    naive_causal_conv1d_update,
)

TOL = 1e-5


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _setup(dim, width, slots, seed=0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(dim, width, generator=gen)
    bias = torch.randn(dim, generator=gen)
    pool = torch.randn(slots, dim, width - 1, generator=gen)
    return weight, bias, pool


@pytest.mark.parametrize(
    "lengths,slots,has_state,width",
    [
        ([1], [0], [True], 4),
        ([2], [1], [True], 4),  # shorter than the state: the new state keeps old columns
        ([1, 2, 9, 3, 1], [4, -1, 0, 5, 2], [True, True, False, True, True], 4),
        ([17, 5], [3, 1], [False, False], 3),
    ],
)
@pytest.mark.parametrize("silu", [True, False])
def test_prefill_matches_reference(lengths, slots, has_state, width, silu):
    dim = 7
    weight, bias, pool = _setup(dim, width, 6)
    x = torch.randn(sum(lengths), dim).t()  # [dim, T] view with token stride 7, as SGLang passes it
    idx, init = torch.tensor(slots, dtype=torch.int32), torch.tensor(has_state)
    ref_pool, got_pool = pool.clone(), pool.clone()
    ref = naive_causal_conv1d_fwd(x, weight, bias, ref_pool, _cu(lengths), idx, init, silu)
    got = causal_conv1d_fwd_cpu(x, weight, bias, got_pool, _cu(lengths), idx, init, silu, -1, True)
    assert got.shape == x.shape
    assert (got - ref).abs().max() <= TOL
    assert torch.equal(got_pool, ref_pool)
    if -1 in slots:
        pad = slots.index(-1)
        lo, hi = _cu(lengths)[pad], _cu(lengths)[pad + 1]
        assert got[:, lo:hi].abs().sum() == 0


def test_prefill_state_equals_last_inputs():
    weight, bias, pool = _setup(3, 4, 2)
    x = torch.arange(15.0).reshape(3, 5)
    causal_conv1d_fwd_cpu(x, weight, bias, pool, _cu([5]), torch.tensor([1]), torch.tensor([False]), True)
    assert torch.equal(pool[1], x[:, 2:])


def test_split_prefill_equals_one_pass():
    weight, bias, pool = _setup(5, 4, 1)
    x = torch.randn(5, 12)
    whole_pool, split_pool = pool.clone(), pool.clone()
    whole = causal_conv1d_fwd_cpu(x, weight, bias, whole_pool, _cu([12]), torch.tensor([0]), torch.tensor([True]), True)
    parts = [
        causal_conv1d_fwd_cpu(x[:, lo:hi], weight, bias, split_pool, _cu([hi - lo]), torch.tensor([0]), torch.tensor([True]), True)
        for lo, hi in ((0, 2), (2, 3), (3, 12))
    ]
    assert (torch.cat(parts, dim=1) - whole).abs().max() <= 1e-6
    assert torch.equal(split_pool, whole_pool)


@pytest.mark.parametrize("steps", [None, 1, 3])
def test_update_matches_reference(steps):
    dim, width = 6, 4
    weight, bias, pool = _setup(dim, width, 5)
    shape = (4, dim) if steps is None else (4, dim, steps)
    x = torch.randn(*shape)
    idx = torch.tensor([3, -1, 0, 4], dtype=torch.int32)
    ref_pool, got_pool = pool.clone(), pool.clone()
    ref = naive_causal_conv1d_update(x, ref_pool, weight, bias, True, idx)
    got = causal_conv1d_update_cpu(x, got_pool, weight, bias, True, None, idx, -1, True)
    assert got.shape == x.shape
    assert (got - ref).abs().max() <= TOL
    assert torch.equal(got_pool, ref_pool)
    assert got[1].abs().sum() == 0


def test_prefill_then_update_equals_longer_prefill():
    weight, bias, pool = _setup(4, 4, 1)
    x = torch.randn(4, 9)
    long_pool, step_pool = pool.clone(), pool.clone()
    slot, init = torch.tensor([0]), torch.tensor([True])
    whole = causal_conv1d_fwd_cpu(x, weight, bias, long_pool, _cu([9]), slot, init, True)
    causal_conv1d_fwd_cpu(x[:, :8], weight, bias, step_pool, _cu([8]), slot, init, True)
    last = causal_conv1d_update_cpu(x[:, 8][None], step_pool, weight, bias, True, None, slot)
    assert (last[0] - whole[:, 8]).abs().max() <= 1e-6
    assert torch.equal(step_pool, long_pool)


def test_update_records_intermediate_windows():
    weight, bias, pool = _setup(3, 4, 3)
    x = torch.randn(2, 3, 2)
    windows = torch.zeros(3, 2, 3, 3)
    idx, rows = torch.tensor([2, 0]), torch.tensor([1, 2])
    start = pool.clone()
    causal_conv1d_update_cpu(x, pool, weight, bias, True, None, idx, -1, False, windows, rows)
    after_first = torch.cat([start[2][:, 1:], x[0, :, :1]], dim=1)
    assert torch.equal(windows[1, 0], after_first)
    assert torch.equal(windows[1, 1], pool[2])
