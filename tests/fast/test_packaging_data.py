"""Offline tooling finds its data files in a wheel install: what setup.py builds into the wheel's package tree
must be enough, with no repository checkout around it.

Builds the packages as a wheel would (`setup.py build_py` into a temporary directory, a few seconds; `-P`: the
repository's `kernels/` must not shadow the installed `kernels` package setuptools' plugins load) and runs a
fresh interpreter from there, outside the repository.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CHECK = """
import prfaas_sgl
from prfaas_sgl.router.planner import load_scenario
from prfaas_sgl.router.sim import studies
from prfaas_sgl.scenarios import scenario_path

assert prfaas_sgl.__file__.startswith({lib!r}), prfaas_sgl.__file__  # the built tree, not the checkout
for name in ("paper_case_study", "burst_link_drop", "qwen3_235b_dense"):
    load_scenario(scenario_path(name))
print(load_scenario(studies.CASE).name)
"""


def test_studies_read_their_scenarios_from_the_built_package(tmp_path):
    lib = tmp_path / "lib"
    build = subprocess.run([sys.executable, "-P", "setup.py", "-q", "egg_info", "--egg-base", str(tmp_path),
                            "build_py", "--build-lib", str(lib)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-2000:]
    run = subprocess.run([sys.executable, "-c", CHECK.format(lib=str(lib))], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120, env={"PYTHONPATH": str(lib), "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "paper_case_study"
