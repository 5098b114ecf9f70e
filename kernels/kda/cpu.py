"""Kimi Delta Attention on CPU in plain torch: chunked prefill (WY form) and batched recurrent decode.

Same math as `naive.py` (see there for one step and the gates). The two public functions take exactly
the arguments of the SGLang 0.5.23 Triton functions they stand in for on CPU, which
`layers/attention/linear/kernels/kda_triton.py` calls: `fla.kda.chunk_kda` and
`linear.fused_sigmoid_gating_recurrent.fused_sigmoid_gating_delta_rule_update` (is_kda=True).

Chunked prefill, one chunk of C tokens, G = in-chunk cumsum of the log gates ([C, K]), S0 the carried
state [K, V]:

    A[t, s] = beta_t sum_c k_t[c] k_s[c] exp(G_t[c] - G_s[c])          s < t
    P[t, s] =        sum_c q_t[c] k_s[c] exp(G_t[c] - G_s[c])          s <= t
    (I + A) U = beta V - (beta K exp(G)) S0      ->   U = u - w S0      (u, w: one triangular solve)
    o_t   = (q_t exp(G_t)) S0 + sum_s P[t, s] U_s
    S_end = exp(G_C)[:, None] S0 + (K exp(G_C - G))^T U

GDN's scalar decay factors as exp(G_t) exp(-G_s); a per-channel decay does not, and exp(-G_s) overflows
fp32 once a chunk decays past e^-88. So the pairwise decay [C, C, K] is formed explicitly, exponent <= 0
on the causal side, a few chunks at a time to bound memory. Chunk bookkeeping (varlen packing, padding
rows with k = v = beta = g = 0, the carry loop batched over sequences) is GDN's, see `gdn/cpu.py`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from prfaas_sgl.kernels._varlen import seq_layout, slot_indices
from prfaas_sgl.kernels.gdn.cpu import ChunkPlan, plan_chunks

CHUNK_SIZE = 64  # FLA's; the per-chunk states `h` SGLang's prefix-cache tracking reads are on this grid
L2NORM_EPS = 1e-6
PAIR_BLOCK_ELEMENTS = 1 << 22  # fp32 elements of one [chunks, HV, C, C, K] pairwise-decay block (16 MiB)


def kda_gate(a, A_log, dt_bias, lower_bound=None, softplus_beta=1.0, softplus_threshold=20.0) -> torch.Tensor:
    """Raw forget gate a [..., HV, K] -> log decay fp32 [..., HV, K]. A_log: HV elements; dt_bias: HV * K."""
    heads, dim = a.shape[-2], a.shape[-1]
    x = a.float() if dt_bias is None else a.float() + dt_bias.float().reshape(heads, dim)
    rate = A_log.float().reshape(heads, 1).exp()
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(rate * x)
    return -rate * F.softplus(x, beta=softplus_beta, threshold=softplus_threshold)


def _prepare_qk(q, k, num_v_heads: int, use_l2norm: bool, scale: float):
    """[T, H, K] -> fp32 [T, HV, K]: l2norm, value-head expansion for grouped heads, scale on q."""
    q, k = q.float(), k.float()
    if use_l2norm:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + L2NORM_EPS)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + L2NORM_EPS)
    group = num_v_heads // q.shape[1]
    if group > 1:
        q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
    return q * scale, k


def _to_chunks(x: torch.Tensor, plan: ChunkPlan) -> torch.Tensor:
    """[T, HV, ...] -> [NC, HV, C, ...] with padding rows zeroed."""
    rows = x[plan.tokens]
    valid = plan.valid.reshape(*plan.valid.shape, *([1] * (rows.dim() - 2)))
    return rows.masked_fill(~valid, 0).transpose(1, 2)


def _pairwise(qc, kc, gc):
    """Decayed products (P with q, A-before-beta with k), both [NC, HV, C, C] and zero above the diagonal.

    qc, kc: [NC, HV, C, K]; gc: in-chunk cumulative log gates [NC, HV, C, K].
    """
    num, heads, size, dim = kc.shape
    causal = torch.ones(size, size, dtype=torch.bool).tril()[..., None]
    qk, kk = (torch.empty(num, heads, size, size) for _ in range(2))
    step = max(1, PAIR_BLOCK_ELEMENTS // (heads * size * size * dim))
    for lo in range(0, num, step):
        part = slice(lo, lo + step)
        g = gc[part]
        decay = (g[..., :, None, :] - g[..., None, :, :]).masked_fill(~causal, float("-inf")).exp()
        decayed_k = decay * kc[part][..., None, :, :]  # [n, HV, t, s, K]
        qk[part] = (decayed_k @ qc[part][..., None]).squeeze(-1)
        kk[part] = (decayed_k @ kc[part][..., None]).squeeze(-1)
    return qk, kk


def _intra_chunk(qc, kc, vc, gc, bc):
    """Everything that does not need the carried state. qc, kc, gc: [NC, HV, C, K]; vc: [..., V]; bc: [NC, HV, C].

    Returns (u, w, P, q exp(G), k exp(G_end - G), G_end [NC, HV, K]).
    """
    gc = gc.cumsum(-2)
    qk, kk = _pairwise(qc, kc, gc)
    lower = (kk * bc[..., None]).tril(-1)
    eye = torch.eye(gc.shape[-2], dtype=lower.dtype)
    k_beta = kc * bc[..., None]
    rhs = torch.cat([vc * bc[..., None], k_beta * gc.exp()], dim=-1)
    solved = torch.linalg.solve_triangular(lower + eye, rhs, upper=False, unitriangular=True)
    u, w = solved.split([vc.shape[-1], kc.shape[-1]], dim=-1)
    g_end = gc[..., -1, :]
    return u, w, qk, qc * gc.exp(), kc * (g_end[..., None, :] - gc).exp(), g_end


def _carry_state(parts, plan: ChunkPlan, state: torch.Tensor, chunk_states: torch.Tensor | None) -> torch.Tensor:
    """Inter-chunk loop. state: [N, HV, K, V] fp32, updated in place; chunk_states [NC, HV, K, V], if given,
    receives every chunk's start state. Returns o chunks [NC, HV, C, V]."""
    u, w, qk, q_decayed, k_to_end, g_end = parts
    out = torch.empty_like(u)
    for j in range(int(plan.count.max()) if plan.count.numel() else 0):
        seqs = torch.nonzero(plan.count > j).flatten()
        ids = plan.first[seqs] + j
        s = state[seqs]
        if chunk_states is not None:
            chunk_states[ids] = s
        v_new = u[ids] - w[ids] @ s
        out[ids] = q_decayed[ids] @ s + qk[ids] @ v_new
        state[seqs] = s * g_end[ids].exp()[..., None] + k_to_end[ids].transpose(-1, -2) @ v_new
    return out


