"""Token-by-token Gated DeltaNet reference, fp32. Slow on purpose: the twin the CPU kernels are tested against.

One step for value head h (state S: [V, K], V-major like SGLang's pool `[slots, HV, V, K]`):

    S     <- S * exp(g_t)
    delta  = beta_t * (v_t - S @ k_t)          [V]
    S     <- S + outer(delta, k_t)
    o_t    = S @ (scale * q_t)                 [V]

q/k are L2-normalised first when asked (x / sqrt(sum(x^2) + eps), eps = 1e-6, as SGLang's Triton
l2norm and recurrent kernels do). Value head h reads key head h // (HV // H) (grouped heads).
This file does not share code with `cpu.py` on purpose.
"""

from __future__ import annotations

import math

import torch
from prfaas_sgl.kernels._varlen import seq_layout, slot_indices

L2NORM_EPS = 1e-6


def _l2norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def _softplus(x: torch.Tensor, beta: float, threshold: float) -> torch.Tensor:
    soft = torch.log(1.0 + torch.exp(beta * x)) / beta
    return torch.where(beta * x <= threshold, soft, x)


def recurrent_sequence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float,
    use_l2norm: bool,
    eps: float = L2NORM_EPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, one token at a time.

    q, k: [L, H, K]; v: [L, HV, V]; g, beta: [L, HV]; state: [HV, V, K] (fp32, not mutated).
    Returns (o [L, HV, V] fp32, final state [HV, V, K] fp32).
    """
    num_v_heads, group = v.shape[1], v.shape[1] // q.shape[1]
    state = state.float().clone()
    out = torch.zeros(v.shape[0], num_v_heads, v.shape[2], dtype=torch.float32)
    for t in range(v.shape[0]):
        for h in range(num_v_heads):
            q_t, k_t = q[t, h // group].float(), k[t, h // group].float()
            if use_l2norm:
                q_t, k_t = _l2norm(q_t, eps), _l2norm(k_t, eps)
            s = state[h] * torch.exp(g[t, h].float())
            delta = beta[t, h].float() * (v[t, h].float() - s @ k_t)
            s = s + torch.outer(delta, k_t)
            out[t, h] = s @ (q_t * scale)
            state[h] = s
    return out, state


def naive_chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    initial_state_indices: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = True,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for `chunk_gated_delta_rule_cpu` (same arguments, same mutation).

    q, k: [B, T, H, K]; v: [B, T, HV, V]; g (log decay), beta: [B, T, HV]; B == 1 with cu_seqlens [N + 1].
    initial_state: pool [slots, HV, V, K]; slot initial_state_indices[n] (n if None) is read as
    sequence n's start state and overwritten with its final state; a negative slot means start from
    zeros and write nothing. Returns (o [B, T, HV, V] in v.dtype, final states [N, HV, V, K] fp32).
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    layout = seq_layout(cu_seqlens, q.shape[0], q.shape[1])
    slots = slot_indices(initial_state_indices, layout.num_seqs)
    flat = [x.reshape(-1, *x.shape[2:]) for x in (q, k, v, g, beta)]
    out = torch.zeros(flat[2].shape, dtype=torch.float32)
    finals = torch.zeros(layout.num_seqs, *initial_state.shape[1:], dtype=torch.float32)
    for n in range(layout.num_seqs):
        lo, hi = int(layout.starts[n]), int(layout.starts[n] + layout.lengths[n])
        slot = int(slots[n])
        h0 = initial_state[slot] if slot >= 0 else torch.zeros(initial_state.shape[1:])
        seq = [x[lo:hi] for x in flat]
        out[lo:hi], finals[n] = recurrent_sequence(*seq, h0, scale, use_qk_l2norm_in_kernel)
        if slot >= 0:
            initial_state[slot] = finals[n].to(initial_state.dtype)
    return out.reshape(v.shape).to(v.dtype), finals


def naive_fused_sigmoid_gating_delta_rule_update(
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    initial_state_source: torch.Tensor,
    initial_state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    use_qk_l2norm_in_kernel: bool,
    softplus_beta: float = 1.0,
    softplus_threshold: float = 20.0,
) -> torch.Tensor:
    """Reference for `fused_sigmoid_gating_delta_rule_update_cpu`: gates from raw a/b, then the recurrence.

    q, k: [1, T, H, K]; v: [1, T, HV, V]; a, b: [T, HV]. Returns o [T, 1, HV, V] in v.dtype; the pool
    initial_state_source [slots, HV, V, K] is updated in place at non-negative slots.
    """
    x = a.float() + dt_bias.float()
    g = -torch.exp(A_log.float()) * _softplus(x, softplus_beta, softplus_threshold)
    beta = 1.0 / (1.0 + torch.exp(-b.float()))
    o, _ = naive_chunk_gated_delta_rule(
        q, k, v, g.reshape(v.shape[:3]), beta.reshape(v.shape[:3]), initial_state_source,
        cu_seqlens, initial_state_indices, use_qk_l2norm_in_kernel,
    )
    return o.reshape(-1, 1, *v.shape[2:])
