"""Gated-DeltaNet gate math shared by the prefill (chunked) and decode (recurrent) paths.

Formulas match SGLang's Triton `fused_gdn_gating` and the gate block of
`fused_sigmoid_gating_delta_rule_update`:

    g    = -exp(A_log) * softplus(a + dt_bias)     (log-space decay per token and value head, <= 0)
    beta = sigmoid(b)                              (delta-rule write strength, in (0, 1))

softplus(x) = log(1 + exp(beta_sp * x)) / beta_sp, and x itself once beta_sp * x > threshold.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gdn_log_decay(
    A_log: torch.Tensor,
    a: torch.Tensor,
    dt_bias: torch.Tensor,
    softplus_beta: float = 1.0,
    softplus_threshold: float = 20.0,
) -> torch.Tensor:
    """Log-space decay g, fp32, shaped like `a`.

    A_log: [HV] (any float dtype). a: [..., HV]. dt_bias: [HV].
    """
    x = a.float() + dt_bias.float()
    return -torch.exp(A_log.float()) * F.softplus(x, beta=softplus_beta, threshold=softplus_threshold)


def fused_gdn_gating_cpu(
    A_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stand-in for `torch.ops.sgl_kernel.fused_gdn_gating_cpu`.

    A_log: [HV] fp32. a, b: [T, HV] (T = tokens of the whole batch). dt_bias: [HV].
    Returns (g [1, T, HV] fp32, beta [1, T, HV] in b.dtype) - the layout SGLang feeds
    straight into `chunk_gated_delta_rule_cpu` as [B=1, T, HV].
    """
    if a.dim() != 2 or b.shape != a.shape:
        raise ValueError(f"fused_gdn_gating_cpu wants a, b as [T, HV]; got {tuple(a.shape)}, {tuple(b.shape)}")
    g = gdn_log_decay(A_log, a, dt_bias).unsqueeze(0)
    beta = torch.sigmoid(b.float()).to(b.dtype).unsqueeze(0)
    return g, beta
