"""Every benchmark and evaluation report says where it came from: the command, the commit, the machine, when."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stam_lab.eval import provenance
from stam_lab.eval.provenance import command, git_commit, missing, stamp

REPO = Path(__file__).resolve().parents[2]
MIMIC = Path(os.environ.get("STAM_SHARED_DATA", REPO.parent / "shared" / "data")) / "mimic-iv-demo-2.2"


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@example.org", *args],
                          check=True, capture_output=True, text=True).stdout.strip()


def test_the_command_reads_as_it_was_typed() -> None:
    assert command(["/x/benchmarks/faust_floor.py", "--messages", "2000", "--storage", "memory", "s3"],
                   main_module="benchmarks.faust_floor") == \
        "python -m benchmarks.faust_floor --messages 2000 --storage memory s3"
    assert command(["/repo/.venv/bin/stam", "eval", "qa", "--limit", "5"], main_module="") == "stam eval qa --limit 5"
    assert command(["python", "-m", "stam.cli"], main_module="stam.cli.__main__").startswith("python -m stam.cli ")
    assert command(["stam", "ask", "--patient", "P", "How high?"], main_module="") == "stam ask --patient P 'How high?'"


def test_the_commit_and_whether_tracked_files_differ_from_it(tmp_path: Path) -> None:
    _git(tmp_path, "init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    _git(tmp_path, "add", "a.py")
    _git(tmp_path, "commit", "-q", "-m", "one")
    head = _git(tmp_path, "rev-parse", "HEAD")
    assert git_commit(tmp_path) == {"commit": head, "dirty": False}
    (tmp_path / "results.json").write_text("{}")  # untracked output of the run itself: not a change of code
    assert git_commit(tmp_path) == {"commit": head, "dirty": False}
    (tmp_path / "a.py").write_text("x = 2\n")
    assert git_commit(tmp_path) == {"commit": head, "dirty": True}


def test_no_checkout_no_commit(tmp_path: Path) -> None:
    assert git_commit(tmp_path) == {"commit": None, "dirty": None}


def test_stamp_keeps_the_report_and_puts_provenance_first() -> None:
    report = {"benchmark": "x", "entries_per_s": 12.5, "provenance": "old"}
    out = stamp(report, argv=["prog", "--n", "3"], main_module="benchmarks.x")
    assert list(out)[0] == "provenance" and out["entries_per_s"] == 12.5 and out["benchmark"] == "x"
    prov = out["provenance"]
    assert prov["command"] == "python -m benchmarks.x --n 3"
    assert prov["commit"] == _git(REPO, "rev-parse", "HEAD")
    assert prov["machine"]["cores"] == os.cpu_count() and prov["machine"]["memory_gib"] > 0
    assert prov["machine"]["cpu"] and prov["machine"]["python"].startswith(f"{sys.version_info[0]}.")
    assert prov["when"].endswith("+00:00")
    assert missing(out) == []
    runs = stamp([{"storage": "s3"}, {"storage": "memory"}], argv=["p"], main_module="benchmarks.y")
    assert runs["results"] == [{"storage": "s3"}, {"storage": "memory"}] and missing(runs) == []


def test_missing_names_what_a_report_lacks() -> None:
    assert missing({"entries_per_s": 1}) == ["provenance"]
    assert missing([1, 2]) == ["provenance"]
    good = stamp({}, argv=["p"], main_module="m")
    assert missing({"provenance": {**good["provenance"], "commit": None}}) == ["commit"]
    no_cpu = {**good["provenance"], "machine": {**good["provenance"]["machine"], "cpu": None}}
    assert missing({"provenance": no_cpu}) == ["machine.cpu"]
    assert missing({"provenance": {k: v for k, v in good["provenance"].items() if k != "command"}}) == ["command"]


def _is_stamp(node: ast.AST, names: dict[str, ast.AST]) -> bool:
    """``node`` is ``stamp(...)``, a name last assigned one, or a comprehension over one's items."""
    for _ in range(4):
        if isinstance(node, ast.Name) and node.id in names:
            node = names[node.id]
        elif isinstance(node, ast.DictComp) and isinstance(node.generators[0].iter, ast.Call) and \
                isinstance(node.generators[0].iter.func, ast.Attribute):
            node = node.generators[0].iter.func.value
        else:
            break
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "stamp"


def _dumps_arg(node: ast.AST) -> ast.AST | None:
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "dumps" and node.args:
        return node.args[0]
    return None


def test_every_benchmark_that_prints_json_stamps_it() -> None:
    """A benchmark's report is printed through ``stamp``: in every function of benchmarks/, what
    ``print(json.dumps(X))`` or ``print(name)`` (``name = json.dumps(X)``) prints is stamped, where X may be a name
    last assigned ``stamp(...)``. A skip notice (``{"skipped": ...}``) is not a measurement, and neither is what a
    ``demo`` function shows (``make demo-fhir`` prints the notification Bundle it received)."""
    unstamped, seen = [], 0
    for path in sorted((REPO / "benchmarks").glob("*.py")):
        for fn in (n for n in ast.walk(ast.parse(path.read_text()))
                   if isinstance(n, ast.FunctionDef) and n.name != "demo"):
            names: dict[str, ast.AST] = {}
            for node in ast.walk(fn):
                if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                    names[node.targets[0].id] = node.value
            for call in (n for n in ast.walk(fn) if isinstance(n, ast.Call)):
                if not (isinstance(call.func, ast.Name) and call.func.id == "print" and call.args):
                    continue
                arg = call.args[0]
                arg = names.get(arg.id, arg) if isinstance(arg, ast.Name) else arg
                inner = _dumps_arg(arg)
                if inner is None:
                    continue
                seen += 1
                skip = isinstance(inner, ast.Dict) and any(isinstance(k, ast.Constant) and k.value == "skipped"
                                                           for k in inner.keys)
                if not skip and not _is_stamp(inner, names):
                    unstamped.append(f"{path.name}:{call.lineno}")
    assert seen >= 16 and not unstamped, (seen, unstamped)


@pytest.mark.skipif(not MIMIC.is_dir(), reason=f"MIMIC-IV demo not found at {MIMIC}")
def test_stam_eval_prints_its_provenance(tmp_path: Path) -> None:
    out = tmp_path / "q.jsonl"
    res = subprocess.run([sys.executable, "-m", "stam.cli", "eval", "questions", "--mimic", str(MIMIC),
                          "--subjects", "10019917", "--out", str(out)], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert missing(report) == [] and report["questions"] > 0 and out.is_file()
    assert report["provenance"]["command"] == f"python -m stam.cli eval questions --mimic {MIMIC} " \
        f"--subjects 10019917 --out {out}"
    assert provenance.REQUIRED == ("command", "commit", "machine", "when")
