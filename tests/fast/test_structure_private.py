"""A leading underscore means "this package's business": no module imports a `_name` from another package.

Read with `ast` (nothing imported). A module may import its own package's private names (a package's
`__init__` and its modules share them); tests and scripts are outside this rule.
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOTS = {"prfaas_sgl": "prfaas_sgl", "router": "prfaas_sgl.router", "cachepool": "prfaas_sgl.cachepool",
         "kernels": "prfaas_sgl.kernels"}  # setup.py's folder -> import name


def _modules() -> dict[str, Path]:
    out = {}
    for folder, name in ROOTS.items():
        for path in (REPO / folder).rglob("*.py"):
            parts = list(path.relative_to(REPO / folder).with_suffix("").parts)
            out[".".join([name, *parts])] = path
    return out


def _package(module: str) -> str:
    """The package a module belongs to ("a.b.__init__" and "a.b.c" both belong to "a.b")."""
    return module.rsplit(".", 1)[0]


def _source(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = _package(module).split(".")
    base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def test_no_private_name_crosses_a_package():
    crossing = []
    for module, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom):
                continue
            src = _source(module, node)
            for alias in node.names:
                private = alias.name.startswith("_") and not alias.name.startswith("__")
                if private and _package(module) not in (src, _package(src)):
                    crossing.append(f"{module}: from {src} import {alias.name}")
    assert crossing == []
