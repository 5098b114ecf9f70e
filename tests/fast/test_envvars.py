"""Environment variables read by our code are the ones `prfaas_sgl/envvars.py` lists, read where it says.

Reads are found in the AST: ``os.environ.get(K)``/``.pop(K)``, ``os.environ[K]``, ``K in os.environ``,
``os.getenv(K)``, the same on a parameter named ``environ``, and SGLang's ``envs.NAME.get()``. ``K`` is a
string, or a module constant (in the same file or imported with ``from M import K``). Copying the whole
environment for a child process (``dict(os.environ)``) reads no variable.
"""

from __future__ import annotations

import ast
import subprocess
from collections import defaultdict
from pathlib import Path

from prfaas_sgl.envvars import REGISTRY

REPO = Path(__file__).resolve().parents[2]
SCOPE = ("prfaas_sgl", "router", "cachepool", "kernels")
ROOTS = {"prfaas_sgl.router": "router", "prfaas_sgl.cachepool": "cachepool", "prfaas_sgl.kernels": "kernels",
         "prfaas_sgl": "prfaas_sgl"}  # import name -> folder (setup.py maps the root folders into prfaas_sgl)


def _is_environ(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id == "environ") or (
        isinstance(node, ast.Attribute) and node.attr == "environ" and isinstance(node.value, ast.Name)
        and node.value.id == "os")


def _keys(tree: ast.AST) -> list[ast.AST]:
    """The key expressions of every environment read in ``tree``."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            f = node.func
            if f.attr in ("get", "pop") and _is_environ(f.value):
                out.append(node.args[0])
            elif f.attr == "getenv" and isinstance(f.value, ast.Name) and f.value.id == "os":
                out.append(node.args[0])
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                and isinstance(node.func.value, ast.Attribute) and isinstance(node.func.value.value, ast.Name)
                and node.func.value.value.id == "envs"):
            out.append(ast.Constant(node.func.value.attr))
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_environ(node.value):
            out.append(node.slice)
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) \
                and any(_is_environ(c) for c in node.comparators):
            out.append(node.left)
    return out


def _module_path(module: str) -> Path | None:
    for name, folder in sorted(ROOTS.items(), key=lambda kv: -len(kv[0])):
        if module == name or module.startswith(name + "."):
            rel = Path(folder, *module[len(name):].strip(".").split(".")) if module != name else Path(folder)
            for cand in (rel.with_suffix(".py"), rel / "__init__.py"):
                if (REPO / cand).is_file():
                    return REPO / cand
    return None


def _constant(name: str, path: Path, module: str) -> str | None:
    """The string ``name`` is bound to in ``path``: a module constant, or ``from M import name`` anywhere in
    the file (followed to M)."""
    tree = ast.parse(path.read_text())
    for node in [*tree.body, *(n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom))]:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return node.value.value if isinstance(node.value, ast.Constant) else None
        if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == name for a in node.names):
            base = module.rsplit(".", node.level)[0] + "." + (node.module or "") if node.level else node.module
            src = _module_path(base.rstrip("."))
            return _constant(next(a.name for a in node.names if (a.asname or a.name) == name), src, base) \
                if src else None
    return None


def _reads(source: str, path: Path, module: str) -> set[str]:
    names = set()
    for key in _keys(ast.parse(source)):
        value = key.value if isinstance(key, ast.Constant) else (
            _constant(key.id, path, module) if isinstance(key, ast.Name) else None)
        assert isinstance(value, str), f"{path}:{key.lineno}: cannot tell which variable {ast.unparse(key)} names"
        names.add(value)
    return names


def _module_name(rel: str) -> str:
    folder, _, rest = rel.partition("/")
    dotted = rest.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
    base = next(k for k, v in ROOTS.items() if v == folder)
    return f"{base}.{dotted}" if dotted != "__init__" else base


def _scan() -> dict[str, set[str]]:
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", *SCOPE],
                           cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    readers: dict[str, set[str]] = defaultdict(set)
    for rel in (f for f in files if f.endswith(".py") and (REPO / f).is_file()):
        for name in _reads((REPO / rel).read_text(), REPO / rel, _module_name(rel)):
            readers[name].add(rel)
    return dict(readers)


def test_the_scanner_sees_each_form_of_read(tmp_path):
    src = ("import os\nfrom sglang.srt.environ import envs\nK = 'F'\n"
           "os.environ.get('A'); os.environ['B']; os.getenv('C'); 'D' in os.environ; envs.E.get()\n"
           "def f(environ=os.environ):\n    return environ.get(K)\n"
           "env = dict(os.environ, X='1')\n")
    (tmp_path / "m.py").write_text(src)
    assert _reads(src, tmp_path / "m.py", "prfaas_sgl.m") == {"A", "B", "C", "D", "E", "F"}


def test_the_scanner_follows_an_imported_constant():
    assert _constant("SUPERVISOR_TOKEN_ENV", REPO / "prfaas_sgl/tools/deploy/up.py",
                     "prfaas_sgl.tools.deploy.up") == "PRFAAS_SUPERVISOR_TOKEN"  # imported inside a function
    assert _constant("ADMIN_TOKEN_ENV", REPO / "prfaas_sgl/tools/deploy/config.py",
                     "prfaas_sgl.tools.deploy.config") == "PRFAAS_ROUTER_ADMIN_TOKEN"


def test_every_variable_read_is_registered_with_its_readers():
    want = {v.name: set(v.readers) for v in REGISTRY}
    assert _scan() == want


def test_registry_entries_say_something():
    assert len({v.name for v in REGISTRY}) == len(REGISTRY)
    for v in REGISTRY:
        assert v.name.isupper() and v.unset and len(v.meaning) > 20 and v.readers, v
