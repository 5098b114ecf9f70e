"""CUDA-only libraries an SGLang server on CPU imports and never uses: refused at import, to start faster.

SGLang 0.5.23 imports FlashInfer at module level from its quantization and sampling modules, each time
inside `try/except ImportError` (or behind `is_cuda()`), so a CPU server runs the same without it. Loading it
(and the CUTLASS DSL it pulls in) costs ~2.5 CPU-s per process, and a server is three processes (HTTP,
scheduler, detokenizer) that each import it: measured, `import sglang.srt.managers.scheduler,
...http_server, ...detokenizer_manager` took 14.5-18.5 user-s with it and ~2.5 s less without it. On a
2-core machine where a test module starts 4-5 servers at once, startup is CPU-bound, so that is its share
of every module's setup.

Installed from the boot `.pth` only when `SGLANG_USE_CPU_ENGINE=1` (the variable our launcher sets for CPU
servers), so the test process and GPU machines import FlashInfer as usual.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

REFUSED = ("flashinfer",)


class _Refuse(importlib.abc.Loader):
    def create_module(self, spec):
        raise ModuleNotFoundError(
            f"No module named {spec.name!r}: prfaas_sgl refuses CUDA-only libraries in a CPU SGLang server "
            "(SGLANG_USE_CPU_ENGINE=1)", name=spec.name)

    def exec_module(self, module):  # never reached: create_module raised
        raise AssertionError(module)


class CudaOnlyFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] in REFUSED:
            return importlib.machinery.ModuleSpec(fullname, _Refuse())
        return None


def install_finder() -> None:
    """Idempotent and cheap; a no-op unless this process is a CPU SGLang server."""
    if os.environ.get("SGLANG_USE_CPU_ENGINE") != "1":
        return
    if not any(isinstance(f, CudaOnlyFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, CudaOnlyFinder())
