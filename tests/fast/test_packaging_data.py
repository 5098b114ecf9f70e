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

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "docs" / "deploy-two-datacenters.toml"  # input data, read from the checkout

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

RENDER = """
import prfaas_sgl
from prfaas_sgl.cli import main

assert prfaas_sgl.__file__.startswith({lib!r}), prfaas_sgl.__file__
raise SystemExit(main(["render", "prometheus", "--config", {example!r}, "--out", {out!r}]))
"""


@pytest.fixture(scope="module")
def lib(tmp_path_factory) -> Path:
    """The packages as a wheel holds them, built once for this module."""
    tmp = tmp_path_factory.mktemp("built")
    build = subprocess.run([sys.executable, "-P", "setup.py", "-q", "egg_info", "--egg-base", str(tmp),
                            "build_py", "--build-lib", str(tmp / "lib")], cwd=REPO, capture_output=True, text=True,
                           timeout=300)
    assert build.returncode == 0, build.stderr[-2000:]
    return tmp / "lib"


def run_built(lib: Path, code: str, cwd: Path) -> str:
    """``code`` in a fresh interpreter that sees the built tree, not the checkout; its stdout."""
    run = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(lib), "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout.strip()


def test_studies_read_their_scenarios_from_the_built_package(lib, tmp_path):
    assert run_built(lib, CHECK.format(lib=str(lib)), tmp_path) == "paper_case_study"


def test_render_prometheus_copies_the_alert_rules_from_the_built_package(lib, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    run_built(lib, RENDER.format(lib=str(lib), example=str(EXAMPLE), out=str(out)), tmp_path)
    assert (out / "prfaas-alerts.yml").read_bytes() == (REPO / "deploy" / "monitoring" / "alerts.yml").read_bytes()
