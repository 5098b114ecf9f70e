"""Token-by-token Kimi Delta Attention reference, fp32. Slow on purpose: the twin `cpu.py` is tested against.

KDA is Gated DeltaNet with a per-channel forget gate: the decay is a vector over the key dim K, not a
scalar per head. One step for value head h (state S: [V, K], V-major like SGLang's pool `[slots, HV, V, K]`):

    S     <- S * exp(g_t)[None, :]           g_t: [K] log decay (<= 0)
    delta  = beta_t * (v_t - S @ k_t)        [V]
    S     <- S + outer(delta, k_t)
    o_t    = S @ (scale * q_t)               [V]

Gates as SGLang computes them from raw projections (fla `kda_gate_chunk_cumsum`, the IS_KDA branch of
`fused_sigmoid_gating_delta_rule_update`), with x = a + dt_bias[h, :]:

    g = -exp(A_log[h]) * softplus(x)                       (standard gate)
    g = lower_bound * sigmoid(exp(A_log[h]) * x)           (safe gate, when lower_bound is set)
    beta = sigmoid(b)

q/k are L2-normalised first when asked (x / sqrt(sum(x^2) + 1e-6)). Value head h reads key head
h // (HV // H). This file shares no code with `cpu.py` on purpose.
"""

from __future__ import annotations

import torch
from prfaas_sgl.kernels._varlen import seq_layout, slot_indices

L2NORM_EPS = 1e-6
CHUNK_SIZE = 64  # only for the chunk-start states (`h`) SGLang's prefix-cache tracking reads


def naive_kda_gate(
    a: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor | None,
    lower_bound: float | None = None,
    softplus_beta: float = 1.0,
    softplus_threshold: float = 20.0,
) -> torch.Tensor:
    """Raw gate a [..., HV, K] -> log decay [..., HV, K] fp32. A_log: HV elements; dt_bias: HV * K."""
    num_heads, dim = a.shape[-2], a.shape[-1]
    x = a.float()
    if dt_bias is not None:
        x = x + dt_bias.float().reshape(num_heads, dim)
    rate = torch.exp(A_log.float().reshape(num_heads, 1))
    if lower_bound is not None:
        return lower_bound / (1.0 + torch.exp(-rate * x))
    bx = softplus_beta * x
    soft = torch.where(bx <= softplus_threshold, torch.log(1.0 + torch.exp(bx)) / softplus_beta, x)
    return -rate * soft


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def recurrent_sequence(q, k, v, g, beta, state, scale: float, use_l2norm: bool):
    """One sequence, one token at a time.

    q, k: [L, H, K]; v: [L, HV, V]; g: [L, HV, K] log decay; beta: [L, HV]; state: [HV, V, K] (not mutated).
    Returns (o [L, HV, V] fp32, states [L + 1, HV, V, K] fp32: states[t] is the state before token t).
    """
    length, num_v_heads = v.shape[0], v.shape[1]
    group = num_v_heads // q.shape[1]
    states = torch.zeros(length + 1, *state.shape, dtype=torch.float32)
    states[0] = state.float()
    out = torch.zeros(length, num_v_heads, v.shape[2], dtype=torch.float32)
    for t in range(length):
        for h in range(num_v_heads):
            q_t, k_t = q[t, h // group].float(), k[t, h // group].float()
            if use_l2norm:
                q_t, k_t = _l2norm(q_t), _l2norm(k_t)
            s = states[t, h] * torch.exp(g[t, h].float())[None, :]
            delta = beta[t, h].float() * (v[t, h].float() - s @ k_t)
            s = s + torch.outer(delta, k_t)
            out[t, h] = s @ (q_t * scale)
            states[t + 1, h] = s
    return out, states


def naive_chunk_kda(
    q, k, v, g, beta, scale=None, initial_state=None, initial_state_indices=None,
    use_qk_l2norm_in_kernel=False, cu_seqlens=None, A_log=None, dt_bias=None, lower_bound=None,
    output_intermediate_states=False, beta_is_raw=False,
):
    """Reference for `chunk_kda_cpu` (same arguments, same pool mutation, same returns).

    q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV, K] (raw when A_log is given, else log decay);
    beta: [B, T, HV] (raw when beta_is_raw). Pool initial_state [slots, HV, V, K]: sequence n starts from
    slot initial_state_indices[n] (n if None; negative: zeros, not written) and its final state is
    written there. Returns o [B, T, HV, V] in v.dtype, or (o, h) with h [B, NT, HV, V, K] the state at
    the start of every 64-token chunk of every sequence (chunks of sequence n follow those of n - 1).
    """
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    layout = seq_layout(cu_seqlens, q.shape[0], q.shape[1])
    slots = slot_indices(initial_state_indices, layout.num_seqs)
    if A_log is not None:
        g = naive_kda_gate(g, A_log, dt_bias, lower_bound)
    if beta_is_raw:
        beta = 1.0 / (1.0 + torch.exp(-beta.float()))
    flat = [x.reshape(-1, *x.shape[2:]) for x in (q, k, v, g, beta)]
    state_shape = (v.shape[2], v.shape[3], k.shape[3])
    out = torch.zeros(flat[2].shape, dtype=torch.float32)
    chunk_states = []
    for n in range(layout.num_seqs):
        lo, hi = int(layout.starts[n]), int(layout.starts[n] + layout.lengths[n])
        slot = int(slots[n])
        use_pool = initial_state is not None and slot >= 0
        h0 = initial_state[slot] if use_pool else torch.zeros(state_shape)
        out[lo:hi], states = recurrent_sequence(*(x[lo:hi] for x in flat), h0, scale, use_qk_l2norm_in_kernel)
        chunk_states.extend(states[t] for t in range(0, hi - lo, CHUNK_SIZE))
        if use_pool:
            initial_state[slot] = states[-1].to(initial_state.dtype)
    o = out.reshape(v.shape).to(v.dtype)
    if not output_intermediate_states:
        return o
    return o, torch.stack(chunk_states).reshape(q.shape[0], -1, *state_shape).to(q.dtype)


def naive_fused_sigmoid_gating_delta_rule_update(
    A_log, a, dt_bias, softplus_beta, softplus_threshold, q, k, v, b, initial_state_source,
    initial_state_indices, scale=None, use_qk_l2norm_in_kernel=False, cu_seqlens=None, is_kda=True,
    lower_bound=None, disable_state_update=False,
):
    """Reference for `fused_sigmoid_gating_delta_rule_update_cpu` (KDA): gates from raw a/b, then the recurrence.

    q, k: [B, T, H, K]; v: [B, T, HV, V]; a: T * HV * K elements; b: T * HV elements (T = B * T tokens).
    Returns o [B, T, HV, V] in q.dtype; the pool is updated at non-negative slots unless disable_state_update.
    """
    assert is_kda, "the reference covers the KDA (per-channel gate) case"
    num_v_heads, dim = v.shape[2], k.shape[3]
    g = naive_kda_gate(a.reshape(-1, num_v_heads, dim), A_log, dt_bias, lower_bound, softplus_beta, softplus_threshold)
    beta = 1.0 / (1.0 + torch.exp(-b.float().reshape(-1, num_v_heads)))
    pool = initial_state_source.clone() if disable_state_update else initial_state_source
    o = naive_chunk_kda(
        q, k, v.float(), g.reshape(*v.shape[:2], num_v_heads, dim), beta.reshape(v.shape[:3]),
        scale, pool, initial_state_indices, use_qk_l2norm_in_kernel,
        cu_seqlens,
    )
    return o.to(q.dtype)
