"""Fixes that let stock SGLang 0.5.23 serve Kimi Linear (KDA + MLA) on a CPU without AMX.

Each fix is one named function with the reason in its docstring; `install` registers them as SGLang hooks
(applied once, before the engine starts). Like `fixes.py`, they run only in CPU mode
(`SGLANG_USE_CPU_ENGINE=1`). `TARGETS` maps each hooked SGLang attribute (dotted path) to its fix.
"""
from __future__ import annotations

import functools
import logging

log = logging.getLogger(__name__)

KDA_BACKEND = "sglang.srt.layers.attention.linear.kda_backend"
KDA_TRITON = "sglang.srt.layers.attention.linear.kernels.kda_triton"
NORM_GATE = "sglang.kernels.ops.attention.fla.fused_norm_gate"
MLA_HANDLER = "sglang.srt.models.deepseek_common.attention_backend_handler"

TARGETS = {
    f"{KDA_BACKEND}.KDAAttnBackend.__init__": "kda_kernels_on_cpu",
    f"{NORM_GATE}.FusedRMSNormGated.forward": "sigmoid_gated_rmsnorm_on_cpu",
    f"{MLA_HANDLER}.AttentionBackendRegistry.get_handler": "mla_absorbed_on_torch_native",
}


def install(HookRegistry, HookType) -> None:
    for target, name in TARGETS.items():
        HookRegistry.register(target, globals()[name], HookType.AROUND)


def kda_kernels_on_cpu(original, self, *args, **kwargs):
    """KDA's Triton kernel class imports `chunk_kda` and `fused_sigmoid_gating_delta_rule_update` only when
    not on CPU, so the first prefill on CPU dies with a NameError; and `kda_backend` always convolves the
    prefill with the Triton `causal_conv1d_fn` (its CPU branch swaps only the decode conv), which cannot
    launch without a GPU. When SGLang builds a KDA backend, point those module-level names at our
    pure-torch kernels, which take the same arguments. The conv one also reads and writes KDA's conv pool
    `[slots, W-1, dim]` through the transposed view the backend hands it (index writes, no contiguity)."""
    import sys

    patch_kda_modules(sys.modules[KDA_TRITON], sys.modules[KDA_BACKEND])
    return original(self, *args, **kwargs)


def patch_kda_modules(kda_triton, kda_backend) -> None:
    """Idempotent. kda_triton / kda_backend: the two SGLang modules (or stand-ins with their globals)."""
    from prfaas_sgl.kernels.kda import cpu as kda_cpu
    from prfaas_sgl.srt.cpu.sgl_ops import causal_conv1d_fn_cpu

    if getattr(kda_triton, "chunk_kda", None) is kda_cpu.chunk_kda_cpu:
        return
    kda_triton.chunk_kda = kda_cpu.chunk_kda_cpu
    kda_triton.fused_sigmoid_gating_delta_rule_update = kda_cpu.fused_sigmoid_gating_delta_rule_update_cpu
    kda_backend.causal_conv1d_fn = causal_conv1d_fn_cpu
    log.info("prfaas_sgl cpu fix: KDA prefill/decode and prefill conv use the pure-torch kernels")


def sigmoid_gated_rmsnorm_on_cpu(original, self, x, g, residual=None, prenorm=False, residual_in_fp32=False):
    """Kimi's KDA output norm is `FusedRMSNormGated(activation="sigmoid")`. On CPU its forward either launches
    the Triton kernel (no GPU) or, with `fixes.fla_gated_rmsnorm_on_cpu` on, asserts that the CPU op only
    does silu. Serve the sigmoid gate in plain torch: rmsnorm(x) * weight * sigmoid(g), fp32 math, x's
    shape and dtype (as fla's `rms_norm_gated`, norm before gate, no bias)."""
    if self.activation != "sigmoid" or residual is not None or prenorm:
        return original(self, x, g, residual, prenorm, residual_in_fp32)
    from prfaas_sgl.kernels.kda.cpu import rmsnorm_sigmoid_gated

    return rmsnorm_sigmoid_gated(x, self.weight, g, self.eps)


def mla_absorbed_on_torch_native(original, cls, backend_name):
    """DeepSeek-style MLA picks its forward method per batch; `torch_native` has no handler, so it gets the
    Triton one, which runs fresh prefills as MHA (per-head K/V, `save_kv_cache=False`). But
    `TorchNativeAttnBackend` never reads the K/V it is given: it reads keys and values back from the pool,
    and an MLA pool holds one latent row per token (kv_lora_rank + rope dims), so MHA's SDPA fails on the
    shapes. The absorbed MLA method writes the latent first and attends over it as one shared KV head
    (SDPA with GQA), which is what the pool holds; use it for every torch_native batch."""
    handler = original(cls, backend_name)
    if backend_name != "torch_native":
        return handler
    return functools.partial(_absorbed_only, handler)


def _absorbed_only(handler, attn, forward_batch):
    method = handler(attn, forward_batch)
    if method.name.startswith("MHA"):
        return type(method).MLA
    return method
