"""Linear-attention conv states on CPU are float32 (`fixes.conv_states_in_float32`).

Regression: SGLang keeps conv states in bf16 whatever --dtype says. A float32 server stored each chunk's
last K-1 conv inputs rounded to bf16, so a Kimi Linear prompt's logits depended on where its prefill
chunks began, and a prfaas_hybrid prefix hit (a chunk beginning at the checkpoint) was not token-exact
against a no-cache server chunking elsewhere (real server, 195-token prompt: input log-probs off HF by
up to 7e-3 from the first chunk end on; 2e-5 with this fix).
"""
from __future__ import annotations

import pytest
import torch

from prfaas_sgl.kernels.conv1d.cpu import causal_conv1d_fwd_cpu
from prfaas_sgl.kernels.kda.cpu import chunk_kda_cpu
from prfaas_sgl.srt.cpu import fixes

ENV = "SGLANG_MAMBA_CONV_DTYPE"
DIM, WIDTH, T, HEADS, D = 48, 4, 195, 2, 8  # KDA: q|k|v conv channels = 3 heads*D


def test_conv_states_default_to_float32_on_cpu(monkeypatch):
    from sglang.srt.configs.mamba_utils import mamba2_state_dtype

    monkeypatch.delenv(ENV, raising=False)
    fixes.conv_states_in_float32()
    assert mamba2_state_dtype(None).conv == torch.float32


def test_an_explicit_conv_dtype_is_kept(monkeypatch):
    from sglang.srt.configs.mamba_utils import mamba2_state_dtype

    monkeypatch.setenv(ENV, "bfloat16")
    fixes.conv_states_in_float32()
    assert mamba2_state_dtype(None).conv == torch.bfloat16


def _prefill(x, q_raw, cuts, conv_dtype):
    """KDA's prefill (conv, then the chunked delta rule) over chunks [0, c1), [c1, c2), ...; both
    states in pools laid out as SGLang's KDA pools ([slots, K-1, dim] conv, [slots, H, V, K] recurrent)."""
    torch.manual_seed(1)
    weight = torch.randn(DIM, WIDTH)
    conv_pool = torch.zeros(3, WIDTH - 1, DIM, dtype=conv_dtype)
    ssm_pool = torch.zeros(3, HEADS, D, D)
    g, beta = torch.randn(1, T, HEADS, D), torch.randn(1, T, HEADS)
    A_log, dt_bias = torch.randn(HEADS), torch.randn(HEADS * D)
    outs = []
    for a, b in zip([0, *cuts], [*cuts, T]):
        mixed = causal_conv1d_fwd_cpu(x[:, a:b], weight, None, conv_pool.transpose(-1, -2),
                                      torch.tensor([0, b - a]), torch.tensor([1]), torch.tensor([a > 0]), True)
        q, k, v = (t.T.reshape(1, b - a, HEADS, D) for t in mixed.split(HEADS * D))
        outs.append(chunk_kda_cpu(q + q_raw[:, a:b], k, v, g[:, a:b], beta[:, a:b], initial_state=ssm_pool,
                                  initial_state_indices=torch.tensor([1]), use_qk_l2norm_in_kernel=True,
                                  cu_seqlens=torch.tensor([0, b - a]), A_log=A_log, dt_bias=dt_bias, beta_is_raw=True))
    return torch.cat(outs, 1)


@pytest.mark.parametrize("cuts", [[64], [128], [64, 128, 192]])
def test_chunked_prefill_equals_one_pass_with_float32_conv_states(cuts):
    """Chunk ends on FLA's 64-token grid (where prefix hits and chunk ends fall): bit-identical."""
    torch.manual_seed(0)
    x, q_raw = torch.randn(DIM, T), torch.randn(1, T, HEADS, D)
    whole = _prefill(x, q_raw, [], torch.float32)
    assert torch.equal(_prefill(x, q_raw, cuts, torch.float32), whole)


def test_bf16_conv_states_make_the_output_depend_on_the_chunking():
    """The mechanism of the regression: the first K-1 tokens after a chunk end read bf16 inputs."""
    torch.manual_seed(0)
    x, q_raw = torch.randn(DIM, T), torch.randn(1, T, HEADS, D)
    whole, split = _prefill(x, q_raw, [], torch.bfloat16), _prefill(x, q_raw, [64], torch.bfloat16)
    assert torch.equal(split[:, :64], whole[:, :64]) and not torch.equal(split[:, 64:], whole[:, 64:])
