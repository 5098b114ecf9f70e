"""Split the GDN input projections into (mixed_qkv, z, b, a), as `torch.ops.sgl_kernel.fused_qkvzba_*_cpu`.

Grouped layout (Qwen3-Next checkpoints), per key head g with G = HV / H value heads:

    mixed_qkvz[t] = | q_g (Dk) | k_g (Dk) | v_g (G*Dv) | z_g (G*Dv) | ... for g = 0..H-1
    mixed_ba[t]   = | b_g (G) | a_g (G) | ...

Contiguous layout (Qwen3.5): mixed_qkvz = | q (H*Dk) | k (H*Dk) | v (HV*Dv) | z (HV*Dv) |, mixed_ba = | b | a |.
Both return mixed_qkv [T, 2*H*Dk + HV*Dv] = | q | k | v |, z [T, HV, Dv], b [T, HV], a [T, HV].
"""

from __future__ import annotations

import torch


def fused_qkvzba_split_reshape_cat_cpu(
    mixed_qkvz: torch.Tensor, mixed_ba: torch.Tensor, num_heads_qk: int, num_heads_v: int, head_qk: int, head_v: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    tokens, group = mixed_qkvz.shape[0], num_heads_v // num_heads_qk
    qkvz = mixed_qkvz.reshape(tokens, num_heads_qk, -1)
    q, k, v, z = qkvz.split([head_qk, head_qk, group * head_v, group * head_v], dim=-1)
    b, a = mixed_ba.reshape(tokens, num_heads_qk, 2 * group).split([group, group], dim=-1)
    mixed_qkv = torch.cat([q.reshape(tokens, -1), k.reshape(tokens, -1), v.reshape(tokens, -1)], dim=-1)
    return (
        mixed_qkv,
        z.reshape(tokens, num_heads_v, head_v).contiguous(),
        b.reshape(tokens, num_heads_v).contiguous(),
        a.reshape(tokens, num_heads_v).contiguous(),
    )


def fused_qkvzba_split_reshape_cat_contiguous_cpu(
    mixed_qkvz: torch.Tensor, mixed_ba: torch.Tensor, num_heads_qk: int, num_heads_v: int, head_qk: int, head_v: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    tokens = mixed_qkvz.shape[0]
    qkv_dim = 2 * num_heads_qk * head_qk + num_heads_v * head_v
    qkv, z = mixed_qkvz.split([qkv_dim, num_heads_v * head_v], dim=-1)
    b, a = mixed_ba.split([num_heads_v, num_heads_v], dim=-1)
    return (
        qkv.contiguous(),
        z.reshape(tokens, num_heads_v, head_v).contiguous(),
        b.contiguous(),
        a.contiguous(),
    )
