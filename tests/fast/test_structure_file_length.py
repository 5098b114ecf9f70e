"""No Python file of ours is longer than 400 lines: past that a module holds more than one idea, and the
reader scrolls instead of reading names (the style guide's "short units").

Scans the project's own folders on disk (tracked files and new ones not yet committed; `__pycache__` and
build output are not ours). `LONGER` names the files allowed past the budget today, each with why; a file
that shrinks under the budget must leave the list (the second test), and none may be added lightly.
"""
from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FOLDERS = ("prfaas_sgl", "router", "cachepool", "kernels", "scripts", "tests")
SKIP = {"__pycache__", "build"}
BUDGET = 400
# path -> why it may be longer today (empty: every file is within the budget)
LONGER: dict[str, str] = {}


def _lengths() -> dict[str, int]:
    out = {}
    for folder in FOLDERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = path.relative_to(REPO)
            if SKIP.intersection(rel.parts) or any(part.startswith(".") for part in rel.parts):
                continue
            with path.open(encoding="utf-8") as f:
                out[rel.as_posix()] = sum(1 for _ in f)
    return out


LENGTHS = _lengths()


def test_no_python_file_over_the_budget():
    over = {f: n for f, n in LENGTHS.items() if n > BUDGET and f not in LONGER}
    assert over == {}, f"split these (or argue one into LONGER with a reason): {over}"


def test_the_allow_list_holds_only_files_still_over_the_budget():
    stale = {f: LENGTHS.get(f) for f in LONGER if LENGTHS.get(f, 0) <= BUDGET}
    assert stale == {}, f"these are within {BUDGET} lines (or gone): drop them from LONGER"
