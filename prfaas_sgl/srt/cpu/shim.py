"""A CPU stand-in for `sgl_kernel`, used only when the real package cannot load (no CUDA driver).

PyPI's `sglang-kernel` is CUDA-only: importing it without a driver fails, yet SGLang's CPU path does
`from sgl_kernel.mamba import causal_conv1d_fn_cpu` and calls `torch.ops.sgl_kernel.*_cpu` ops. The finder
below is installed at interpreter start (from `prfaas_sgl_boot.pth`) and stays inert until something imports
`sgl_kernel`. Then it first tries the real package; only if that raises does it serve stand-in modules:

- names we implement (`sgl_ops`, placed by `ops_table`) are real pure-torch functions;
- every other name imports fine but raises `NotImplementedError` naming the op when called, because SGLang
  imports many ops it never calls on CPU.

Set PRFAAS_SGL_KERNEL_SHIM=off to disable the stand-in entirely.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types

ROOT = "sgl_kernel"
ENV_SWITCH = "PRFAAS_SGL_KERNEL_SHIM"
# Pure-Python submodules of the real package that SGLang needs as real objects (not ops), e.g.
# `from sgl_kernel.scalar_type import scalar_types` at quantization import time. Loaded from its files.
PURE_SUBMODULES = ("scalar_type",)


class ShimModule(types.ModuleType):
    """A package-like module whose unknown attributes are `MissingOp`s (dunders stay AttributeErrors)."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        from prfaas_sgl.srt.cpu.ops_table import MissingOp

        op = MissingOp(f"{self.__name__}.{name}")
        setattr(self, name, op)
        return op


class _ShimLoader(importlib.abc.Loader):
    def create_module(self, spec):
        return ShimModule(spec.name)

    def exec_module(self, module):
        module.__path__ = []  # a package, so `sgl_kernel.<sub>` imports come back to the finder
        module.__prfaas_shim__ = True
        # imported here, not at the top: this module loads at every interpreter start (boot .pth), the table
        # only when something imports sgl_kernel without a working real one
        from prfaas_sgl.srt.cpu import ops_table

        ops_table.populate(module)


class SglKernelFinder(importlib.abc.MetaPathFinder):
    """Serves `sgl_kernel[.*]` from the shim once the real package has failed to import."""

    def __init__(self):
        self.use_shim: bool | None = None  # decided on the first `import sgl_kernel`

    def find_spec(self, fullname, path=None, target=None):
        if fullname != ROOT and not fullname.startswith(ROOT + "."):
            return None
        if self.use_shim is None:
            self.use_shim = not _real_package_loads()
        if not self.use_shim:
            return None
        sub = fullname.partition(".")[2]
        if sub in PURE_SUBMODULES:
            real = _real_file_spec(fullname, sub)
            if real is not None:
                return real
        return importlib.machinery.ModuleSpec(fullname, _ShimLoader(), is_package=True)


def _real_file_spec(fullname: str, sub: str):
    pkg = importlib.machinery.PathFinder.find_spec(ROOT)
    if pkg is None or not pkg.submodule_search_locations:
        return None
    for folder in pkg.submodule_search_locations:
        path = os.path.join(folder, sub + ".py")
        if os.path.exists(path):
            return importlib.util.spec_from_file_location(fullname, path)
    return None


def _real_package_loads() -> bool:
    """Imports the real `sgl_kernel` with this finder out of the way; on failure undoes the partial import."""
    before = set(sys.modules)
    finders = [f for f in sys.meta_path if isinstance(f, SglKernelFinder)]
    for f in finders:
        sys.meta_path.remove(f)
    try:
        __import__(ROOT)
        return True
    except Exception:  # ImportError, OSError (libcuda.so.1), RuntimeError from its loader
        for name in set(sys.modules) - before:
            if name == ROOT or name.startswith(ROOT + "."):
                del sys.modules[name]
        return False
    finally:
        sys.meta_path[0:0] = finders


def install_finder() -> None:
    """Idempotent; cheap (imports nothing heavy). Called from the boot `.pth` and the plugin."""
    if os.environ.get(ENV_SWITCH, "auto").lower() in ("off", "0", "false"):
        return
    if any(isinstance(f, SglKernelFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, SglKernelFinder())


def shim_active() -> bool:
    mod = sys.modules.get(ROOT)
    return bool(mod is not None and getattr(mod, "__prfaas_shim__", False))
