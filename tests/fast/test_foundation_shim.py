"""The sgl_kernel stand-in: active only when the real package cannot load; missing ops name themselves."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch", reason="the shim serves torch ops; the fast tier runs in the project venv with torch")


def run(code: str, env_path: str | None = None) -> subprocess.CompletedProcess:
    import os

    env = dict(os.environ)
    if env_path:
        env["PYTHONPATH"] = env_path + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=180, env=env)


def test_shim_serves_our_ops_and_names_missing_ones():
    out = run("""
        import importlib.util, torch
        import sgl_kernel
        from prfaas_sgl.srt.cpu.shim import shim_active
        assert shim_active()
        from sgl_kernel.mamba import causal_conv1d_fn_cpu
        from prfaas_sgl.srt.cpu import sgl_ops
        assert causal_conv1d_fn_cpu is sgl_ops.MAMBA_OPS["causal_conv1d_fn_cpu"]
        from sgl_kernel.scalar_type import scalar_types   # real pure-Python submodule
        assert scalar_types.uint4b8 is not None
        assert torch.ops.sgl_kernel.fused_gdn_gating_cpu is sgl_ops.TORCH_OPS["fused_gdn_gating_cpu"]
        assert not hasattr(torch.ops.sgl_kernel, "gptq_marlin_repack")   # CUDA names stay absent
        from sgl_kernel import silu_and_mul
        for op in (silu_and_mul, torch.ops.sgl_kernel.weird_thing_cpu):
            try:
                op(1)
            except NotImplementedError as e:
                print("ERR", e)
    """)
    assert out.returncode == 0, out.stderr[-2000:]
    errs = [line for line in out.stdout.splitlines() if line.startswith("ERR")]
    assert "sgl_kernel.silu_and_mul" in errs[0]
    assert "torch.ops.sgl_kernel.weird_thing_cpu" in errs[1]


def test_real_package_wins_when_it_loads(tmp_path):
    pkg = tmp_path / "sgl_kernel"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("REAL = True\n")
    out = run("""
        import sgl_kernel
        from prfaas_sgl.srt.cpu.shim import shim_active
        print(getattr(sgl_kernel, "REAL", False), shim_active())
    """, env_path=str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "False"]


def test_switch_off_disables_shim():
    import os

    import torch

    if torch.cuda.is_available():
        pytest.skip("GPU machine: the real sgl_kernel loads, so there is no failure to observe")

    env = dict(os.environ, PRFAAS_SGL_KERNEL_SHIM="off")
    code = "import sys\ntry:\n    import sgl_kernel\nexcept Exception as e:\n    print('FAILED', type(e).__name__)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=env)
    assert "FAILED" in out.stdout
