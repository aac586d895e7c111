"""The layers of the code, held: no import circle, and no module importing a layer above its own beyond the known
exceptions listed here, each with its reason (issue 39). Every import counts, deferred ones included (a deferred
import hides a dependency, it does not remove it). The exceptions only shrink: one that no longer happens fails
too, so that fixing an arrow also removes it from the list."""

from __future__ import annotations

import ast
from collections import defaultdict
from functools import cache
from pathlib import Path

from tests.conftest import REPO

# Top-level package -> its folder: the product's (what a deployment installs), then the lab part's (lab/: the
# project stam-lab) and the benchmarks (run from a checkout).
ROOTS = {"schemas": REPO / "schemas", "stam": REPO / "stam", "topology": REPO / "topology", "workers": REPO / "workers",
         "stam_lab": REPO / "lab" / "stam_lab", "benchmarks": REPO / "benchmarks"}

# Bottom to top. A component is a top-level package (schemas, topology, workers, benchmarks) or a module/package
# directly under stam or stam_lab. The lab (stam_lab.*) and the benchmarks sit above the whole product: they may use
# it, the product must not use them.
LAYERS: list[set[str]] = [
    {"schemas"},
    {"stam.config", "stam.errors", "stam.ids", "stam.cache", "stam.patient_state", "stam.integrity",
     "stam.deadletter_payload", "stam.stage_thread", "stam.metrics", "stam.logs", "stam.net", "stam.stack",
     "stam.lifecycle", "stam.export"},
    {"stam.transport", "stam.crypto", "stam.backends", "stam.embedding", "stam.encoder", "stam.llm", "topology"},
    {"stam.sources", "stam.reasoning", "stam.deadletters", "stam.fhir", "stam.deletion"},
    {"stam.stages", "stam.rebuild"},
    {"stam.read", "stam.publish", "stam.mllp", "stam.erase", "stam.recovery", "stam.serving", "stam.ops"},
    {"stam.compose"},
    {"workers", "stam.cli"},
    {"stam_lab", "stam_lab.eval", "stam_lab.training"},
    {"stam_lab.cli"},
    {"benchmarks"},
]

KNOWN_UPWARD: dict[tuple[str, str], str] = {}


def _component(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] in ("stam", "stam_lab") and len(parts) > 1 else parts[0]


@cache
def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for folder in ROOTS.values():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder.parent).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


@cache
def _imports() -> dict[str, set[str]]:
    """Module -> the project modules it imports (a ``from package import name`` of a submodule counts it)."""
    modules = _modules()
    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            edges[name].update(t for t in targets if t in modules and t != name)
    return edges


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_no_import_circle() -> None:
    assert _circles(_imports()) == []


def test_the_circle_check_finds_one() -> None:
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_component_has_a_layer() -> None:
    rank = {c for layer in LAYERS for c in layer}
    assert {_component(m) for m in _modules()} - {"stam"} <= rank


def test_no_module_imports_a_layer_above_its_own() -> None:
    rank = {c: i for i, layer in enumerate(LAYERS) for c in layer}
    upward: dict[tuple[str, str], list[str]] = defaultdict(list)
    for module, targets in _imports().items():
        a = _component(module)
        for target in targets:
            b = _component(target)
            if a != b and b != "stam" and rank[b] > rank[a]:
                upward[(a, b)].append(f"{module} -> {target}")
    unknown = {k: v for k, v in upward.items() if k not in KNOWN_UPWARD}
    assert unknown == {}, "imports of a higher layer (move the code, or the import, down)"
    gone = set(KNOWN_UPWARD) - set(upward)
    assert gone == set(), "no longer imported: remove these from KNOWN_UPWARD"


def _private_imports(sources: dict[str, str]) -> list[str]:
    """``from a.b import _name`` in one module of another's private name (a leading underscore, not a dunder)."""
    found = []
    for module, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                    and node.module.split(".")[0] in (*ROOTS, "tests") and node.module != module:
                found += [f"{module}: from {node.module} import {a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
    return found


def test_no_private_name_is_imported_from_another_module() -> None:
    """What two modules share is a public name with a docstring (tests may reach into the module they test)."""
    assert _private_imports({m: p.read_text() for m, p in _modules().items()}) == []


def test_the_private_import_check_finds_one() -> None:
    assert _private_imports({"stam.a": "from stam.b import _x, y\nfrom stam.a import _z\nfrom os import _exit\n",
                             "benchmarks.c": "from tests.integration.broker import _helper\n"}) \
        == ["stam.a: from stam.b import _x", "benchmarks.c: from tests.integration.broker import _helper"]


PRODUCT = ("schemas", "stam", "topology", "workers", "stam_lab")


def _unmarked_deferred_imports(sources: dict[str, str]) -> list[str]:
    """Imports inside a function with no comment saying why they are deferred: a comment containing "deferred" on
    the import's line, or a comment line above it or above the run of imports it belongs to (consecutive import
    statements: one comment for the run). A module's dependencies are at its top otherwise."""
    found = []
    for module, text in sources.items():
        lines = text.splitlines()
        for fn in ast.walk(ast.parse(text)):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for owner in ast.walk(fn):
                for field in ("body", "orelse", "finalbody"):
                    run_first: int | None = None  # the first line of the run of imports the statement is in
                    body = getattr(owner, field, None)
                    for stmt in body if isinstance(body, list) else []:
                        if not isinstance(stmt, ast.Import | ast.ImportFrom):
                            run_first = None
                            continue
                        run_first = run_first or stmt.lineno
                        above = [lines[n - 2] for n in (stmt.lineno, run_first) if lines[n - 2].lstrip().startswith("#")]
                        if not any("#" in line and "deferred" in line.split("#", 1)[1]
                                   for line in [*lines[stmt.lineno - 1:stmt.end_lineno], *above]):
                            found.append(f"{module}:{stmt.lineno}: {ast.unparse(stmt)}")
    return sorted(set(found))


def test_every_import_inside_a_function_says_why_it_is_deferred() -> None:
    """Issue 39: a module's dependencies are at its top, unless a comment says why an import is deferred (an
    optional or slow dependency kept off a light path such as `stam --help`, a circle it breaks)."""
    assert _unmarked_deferred_imports({m: p.read_text() for m, p in _modules().items()
                                       if m.split(".")[0] in PRODUCT}) == []


def test_the_deferred_import_check_finds_one() -> None:
    source = ("import os\n\n\ndef f():\n    # deferred: torch is slow to import\n    import torch\n"
              "    from transformers import A\n\n    import json\n    x = 1\n    import yaml  # deferred: optional\n"
              "    import re\n    return x\n")
    assert _unmarked_deferred_imports({"stam.a": source}) == ["stam.a:12: import re"]
