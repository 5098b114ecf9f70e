"""The CPU GDN ops (SGLang's sgl_kernel stand-ins) on slab state views: a state pool that is a
strided view over the one slab (block stride, not contiguous) gives the same outputs and the same
updated states as a contiguous pool, and the in-place updates land in the indexed blocks only."""
from __future__ import annotations

import torch

from prfaas_sgl.cachepool.slab import Slab
from prfaas_sgl.cachepool.slab_layout import SlabLayout
from prfaas_sgl.kernels.conv1d.cpu import causal_conv1d_fwd_cpu, causal_conv1d_update_cpu
from prfaas_sgl.kernels.gdn.cpu import chunk_gated_delta_rule_cpu

F32 = torch.float32
LAYERS, DIM, WIDTH, HV, H, D = 3, 32, 4, 4, 2, 8  # tiny-qwen35-hybrid's shape family, smaller
LAYOUT = SlabLayout.plan([(2 * D * 4, 2 * D * 4)] * 2,
                         [("conv0", DIM * (WIDTH - 1) * 4, LAYERS), ("temporal", HV * D * D * 4, LAYERS)], 16)
SLOTS = torch.tensor([3, 5])  # the blocks that hold the two requests' states


def _pools(seed: int):
    slab = Slab(LAYOUT, 8)
    slab.buffer.copy_(torch.randint(0, 256, slab.buffer.shape, generator=torch.Generator().manual_seed(seed),
                                    dtype=torch.uint8))
    conv = slab.state_view("conv0", F32, (DIM, WIDTH - 1))[1]  # layer 1: [blocks, dim, W-1], block stride
    temporal = slab.state_view("temporal", F32, (HV, D, D))[1]
    for t in (conv, temporal):  # finite values where the ops read
        t[SLOTS] = torch.randn(t[SLOTS].shape, generator=torch.Generator().manual_seed(seed))
    return slab, conv, temporal


def _untouched_outside(slab: Slab, before: torch.Tensor) -> None:
    for b in range(slab.num_blocks):
        if b not in SLOTS.tolist():
            assert torch.equal(slab.block(b), before[b * LAYOUT.block_bytes:(b + 1) * LAYOUT.block_bytes]), b


def test_conv_ops_on_slab_views_match_contiguous_pools():
    slab, conv, _ = _pools(1)
    assert not conv.is_contiguous()
    ref, before, before_states = conv.clone(), slab.buffer.clone(), conv[SLOTS].clone()
    g = torch.Generator().manual_seed(2)
    weight, x = torch.randn(DIM, WIDTH, generator=g), torch.randn(DIM, 9, generator=g)
    loc, has = torch.tensor([0, 5, 9]), torch.tensor([True, True])
    outs = [causal_conv1d_fwd_cpu(x, weight, None, pool, loc, SLOTS, has, True) for pool in (conv, ref)]
    step = torch.randn(2, DIM, generator=g)
    outs += [causal_conv1d_update_cpu(step, pool, weight, None, True, conv_state_indices=SLOTS) for pool in (conv, ref)]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[2], outs[3])
    assert torch.equal(conv[SLOTS], ref[SLOTS]) and not torch.equal(conv[SLOTS], before_states)
    _untouched_outside(slab, before)


def test_gdn_chunk_on_slab_views_matches_contiguous_pool():
    slab, _, temporal = _pools(3)
    assert not temporal.is_contiguous()
    ref, before, before_states = temporal.clone(), slab.buffer.clone(), temporal[SLOTS].clone()
    g = torch.Generator().manual_seed(4)
    q, k = torch.randn(1, 9, H, D, generator=g), torch.randn(1, 9, H, D, generator=g)
    v = torch.randn(1, 9, HV, D, generator=g)
    decay, beta = -torch.rand(1, 9, HV, generator=g), torch.rand(1, 9, HV, generator=g)
    cu = torch.tensor([0, 5, 9])
    outs = [chunk_gated_delta_rule_cpu(q, k, v, decay, beta, pool, cu_seqlens=cu, initial_state_indices=SLOTS)
            for pool in (temporal, ref)]
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(temporal[SLOTS], ref[SLOTS])
    assert not torch.equal(temporal[SLOTS], before_states)
    _untouched_outside(slab, before)
