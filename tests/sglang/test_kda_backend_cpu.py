"""SGLang's own KDAAttnBackend.forward_extend / forward_decode on CPU with the prfaas CPU fixes (no server).

Runs the real backend methods (conv on the transposed KDA conv pool, Triton-named kernels re-pointed at
`prfaas_sgl.kernels.kda`) on a stand-in pool and metadata, against the naive conv + naive KDA pipeline.
Lives in the sglang tier because importing SGLang's KDA backend takes ~30 s of CPU (subprocess, CPU mode).
Run: .venv/bin/python -m pytest -p no:cacheprovider -q tests/sglang/test_kda_backend_cpu.py
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

PROBE = r'''
import json, types, torch
from sglang.srt.layers.attention.linear import kda_backend as kb
from sglang.srt.layers.attention.linear.kernels import kda_triton
from sglang.srt.layers.attention.linear.utils import LinearAttnKernelBackend as LB
from prfaas_sgl.kernels.conv1d.naive import naive_causal_conv1d_fwd, naive_causal_conv1d_update
from prfaas_sgl.kernels.kda.naive import naive_chunk_kda, naive_fused_sigmoid_gating_delta_rule_update
from prfaas_sgl.srt.cpu import kda_fixes

kda_fixes.kda_kernels_on_cpu(lambda self: None, None)  # the hook body, minus SGLang's __init__
assert kda_triton.chunk_kda.__module__ == "prfaas_sgl.kernels.kda.cpu"
gen = torch.Generator().manual_seed(0)
H, D, W, lengths = 2, 8, 4, [5, 70]
dim, T, slots = 3 * H * D, sum(lengths), 4
layer = types.SimpleNamespace(q_dim=H*D, k_dim=H*D, v_dim=H*D, head_q_dim=D, head_k_dim=D, head_v_dim=D, num_v_heads=H,
    conv_weights=torch.randn(dim, W, generator=gen), bias=None, A_log=torch.randn(1, 1, H, 1, generator=gen),
    dt_bias=torch.randn(H * D, generator=gen), lower_bound=None, layer_id=0)
conv_pool = torch.randn(slots, W - 1, dim, generator=gen)
ssm_pool = torch.randn(slots, H, D, D, generator=gen)
cache = types.SimpleNamespace(conv=[conv_pool], temporal=ssm_pool, intermediate_ssm=None, replayssm_d=None, replayssm_k=None, replayssm_g=None)
idx = torch.tensor([3, 1], dtype=torch.int32)
cu = torch.tensor([0, 5, 75], dtype=torch.int32)
be = kb.KDAAttnBackend.__new__(kb.KDAAttnBackend)
be.prefill_graph_metadata = None
be.accept_lens_pool = None
be.req_to_token_pool = types.SimpleNamespace(mamba2_layer_cache=lambda i: cache)
be.kernel_dispatcher = kb.KDAKernelDispatcher(LB.TRITON, LB.TRITON, LB.TRITON)
be._track_mamba_state_decode = lambda *a, **k: None
meta = dict(query_start_loc=cu, mamba_cache_indices=idx, logical_num_tokens=None, has_mamba_track_mask=False,
    track_chunk_idx=None, track_ssm_h_src=None, state_checkpoint_cu_starts=None, num_state_checkpoints=None,
    state_checkpoint_every_n_tokens=None, state_checkpoint_indices=None, track_ssm_h_batch_src=None)
be.forward_metadata = types.SimpleNamespace(**meta)
mode = types.SimpleNamespace(is_target_verify=lambda: False, is_draft_extend_v2=lambda: False)
batch = types.SimpleNamespace(forward_mode=mode, extend_prefix_lens=torch.tensor([3, 0]), extend_seq_lens_cpu=lengths)
mixed = torch.randn(T, dim, generator=gen)
a = torch.randn(1, T, H, D, generator=gen); b = torch.randn(1, T, H, generator=gen)
ref_conv, ref_ssm = conv_pool.transpose(-1, -2).contiguous(), ssm_pool.clone()
got = be.forward_extend(layer, batch, mixed, a, b)
x = naive_causal_conv1d_fwd(mixed.T, layer.conv_weights, None, ref_conv, cu, idx, torch.tensor([True, False]), True).T
q, k, v = (t.reshape(1, T, H, D) for t in x.split(H * D, dim=-1))
ref = naive_chunk_kda(q, k, v, a, b, None, ref_ssm, idx, True, cu, layer.A_log, layer.dt_bias, None, beta_is_raw=True)
errors = {"extend": (got - ref).abs().max().item(), "extend_ssm": (ssm_pool - ref_ssm).abs().max().item(),
          "extend_conv": (conv_pool - ref_conv.transpose(-1, -2)).abs().max().item()}
assert tuple(got.shape) == (1, T, H, D), got.shape
# one decode step for both sequences
be.forward_metadata = types.SimpleNamespace(**{**meta, "query_start_loc": torch.tensor([0, 1, 2], dtype=torch.int32)})
md = torch.randn(2, dim, generator=gen); ad = torch.randn(2, H * D, generator=gen); bd = torch.randn(1, 2, H, generator=gen)
got = be.forward_decode(layer, batch, md, ad, bd)
xd = naive_causal_conv1d_update(md, ref_conv, layer.conv_weights, None, True, idx)
qd, kd, vd = (t.reshape(1, 2, H, D) for t in xd.split(H * D, dim=-1))
ref = naive_fused_sigmoid_gating_delta_rule_update(layer.A_log, ad, layer.dt_bias, 1.0, 20.0, qd, kd, vd, bd, ref_ssm, idx,
    use_qk_l2norm_in_kernel=True, cu_seqlens=torch.tensor([0, 1, 2]))
errors.update(decode=(got - ref).abs().max().item(), decode_ssm=(ssm_pool - ref_ssm).abs().max().item(),
              decode_conv=(conv_pool - ref_conv.transpose(-1, -2)).abs().max().item())
assert tuple(got.shape) == (1, 2, H, D), got.shape
print("ERRORS=" + json.dumps(errors))
'''


def test_kda_backend_extend_then_decode_on_cpu():
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1")
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("ERRORS="))
    errors = json.loads(line.removeprefix("ERRORS="))
    assert max(errors.values()) <= 1e-5, errors
