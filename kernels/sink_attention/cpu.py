"""Sink attention for SGLang's CPU path: one sequence at a time, queries in blocks, each block reading only
the keys it can see (a sliding-window block reads window + block keys, not the whole prefix).

Semantics (window, sinks, positions, GQA mapping) are those of `naive.py`; math in fp32.
"""

from __future__ import annotations

import torch

Q_BLOCK = 512  # bounds the [Hq, block, keys] score tensor on long prompts


def sink_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    sinks: torch.Tensor | None = None,
    window: int = -1,
    q_pos0: int = 0,
    k_pos0: int = 0,
) -> torch.Tensor:
    """q [Tq, Hq, D] at positions q_pos0 + i; k [Tk, Hkv, D], v [Tk, Hkv, Dv] at positions k_pos0 + j, which
    must cover every key a query sees (k_pos0 <= max(0, q_pos0 - window) when windowed, else 0; the last
    key at q_pos0 + Tq - 1). sinks [Hq] logits or None; window < 0: plain causal.
    Returns [Tq, Hq, Dv] in q's dtype."""
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
    for start in range(0, q.shape[0], Q_BLOCK):
        stop = min(start + Q_BLOCK, q.shape[0])
        out[start:stop] = _block(q[start:stop], k, v, scale, sinks, window, q_pos0 + start, k_pos0)
    return out


def _block(q, k, v, scale, sinks, window, q_pos0, k_pos0):
    q_pos = torch.arange(q_pos0, q_pos0 + q.shape[0])
    #   keys  k_pos0 ......... lo ============ hi ...      lo = first key the block's first query sees,
    #   block                   [q_pos0 ... q_pos0+Tq-1]   hi = the block's last query (causal)
    lo = max(k_pos0, q_pos0 - window) if window >= 0 else k_pos0
    hi = q_pos0 + q.shape[0]
    keys, values = k[lo - k_pos0 : hi - k_pos0].float(), v[lo - k_pos0 : hi - k_pos0].float()
    k_pos = torch.arange(lo, hi)
    group = q.shape[1] // k.shape[1]
    keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, Tk, D]
    values = values.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, Tk, Dv]
    scores = torch.matmul(q.float().transpose(0, 1), keys.transpose(1, 2)) * scale  # [Hq, Tq, Tk]
    visible = k_pos[None, :] <= q_pos[:, None]
    if window >= 0:
        visible &= k_pos[None, :] >= q_pos[:, None] - window
    scores.masked_fill_(~visible, float("-inf"))
    if sinks is not None:
        sink_col = sinks.float().view(-1, 1, 1).expand(-1, q.shape[0], 1)
        probs = torch.softmax(torch.cat([scores, sink_col], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, values).transpose(0, 1).to(q.dtype)  # [Tq, Hq, Dv]
