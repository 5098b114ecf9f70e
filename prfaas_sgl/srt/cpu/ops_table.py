"""What each `sgl_kernel` name resolves to in the stand-in: our pure-torch op (`sgl_ops`) or a `MissingOp`.

Two surfaces, both as SGLang 0.5.23 calls them on CPU:
- Python attributes, e.g. `sgl_kernel.mamba.causal_conv1d_fn_cpu`;
- torch custom ops, e.g. `torch.ops.sgl_kernel.fused_gdn_gating_cpu` (see `register_torch_ops`).

`shim` (the import finder) calls `populate` on the modules it creates; this table never imports `shim`, so
the dependency runs one way: the finder knows the table, the table does not know who serves it.
"""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)

_WRAPPED: list[bool] = []  # process-wide, once


class MissingOp:
    """Placeholder for an op SGLang imports but we do not implement; calling it says which one."""

    def __init__(self, qualname: str):
        self.qualname = qualname

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(
            f"{self.qualname} is not available: the real sgl_kernel could not load (no CUDA), and "
            f"prfaas_sgl's CPU stand-in does not implement this op"
        )

    def __repr__(self) -> str:
        return f"<prfaas_sgl missing op {self.qualname}>"


def populate(module) -> None:
    """Called when the stand-in module `module` (`sgl_kernel` or `sgl_kernel.<sub>`) is created."""
    sgl_ops = _load_ops()
    if sgl_ops is None:
        return
    sub = module.__name__.partition(".")[2]  # "" for the root package
    if sub == "mamba":  # the only submodule whose Python attributes SGLang calls
        for name, fn in sgl_ops.MAMBA_OPS.items():
            setattr(module, name, fn)
    if sub == "":
        register_torch_ops()


def _load_ops():
    try:
        from prfaas_sgl.srt.cpu import sgl_ops
    except ImportError as e:  # every op then raises MissingOp's clear error when called
        log.warning("prfaas_sgl: CPU kernels unavailable (%s); sgl_kernel ops will raise when called", e)
        return None
    return sgl_ops


def register_torch_ops() -> None:
    """Makes `torch.ops.sgl_kernel.<name>` resolve to our ops, and unknown names to `MissingOp`.

    The ops are plain Python callables served by the namespace rather than `torch.library` registrations:
    SGLang's CPU path calls them eagerly (never under torch.compile / CUDA graphs), and a Python callable
    cannot drift from a hand-written schema string.
    """
    if _WRAPPED:
        return
    import torch

    sgl_ops = _load_ops()
    table = dict(sgl_ops.TORCH_OPS) if sgl_ops is not None else {}
    base = type(torch.ops.sgl_kernel)

    class Namespace(base):
        # SGLang binds some CPU ops at module import (`x = torch.ops.sgl_kernel.fused_sigmoid_mul_cpu`)
        # even on paths that never call them, so unknown `*_cpu` names resolve to a MissingOp. Other names
        # must keep raising: `register_fake_if_exists` probes CUDA op names with hasattr().
        def __getattr__(self, name):
            if name in table:
                return table[name]
            try:
                return super().__getattr__(name)
            except AttributeError:
                if not name.endswith("_cpu"):
                    raise
                return MissingOp(f"torch.ops.sgl_kernel.{name}")

    torch.ops.sgl_kernel.__class__ = Namespace
    _WRAPPED.append(True)
    log.info("prfaas_sgl: %d CPU stand-ins under torch.ops.sgl_kernel", len(table))
