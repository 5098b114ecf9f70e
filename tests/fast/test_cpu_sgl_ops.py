"""The sgl_kernel stand-in tables: schemas register with torch.library and accept SGLang's call shapes."""

from __future__ import annotations

import torch
from prfaas_sgl.kernels.conv1d.naive import naive_causal_conv1d_fwd
from prfaas_sgl.kernels.gdn.naive import naive_chunk_gated_delta_rule
from prfaas_sgl.srt.cpu import sgl_ops

NAMESPACE = "prfaas_sgl_kernels_test"  # scratch namespace: the real `sgl_kernel` one is the shim's


def _ops():
    if not hasattr(_ops, "lib"):
        _ops.lib = torch.library.Library(NAMESPACE, "DEF")
        for name, schema in sgl_ops.TORCH_OP_SCHEMAS.items():
            _ops.lib.define(schema)
            _ops.lib.impl(name, sgl_ops.TORCH_OPS[name], "CPU")
    return getattr(torch.ops, NAMESPACE)


def test_tables_agree():
    assert set(sgl_ops.TORCH_OPS) == set(sgl_ops.TORCH_OP_SCHEMAS)
    for name, schema in sgl_ops.TORCH_OP_SCHEMAS.items():
        assert schema.startswith(name + "(")
    assert {"causal_conv1d_fn_cpu", "causal_conv1d_update_cpu", "chunk_gated_delta_rule_cpu"} <= set(sgl_ops.MAMBA_OPS)


def test_gdn_gating_values():
    A_log = torch.tensor([0.0, 0.5])
    a = torch.tensor([[0.0, 30.0], [-1.0, 2.0]])
    b = torch.tensor([[0.0, 1.0], [-2.0, 3.0]])
    dt_bias = torch.tensor([0.0, -5.0])
    g, beta = _ops().fused_gdn_gating_cpu(A_log, a, b, dt_bias)
    x = a + dt_bias
    soft = torch.where(x > 20, x, torch.log1p(torch.exp(x)))
    assert g.shape == (1, 2, 2) and g.dtype == torch.float32
    assert torch.allclose(g[0], -torch.exp(A_log) * soft, atol=1e-6)
    assert torch.allclose(beta[0], 1 / (1 + torch.exp(-b)), atol=1e-6)


def test_decode_op_called_with_sglang_keywords():
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 3, 2, 8, generator=gen), torch.randn(1, 3, 2, 8, generator=gen)
    v = torch.randn(1, 3, 4, 8, generator=gen)
    a, b = torch.randn(3, 4, generator=gen), torch.randn(3, 4, generator=gen)
    pool = torch.zeros(5, 4, 8, 8)
    out = _ops().fused_sigmoid_gating_delta_rule_update_cpu(
        A_log=torch.zeros(4), dt_bias=torch.zeros(4), q=q, k=k, v=v, a=a, b=b,
        initial_state_source=pool, initial_state_indices=torch.tensor([4, 0, 2], dtype=torch.int32),
        cu_seqlens=torch.tensor([0, 1, 2, 3], dtype=torch.int32), use_qk_l2norm_in_kernel=True,
        softplus_beta=1.0, softplus_threshold=20.0,
    )
    assert out.shape == (3, 1, 4, 8)
    assert pool[[4, 0, 2]].abs().sum() > 0 and pool[[1, 3]].abs().sum() == 0


def test_mamba_prefill_wrappers_match_reference():
    """The GDN prefill exactly as gdn_backend.forward_extend calls it on CPU."""
    gen = torch.Generator().manual_seed(1)
    lengths, dim_k, heads, v_heads = [5, 1, 11], 4, 1, 2
    total = sum(lengths)
    conv_dim = 2 * heads * dim_k + v_heads * dim_k
    mixed_qkv = torch.randn(total, conv_dim, generator=gen)
    weight, conv_pool = torch.randn(conv_dim, 4, generator=gen), torch.zeros(4, conv_dim, 3)
    qsl = torch.tensor([0, 5, 6, 17], dtype=torch.int32)
    slots = torch.tensor([3, 0, 1], dtype=torch.int32)
    conv = sgl_ops.MAMBA_OPS["causal_conv1d_fn_cpu"](
        mixed_qkv.transpose(0, 1), weight, None, activation="silu", conv_states=conv_pool,
        has_initial_state=torch.tensor([False, False, False]), cache_indices=slots,
        query_start_loc=qsl, seq_lens_cpu=lengths,
    ).transpose(0, 1)
    ref_conv = naive_causal_conv1d_fwd(
        mixed_qkv.t(), weight, None, torch.zeros(4, conv_dim, 3), qsl, slots, torch.tensor([False] * 3), True
    )
    assert conv.shape == mixed_qkv.shape and (conv - ref_conv.t()).abs().max() <= 1e-5
    assert torch.equal(conv_pool[1], mixed_qkv[-3:].t())  # slot of the 11-token sequence: its last 3 inputs
    q, k, v = conv.split([heads * dim_k, heads * dim_k, v_heads * dim_k], dim=-1)
    q, k = q.view(1, total, heads, dim_k), k.view(1, total, heads, dim_k)
    v = v.reshape(1, total, v_heads, dim_k)
    g, beta = _ops().fused_gdn_gating_cpu(torch.zeros(v_heads), torch.randn(total, v_heads, generator=gen),
                                          torch.randn(total, v_heads, generator=gen), torch.zeros(v_heads))
    ssm, ref_ssm = torch.zeros(4, v_heads, dim_k, dim_k), torch.zeros(4, v_heads, dim_k, dim_k)
    o, last, h = sgl_ops.MAMBA_OPS["chunk_gated_delta_rule_cpu"](
        q=q, k=k, v=v, g=g, beta=beta, initial_state=ssm, cu_seqlens=qsl, head_first=False,
        use_qk_l2norm_in_kernel=True, initial_state_indices=slots,
    )
    ref, _ = naive_chunk_gated_delta_rule(q, k, v, g, beta, ref_ssm, qsl, slots)
    assert h is None and last.shape == (3, v_heads, dim_k, dim_k)
    assert (o - ref).abs().max() <= 1e-5 and (ssm - ref_ssm).abs().max() <= 1e-5


