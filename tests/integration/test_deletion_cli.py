"""`stam deletion calibrate` on a replayed Synthea patient (real stores, the real embedding model, labels from
codes and a reviewer's): it runs end to end, deletes nothing, and with too few calibration types for alpha it says
tau is infinite rather than inventing a threshold."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import BUNDLES, REPO, SMALL_PATIENT, need_data


def test_calibrate_reports_the_gate_on_a_replayed_patient(tmp_path: Path) -> None:
    need_data()
    out, labels = tmp_path / "report.json", tmp_path / "labels.jsonl"
    # The three runs share one replay (--replay-dir): the first writes it, the next two reopen it.
    replay = ["--source", "synthea", "--synthea", str(BUNDLES), "--subjects", SMALL_PATIENT, "--labels", str(labels),
              "--replay-dir", str(tmp_path / "replay")]
    labelled = subprocess.run([sys.executable, "-m", "stam.cli", "deletion", "label", *replay],
                              cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert labelled.returncode == 0, labelled.stderr[-3000:]
    assert json.loads((tmp_path / "replay" / "replay.json").read_text())["patients"] == [SMALL_PATIENT]
    counts = json.loads(labelled.stdout)["types"]
    assert counts["labelled"] == labels.read_text().count("\n") > 0
    # Codes label this patient's vital signs safe; its coded never-forget types are held by rule, not candidates.
    # With one class the head cannot be trained: calibrate says so in one line.
    one_class = subprocess.run([sys.executable, "-m", "stam.cli", "deletion", "calibrate", *replay],
                               cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert one_class.returncode == 2, one_class.stderr[-3000:]
    assert one_class.stderr.strip().splitlines()[-1] == (
        "stam deletion calibrate: the labels hold only safe-to-forget candidate types; the head needs both safe and "
        "protected ones (label more types: --judge-url, or add labels to --labels)")
    # A person labels the types the codes left (the report lists them): uncertain, as a cautious reviewer would.
    todo = json.loads(labelled.stdout)["unlabelled_types"]
    assert todo and not set(todo) & {json.loads(x)["concept_type"] for x in labels.read_text().splitlines()}
    with labels.open("a") as fh:
        for t in todo:
            fh.write(json.dumps({"concept_type": t, "endurance": "uncertain", "source": "person", "judge": "reviewer",
                                 "prompt": "", "date": "2026-11-26", "examples": 0}) + "\n")
    done = subprocess.run([sys.executable, "-m", "stam.cli", "deletion", "calibrate", *replay, "--rounds", "20",
                           "--out", str(out), "--gate-out", str(tmp_path / "gate"), "--alpha", "0.01", "0.5"],
                          cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{counts['labelled'] + len(todo)} labels read from" in done.stderr
    report = json.loads(out.read_text())
    gate = json.loads((tmp_path / "gate" / "gate.json").read_text())
    assert gate["tau"] is None and gate["criterion"] == "strict" and gate["calibration_id"].startswith("gate-")
    assert report["gate"][0]["calibration_id"] == gate["calibration_id"] == report["calibration_id"]["strict"]
    # Another alpha: the same head's threshold, reported beside the gate's and written as its own gate.
    other = json.loads((tmp_path / "gate-alpha0.5" / "gate.json").read_text())
    assert other["alpha"] == 0.5 and other["calibration_id"] != gate["calibration_id"]
    assert report["other_alphas"]["0.5"]["calibration_id"]["strict"] == other["calibration_id"]
    assert report["labels"] == "codes+person" and report["codes_vs_labels"]["agree"] == 1.0
    assert report["types"]["by_label"]["safe-to-forget"] > 0 and report["types"]["by_label"]["uncertain"] == len(todo)
    assert report["types"]["labelled"] > 0 and report["memories"]["labelled"] > 0
    assert sum(report["kept_by_rule"].values()) > 0  # the record's own needs held memories back
    # One patient's types cannot certify alpha = 0.01 (that needs 99 calibration types): nothing would go.
    assert report["tau"] == {"strict": None, "never-forget-only": None}
    assert report["store"]["strict"]["deleted"] == 0
    assert "exchangeable" in report["guarantee"]
    assert labels.read_text().count("\n") == report["types"]["labelled"]
    assert "tau" in done.stderr and "resplit check" in done.stderr
