"""Gated DeltaNet on CPU in plain torch: chunked prefill (WY form) and batched recurrent decode.

Same math as `naive.py` (see there for one step). Prefill splits every sequence into chunks of
C tokens; within a chunk the delta rule is a unit-lower-triangular solve (the WY representation,
as in flash-linear-attention's chunk kernels and transformers' torch fallback), across chunks a
state S [K, V] is carried. All chunks of all sequences are processed together; only the S-carry
loop runs per chunk index, and each step batches every sequence still that long:

    seq 0  |c0|c1|c2|        step j=0: chunks {0:c0, 1:c0}   (sequence ids : chunk)
    seq 1  |c0|              step j=1: chunks {0:c1}
                             step j=2: chunks {0:c2}

Padding tokens inside the last chunk carry k = v = beta = g = 0, so they change neither outputs
nor the state. The pool `[slots, HV, V, K]` is read and written through index lists, so strided
(non-contiguous) pools work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from prfaas_sgl.kernels._varlen import SeqLayout, seq_layout, slot_indices
from prfaas_sgl.kernels.gating import gdn_log_decay

CHUNK_SIZE = 64
L2NORM_EPS = 1e-6


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    """tokens: [NC, C] flat token index per chunk row (clamped); valid: [NC, C] bool;
    first: [N] id of each sequence's first chunk; count: [N] chunks per sequence."""

    tokens: torch.Tensor
    valid: torch.Tensor
    first: torch.Tensor
    count: torch.Tensor


def plan_chunks(layout: SeqLayout, chunk: int) -> ChunkPlan:
    count = (layout.lengths + chunk - 1) // chunk
    first = torch.cumsum(count, 0) - count
    seq_of_chunk = torch.repeat_interleave(torch.arange(layout.num_seqs), count)
    local = torch.arange(int(count.sum())) - first[seq_of_chunk]
    offset = local[:, None] * chunk + torch.arange(chunk)
    valid = offset < layout.lengths[seq_of_chunk][:, None]
    tokens = (layout.starts[seq_of_chunk][:, None] + offset).masked_fill(~valid, 0)
    return ChunkPlan(tokens, valid, first, count)


def _prepare_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int, use_l2norm: bool, scale: float):
    """[T, H, K] -> fp32 [T, HV, K]; l2norm, scale on q, value-head expansion for grouped heads."""
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
    rows = x[plan.tokens].masked_fill(_expand(~plan.valid, x.dim() + 1), 0)
    return rows.transpose(1, 2)


def _expand(mask: torch.Tensor, ndim: int) -> torch.Tensor:
    return mask.reshape(*mask.shape, *([1] * (ndim - mask.dim())))


def _intra_chunk(qc, kc, vc, gc, bc):
    """Everything that does not need the carried state. Shapes: [NC, HV, C, D]; gc, bc: [NC, HV, C].

    Returns (u, w, attn, q_decayed, k_to_end, g_end): u = T @ (beta v) and w = T @ (beta k exp(g))
    with T = (I + L)^-1, L = strictly-lower(beta k k^T * decay); attn = causal q k^T * decay.
    """
    size = gc.shape[-1]
    gc = gc.cumsum(-1)
    causal = torch.ones(size, size, dtype=torch.bool).tril()
    diff = (gc[..., :, None] - gc[..., None, :]).masked_fill(~causal, float("-inf"))
    decay = diff.exp()
    k_beta = kc * bc[..., None]
    lower = (k_beta @ kc.transpose(-1, -2) * decay).masked_fill(~causal.tril(-1), 0)
    eye = torch.eye(size, dtype=lower.dtype)
    rhs = torch.cat([vc * bc[..., None], k_beta * gc.exp()[..., None]], dim=-1)
    solved = torch.linalg.solve_triangular(lower + eye, rhs, upper=False, unitriangular=True)
    u, w = solved.split([vc.shape[-1], kc.shape[-1]], dim=-1)
    attn = qc @ kc.transpose(-1, -2) * decay
    g_end = gc[..., -1]
    k_to_end = kc * (g_end[..., None] - gc).exp()[..., None]
    return u, w, attn, qc * gc.exp()[..., None], k_to_end, g_end


