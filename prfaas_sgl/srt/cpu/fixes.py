"""Small fixes that let stock SGLang 0.5.23 serve hybrid models on a CPU without AMX.

Each fix is one named function with the reason in its docstring; `install` applies all of them. They run
only when SGLang is in CPU mode (`SGLANG_USE_CPU_ENGINE=1`), never on a GPU machine.
"""
from __future__ import annotations

import contextlib
import importlib
import logging

log = logging.getLogger(__name__)


def install(HookRegistry, HookType) -> None:
    for fix in (fla_gated_rmsnorm_on_cpu, mooncake_sender_host_indices_off, conv_states_in_float32):
        fix()
    HookRegistry.register(
        "sglang.srt.models.qwen3_next.Qwen3GatedDeltaNet.__init__", qwen3_next_current_device, HookType.AROUND
    )
    from prfaas_sgl.srt.cpu import kda_fixes  # Kimi Linear: KDA kernels, its sigmoid output norm, MLA on torch_native

    kda_fixes.install(HookRegistry, HookType)
    from prfaas_sgl.srt.cpu import swa_fixes  # MiMo-V2-Flash: attention sinks and SWA-pool reads on torch_native

    swa_fixes.install(HookRegistry, HookType)
    from prfaas_sgl.srt.cpu import query_only  # opt-in: extend attention over the new queries only

    query_only.install(HookRegistry, HookType)


def fla_gated_rmsnorm_on_cpu() -> None:
    """Gated RMSNorm picks its CPU op only when AMX is present; otherwise it launches a Triton kernel that
    queries the CUDA SM count and crashes. Our `torch.ops.sgl_kernel.fused_rmsnorm_gated_cpu` stand-in
    serves the CPU branch without AMX, so turn that branch on."""
    for name in (
        "sglang.kernels.ops.attention.fla.layernorm_gated",
        "sglang.kernels.ops.attention.fla.fused_norm_gate",
    ):
        module = importlib.import_module(name)
        if not module._use_cpu:
            module._use_cpu = True
            log.info("prfaas_sgl cpu fix: %s uses the CPU gated-RMSNorm op", name)


def conv_states_in_float32() -> None:
    """SGLang keeps linear-attention conv states (GDN, KDA) in bf16 whatever --dtype says
    (`mamba_utils.mamba2_state_dtype`: SGLANG_MAMBA_CONV_DTYPE, default "bfloat16"); our CPU servers
    compute in float32. The conv state is stored at every chunk end and read by the next chunk's
    first K-1 tokens, so a float32 model's logits depended on where its prefill chunks began, and a
    prefix hit (which begins a chunk at its checkpoint) was not token-exact against a server whose
    chunks fell elsewhere. Measured on tiny-kimi-linear, 195-token prompt: input log-probs equal HF to
    2e-5 before the first chunk end and off by up to 7e-3 from it on (chunk 64 or 512 alike). Keep
    them in float32 unless the variable is set explicitly."""
    from sglang.srt.environ import envs

    if not envs.SGLANG_MAMBA_CONV_DTYPE.is_set():
        envs.SGLANG_MAMBA_CONV_DTYPE.set("float32")
        log.info("prfaas_sgl cpu fix: linear-attention conv states in float32")


def mooncake_sender_host_indices_off() -> None:
    """With `supports_host_tensor_indices`, the prefill side copies page indices into pinned memory and
    records a CUDA event (prefill.py `_send_kv_chunk`); on CPU the indices are host tensors already."""
    try:
        from sglang.srt.disaggregation.mooncake import conn
    except ImportError:  # mooncake backend not importable: nothing to fix
        return
    conn.MooncakeKVSender.supports_host_tensor_indices = False


def qwen3_next_current_device(original, self, *args, **kwargs):
    """Qwen3GatedDeltaNet.__init__ calls `torch.get_device_module().current_device()`, which on a CUDA build
    of torch without a driver resolves to torch.cuda and raises; on CPU the answer is simply 'cpu'."""
    with _device_module_is_cpu():
        return original(self, *args, **kwargs)


@contextlib.contextmanager
def _device_module_is_cpu():
    import torch

    saved = torch.get_device_module
    torch.get_device_module = lambda device=None: torch.cpu if device is None else saved(device)
    try:
        yield
    finally:
        torch.get_device_module = saved
