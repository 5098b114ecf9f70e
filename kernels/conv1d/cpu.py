"""Causal depthwise conv1d with per-request conv state on CPU, vectorised over the batch.

Prefill packs each sequence's stored state (W - 1 columns) in front of its tokens and runs one
grouped `F.conv1d` over the whole buffer; a window never crosses into the previous sequence
because every sequence brings its own W - 1 history columns:

    ext  | s0 s0 s0 | x0 x0 x0 x0 x0 | s1 s1 s1 | x1 | ...      (W = 4)
           state 0    tokens of seq 0  state 1   seq 1

Output for a token at ext column p is conv column p - (W - 1); the new state of a sequence is the
last W - 1 columns of its segment. Padded requests (slot == pad_slot_id) produce zeros and leave
the pool alone, like SGLang's kernels which skip them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from prfaas_sgl.kernels._varlen import slot_indices


def _check_weight(weight: torch.Tensor, dim: int) -> None:
    if weight.dim() != 2 or weight.shape[0] != dim:
        raise ValueError(f"conv weight must be plain [dim={dim}, width]; got {tuple(weight.shape)} (VNNI-packed weights are not supported)")


def _initial_states(conv_states, slots, use_state, dim, width) -> torch.Tensor:
    """[N, dim, W-1] fp32: the pooled state where use_state, zeros elsewhere."""
    states = torch.zeros(slots.numel(), dim, width - 1, dtype=torch.float32)
    if bool(use_state.any()):
        states[use_state] = conv_states[slots[use_state]].float()
    return states


def causal_conv1d_fwd_cpu(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor | None,
    query_start_loc: torch.Tensor | None,
    cache_indices: torch.Tensor | None,
    has_initial_state: torch.Tensor | None,
    silu_activation: bool,
    pad_slot_id: int = -1,
    is_vnni: bool = False,
) -> torch.Tensor:
    """Prefill conv over a packed batch (`torch.ops.sgl_kernel.causal_conv1d_fwd_cpu`).

    x: [dim, T] (any strides; tokens of all sequences side by side); weight: [dim, W]; bias: [dim];
    conv_states: pool [slots, dim, W-1], updated in place at cache_indices[n] (n when None);
    query_start_loc: [N + 1] (None: one sequence); has_initial_state: [N] bool (None: all False).
    is_vnni is accepted for signature parity and ignored (weights are never packed here).
    Returns [dim, T] in x.dtype; tokens past query_start_loc[-1] get zeros.
    """
    dim, total = x.shape
    _check_weight(weight, dim)
    width = weight.shape[1]
    cu = torch.tensor([0, total]) if query_start_loc is None else query_start_loc.cpu().long()
    lengths = cu[1:] - cu[:-1]
    slots = slot_indices(cache_indices, lengths.numel())
    live = slots != pad_slot_id
    use_state = live.clone() if has_initial_state is not None else torch.zeros_like(live)
    if has_initial_state is not None:
        use_state &= has_initial_state.cpu().bool().reshape(-1)[: lengths.numel()]
    if conv_states is None:
        use_state[:] = False
    states = _initial_states(conv_states, slots, use_state, dim, width)

    seq_of_token = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    token_pos = cu[0] + torch.arange(int(lengths.sum()))
    seg_start = cu[:-1] + torch.arange(lengths.numel()) * (width - 1)
    token_col = token_pos + (seq_of_token + 1) * (width - 1)
    state_col = seg_start[:, None] + torch.arange(width - 1)
    ext = torch.empty(dim, int(lengths.sum()) + lengths.numel() * (width - 1), dtype=torch.float32)
    ext[:, token_col - cu[0]] = x[:, token_pos].float()
    ext[:, (state_col - cu[0]).flatten()] = states.permute(1, 0, 2).reshape(dim, -1)

    bias32 = bias.float() if bias is not None else None
    y = F.conv1d(ext[None], weight.float()[:, None, :], bias32, groups=dim)[0]
    y = F.silu(y) if silu_activation else y
    out = torch.zeros(dim, total, dtype=torch.float32)
    keep = live[seq_of_token]
    out[:, token_pos[keep]] = y[:, (token_col - cu[0] - (width - 1))[keep]]

    if conv_states is not None and bool(live.any()):
        end_col = (seg_start + lengths)[:, None] + torch.arange(width - 1) - cu[0]
        finals = ext[:, end_col[live].flatten()].reshape(dim, -1, width - 1).permute(1, 0, 2)
        conv_states[slots[live]] = finals.to(conv_states.dtype)
    return out.to(x.dtype)


def causal_conv1d_update_cpu(
    x: torch.Tensor,
    conv_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    silu_activation: bool,
    cache_seqlens: torch.Tensor | None = None,
    conv_state_indices: torch.Tensor | None = None,
    pad_slot_id: int = -1,
    is_vnni: bool = False,
    intermediate_conv_window: torch.Tensor | None = None,
    intermediate_state_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode conv step(s) (`torch.ops.sgl_kernel.causal_conv1d_update_cpu`).

    x: [B, dim] (one token per request) or [B, dim, S] (S draft tokens per request); conv_states:
    pool [slots, dim, W-1] rolled in place at conv_state_indices[b]; weight: [dim, W]. With
    intermediate_conv_window [rows, S, dim, W-1] the state after step t of request b is also stored
    at [intermediate_state_indices[b], t] (speculative verify). Returns x's shape and dtype.
    """
    if cache_seqlens is not None:
        raise NotImplementedError("cache_seqlens (circular conv state) is not used by SGLang's CPU path")
    steps = x if x.dim() == 3 else x.unsqueeze(-1)
    batch, dim, num_steps = steps.shape
    _check_weight(weight, dim)
    width = weight.shape[1]
    slots = slot_indices(conv_state_indices, batch)
    live = slots != pad_slot_id
    history = torch.cat([_initial_states(conv_states, slots, live, dim, width), steps.float()], dim=-1)
    windows = history.unfold(-1, width, 1)  # [B, dim, S, W]
    y = (windows * weight.float()[:, None, :]).sum(-1)
    y = y + bias.float()[:, None] if bias is not None else y
    y = (F.silu(y) if silu_activation else y) * live[:, None, None]
    if bool(live.any()):
        conv_states[slots[live]] = history[live, :, num_steps:].to(conv_states.dtype)
    if intermediate_conv_window is not None:
        rows = intermediate_state_indices.cpu().long()[:batch]
        for t in range(num_steps):
            intermediate_conv_window[rows[live], t] = history[live, :, t + 1 : t + width].to(intermediate_conv_window.dtype)
    return y.reshape(x.shape).to(x.dtype)
