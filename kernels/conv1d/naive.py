"""Token-by-token causal depthwise conv1d with conv state, fp32. The reference for `cpu.py`.

For channel c, width W and a state holding the W - 1 inputs before the sequence (oldest first):

    window_t = [state | x][:, t : t + W]            (W columns ending at token t)
    y_t      = act(sum_w weight[:, w] * window_t[:, w] + bias)
    state   <- last W - 1 columns of [state | x]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from prfaas_sgl.kernels._varlen import slot_indices


def _step(window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu: bool) -> torch.Tensor:
    y = (window * weight).sum(-1)
    y = y + bias.float() if bias is not None else y
    return F.silu(y) if silu else y


def naive_causal_conv1d_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    cache_indices: torch.Tensor | None,
    has_initial_state: torch.Tensor | None,
    silu_activation: bool,
    pad_slot_id: int = -1,
) -> torch.Tensor:
    """Reference for `causal_conv1d_fwd_cpu`. x: [dim, T]; weight: [dim, W]; conv_states [slots, dim, W-1].

    Sequences whose slot is pad_slot_id are skipped: zero output, state untouched.
    """
    weight = weight.float()
    width = weight.shape[1]
    out = torch.zeros(x.shape, dtype=torch.float32)
    bounds = query_start_loc.cpu().long().tolist()
    slots = slot_indices(cache_indices, len(bounds) - 1)
    for n in range(len(bounds) - 1):
        slot = int(slots[n])
        if slot == pad_slot_id:
            continue
        use_state = has_initial_state is not None and bool(has_initial_state[n])
        state = conv_states[slot].float() if use_state else torch.zeros(x.shape[0], width - 1)
        history = torch.cat([state, x[:, bounds[n] : bounds[n + 1]].float()], dim=1)
        for t in range(bounds[n + 1] - bounds[n]):
            out[:, bounds[n] + t] = _step(history[:, t : t + width], weight, bias, silu_activation)
        conv_states[slot] = history[:, history.shape[1] - (width - 1) :].to(conv_states.dtype)
    return out.to(x.dtype)


def naive_causal_conv1d_update(
    x: torch.Tensor,
    conv_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    silu_activation: bool,
    conv_state_indices: torch.Tensor | None,
    pad_slot_id: int = -1,
) -> torch.Tensor:
    """Reference for `causal_conv1d_update_cpu`. x: [B, dim] or [B, dim, S] (S steps per request)."""
    steps = x if x.dim() == 3 else x.unsqueeze(-1)
    weight = weight.float()
    out = torch.zeros(steps.shape, dtype=torch.float32)
    slots = slot_indices(conv_state_indices, steps.shape[0])
    for n in range(steps.shape[0]):
        slot = int(slots[n])
        if slot == pad_slot_id:
            continue
        state = conv_states[slot].float()
        for t in range(steps.shape[2]):
            window = torch.cat([state, steps[n, :, t : t + 1].float()], dim=1)
            out[n, :, t] = _step(window, weight, bias, silu_activation)
            state = window[:, 1:]
        conv_states[slot] = state.to(conv_states.dtype)
    return out.reshape(x.shape).to(x.dtype)
