"""The GPU check kit on a machine without a GPU: the run half stops cleanly at "no CUDA device" and says
so in its JSON; the package it puts on the path is the one setup.py installs; the trimmed FlashInfer wheel
keeps what its paged FA2 kernels compile from and a RECORD that matches what is left."""
from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check  # noqa: E402
import gpu_wheels  # noqa: E402


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the no-GPU path")
def test_run_half_stops_at_no_cuda_and_records_it(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "scripts/gpu_check.py"), "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert gpu_check.NO_CUDA in r.stdout
    assert json.loads((tmp_path / "gpu_check.json").read_text())["cuda"] is False


def test_package_links_are_what_setup_py_installs(tmp_path):
    """A fresh interpreter without site-packages' editable finder imports the mapped subpackages from
    the link tree (the GPU machine has no install of ours)."""
    links = gpu_check.package_links(tmp_path / "links")
    code = ("import prfaas_sgl.cachepool.slab_blocks, prfaas_sgl.kernels.paged_attention.spec, "
            "prfaas_sgl.router.fields, prfaas_sgl.transfer.items as t; print(t.__file__)")
    env = {**os.environ, "PYTHONPATH": str(links), "PYTHONSAFEPATH": "1"}
    r = subprocess.run([sys.executable, "-S", "-c", f"import sys; sys.path += {_site_dirs()!r}; {code}"],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().startswith(str(links))


def _site_dirs() -> list[str]:
    """site-packages without running their .pth files (the editable finder would answer first)."""
    return [p for p in sys.path if p.endswith("site-packages")]


@pytest.mark.parametrize(("name", "dropped"), [
    ("flashinfer/data/csrc/batch_prefill.cu", False),
    ("flashinfer/data/csrc/batch_decode_customize_config.jinja", False),
    ("flashinfer/data/include/flashinfer/attention/prefill.cuh", False),
    ("flashinfer/data/cutlass/include/cute/tensor.hpp", False),
    ("flashinfer/data/cutlass/tools/util/include/cutlass/util/command_line.h", False),  # FA3 on sm_90 reads it
    ("flashinfer/fused_moe/core.py", False),
    ("flashinfer/data/csrc/kda/kda_fwd.cu", True),
    ("flashinfer/data/csrc/fused_moe/cutlass_backend/x.cu", True),
    ("flashinfer/data/cutlass/examples/00_basic_gemm/basic_gemm.cu", True),
])
def test_trim_keeps_what_the_paged_kernels_compile_from(name, dropped):
    assert gpu_wheels.trimmed(name) is dropped


def test_repack_rewrites_record_to_the_kept_files(tmp_path):
    wheel = tmp_path / "flashinfer_python-0.7.2-py3-none-any.whl"
    files = {"flashinfer/__init__.py": b"x = 1\n", "flashinfer/data/csrc/batch_prefill.cu": b"// fa2\n",
             "flashinfer/data/csrc/kda/big.cu": b"0" * 1000}
    with zipfile.ZipFile(wheel, "w") as z:
        for n, data in files.items():
            z.writestr(n, data)
        z.writestr("flashinfer_python-0.7.2.dist-info/RECORD", "stale\n")
    assert gpu_wheels.repack(wheel) == (2, 1)
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        record = z.read("flashinfer_python-0.7.2.dist-info/RECORD").decode().splitlines()
    assert "flashinfer/data/csrc/kda/big.cu" not in names
    for n in ("flashinfer/__init__.py", "flashinfer/data/csrc/batch_prefill.cu"):
        digest = base64.urlsafe_b64encode(hashlib.sha256(files[n]).digest()).rstrip(b"=").decode()
        assert f"{n},sha256={digest},{len(files[n])}" in record
    assert record[-1] == "flashinfer_python-0.7.2.dist-info/RECORD,,"


def test_the_commit_named_by_the_caller_wins_over_git(monkeypatch):
    monkeypatch.setenv("GPU_CHECK_COMMIT", "abc1234")
    assert gpu_check._commit() == "abc1234"
