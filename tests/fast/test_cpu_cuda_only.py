"""A CPU SGLang server refuses FlashInfer at import (prfaas_sgl.srt.cpu.cuda_only); any other process finds it
as usual. That SGLang's server modules still import and serve without it is what every server of the sglang
tier shows (each starts with SGLANG_USE_CPU_ENGINE=1)."""
from __future__ import annotations

import os
import subprocess
import sys

FIND = """
import importlib.util
spec = importlib.util.find_spec("flashinfer")
print("found" if spec is not None and spec.origin and "flashinfer" in spec.origin else f"not found: {spec}")
"""
PROBE = """
try:
    import flashinfer
    print("flashinfer imported")
except ModuleNotFoundError as e:
    print("refused:", e)
"""


def _run(code: str, cpu_engine: bool) -> str:
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_USE_CPU_ENGINE"}
    if cpu_engine:
        env["SGLANG_USE_CPU_ENGINE"] = "1"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def test_a_cpu_server_process_refuses_flashinfer_with_a_reason():
    line = _run(PROBE, cpu_engine=True)
    assert line.startswith("refused:") and "SGLANG_USE_CPU_ENGINE=1" in line, line


def test_other_processes_find_flashinfer_as_usual():
    # find_spec, not import: importing FlashInfer costs seconds, and the finder only decides the spec
    assert _run(FIND, cpu_engine=False) == "found"

