"""The docs stay true to the tree: the README points to docs/architecture.md first, every file and Python name
that page walks through exists, and no doc points at a Markdown file outside the repository.

Read from the source with `ast` (nothing imported), so a rename that leaves the page behind fails here.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ARCH = REPO / "docs" / "architecture.md"
PACKAGES = ("prfaas_sgl", "router", "cachepool", "kernels")
# SGLang's names the page uses to say where our code plugs in; they live in the sglang wheel, not here.
SGLANG_NAMES = {"BasePrefixCache", "get_kv_class", "Success", "bootstrap_host", "bootstrap_port", "bootstrap_room",
                "rid"}
IDENT = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)?")


def _spans(text: str) -> set[str]:
    """Inline code spans outside fenced blocks."""
    return set(re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S)))


def _defined() -> set[str]:
    """Every class, function, `Class.method`, `module.function` and module-level name of the packages."""
    names: set[str] = set()
    for pkg in PACKAGES:
        for path in (REPO / pkg).rglob("*.py"):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node in tree.body:
                if isinstance(node, (ast.Assign, ast.AnnAssign)):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    names.update(t.id for t in targets if isinstance(t, ast.Name))
                if not isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                names |= {node.name, f"{path.stem}.{node.name}", f"{path.parent.name}.{node.name}"}
                for sub in node.body if isinstance(node, ast.ClassDef) else ():
                    if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        names |= {sub.name, f"{node.name}.{sub.name}"}
    return names


def _repo_file(token: str, base: Path) -> bool:
    token = token.rstrip("/")
    return any(p.exists() for p in (REPO / token, base / token, REPO / "docs" / token))


def test_readme_points_to_the_architecture_first():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    docs = re.findall(r"docs/[\w.-]+\.md", readme)
    assert ARCH.exists() and docs and docs[0] == "docs/architecture.md", docs[:3]


def test_architecture_names_only_what_exists():
    files = {p.name for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")}
    defined = _defined()
    missing = []
    for token in _spans(ARCH.read_text(encoding="utf-8")):
        if "/" in token and " " not in token and not token.startswith("/"):
            ok = _repo_file(token, ARCH.parent) or any((REPO / pkg / token).exists() for pkg in PACKAGES)
        elif token.endswith(".py"):
            ok = token in files
        elif IDENT.fullmatch(token) and not token.startswith("prfaas"):
            ok = token in defined or token in SGLANG_NAMES
        else:
            continue  # flags, endpoints, commands
        if not ok:
            missing.append(token)
    assert sorted(missing) == []


def test_docs_point_at_no_markdown_outside_the_repo():
    dangling = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for token in _spans(doc.read_text(encoding="utf-8")):
            if token.endswith(".md") and " " not in token and not token.startswith("out/"):  # out/: run output
                if not _repo_file(token, doc.parent):
                    dangling.append(f"{doc.name}: {token}")
    assert dangling == []