def _gather_states(pool: torch.Tensor | None, slots: torch.Tensor, shape) -> torch.Tensor:
    """Pool rows [N, HV, V, K] -> fp32 copy; negative slots (or no pool) start from zeros."""
    states = torch.zeros(slots.numel(), *shape, dtype=torch.float32)
    live = slots >= 0
    if pool is not None and bool(live.any()):
        states[live] = pool[slots[live]].float()
    return states


def _scatter_states(pool: torch.Tensor | None, slots: torch.Tensor, states: torch.Tensor) -> None:
    """Write fp32 [N, HV, V, K] to the pool at non-negative slots (index writes: strided views work)."""
    live = slots >= 0
    if pool is not None and bool(live.any()):
        pool[slots[live]] = states[live].to(pool.dtype)


def _write_track(track_state, track_chunk_idx, plan: ChunkPlan, chunk_states) -> None:
    """track_state[n] <- start state of sequence n's chunk track_chunk_idx[n], when that chunk exists (as FLA)."""
    idx = track_chunk_idx.to(device="cpu", dtype=torch.int64).reshape(-1)[: plan.count.numel()]
    rows = torch.nonzero((idx >= 0) & (idx < plan.count[: idx.numel()])).flatten()
    picked = chunk_states[plan.first[rows] + idx[rows]].transpose(-1, -2)
    track_state[rows] = picked.to(track_state.dtype)


