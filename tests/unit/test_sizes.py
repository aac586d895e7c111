"""Modules of at most 600 lines and functions of at most 80, tests and benchmarks included (issue 39). A function
that is a table (a literal mapping or list, read row by row) may be longer: the line above its ``def`` (or above
its first decorator) says ``# a table``. Split a long one by what its parts do, not at line N."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

MAX_MODULE = 600
MAX_FUNCTION = 80
SKIP = {".venv", ".git", "site", "docs", "node_modules", ".stam", "build"}


def _python_files() -> list[Path]:
    return sorted(p for p in REPO.rglob("*.py")
                  if not SKIP & set(p.relative_to(REPO).parts) and not p.relative_to(REPO).parts[0].startswith("."))


def oversized(name: str, text: str) -> list[str]:
    """What in one source file is over the limits: ``name: N lines`` for the module, ``name:line def f: N lines``
    for each function (a nested one counts on its own too)."""
    lines = text.splitlines()
    found = [f"{name}: {len(lines)} lines"] if len(lines) > MAX_MODULE else []
    for node in ast.walk(ast.parse(text, name)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            table = start >= 2 and lines[start - 2].strip() == "# a table"
            if length > MAX_FUNCTION and not table:
                found.append(f"{name}:{node.lineno} def {node.name}: {length} lines")
    return found


def test_every_module_and_function_is_within_its_size() -> None:
    found = [f for p in _python_files() for f in oversized(str(p.relative_to(REPO)), p.read_text())]
    assert found == [], "split these by responsibility (or mark a table)"


def test_the_size_check_finds_a_long_module_and_a_long_function() -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION))
    long_function = f"def f():\n{body}"
    table = f"# a table\ndef g():\n{body}"
    assert oversized("a.py", long_function) == [f"a.py:1 def f: {MAX_FUNCTION + 1} lines"]
    assert oversized("b.py", table) == []
    assert oversized("c.py", "x = 1\n" * (MAX_MODULE + 1)) == [f"c.py: {MAX_MODULE + 1} lines"]
