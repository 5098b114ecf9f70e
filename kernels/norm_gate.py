"""Small fused norm/gate ops that SGLang's CPU path calls through `torch.ops.sgl_kernel` (fp32 math).

RMSNorm:        y = x / sqrt(mean(x^2) + eps) * w
Gemma RMSNorm:  y = x / sqrt(mean(x^2) + eps) * (1 + w)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def fused_rmsnorm_gated_cpu(input: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    """GDN output norm, norm before gate: rmsnorm(input) * weight * silu(gate).

    input, gate: [N, D]; weight: [D]. Returns [N, D] in input.dtype (SGLang's `FusedRMSNormGated`
    and `layernorm_gated.RMSNorm` with activation silu/swish and no groups).
    """
    return (_rms(input, eps) * weight.float() * F.silu(gate.float())).to(input.dtype)


def fused_sigmoid_mul_cpu(input: torch.Tensor, gate: torch.Tensor) -> None:
    """In place: input *= sigmoid(gate) (attention output gate of Qwen3.5). Shapes broadcast to input."""
    input.copy_((input.float() * torch.sigmoid(gate.float())).to(input.dtype))


def _gemma_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return (_rms(x, eps) * (1.0 + weight.float())).to(x.dtype)


def fused_qk_gemma_rmsnorm_cpu(
    q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head Gemma RMSNorm of q and k. q: [T, Hq * D]; k: [T, Hk * D]; returns [T * Hq, D], [T * Hk, D]."""
    return (
        _gemma_rows(q.reshape(-1, head_dim), q_weight, eps),
        _gemma_rows(k.reshape(-1, head_dim), k_weight, eps),
    )


def fused_qk_gemma_rmsnorm_with_gate_cpu(
    q_gate: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    head_dim: int,
    num_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Like `fused_qk_gemma_rmsnorm_cpu` for q interleaved with the output gate per head.

    q_gate: [T, Hq * 2D] laid out [q_h0 | gate_h0 | q_h1 | gate_h1 | ...]; k: [T, Hk * D].
    Returns (q [T * Hq, D], k [T * Hk, D], gate [T * Hq, D]), contiguous.
    """
    pairs = q_gate.reshape(q_gate.shape[0], num_heads, 2, head_dim)
    q_out = _gemma_rows(pairs[:, :, 0].reshape(-1, head_dim), q_weight, eps)
    k_out = _gemma_rows(k.reshape(-1, head_dim), k_weight, eps)
    return q_out, k_out, pairs[:, :, 1].reshape(-1, head_dim).contiguous()
