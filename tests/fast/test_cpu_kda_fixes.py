"""The Kimi Linear CPU fixes (`prfaas_sgl.srt.cpu.kda_fixes`) against SGLang 0.5.23's own code.

Importing SGLang's KDA backend takes ~15 s of CPU, too slow here, so the tests run SGLang's real source
text: `kda_triton.py` executed whole as it executes on CPU (imports of sglang modules served by small
stand-ins), and single methods lifted out of `kda_backend.py`. Each test fails without its fix.
"""

from __future__ import annotations

import ast
import builtins
import enum
import importlib.util
import textwrap
import types
from pathlib import Path

import pytest
import torch
from prfaas_sgl.kernels.conv1d.naive import naive_causal_conv1d_fwd, naive_causal_conv1d_update
from prfaas_sgl.kernels.kda.naive import naive_chunk_kda, naive_fused_sigmoid_gating_delta_rule_update
from prfaas_sgl.srt.cpu import kda_fixes
from prfaas_sgl.srt.cpu.sgl_ops import causal_conv1d_update_cpu

SGLANG = Path(importlib.util.find_spec("sglang").submodule_search_locations[0])  # finds, does not import
LINEAR = SGLANG / "srt/layers/attention/linear"


def _module_from_file(path: Path, stand_ins: dict[str, object]) -> types.ModuleType:
    """Execute an SGLang source file as a module whose `import sglang...` statements get `stand_ins`."""
    def importer(name, globals=None, locals=None, fromlist=(), level=0):
        if name in stand_ins:
            return stand_ins[name]
        if name.startswith("sglang"):
            raise ImportError(f"test gives no stand-in for {name}")
        return builtins.__import__(name, globals, locals, fromlist, level)

    module = types.ModuleType(path.stem)
    module.__dict__["__builtins__"] = {**builtins.__dict__, "__import__": importer}
    exec(compile(path.read_text(), str(path), "exec"), module.__dict__)
    return module


def _kda_triton_on_cpu() -> types.ModuleType:
    utils = types.SimpleNamespace(is_cpu=lambda: True, is_hip=lambda: False, is_npu=lambda: False, is_xpu=lambda: False)
    kernel_backend = _module_from_file(LINEAR / "kernels/kernel_backend.py", {})
    return _module_from_file(LINEAR / "kernels/kda_triton.py", {
        "sglang.srt.utils": utils,
        "sglang.srt.layers.attention.linear.kernels.kernel_backend": kernel_backend,
    })


def _method_source(path: Path, cls: str, method: str) -> str:
    tree = ast.parse(path.read_text())
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    fn = next(n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == method)
    return textwrap.dedent(ast.get_source_segment(path.read_text(), fn))


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def test_targets_exist_in_sglang_source():
    """Every hooked attribute is defined where TARGETS says (guards against SGLang moving them)."""
    for target in kda_fixes.TARGETS:
        parts = target.split(".")
        for split in range(len(parts) - 1, 0, -1):
            path = SGLANG.parent / Path(*parts[:split]).with_suffix(".py")
            if path.exists():
                break
        cls, method = parts[split:]
        assert _method_source(path, cls, method).lstrip().startswith(("def", "@"))
    names = []

    class Registry:
        register = staticmethod(lambda target, hook, kind: names.append((target, hook.__name__, kind)))

    kda_fixes.install(Registry, types.SimpleNamespace(AROUND="around"))
    assert [(t, n) for t, n, _ in names] == list(kda_fixes.TARGETS.items())


