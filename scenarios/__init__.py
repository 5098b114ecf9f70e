"""Planner and simulator scenarios (TOML; `paper_case_study.toml` is the commented example).

Installed as `prfaas_sgl.scenarios` with its `.toml` files as package data (setup.py), so offline tooling finds
them in a wheel install as well as in the repository.
"""
from importlib.resources import files
from pathlib import Path


def scenario_path(name: str) -> Path:
    """The shipped scenario file `name` (its stem, e.g. "paper_case_study"); a real file in either install."""
    return Path(str(files(__name__) / f"{name}.toml"))
