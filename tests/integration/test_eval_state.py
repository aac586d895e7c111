"""`stam eval state` on a real MIMIC-IV patient: the replay on real stores under STAM and under the
append-only ablation, diagnosed against gold taken from the rows (POE Change/D/C links, pharmacy stops,
repeated labs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.conftest import DATA

pytestmark = pytest.mark.integration
MIMIC = DATA / "mimic-iv-demo-2.2"
PATIENT = "10019917"


@pytest.fixture(scope="module")
def reports(tmp_path_factory: Any, embedder: Any) -> dict[str, Any]:
    if not MIMIC.is_dir():
        pytest.skip(f"MIMIC-IV demo not found at {MIMIC} (set STAM_SHARED_DATA)")
    from stam_lab.eval.state_eval import evaluate_mimic

    work = tmp_path_factory.mktemp("eval")
    return {v: evaluate_mimic(MIMIC, subjects=[PATIENT], variant=v, workdir=Path(work), embedder=embedder)
            for v in ("stam", "append-only", "rule-measurement-dose")}


def test_gold_pairs_come_from_the_rows(reports: dict[str, Any]) -> None:
    by_kind = reports["stam"]["pairs"]["by_kind"]
    # 10019917's diet order changed five times (8 -> 27 -> 40 -> 45 -> 46 -> 52) among its POE Changes.
    assert by_kind["poe-change"]["pairs"] >= 5 and by_kind["poe-dc"]["pairs"] >= 1
    assert by_kind["lab-repeat"]["pairs"] > 20 and by_kind["pharmacy-stop"]["pairs"] > 0


def test_stam_archives_what_ended_linked_to_what_ended_it(reports: dict[str, Any]) -> None:
    r = reports["stam"]
    kinds = r["pairs"]["by_kind"]
    assert kinds["poe-change"]["recall"] == 1.0 and kinds["lab-repeat"]["recall"] == 1.0
    assert kinds["pharmacy-stop"]["recall"] == 1.0
    # Every D/C'd order is archived; some were already ended by their own pharmacy stop before the D/C came.
    assert kinds["poe-dc"]["archived"] == 1.0 and kinds["poe-dc"]["recall"] is not None
    assert r["pairs"]["impact_ceiling"] == 1.0
    assert r["false_archival"]["held_facts"] > 10 and r["false_archival"]["rate"] == 0.0
    assert r["point_in_time"]["checks"] > 50 and r["point_in_time"]["agreement"] == 1.0


def test_the_ablations_lose_what_the_paper_says_they_lose(reports: dict[str, Any]) -> None:
    append = reports["append-only"]
    assert append["pairs"]["recall"] == 0.0 and append["archived_fraction"] == 0.0
    assert append["point_in_time"]["agreement"] < 0.9  # older lab values stay ACTIVE beside the newest
    rule = reports["rule-measurement-dose"]
    assert rule["pairs"]["by_kind"]["lab-repeat"]["recall"] == 1.0  # a newer value supersedes: the rule holds
    assert rule["pairs"]["recall"] < reports["stam"]["pairs"]["recall"]  # but stops and D/Cs are missed


SYNTHEA = DATA / "synthea-r4-bundles"
# The smallest bundle (132 entries): a patient with resolved conditions, stopped and renewed medications and
# repeated observations.
SYNTHEA_PATIENT = "12981771-2029-4458-9260-efb1e6b43db7"


@pytest.fixture(scope="module")
def synthea(tmp_path_factory: Any, embedder: Any) -> dict[str, Any]:
    if not SYNTHEA.is_dir():
        pytest.skip(f"Synthea bundles not found at {SYNTHEA} (set STAM_SHARED_DATA)")
    from stam_lab.eval.synthea import evaluate_synthea

    work = tmp_path_factory.mktemp("eval-synthea")
    return {v: evaluate_synthea(SYNTHEA, patients=[SYNTHEA_PATIENT], variant=v, workdir=Path(work) / v,
                                embedder=embedder) for v in ("stam", "append-only")}


def test_synthea_gold_stops_abatements_and_repeated_observations(synthea: dict[str, Any]) -> None:
    r = synthea["stam"]
    kinds = r["pairs"]["by_kind"]
    assert kinds["observation-repeat"]["pairs"] > 20 and kinds["observation-repeat"]["recall"] == 1.0
    # Renewed prescriptions arrive already stopped (the bundle is a snapshot): archived with reason "stopped",
    # but the successor is not known when they arrive (the gap the issue note describes).
    assert kinds["med-renewal"]["pairs"] > 0 and kinds["med-renewal"]["archived"] == 1.0
    assert r["ended"]["facts"] > 5 and r["ended"]["in_history"] == 1.0 and r["ended"]["reason_agrees"] == 1.0
    assert r["false_archival"]["held_facts"] > 5 and r["false_archival"]["rate"] == 0.0


def test_point_in_time_holds_a_condition_inside_its_onset_abatement_interval(synthea: dict[str, Any]) -> None:
    pit = synthea["stam"]["point_in_time"]
    # A resolved condition arrives once, with its abatement; as of a time inside its interval it is ACTIVE,
    # from the abatement on it is not.
    assert pit["interval_checks"] > 20 and pit["interval_agreement"] == 1.0 and pit["agreement"] == 1.0
    assert synthea["append-only"]["point_in_time"]["agreement"] < 0.9


def test_timeline_and_plot_come_from_the_transition_log(synthea: dict[str, Any], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="plots need the eval extra (make setup installs it)")
    from stam_lab.eval.plots import plot_timeline

    tl = synthea["stam"]["timeline"]
    assert tl["patient"] == SYNTHEA_PATIENT
    times = [p[0] for p in tl["points"]]
    assert times == sorted(times) and len(times) > 50
    last = tl["points"][-1]
    assert last[1] + last[2] == synthea["stam"]["memories"] and last[2] > 0
    assert synthea["append-only"]["timeline"]["points"][-1][2] == 0  # append-only never archives
    out = plot_timeline([(v, synthea[v]["timeline"]["points"]) for v in synthea], tmp_path / "t.png", title="t")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
