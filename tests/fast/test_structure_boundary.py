"""Structure checks read from the source with `ast` (nothing is imported, so this runs in well under a second):

1. the SGLang boundary is a folder: only files under `prfaas_sgl/srt/` import sglang, load it with
   `importlib.import_module("sglang...")`, or name an SGLang attribute as a hook target ("sglang.srt...");
2. the project's modules have no import cycle at module level (imports inside functions and
   `if TYPE_CHECKING:` blocks run later or never, so they cannot deadlock a partial import);
3. runtime never depends on tooling: nothing outside `prfaas_sgl/tools/` imports it (at any depth) or names
   it in a string (`python -m prfaas_sgl.tools...`), but the `prfaas` console script that dispatches to it.
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# folder -> import name (setup.py's ROOTS)
ROOTS = {"prfaas_sgl": "prfaas_sgl", "router": "prfaas_sgl.router", "cachepool": "prfaas_sgl.cachepool",
         "kernels": "prfaas_sgl.kernels"}
BOUNDARY = "prfaas_sgl.srt"
# `python -m sglang.launch_server` in a server command line starts SGLang in another process; it is not an import.
COMMAND_MODULES = {"sglang.launch_server"}
TOOLS = "prfaas_sgl.tools"
# pyproject.toml's `prfaas` console script names this module, so it stays outside tools/ and dispatches into it.
TOOLS_ENTRY_POINTS = {"prfaas_sgl.cli"}
# Cycles other work removes; each entry is one cycle's sorted module names. Keep it empty.
KNOWN_CYCLES: set[tuple[str, ...]] = set()


def _modules() -> dict[str, tuple[Path, ast.Module]]:
    out = {}
    for folder, name in ROOTS.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = list(path.relative_to(REPO / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([name, *parts])] = (path, ast.parse(path.read_text(encoding="utf-8"), str(path)))
    return out


MODULES = _modules()


def _is_package(module: str) -> bool:
    return MODULES[module][0].name == "__init__.py"


def _absolute(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base[: len(base) - node.level + (1 if _is_package(module) else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def _imported(module: str, node: ast.AST) -> list[str]:
    """Module names an import statement loads (`from pkg import sub` names pkg.sub when that is a module)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        src = _absolute(module, node)
        return [f"{src}.{a.name}" if f"{src}.{a.name}" in MODULES else src for a in node.names]
    return []


def _sglang_uses(module: str, tree: ast.Module) -> list[str]:
    found = []
    for node in ast.walk(tree):
        names = [n for n in _imported(module, node) if n == "sglang" or n.startswith("sglang.")]
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("sglang."):
            names = [node.value]  # importlib.import_module("sglang..."), HookRegistry targets, module constants
        found += [f"line {node.lineno}: {n}" for n in names if n not in COMMAND_MODULES]
    return sorted(set(found))


def test_only_the_boundary_package_touches_sglang():
    outside = {m: uses for m, (_, tree) in MODULES.items()
               if m != BOUNDARY and not m.startswith(BOUNDARY + ".") and (uses := _sglang_uses(m, tree))}
    assert outside == {}, f"only {BOUNDARY} may import or hook sglang"
    assert any(_sglang_uses(m, t) for m, (_, t) in MODULES.items())  # the walk does find the real ones


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _module_level_imports(module: str, body: list[ast.stmt]) -> set[str]:
    """Imports executed while the module loads: top level, and inside module-level if/try/with blocks."""
    out: set[str] = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue  # a class body runs at import, but no module here imports inside one
        if isinstance(node, ast.If) and _type_checking(node):
            out |= _module_level_imports(module, node.orelse)
            continue
        out |= set(_imported(module, node))
        for field in ("body", "orelse", "finalbody", "handlers"):
            out |= _module_level_imports(module, getattr(node, field, []) or [])
    return out


def _graph() -> dict[str, set[str]]:
    return {m: {d for d in _module_level_imports(m, tree.body) if d in MODULES and d != m}
            for m, (_, tree) in MODULES.items()}


def _cycles(graph: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = set()
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.add(tuple(sorted(component)))
    return out


def test_no_import_cycles():
    assert _cycles(_graph()) == KNOWN_CYCLES


def test_cycle_finder_sees_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == {("a", "b", "c")}


# Packages whose modules may not import one another in a circle even from inside a function: there a lazy
# import that runs back up hides which module is the base and which the role (the KV managers: manager.py
# is the shared base, prefill.py/decode.py its roles, conn.py picks one).
NO_LAZY_CYCLES = ("prfaas_sgl.srt.backend",)


def _imports_at_any_depth(module: str, node: ast.AST) -> set[str]:
    """Every import ``node`` can run, inside functions too (not under `if TYPE_CHECKING:`: never at run time)."""
    if isinstance(node, ast.If) and _type_checking(node):
        return set().union(*(_imports_at_any_depth(module, n) for n in node.orelse))
    out = set(_imported(module, node))
    for child in ast.iter_child_nodes(node):
        out |= _imports_at_any_depth(module, child)
    return out


def _package_graph(package: str) -> dict[str, set[str]]:
    inside = {m: tree for m, (_, tree) in MODULES.items() if _in(m, package)}
    return {m: {d for d in _imports_at_any_depth(m, tree) if d in inside and d != m} for m, tree in inside.items()}


def test_no_import_cycles_even_through_function_level_imports():
    for package in NO_LAZY_CYCLES:
        graph = _package_graph(package)
        assert len(graph) > 1 and any(graph.values())  # the package is there and its modules import each other
        assert _cycles(graph) == set(), package


def test_imports_at_any_depth_see_function_level_and_skip_type_checking():
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\nelse:\n    import b\n"
                     "def f():\n    import c\nclass K:\n    def g(self):\n        from d import e\n")
    assert _imports_at_any_depth("x", tree) == {"typing", "b", "c", "d"}


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _tools_uses(module: str, tree: ast.Module) -> list[str]:
    found = []
    for node in ast.walk(tree):
        names = [n for n in _imported(module, node) if _in(n, TOOLS)]
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith(TOOLS):
            names = [node.value]  # `-m prfaas_sgl.tools...` arguments, importlib names (an f-string's head too)
        found += [f"line {node.lineno}: {n}" for n in names]
    return sorted(set(found))


def test_runtime_never_imports_tooling():
    runtime = {m: uses for m, (_, tree) in MODULES.items()
               if not _in(m, TOOLS) and m not in TOOLS_ENTRY_POINTS and (uses := _tools_uses(m, tree))}
    assert runtime == {}, f"runtime code imports {TOOLS}"
    assert all(_tools_uses(m, MODULES[m][1]) for m in TOOLS_ENTRY_POINTS)  # the walk does find the dispatch
    assert _tools_uses("x", ast.parse("def f():\n    from prfaas_sgl.tools import launch"))  # also in functions
