"""Public tables of pure-torch stand-ins for the CPU-only `sgl_kernel` ops SGLang 0.5.23 calls.

`ops_table` places them in the `sgl_kernel` stand-in (`shim`); nothing here touches sglang or torch.library
by itself.

- `MAMBA_OPS`: attributes of the `sgl_kernel.mamba` module. SGLang calls these Python functions
  directly (`layers/attention/linear/gdn_backend.py`, `kernels/gdn_triton.py`, `kda_backend.py`)
  with the signatures below.
- `TORCH_OPS` + `TORCH_OP_SCHEMAS`: ops under `torch.ops.sgl_kernel.<name>`, to be registered with
  `torch.library` (define the schema, impl for CPU). SGLang calls some of them with keyword
  arguments, so the schema argument names are part of the contract. `(a!)` marks a tensor the op
  mutates; no output aliases an input.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from prfaas_sgl.kernels import norm_gate, qkvzba
from prfaas_sgl.kernels.conv1d.cpu import causal_conv1d_fwd_cpu
from prfaas_sgl.kernels.conv1d.cpu import causal_conv1d_update_cpu as _conv_update
from prfaas_sgl.kernels.gating import fused_gdn_gating_cpu
from prfaas_sgl.kernels.gdn.cpu import chunk_gated_delta_rule_cpu as _chunk_gdr
from prfaas_sgl.kernels.gdn.cpu import fused_sigmoid_gating_delta_rule_update_cpu

PAD_SLOT_ID = -1  # sgl_kernel's CPU wrappers hard-code -1; SGLang's pools use the same value


def _is_silu(activation) -> bool:
    return activation is True or activation in ("silu", "swish")


def causal_conv1d_fn_cpu(
    mixed_qkv_transposed, conv_weights, bias, activation, conv_states, has_initial_state,
    cache_indices, query_start_loc, seq_lens_cpu=None, **_unused,
) -> torch.Tensor:
    """`sgl_kernel.mamba.causal_conv1d_fn_cpu`: prefill conv. x [dim, T] -> [dim, T]; pool [slots, dim, W-1].

    `seq_lens_cpu` and extra CUDA-only keywords (`block_table`) are accepted and ignored.
    """
    return causal_conv1d_fwd_cpu(
        mixed_qkv_transposed, conv_weights, bias, conv_states, query_start_loc, cache_indices,
        has_initial_state, _is_silu(activation), PAD_SLOT_ID,
    )


def causal_conv1d_update_cpu(
    mixed_qkv, conv_states, conv_weights, bias, activation, conv_state_indices,
    intermediate_conv_window=None, intermediate_state_indices=None,
    retrieve_next_token=None, retrieve_next_sibling=None, retrieve_parent_token=None,
) -> torch.Tensor:
    """`sgl_kernel.mamba.causal_conv1d_update_cpu`: decode conv. x [B, dim] or [B, dim, S] (verify).

    Verify (intermediate_conv_window given) supports linear draft chains only and, like the CUDA
    kernel, fills retrieve_parent_token [B, S] with the chain's parents (0, 0, 1, ..., S-2).
    """
    branching = retrieve_next_sibling is not None and bool((retrieve_next_sibling != -1).any())
    if intermediate_conv_window is not None and branching:
        raise NotImplementedError("CPU conv verify supports a linear draft chain only (topk <= 1)")
    out = _conv_update(
        mixed_qkv, conv_states, conv_weights, bias, _is_silu(activation), None, conv_state_indices,
        PAD_SLOT_ID, False, intermediate_conv_window, intermediate_state_indices,
    )
    if intermediate_conv_window is not None and retrieve_parent_token is not None:
        steps = mixed_qkv.shape[-1]
        retrieve_parent_token[:, 0] = 0
        retrieve_parent_token[:, 1:steps] = torch.arange(steps - 1, dtype=retrieve_parent_token.dtype)
    return out


def chunk_gated_delta_rule_cpu(
    q, k, v, g, beta, initial_state, cu_seqlens, head_first=False, use_qk_l2norm_in_kernel=True,
    initial_state_indices=None, **_unused,
):
    """`sgl_kernel.mamba.chunk_gated_delta_rule_cpu`: prefill. Returns (o [1, T, HV, V], final states
    [N, HV, V, K] fp32, h=None); the pool `initial_state` is updated in place at initial_state_indices."""
    o, finals = _chunk_gdr(q, k, v, g, beta, initial_state, cu_seqlens, head_first, use_qk_l2norm_in_kernel, initial_state_indices)
    return o, finals, None


def _chunk_gdr_op(query, key, value, g, beta, initial_state, output_final_state, cu_seqlens, head_first,
                  use_qk_l2norm_in_kernel, initial_state_indices=None, eps=1e-6):
    # eps is part of the C++ schema; the l2norm eps is fixed at 1e-6 like SGLang's Triton kernels.
    return _chunk_gdr(query, key, value, g, beta, initial_state, cu_seqlens, head_first, use_qk_l2norm_in_kernel, initial_state_indices)


def _owned(fn: Callable) -> Callable:
    """Wrap an op so none of its tensor outputs is a view of an input (torch.library forbids aliasing)."""
    def run(*args, **kwargs):
        out = fn(*args, **kwargs)
        if isinstance(out, tuple):
            return tuple(t.clone(memory_format=torch.contiguous_format) for t in out)
        return out
    run.__name__, run.__doc__ = fn.__name__, fn.__doc__
    return run


MAMBA_OPS: dict[str, Callable] = {
    "causal_conv1d_fn_cpu": causal_conv1d_fn_cpu,
    "causal_conv1d_update_cpu": causal_conv1d_update_cpu,
    "chunk_gated_delta_rule_cpu": chunk_gated_delta_rule_cpu,
    "fused_sigmoid_gating_delta_rule_update_cpu": fused_sigmoid_gating_delta_rule_update_cpu,
}

TORCH_OPS: dict[str, Callable] = {
    "causal_conv1d_fwd_cpu": causal_conv1d_fwd_cpu,
    "causal_conv1d_update_cpu": _conv_update,
    "chunk_gated_delta_rule_cpu": _chunk_gdr_op,
    "fused_sigmoid_gating_delta_rule_update_cpu": fused_sigmoid_gating_delta_rule_update_cpu,
    "fused_gdn_gating_cpu": fused_gdn_gating_cpu,
    "fused_rmsnorm_gated_cpu": norm_gate.fused_rmsnorm_gated_cpu,
    "fused_sigmoid_mul_cpu": norm_gate.fused_sigmoid_mul_cpu,
    "fused_qk_gemma_rmsnorm_cpu": _owned(norm_gate.fused_qk_gemma_rmsnorm_cpu),
    "fused_qk_gemma_rmsnorm_with_gate_cpu": _owned(norm_gate.fused_qk_gemma_rmsnorm_with_gate_cpu),
    "fused_qkvzba_split_reshape_cat_cpu": _owned(qkvzba.fused_qkvzba_split_reshape_cat_cpu),
    "fused_qkvzba_split_reshape_cat_contiguous_cpu": _owned(qkvzba.fused_qkvzba_split_reshape_cat_contiguous_cpu),
}

_QKVZBA_ARGS = "Tensor mixed_qkvz, Tensor mixed_ba, int num_heads_qk, int num_heads_v, int head_qk, int head_v"

TORCH_OP_SCHEMAS: dict[str, str] = {
    "causal_conv1d_fwd_cpu": (
        "causal_conv1d_fwd_cpu(Tensor x, Tensor weight, Tensor? bias, Tensor(a!)? conv_states, "
        "Tensor? query_start_loc, Tensor? cache_indices, Tensor? has_initial_state, bool silu_activation, "
        "int pad_slot_id, bool is_vnni) -> Tensor"
    ),
    "causal_conv1d_update_cpu": (
        "causal_conv1d_update_cpu(Tensor x, Tensor(a!) conv_states, Tensor weight, Tensor? bias, "
        "bool silu_activation, Tensor? cache_seqlens, Tensor? conv_state_indices, int pad_slot_id, "
        "bool is_vnni) -> Tensor"
    ),
    "chunk_gated_delta_rule_cpu": (
        "chunk_gated_delta_rule_cpu(Tensor query, Tensor key, Tensor value, Tensor g, Tensor beta, "
        "Tensor(a!) initial_state, bool output_final_state, Tensor cu_seqlens, bool head_first, "
        "bool use_qk_l2norm_in_kernel, Tensor? initial_state_indices=None, float eps=1e-6) -> (Tensor, Tensor)"
    ),
    "fused_sigmoid_gating_delta_rule_update_cpu": (
        "fused_sigmoid_gating_delta_rule_update_cpu(Tensor A_log, Tensor dt_bias, Tensor q, Tensor k, "
        "Tensor v, Tensor a, Tensor b, Tensor(a!) initial_state_source, Tensor initial_state_indices, "
        "Tensor cu_seqlens, bool use_qk_l2norm_in_kernel, float softplus_beta=1.0, "
        "float softplus_threshold=20.0, bool is_kda=False, bool disable_state_update=False, "
        "Tensor(b!)? intermediate_states_buffer=None, Tensor? intermediate_state_indices=None, "
        "int? cache_steps=None, Tensor? retrieve_parent_token=None) -> Tensor"
    ),
    "fused_gdn_gating_cpu": "fused_gdn_gating_cpu(Tensor A_log, Tensor a, Tensor b, Tensor dt_bias) -> (Tensor, Tensor)",
    "fused_rmsnorm_gated_cpu": "fused_rmsnorm_gated_cpu(Tensor input, Tensor weight, Tensor gate, float eps) -> Tensor",
    "fused_sigmoid_mul_cpu": "fused_sigmoid_mul_cpu(Tensor(a!) input, Tensor gate) -> ()",
    "fused_qk_gemma_rmsnorm_cpu": (
        "fused_qk_gemma_rmsnorm_cpu(Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, float eps, "
        "int head_dim) -> (Tensor, Tensor)"
    ),
    "fused_qk_gemma_rmsnorm_with_gate_cpu": (
        "fused_qk_gemma_rmsnorm_with_gate_cpu(Tensor q_gate, Tensor k, Tensor q_weight, Tensor k_weight, "
        "float eps, int head_dim, int num_heads) -> (Tensor, Tensor, Tensor)"
    ),
    "fused_qkvzba_split_reshape_cat_cpu": (
        f"fused_qkvzba_split_reshape_cat_cpu({_QKVZBA_ARGS}) -> (Tensor, Tensor, Tensor, Tensor)"
    ),
    "fused_qkvzba_split_reshape_cat_contiguous_cpu": (
        f"fused_qkvzba_split_reshape_cat_contiguous_cpu({_QKVZBA_ARGS}) -> (Tensor, Tensor, Tensor, Tensor)"
    ),
}