def test_chunk_torch_op_returns_fresh_final_states():
    q = torch.randn(1, 4, 1, 4)
    pool = torch.zeros(2, 1, 4, 4)
    o, final = _ops().chunk_gated_delta_rule_cpu(
        q, q, q, -torch.ones(1, 4, 1), torch.ones(1, 4, 1), pool, True,
        torch.tensor([0, 4], dtype=torch.int32), False, True, torch.tensor([1], dtype=torch.int32),
    )
    assert o.shape == (1, 4, 1, 4)
    assert torch.equal(final[0], pool[1]) and final.data_ptr() != pool.data_ptr()


def test_rmsnorm_gated_and_gemma_norms():
    gen = torch.Generator().manual_seed(2)
    x, z, w = torch.randn(3, 8, generator=gen), torch.randn(3, 8, generator=gen), torch.randn(8, generator=gen)
    want = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w * z * torch.sigmoid(z)
    assert torch.allclose(_ops().fused_rmsnorm_gated_cpu(x, w, z, 1e-6), want, atol=1e-6)

    q_gate, k = torch.randn(2, 2 * 2 * 4, generator=gen), torch.randn(2, 4, generator=gen)
    qw, kw = torch.randn(4, generator=gen), torch.randn(4, generator=gen)
    q_out, k_out, gate = _ops().fused_qk_gemma_rmsnorm_with_gate_cpu(q_gate, k, qw, kw, 1e-6, 4, 2)
    heads = q_gate.view(2, 2, 8)
    q_ref = heads[..., :4].reshape(-1, 4)
    q_ref = q_ref / torch.sqrt(q_ref.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + qw)
    assert torch.allclose(q_out, q_ref, atol=1e-6) and torch.equal(gate, heads[..., 4:].reshape(-1, 4))
    q2, k2 = _ops().fused_qk_gemma_rmsnorm_cpu(heads[..., :4].reshape(2, 8), k, qw, kw, 1e-6, 4)
    assert torch.allclose(q2, q_out, atol=1e-6) and torch.allclose(k2, k_out, atol=1e-6)

    y = torch.randn(2, 4, generator=gen)
    gate2 = torch.randn(2, 4, generator=gen)
    expected = y * torch.sigmoid(gate2)
    _ops().fused_sigmoid_mul_cpu(y, gate2)
    assert torch.allclose(y, expected, atol=1e-6)


def _reference_qkvzba(mixed_qkvz, mixed_ba, nk, nv, dk, dv):
    """Qwen3-Next's `fix_query_key_value_ordering` + cat, re-derived from the grouped layout."""
    t, grp = mixed_qkvz.shape[0], nv // nk
    per = mixed_qkvz.view(t, nk, 2 * dk + 2 * grp * dv)
    q, k = per[..., :dk], per[..., dk : 2 * dk]
    v, z = per[..., 2 * dk : 2 * dk + grp * dv], per[..., 2 * dk + grp * dv :]
    ba = mixed_ba.view(t, nk, 2 * grp)
    mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
    return mixed, z.reshape(t, nv, dv), ba[..., :grp].reshape(t, nv), ba[..., grp:].reshape(t, nv)


def test_qkvzba_splits():
    nk, nv, dk, dv, t = 2, 6, 3, 5, 4
    qkvz = torch.randn(t, nk * (2 * dk) + 2 * nv * dv)
    ba = torch.randn(t, 2 * nv)
    got = _ops().fused_qkvzba_split_reshape_cat_cpu(qkvz, ba, nk, nv, dk, dv)
    for g, r in zip(got, _reference_qkvzba(qkvz, ba, nk, nv, dk, dv)):
        assert torch.equal(g, r)
    mixed, z, b, a = _ops().fused_qkvzba_split_reshape_cat_contiguous_cpu(qkvz, ba, nk, nv, dk, dv)
    qkv_dim = 2 * nk * dk + nv * dv
    assert torch.equal(mixed, qkvz[:, :qkv_dim]) and torch.equal(z.reshape(t, -1), qkvz[:, qkv_dim:])
    assert torch.equal(b, ba[:, :nv]) and torch.equal(a, ba[:, nv:])