def chunk_kda_cpu(
    q, k, v, g, beta, scale=None, initial_state=None, initial_state_indices=None,
    use_qk_l2norm_in_kernel=False, cu_seqlens=None, A_log=None, dt_bias=None, lower_bound=None,
    output_intermediate_states=False, track_state=None, track_chunk_idx=None, beta_is_raw=False,
    chunk_indices=None, chunk_offsets=None, chunk_size: int = CHUNK_SIZE, **_unused,
):
    """Chunked KDA prefill over a packed batch (`chunk_kda`'s arguments), state pool updated in place.

    q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV, K], raw gate when A_log [HV] / dt_bias [HV * K] /
    lower_bound are given (SGLang's extend path), else log decay; beta: [B, T, HV], raw when beta_is_raw.
    B == 1 with cu_seqlens [N + 1]. initial_state: pool [slots, HV, V, K]; sequence n starts from slot
    initial_state_indices[n] (n when None; negative: zeros) and its final state is written there (not for
    negative slots). track_state [N, HV, V, K] fp32, if given, gets sequence n's state at the start of its
    chunk track_chunk_idx[n]. chunk_indices / chunk_offsets (CUDA-graph tables) are accepted and unused.
    Returns o [B, T, HV, V] in v.dtype; with output_intermediate_states, (o, h [B, NT, HV, V, K] in q.dtype),
    h holding the state at the start of every chunk, the chunks of sequence n after those of n - 1.
    """
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    layout = seq_layout(cu_seqlens, q.shape[0], q.shape[1])
    slots = slot_indices(initial_state_indices, layout.num_seqs)
    num_v_heads, dim_v, dim_k = v.shape[2], v.shape[3], k.shape[3]
    qf, kf = _prepare_qk(q.flatten(0, 1), k.flatten(0, 1), num_v_heads, use_qk_l2norm_in_kernel, scale)
    gf = g.flatten(0, 1)
    gf = kda_gate(gf, A_log, dt_bias, lower_bound) if A_log is not None else gf.float()
    bf = beta.flatten(0, 1).float()
    bf = torch.sigmoid(bf) if beta_is_raw else bf
    vf = v.flatten(0, 1).float()
    plan = plan_chunks(layout, chunk_size)
    parts = _intra_chunk(*(_to_chunks(x, plan) for x in (qf, kf, vf, gf, bf)))
    state = _gather_states(initial_state, slots, (num_v_heads, dim_v, dim_k)).transpose(-1, -2).contiguous()
    keep_chunks = output_intermediate_states or track_state is not None
    chunk_states = torch.empty(plan.tokens.shape[0], num_v_heads, dim_k, dim_v) if keep_chunks else None
    o_chunks = _carry_state(parts, plan, state, chunk_states)
    out = torch.zeros(vf.shape, dtype=torch.float32)
    out[plan.tokens[plan.valid]] = o_chunks.transpose(1, 2)[plan.valid]
    _scatter_states(initial_state, slots, state.transpose(-1, -2))
    if track_state is not None:
        _write_track(track_state, track_chunk_idx, plan, chunk_states)
    o = out.reshape(v.shape).to(v.dtype)
    if not output_intermediate_states:
        return o
    h = chunk_states.transpose(-1, -2).reshape(q.shape[0], -1, num_v_heads, dim_v, dim_k)
    return o, h.to(q.dtype)


def _recurrent_step(s, q, k, v, g, beta) -> torch.Tensor:
    """One token for a batch of sequences, state updated in place.

    s: [N, HV, V, K] fp32; q, k, g: [N, HV, K]; v: [N, HV, V]; beta: [N, HV]. Returns o [N, HV, V].
    """
    s.mul_(g.exp()[..., None, :])
    delta = beta[..., None] * (v - torch.einsum("nhvk,nhk->nhv", s, k))
    s.add_(delta[..., None] * k[..., None, :])
    return torch.einsum("nhvk,nhk->nhv", s, q)


def _linear_chain_only(retrieve_parent_token: torch.Tensor | None) -> None:
    if retrieve_parent_token is None:
        return
    steps = retrieve_parent_token.shape[-1]
    expected = torch.arange(-1, steps - 1, dtype=retrieve_parent_token.dtype).clamp_(min=0)
    if not torch.equal(retrieve_parent_token.cpu(), expected.expand_as(retrieve_parent_token)):
        raise NotImplementedError("CPU KDA verify supports a linear draft chain only (topk <= 1), not EAGLE trees")