def test_kda_triton_kernel_runs_on_cpu_after_fix():
    """SGLang's TritonKDAKernel.extend/decode, run as on CPU: NameError before, our kernels (== naive) after."""
    module = _kda_triton_on_cpu()
    kernel = module.TritonKDAKernel()
    gen = torch.Generator().manual_seed(0)
    lengths, heads, dim = [5, 70], 2, 8
    q, k, v = (torch.randn(1, sum(lengths), heads, dim, generator=gen) for _ in range(3))
    a, b = torch.randn(1, sum(lengths), heads, dim, generator=gen), torch.randn(1, sum(lengths), heads, generator=gen)
    A_log, dt_bias = torch.randn(1, 1, heads, 1, generator=gen), torch.randn(heads * dim, generator=gen)
    pool, idx, cu = torch.randn(3, heads, dim, dim, generator=gen), torch.tensor([2, 0], dtype=torch.int32), _cu(lengths)
    extend = dict(ssm_states=pool.clone(), cache_indices=idx, query_start_loc=cu, A_log=A_log, dt_bias=dt_bias,
                  lower_bound=None, beta_is_raw=True)
    with pytest.raises(NameError, match="chunk_kda"):
        kernel.extend(q, k, v, a, b, **extend)
    kda_fixes.patch_kda_modules(module, types.SimpleNamespace())
    ref_pool = pool.clone()
    ref = naive_chunk_kda(q, k, v, a, b, None, ref_pool, idx, True, cu, A_log, dt_bias, None, beta_is_raw=True)
    got = kernel.extend(q, k, v, a, b, **extend)
    assert (got - ref).abs().max() <= 1e-5 and (extend["ssm_states"] - ref_pool).abs().max() <= 1e-5

    step = dict(A_log=A_log, dt_bias=dt_bias, ssm_states=pool.clone(), cache_indices=idx, query_start_loc=_cu([1, 1]))
    qd, kd, vd = q[:, :2], k[:, :2], v[:, :2]
    ad, bd = a[0, :2].reshape(2, heads * dim), b[:, :2]  # decode shapes: a [N, HV * K], b [1, N, HV]
    got = kernel.decode(qd, kd, vd, ad, bd, **step)
    ref_pool = pool.clone()
    ref = naive_fused_sigmoid_gating_delta_rule_update(A_log, ad, dt_bias, 1.0, 20.0, qd, kd, vd, bd, ref_pool, idx,
                                                       use_qk_l2norm_in_kernel=True, cu_seqlens=_cu([1, 1]))
    assert got.shape == (1, 2, heads, dim)
    assert (got - ref).abs().max() <= 1e-5 and (step["ssm_states"] - ref_pool).abs().max() <= 1e-5


class _Conv(torch.nn.Module):
    """The attributes `_convolve_prefill` reads from a RadixLinearAttention layer."""

    def __init__(self, dim, width, gen):
        super().__init__()
        self.conv_weights, self.bias = torch.randn(dim, width, generator=gen), torch.randn(dim, generator=gen)


def test_kda_prefill_conv_uses_cpu_kernel_on_transposed_pool():
    """kda_backend convolves prefill with Triton on every platform, over the pool `[slots, W-1, dim]` seen
    transposed. After the fix SGLang's own `_convolve_prefill` runs on CPU and writes the KDA pool."""
    source = _method_source(LINEAR / "kda_backend.py", "KDAAttnBackend", "_convolve_prefill")
    backend = types.ModuleType("kda_backend")
    backend.__dict__.update(torch=torch, RadixLinearAttention=object, ForwardBatch=object)

    def triton_conv(*args, **kwargs):
        raise RuntimeError("0 active drivers ([]). There should only be one.")  # Triton without a GPU

    backend.causal_conv1d_fn = triton_conv
    exec(source, backend.__dict__)
    gen = torch.Generator().manual_seed(1)
    dim, width, lengths = 6, 4, [3, 9]
    layer = _Conv(dim, width, gen)
    tokens = torch.randn(sum(lengths), dim, generator=gen)
    pool = torch.randn(4, width - 1, dim, generator=gen)  # KDA layout
    meta = types.SimpleNamespace(forward_metadata=types.SimpleNamespace(query_start_loc=_cu(lengths)))
    batch = types.SimpleNamespace(extend_prefix_lens=torch.tensor([2, 0]), extend_seq_lens_cpu=lengths)
    idx = torch.tensor([3, 1], dtype=torch.int32)
    run = backend._convolve_prefill
    with pytest.raises(RuntimeError, match="active drivers"):
        run(meta, layer, batch, tokens, pool.transpose(-1, -2), idx)
    kda_fixes.patch_kda_modules(types.SimpleNamespace(), backend)
    got_pool, ref_pool = pool.clone(), pool.transpose(-1, -2).contiguous()  # reference on GDN's layout
    got = run(meta, layer, batch, tokens, got_pool.transpose(-1, -2), idx)
    ref = naive_causal_conv1d_fwd(tokens.T, layer.conv_weights, layer.bias, ref_pool, _cu(lengths), idx,
                                  torch.tensor([True, False]), True)
    assert got.shape == tokens.shape and (got - ref.T).abs().max() <= 1e-6
    assert (got_pool - ref_pool.transpose(-1, -2)).abs().max() <= 1e-6


