"""Token-by-token sink attention reference, fp32. Slow on purpose: the twin `cpu.py` is tested against.

For query head h at absolute position p, with keys at positions k_pos0 .. k_pos0 + Tk - 1:

    visible(p)  = { j : j <= p and (window < 0 or j >= p - window) }       (window + 1 keys, self included)
    s_j         = scale * <q, k_j>                                         j in visible(p)
    o           = sum_j exp(s_j - m) v_j / (sum_j exp(s_j - m) + exp(sink_h - m))
    m           = max(max_j s_j, sink_h)

The sink is a learned logit that joins the softmax denominator only (it has no value), so a head can put
weight "nowhere". `window` counts keys before the query, as SGLang's `sliding_window_size` does (HF's
`sliding_window` = window + 1). Query head h reads key head h // (Hq // Hkv). Shares no code with `cpu.py`.
"""

from __future__ import annotations

import math

import torch


def naive_sink_attention(
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
    """q [Tq, Hq, D] at positions q_pos0 + i; k [Tk, Hkv, D], v [Tk, Hkv, Dv] at positions k_pos0 + j;
    sinks [Hq] logits or None. Returns [Tq, Hq, Dv] fp32."""
    num_q, num_heads = q.shape[0], q.shape[1]
    group = num_heads // k.shape[1]
    out = torch.zeros(num_q, num_heads, v.shape[2], dtype=torch.float32)
    for i in range(num_q):
        p = q_pos0 + i
        for h in range(num_heads):
            out[i, h] = _one_query(q[i, h].float(), k[:, h // group].float(), v[:, h // group].float(),
                                   scale, None if sinks is None else float(sinks[h]), window, p, k_pos0)
    return out


def _one_query(qv, keys, values, scale, sink, window, p, k_pos0):
    logits, rows = [], []
    for j in range(keys.shape[0]):
        pos = k_pos0 + j
        if pos > p or (window >= 0 and pos < p - window):
            continue
        logits.append(scale * float(torch.dot(qv, keys[j])))
        rows.append(values[j])
    m = max(logits + ([sink] if sink is not None else []))
    weights = [math.exp(s - m) for s in logits]
    denom = sum(weights) + (math.exp(sink - m) if sink is not None else 0.0)
    acc = torch.zeros(values.shape[1], dtype=torch.float64)
    for w, row in zip(weights, rows):
        acc += w * row.double()
    return (acc / denom).float()
