"""Import hygiene: router and cachepool (every submodule) import without torch or sglang."""
from __future__ import annotations

import subprocess
import sys

PROBE = r"""
import importlib, pkgutil, sys
import prfaas_sgl.router, prfaas_sgl.cachepool
for pkg in (prfaas_sgl.router, prfaas_sgl.cachepool):
    for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        importlib.import_module(info.name)
heavy = sorted(m for m in ("torch", "sglang", "sgl_kernel", "transformers") if m in sys.modules)
print("HEAVY=" + ",".join(heavy))
"""


def test_router_and_cachepool_import_without_torch_or_sglang():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "HEAVY="


def test_plugin_module_is_cheap():
    code = "import prfaas_sgl, prfaas_sgl.plugin, prfaas_sgl.config, sys; print(sorted(m for m in ('torch','sglang','zmq') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