def test_decode_conv_stand_in_writes_transposed_pool():
    """kda_backend's CPU decode conv (`sgl_kernel.mamba.causal_conv1d_update_cpu`, our stand-in) gets the
    KDA pool transposed too; the rolled state must land in `[slots, W-1, dim]`."""
    gen = torch.Generator().manual_seed(2)
    dim, width = 5, 4
    weight, bias, x = torch.randn(dim, width, generator=gen), torch.randn(dim, generator=gen), torch.randn(3, dim, generator=gen)
    pool = torch.randn(4, width - 1, dim, generator=gen)
    idx = torch.tensor([2, -1, 0], dtype=torch.int32)
    ref_pool = pool.transpose(-1, -2).contiguous()
    got = causal_conv1d_update_cpu(x, pool.transpose(-1, -2), weight, bias, activation="silu", conv_state_indices=idx)
    ref = naive_causal_conv1d_update(x, ref_pool, weight, bias, True, idx)
    assert (got - ref).abs().max() <= 1e-6
    assert (pool - ref_pool.transpose(-1, -2)).abs().max() <= 1e-6


class _Norm:
    activation, eps = "sigmoid", 1e-5

    def __init__(self):
        self.weight = torch.randn(8, generator=torch.Generator().manual_seed(4))


def test_sigmoid_gated_rmsnorm_in_torch():
    """Kimi's o_norm (activation sigmoid): x [1, N, H, D], gate [N, H, D] -> rmsnorm(x) * w * sigmoid(gate)."""
    gen = torch.Generator().manual_seed(5)
    x, gate = torch.randn(1, 3, 2, 8, generator=gen).bfloat16(), torch.randn(3, 2, 8, generator=gen).bfloat16()
    norm = _Norm()

    def original(*args):
        raise AssertionError("CPU rmsnorm_gated currently only supports activation silu")

    got = kda_fixes.sigmoid_gated_rmsnorm_on_cpu(original, norm, x, gate)
    xf = x.float()
    ref = xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight * torch.sigmoid(gate.float())
    assert got.shape == x.shape and got.dtype == torch.bfloat16
    assert (got.float() - ref).abs().max() <= 2e-2
    norm.activation = "silu"  # GDN's norm keeps its own path
    with pytest.raises(AssertionError, match="only supports activation silu"):
        kda_fixes.sigmoid_gated_rmsnorm_on_cpu(original, norm, x, gate)


def _forward_methods() -> type[enum.IntEnum]:
    return _module_from_file(SGLANG / "srt/models/deepseek_common/attention_forward_methods/forward_methods.py", {}).AttnForwardMethod


def test_mla_uses_absorbed_method_on_torch_native():
    """torch_native falls back to the Triton MLA handler, which picks MHA for fresh prefills; the fix turns every
    MHA choice into absorbed MLA for torch_native only."""
    methods = _forward_methods()
    chosen = {"value": methods.MHA}

    def triton_handler(attn, forward_batch):
        return chosen["value"]

    def get_handler(cls, backend_name):
        return triton_handler

    native = kda_fixes.mla_absorbed_on_torch_native(get_handler, object, "torch_native")
    for picked, expected in ((methods.MHA, methods.MLA), (methods.MHA_CHUNKED_KV, methods.MLA), (methods.MLA, methods.MLA)):
        chosen["value"] = picked
        assert native(None, None) is expected
    chosen["value"] = methods.MHA
    assert kda_fixes.mla_absorbed_on_torch_native(get_handler, object, "triton")(None, None) is methods.MHA


def test_sdpa_attends_over_one_latent_head():
    """What torch_native then runs for absorbed MLA: q [H, Lq, R + P], one shared latent key [1, Lk, R + P] and
    value [1, Lk, R] (its first R dims), enable_gqa. Must equal per-head attention over the broadcast latent."""
    gen = torch.Generator().manual_seed(6)
    heads, rank, rope, length = 4, 16, 8, 7
    q = torch.randn(1, heads, length, rank + rope, generator=gen)
    latent = torch.randn(1, 1, length, rank + rope, generator=gen)
    got = torch.nn.functional.scaled_dot_product_attention(q, latent, latent[..., :rank], is_causal=True, enable_gqa=True, scale=0.3)
    scores = (q @ latent.transpose(-1, -2) * 0.3).masked_fill(~torch.ones(length, length, dtype=torch.bool).tril(), float("-inf"))
    ref = scores.softmax(-1) @ latent[..., :rank]
    assert got.shape == (1, heads, length, rank) and (got - ref).abs().max() <= 1e-5