def _carry_state(parts, plan: ChunkPlan, state: torch.Tensor) -> torch.Tensor:
    """Inter-chunk loop. state: [N, HV, K, V] fp32, updated in place. Returns o chunks [NC, HV, C, V]."""
    u, w, attn, q_decayed, k_to_end, g_end = parts
    out = torch.empty_like(u)
    for j in range(int(plan.count.max()) if plan.count.numel() else 0):
        seqs = torch.nonzero(plan.count > j).flatten()
        ids = plan.first[seqs] + j
        s = state[seqs]
        v_new = u[ids] - w[ids] @ s
        out[ids] = q_decayed[ids] @ s + attn[ids] @ v_new
        decay_end = g_end[ids].exp()[..., None, None]
        state[seqs] = s * decay_end + k_to_end[ids].transpose(-1, -2) @ v_new
    return out


def _gather_states(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Pool rows [N, HV, V, K] -> fp32 [N, HV, V, K] copy; negative slots start from zeros."""
    live = slots >= 0
    if bool(live.all()):
        return pool[slots].float()
    states = torch.zeros(slots.numel(), *pool.shape[1:], dtype=torch.float32)
    states[live] = pool[slots[live]].float()
    return states


def _scatter_states(pool: torch.Tensor, slots: torch.Tensor, states_kv: torch.Tensor) -> torch.Tensor:
    """Write fp32 [N, HV, K, V] back to the pool at non-negative slots; returns [N, HV, V, K] fp32."""
    finals = states_kv.transpose(-1, -2).contiguous()
    live = slots >= 0
    pool[slots[live]] = finals[live].to(pool.dtype)
    return finals


def chunk_gated_delta_rule_cpu(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    head_first: bool = False,
    use_qk_l2norm_in_kernel: bool = True,
    initial_state_indices: torch.Tensor | None = None,
    scale: float | None = None,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked gated delta rule over a packed batch, state pool updated in place.

    q, k: [B, T, H, K]; v: [B, T, HV, V] (HV a multiple of H); g (log decay, fp32), beta: [B, T, HV];
    B == 1 when cu_seqlens [N + 1] is given. initial_state: pool [slots, HV, V, K]; sequence n
    starts from slot initial_state_indices[n] (n when None) and its final state is written there;
    a negative slot starts from zeros and is not written. scale defaults to K ** -0.5.
    Returns (o [B, T, HV, V] in v.dtype, final states [N, HV, V, K] fp32).
    """
    if head_first:
        raise ValueError("head_first=True is not supported; SGLang passes [B, T, H, D] (head_first=False)")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    layout = seq_layout(cu_seqlens, q.shape[0], q.shape[1])
    slots = slot_indices(initial_state_indices, layout.num_seqs)
    num_v_heads = v.shape[2]
    qf, kf = _prepare_qk(q.flatten(0, 1), k.flatten(0, 1), num_v_heads, use_qk_l2norm_in_kernel, scale)
    vf, gf, bf = (x.flatten(0, 1).float() for x in (v, g, beta))
    plan = plan_chunks(layout, chunk_size)
    parts = _intra_chunk(*(_to_chunks(x, plan) for x in (qf, kf, vf, gf, bf)))
    state = _gather_states(initial_state, slots).transpose(-1, -2).contiguous()
    o_chunks = _carry_state(parts, plan, state)
    out = torch.zeros(vf.shape, dtype=torch.float32)
    out[plan.tokens[plan.valid]] = o_chunks.transpose(1, 2)[plan.valid]
    finals = _scatter_states(initial_state, slots, state)
    return out.reshape(v.shape).to(v.dtype), finals


def _recurrent_step(s, q, k, v, g, beta) -> torch.Tensor:
    """One token for a batch of sequences, state updated in place.

    s: [N, HV, V, K] fp32; q, k: [N, HV, K]; v: [N, HV, V]; g, beta: [N, HV]. Returns o [N, HV, V].
    """
    s.mul_(g.exp()[..., None, None])
    delta = beta[..., None] * (v - torch.einsum("nhvk,nhk->nhv", s, k))
    s.add_(delta[..., None] * k[..., None, :])
    return torch.einsum("nhvk,nhk->nhv", s, q)


def _linear_chain_only(retrieve_parent_token: torch.Tensor | None) -> None:
    if retrieve_parent_token is None:
        return
    steps = retrieve_parent_token.shape[-1]
    expected = torch.arange(-1, steps - 1, dtype=retrieve_parent_token.dtype).clamp_(min=0)
    if not torch.equal(retrieve_parent_token.cpu(), expected.expand_as(retrieve_parent_token)):
        raise NotImplementedError("CPU GDN verify supports a linear draft chain only (topk <= 1), not EAGLE trees")


def fused_sigmoid_gating_delta_rule_update_cpu(
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
    is_kda: bool = False,
    disable_state_update: bool = False,
    intermediate_states_buffer: torch.Tensor | None = None,
    intermediate_state_indices: torch.Tensor | None = None,
    cache_steps: int | None = None,
    retrieve_parent_token: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode step(s): gates from raw a/b, then the recurrence, batched over sequences.

    q, k: [1, T, H, K]; v: [1, T, HV, V]; a, b: [T, HV] (T = packed tokens; decode has one per
    sequence); A_log, dt_bias: [HV]; cu_seqlens: [N + 1]. initial_state_source: pool
    [slots, HV, V, K], read at initial_state_indices[n] (negative: zeros) and written back there
    unless disable_state_update. Target verify (linear chains only): the state after token t of
    sequence n is stored at intermediate_states_buffer[intermediate_state_indices[n], t].
    Returns o [T, 1, HV, V] in v.dtype (the sgl_kernel CPU op's layout).
    """
    if is_kda:
        raise NotImplementedError("KDA gates (per-K decay) are not implemented by this GDN CPU kernel")
    _linear_chain_only(retrieve_parent_token)
    layout = seq_layout(cu_seqlens, q.shape[0], q.shape[1])
    slots = slot_indices(initial_state_indices, layout.num_seqs)
    qf, kf = _prepare_qk(q.flatten(0, 1), k.flatten(0, 1), v.shape[2], use_qk_l2norm_in_kernel, q.shape[-1] ** -0.5)
    g = gdn_log_decay(A_log, a.reshape(-1, v.shape[2]), dt_bias, softplus_beta, softplus_threshold)
    beta = torch.sigmoid(b.reshape(-1, v.shape[2]).float())
    vf = v.flatten(0, 1).float()
    state = _gather_states(initial_state_source, slots)  # [N, HV, V, K]
    out = torch.empty_like(vf)
    for t in range(int(layout.lengths.max()) if layout.num_seqs else 0):
        seqs = torch.nonzero(layout.lengths > t).flatten()
        tok = layout.starts[seqs] + t
        everyone = seqs.numel() == layout.num_seqs  # plain decode: skip the gather/scatter copies
        s = state if everyone else state[seqs]
        out[tok] = _recurrent_step(s, qf[tok], kf[tok], vf[tok], g[tok], beta[tok])
        if not everyone:
            state[seqs] = s
        if intermediate_states_buffer is not None:
            rows = intermediate_state_indices.cpu().long()[seqs]
            keep = rows >= 0
            intermediate_states_buffer[rows[keep], t] = s[keep].to(intermediate_states_buffer.dtype)
    if not disable_state_update:
        live = slots >= 0
        initial_state_source[slots[live]] = state[live].to(initial_state_source.dtype)
    return out.reshape(-1, 1, *v.shape[2:]).to(v.dtype)
