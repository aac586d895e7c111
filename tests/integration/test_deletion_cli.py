"""`stam deletion calibrate` on a replayed Synthea patient (real stores, the real embedding model, labels from
codes): it runs end to end, deletes nothing, and with too few calibration types for alpha it says tau is
infinite rather than inventing a threshold."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import BUNDLES, REPO, SMALL_PATIENT, need_data


def test_calibrate_reports_the_gate_on_a_replayed_patient(tmp_path: Path) -> None:
    need_data()
    out, labels = tmp_path / "report.json", tmp_path / "labels.jsonl"
    replay = ["--source", "synthea", "--synthea", str(BUNDLES), "--subjects", SMALL_PATIENT, "--labels", str(labels)]
    labelled = subprocess.run([sys.executable, "-m", "stam.cli", "deletion", "label", *replay],
                              cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert labelled.returncode == 0, labelled.stderr[-3000:]
    counts = json.loads(labelled.stdout)["types"]
    assert counts["labelled"] == labels.read_text().count("\n") > 0
    done = subprocess.run([sys.executable, "-m", "stam.cli", "deletion", "calibrate", *replay, "--rounds", "20",
                           "--out", str(out), "--gate-out", str(tmp_path / "gate"), "--alpha", "0.01", "0.5"],
                          cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{counts['labelled']} labels read from" in done.stderr
    report = json.loads(out.read_text())
    gate = json.loads((tmp_path / "gate" / "gate.json").read_text())
    assert gate["tau"] is None and gate["criterion"] == "strict" and gate["calibration_id"].startswith("gate-")
    assert report["gate"][0]["calibration_id"] == gate["calibration_id"] == report["calibration_id"]["strict"]
    # Another alpha: the same head's threshold, reported beside the gate's and written as its own gate.
    other = json.loads((tmp_path / "gate-alpha0.5" / "gate.json").read_text())
    assert other["alpha"] == 0.5 and other["calibration_id"] != gate["calibration_id"]
    assert report["other_alphas"]["0.5"]["calibration_id"]["strict"] == other["calibration_id"]
    assert report["labels"] == "codes" and report["codes_vs_labels"]["agree"] == 1.0
    assert report["types"]["labelled"] > 0 and report["memories"]["labelled"] > 0
    assert sum(report["kept_by_rule"].values()) > 0  # the record's own needs held memories back
    # One patient's types cannot certify alpha = 0.01 (that needs 99 calibration types): nothing would go.
    assert report["tau"] == {"strict": None, "never-forget-only": None}
    assert report["store"]["strict"]["deleted"] == 0
    assert "exchangeable" in report["guarantee"]
    assert labels.read_text().count("\n") == report["types"]["labelled"]
    assert "tau" in done.stderr and "resplit check" in done.stderr
