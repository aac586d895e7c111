"""The docs' generated figures are what their results files give, and every results file says which run it is."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from benchmarks import figures
from stam_lab.eval.provenance import missing, stamp

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"


def test_the_committed_docs_are_what_make_figures_writes() -> None:
    stale, problems = figures.run(DOCS, write=False)
    assert problems == []
    assert stale == [], f"{stale}: run `make figures`; a generated figure is never edited by hand"


def test_every_results_file_names_its_command_commit_and_machine() -> None:
    files = sorted((DOCS / "results").glob("*.json"))
    assert files, "the docs cite no results file"
    for path in files:
        report = json.loads(path.read_text())
        assert missing(report) == [], path
        prov = report["provenance"]
        assert len(prov["commit"]) == 40 and prov["dirty"] is False, f"{path}: run on a committed, clean tree"
        assert prov["command"].startswith(("python -m benchmarks.", "stam eval ", "python -m stam.cli eval ")), path
        assert figures.kind(report) in figures.RENDERERS, path


def test_every_results_file_is_cited_and_every_figure_has_one() -> None:
    cited = {name for page in figures.pages(DOCS) for name, _ in figures.find(page.read_text())}
    assert cited == {p.stem for p in (DOCS / "results").glob("*.json")}


@pytest.fixture()
def docs_copy(tmp_path: Path) -> Path:
    shutil.copytree(DOCS, tmp_path / "docs")
    return tmp_path / "docs"


def _a_figure(docs: Path) -> tuple[Path, str]:
    for page in figures.pages(docs):
        for name, _ in figures.find(page.read_text()):
            return page, name
    raise AssertionError("no generated figure in the docs")


def test_a_figure_edited_by_hand_fails_the_check_and_make_figures_restores_it(docs_copy: Path) -> None:
    page, name = _a_figure(docs_copy)
    original = page.read_text()
    body = dict(figures.find(original))[name]
    row = next(line for line in body.splitlines() if line.startswith("| ") and any(c.isdigit() for c in line))
    edited = re.sub(r"\d", lambda d: str((int(d.group()) + 1) % 10), row, count=1)  # one digit of a number
    page.write_text(original.replace(row, edited, 1))
    assert figures.main(["--check", "--docs", str(docs_copy)]) == 1
    stale, _ = figures.run(docs_copy, write=False)
    assert stale == [f"{page.relative_to(docs_copy)}: {name}"]
    assert figures.main(["--docs", str(docs_copy)]) == 0
    assert page.read_text() == original
    assert figures.main(["--check", "--docs", str(docs_copy)]) == 0


def test_a_new_result_changes_the_figure(docs_copy: Path) -> None:
    page, name = _a_figure(docs_copy)
    path = docs_copy / "results" / f"{name}.json"
    report = json.loads(path.read_text())
    report["provenance"]["commit"] = "0" * 40
    path.write_text(json.dumps(report))
    stale, problems = figures.run(docs_copy, write=True)
    assert problems == [] and stale == [f"{page.relative_to(docs_copy)}: {name}"]
    assert "at commit `0000000000`" in page.read_text()


def test_a_figure_without_its_results_or_provenance_or_renderer_is_refused(docs_copy: Path) -> None:
    page = docs_copy / "new.md"
    page.write_text("# New\n\n<!-- figure: nothing-here -->\n<!-- /figure -->\n")
    _, problems = figures.run(docs_copy, write=False)
    assert any("nothing-here" in p and "no results file" in p for p in problems)
    (docs_copy / "results" / "nothing-here.json").write_text(json.dumps({"benchmark": "faust_floor"}))
    _, problems = figures.run(docs_copy, write=False)
    assert any("provenance incomplete" in p for p in problems)
    (docs_copy / "results" / "nothing-here.json").write_text(json.dumps(stamp({"benchmark": "no_such_kind"})))
    _, problems = figures.run(docs_copy, write=False)
    assert any("no renderer" in p for p in problems)
    page.write_text("# New\n\n<!-- figure: nothing-here -->\nnever closed\n")
    _, problems = figures.run(docs_copy, write=False)
    assert any("closed" in p for p in problems)
    page.unlink()
    _, problems = figures.run(docs_copy, write=False)
    assert any("no page cites it" in p for p in problems)


def test_the_floor_renderer_shows_each_run() -> None:
    run = {"benchmark": "faust_floor", "fanout": 2, "payload_bytes": 3000, "linger_ms": 5, "messages": 2000,
           "entries_per_s": 1341.5, "first_message_s": 8.8, "stack_up_s": 1.1, "broker_disk_mb": 0.0,
           "storage": "memory", "rss_mb": {"broker": 80.0},
           "cpu": {"cpu_ms_per_entry_total": 3.38, "cores_busy": 1.43}}
    text = figures.render_faust_floor({"results": [run, {**run, "storage": "s3", "entries_per_s": 197.0,
                                                         "rss_mb": {"s3": 390.0, "broker": 20.0}}]})
    rows = [line for line in text.splitlines() if line.startswith("| memory") or line.startswith("| s3")]
    assert len(rows) == 2 and "| 1,341.5 |" in rows[0] and "| 197.0 |" in rows[1] and "390.0 / 20.0" in rows[1]
    assert text.startswith("2,000 messages, 3,000 bytes each, fan-out 2, producer linger 5 ms\n")
    lingers = figures.render_faust_floor({"results": [run, {**run, "linger_ms": 50}]})
    assert "| linger ms |" in lingers and "producer linger" not in lingers


def test_a_marker_shown_as_an_example_is_not_a_figure() -> None:
    text = ("Put `<!-- figure: NAME -->` on the page:\n\n```html\n<!-- figure: example -->\n<!-- /figure -->\n```\n\n"
            "<!-- figure: real -->\nold\n<!-- /figure -->\nafter\n")
    assert figures.find(text) == [("real", "old\n")]
    with pytest.raises(figures.FigureError, match="without its opening marker"):
        figures.find("text\n<!-- /figure -->\n")
    with pytest.raises(figures.FigureError, match="opens inside"):
        figures.find("<!-- figure: a -->\n<!-- figure: b -->\n<!-- /figure -->\n")