def _check_decode_mode(is_kda: bool, cache_ring: bool, match_cutedsl_decode: bool, retrieve_parent_token) -> None:
    if not is_kda:
        raise ValueError("this is the KDA (per-channel gate) kernel; GDN's CPU decode is kernels.gdn.cpu")
    if cache_ring or match_cutedsl_decode:
        raise NotImplementedError("ReplaySSM rings and CuTe-DSL parity mode are CUDA-only; not on CPU")
    _linear_chain_only(retrieve_parent_token)


def fused_sigmoid_gating_delta_rule_update_cpu(
    A_log, a, dt_bias, softplus_beta, softplus_threshold, q, k, v, b, initial_state_source,
    initial_state_indices, scale=None, use_qk_l2norm_in_kernel=False, cu_seqlens=None, is_kda=False,
    lower_bound=None, disable_state_update=False, intermediate_states_buffer=None,
    intermediate_state_indices=None, cache_steps=None, retrieve_parent_token=None, cache_ring=False,
    replayssm_rawv=None, replayssm_rawk=None, replayssm_g=None, replayssm_beta=None,
    match_cutedsl_decode=False,
):
    """KDA decode / verify step(s) with SGLang's Triton arguments: gates from raw a/b, then the recurrence.

    q, k: [B, T, H, K]; v: [B, T, HV, V]; a: B * T * HV * K elements ([T, HV * K] in decode); b: B * T * HV
    elements; A_log: HV elements; dt_bias: HV * K. cu_seqlens [N + 1] packs B == 1 (decode: one token per
    sequence). Pool initial_state_source [slots, HV, V, K] is read at initial_state_indices[n] (negative:
    zeros) and written back unless disable_state_update. Verify (linear chains only): the state after
    token t of sequence n goes to intermediate_states_buffer[intermediate_state_indices[n], t].
    Returns o [B, T, HV, V] in q.dtype, as the Triton function does.
    """
    _check_decode_mode(is_kda, cache_ring, match_cutedsl_decode, retrieve_parent_token)
    num_v_heads, dim_k = v.shape[2], k.shape[3]
    layout = seq_layout(cu_seqlens, k.shape[0], k.shape[1])
    slots = slot_indices(initial_state_indices, layout.num_seqs)
    scale = dim_k ** -0.5 if scale is None else scale
    qf, kf = _prepare_qk(q.flatten(0, 1), k.flatten(0, 1), num_v_heads, use_qk_l2norm_in_kernel, scale)
    g = kda_gate(a.reshape(-1, num_v_heads, dim_k), A_log, dt_bias, lower_bound, softplus_beta, softplus_threshold)
    beta = torch.sigmoid(b.reshape(-1, num_v_heads).float())
    vf = v.flatten(0, 1).float()
    state = _gather_states(initial_state_source, slots, (num_v_heads, v.shape[3], dim_k))
    rows = None if intermediate_states_buffer is None else intermediate_state_indices.to("cpu", torch.int64)
    out = torch.zeros_like(vf)
    for t in range(int(layout.lengths.max()) if layout.num_seqs else 0):
        seqs = torch.nonzero(layout.lengths > t).flatten()
        tok = layout.starts[seqs] + t
        everyone = seqs.numel() == layout.num_seqs  # plain decode: skip the gather/scatter copies
        s = state if everyone else state[seqs]
        out[tok] = _recurrent_step(s, qf[tok], kf[tok], vf[tok], g[tok], beta[tok])
        if not everyone:
            state[seqs] = s
        if rows is not None:
            keep = rows[seqs] >= 0
            intermediate_states_buffer[rows[seqs][keep], t] = s[keep].to(intermediate_states_buffer.dtype)
    if not disable_state_update:
        _scatter_states(initial_state_source, slots, state)
    return out.reshape(v.shape).to(q.dtype)


def rmsnorm_sigmoid_gated(x: torch.Tensor, weight: torch.Tensor | None, gate: torch.Tensor, eps: float) -> torch.Tensor:
    """KDA's output norm: rmsnorm(x) * weight * sigmoid(gate) over the last dim, fp32 math.

    x: [..., D]; gate: same number of elements (SGLang passes x [1, N, H, D], gate [N, H, D]); weight: [D].
    Returns x's shape and dtype.
    """
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = y * weight.float() if weight is not None else y
    return (y * torch.sigmoid(gate.reshape(x.shape).float())).to(x.dtype)
