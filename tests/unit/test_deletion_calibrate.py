"""The deletion gate's calibration arithmetic against values computed by hand (stam/deletion/calibrate.py)."""

from __future__ import annotations

import math
import random

import pytest

from schemas import AtomicMemory, Category, CodeSystem, Coding
from stam.deletion.calibrate import NEVER_FORGET_ONLY, STRICT, TypeScores, calibrate, diagnose, resplit_check, risk
from stam.deletion.labels import Endurance, code_label, concept_type

S, U, N = Endurance.SAFE, Endurance.UNCERTAIN, Endurance.NEVER_FORGET

# n = 4 types. Strict: risk(tau) = (L_B + L_C + 1) / 5 <= 0.3  <=>  L_B + L_C <= 0.5.
#   tau 0.8: L_B = 1/2 (0.85), L_C = 2/4 (0.8, 0.99) -> 1.0   no
#   tau 0.85: L_B = 1/2, L_C = 1/4 (0.99)            -> 0.75  no
#   tau 0.9: L_B = 0, L_C = 1/4                       -> 0.25  yes: tau = 0.9
# Never-forget-only: L_C <= 0.5: tau 0.7 gives 3/4 (no), 0.8 gives 2/4 (yes): tau = 0.8.
HAND = [
    TypeScores("A", S, (0.9, 0.95)),
    TypeScores("B", U, (0.2, 0.85)),
    TypeScores("C", N, (0.5, 0.7, 0.8, 0.99)),
    TypeScores("D", S, (0.1,)),
]


def test_strict_and_never_forget_only_thresholds_match_the_hand_computation() -> None:
    assert calibrate(HAND, alpha=0.3) == 0.9
    assert risk(HAND, 0.9) == pytest.approx((0 + 0.25 + 1) / 5)
    assert risk(HAND, 0.85) == pytest.approx((0.5 + 0.25 + 1) / 5)
    assert calibrate(HAND, alpha=0.3, criterion=NEVER_FORGET_ONLY) == 0.8
    assert risk(HAND, 0.8, NEVER_FORGET_ONLY) == pytest.approx((0.5 + 1) / 5)


def test_diagnostics_at_a_threshold_match_the_hand_count() -> None:
    d = diagnose(HAND, 0.9)  # deletes A's 0.9 and 0.95, C's 0.99; keeps B's 0.85 and D's 0.1
    assert (d.memories, d.deleted) == (9, 3)
    assert d.removed_share == pytest.approx(3 / 9)
    assert d.safe_recall == pytest.approx(2 / 3) and d.safe_precision == pytest.approx(2 / 3)
    assert d.never_forget_loss == pytest.approx(1 / 4) and d.uncertain_loss == 0.0
    nothing = diagnose(HAND, math.inf)
    assert (nothing.deleted, nothing.safe_precision, nothing.safe_recall) == (0, 1.0, 0.0)


def test_nothing_is_deleted_where_alpha_cannot_be_certified() -> None:
    assert calibrate(HAND, alpha=0.1) == math.inf  # 1 / (4 + 1) > 0.1: four types cannot certify 10 %
    top = [*HAND, TypeScores("E", N, (1.0,))] + [TypeScores(f"s{i}", S, (0.5,)) for i in range(20)]
    # 25 types, E a never-forget memory scored above everything else. alpha 0.1: at tau 0.9 the loss is
    # L_C + L_E = 0.25 + 1 -> (1.25 + 1) / 26 = 0.087 (yes); at 0.85 L_B adds 0.5 -> 2.75 / 26 = 0.106 (no).
    assert calibrate(top, alpha=0.1) == 0.9
    # alpha 0.05: even tau 1.0 costs L_E = 1 -> 2 / 26 = 0.077; only a tau above every score (1 / 26) is
    # feasible, and that deletes nothing.
    assert calibrate(top, alpha=0.05) == math.inf
    with pytest.raises(ValueError):
        calibrate(HAND, alpha=0.0)
    with pytest.raises(ValueError, match="unknown criterion"):
        calibrate(HAND, alpha=0.3, criterion="lenient")


def _synthetic(n: int, seed: int) -> list[TypeScores]:
    """Types whose scores lean high when safe, low when protected, with overlap (a realistic scorer)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        label = rng.choices([S, U, N], weights=[0.4, 0.5, 0.1])[0]
        centre = 0.8 if label is S else 0.35
        out.append(TypeScores(f"t{i}", label, tuple(min(1.0, max(0.0, rng.gauss(centre, 0.2)))
                                                    for _ in range(rng.randint(1, 8)))))
    return out


def test_the_search_finds_the_smallest_feasible_score_like_a_scan() -> None:
    types = _synthetic(300, seed=1)
    for alpha in (0.01, 0.05, 0.2):
        for criterion in (STRICT, NEVER_FORGET_ONLY):
            values = sorted({s for t in types for s in t.scores})
            scan = next((v for v in values if risk(types, v, criterion) <= alpha), math.inf)
            assert calibrate(types, alpha, criterion) == scan


def test_the_guarantee_holds_on_random_resplits() -> None:
    """Over 200 random calibration/test splits of exchangeable types, the mean protected loss on the test types
    stays at or below alpha (the conformal bound is on the expectation)."""
    types = _synthetic(800, seed=2)
    for alpha in (0.01, 0.05):
        check = resplit_check(types, alpha, rounds=200, seed=3)
        assert check["rounds_deleting_nothing"] == 0
        assert check["mean_test_loss"] <= alpha, check
        assert check["mean_test_loss"] > alpha / 4, check  # and the gate is not vacuous: it deletes something


def test_labels_from_codes() -> None:
    def memory(category: Category, system: str | None, code: str | None, text: str) -> AtomicMemory:
        concept = Coding(system=system, code=code, display=text) if system and code else None
        return AtomicMemory(memory_id="m", patient_id="p", entry_id="e", category=category, text=text,
                            concept=concept, position=0)

    hr = memory(Category.OBSERVATION, CodeSystem.LOINC.value, "8867-4", "Heart rate 80 /min")
    mimic_hr = memory(Category.OBSERVATION, "http://mimic.mit.edu/fhir/mimic/CodeSystem/mimic-d-items", "220045",
                      "Heart Rate 92 bpm")
    glucose = memory(Category.OBSERVATION, CodeSystem.LOINC.value, "2339-0", "Glucose 110 mg/dL")
    glucose_value = glucose.model_copy(update={"value": 110.0, "unit": "mg/dL"})
    mimic_hgb = memory(Category.OBSERVATION, "http://mimic.mit.edu/fhir/mimic/CodeSystem/mimic-d-labitems", "51222",
                       "Hemoglobin 9.1 g/dL").model_copy(update={"value": 9.1})
    mimic_gcs = memory(Category.OBSERVATION, "http://mimic.mit.edu/fhir/mimic/CodeSystem/mimic-d-items", "220739",
                       "GCS - Eye Opening 4").model_copy(update={"value": 4.0})
    diabetes = memory(Category.CONDITION, CodeSystem.SNOMED.value, "44054006", "Diabetes mellitus type 2")
    note = memory(Category.CONDITION, None, None, "Chest  pain, resolved!")
    assert code_label(hr) is S and code_label(mimic_hr) is S
    assert code_label(glucose) is None  # a lab code without a value: not a result, the judge decides
    assert code_label(glucose_value) is N and code_label(mimic_hgb) is N  # a lab result: series values are asked
    # a MIMIC-IV lab event whose value was withheld ("___") still replaced the value before it in its series
    assert code_label(mimic_hgb.model_copy(update={"value": None})) is N
    assert code_label(mimic_gcs) is None  # a charted bedside item that is not a vital sign: the judge decides
    assert code_label(diabetes) is N
    assert code_label(note) is None  # free text: no code to go by
    assert concept_type(hr) == f"{CodeSystem.LOINC.value}|8867-4"
    assert concept_type(note) == "condition:chest pain resolved"
    assert S.protected is False and U.protected and N.protected


def test_candidates_are_archived_memories_less_what_the_record_needs() -> None:
    from datetime import UTC, datetime

    from schemas import Reason, Relation, RelationType, Store
    from stam.deletion.candidates import Keep, Source, relink, select
    from stam.patient_state import PatientState

    at = datetime(2020, 1, 1, tzinfo=UTC)

    def mem(mid: str, category: Category = Category.OBSERVATION) -> AtomicMemory:
        return AtomicMemory(memory_id=mid, patient_id="p", entry_id=f"e-{mid}", category=category, text=mid,
                            position=0)

    s = PatientState("p")
    # A series v1 -> v2 -> v3 -> v4 (ACTIVE); a stopped drug related to an ACTIVE condition; a lone old value.
    for mid in ("v1", "v2", "v3", "v4", "cond", "drug", "lone"):
        s.add(mem(mid), Store.ACTIVE)
    # An old diagnosis, resolved: its code says never forget, whatever a head would score it.
    s.add(AtomicMemory(memory_id="dx", patient_id="p", entry_id="e-dx", category=Category.CONDITION,
                       text="Pneumonia", position=0,
                       concept=Coding(system=CodeSystem.SNOMED.value, code="233604007", display="Pneumonia")),
          Store.ACTIVE)
    s.archive("dx", reason=Reason.RESOLVED, successor_id=None, evidence_id=None, entry_id="e", at=at)
    s.relate(Relation(source_id="drug", target_id="cond", type=RelationType.TREATMENT_FOR))
    s.archive("v1", reason=Reason.SUPERSEDED, successor_id="v2", evidence_id="v2", entry_id="e", at=at)
    s.archive("v2", reason=Reason.SUPERSEDED, successor_id="v3", evidence_id="v3", entry_id="e", at=at)
    s.archive("v3", reason=Reason.SUPERSEDED, successor_id="v4", evidence_id="v4", entry_id="e", at=at)
    s.archive("drug", reason=Reason.STOPPED, successor_id=None, evidence_id=None, entry_id="e", at=at)
    s.archive("lone", reason=Reason.SUPERSEDED, successor_id=None, evidence_id=None, entry_id="e", at=at)

    sel = select(s, proposals=["lone", "v4"])
    assert {c.stored.memory.memory_id for c in sel.candidates} == {"v2", "lone"}
    assert sel.kept == {"v1": Keep.THREAD_START, "v3": Keep.BEFORE_CURRENT, "drug": Keep.RELATED,
                        "v4": Keep.ACTIVE, "dx": Keep.CODED}
    assert next(c.sources for c in sel.candidates if c.stored.memory.memory_id == "lone") == {Source.SWEEP,
                                                                                              Source.PROPOSAL}
    assert [c.stored.memory.memory_id for c in select(s, proposals=["lone"], sweep=False).candidates] == ["lone"]
    assert relink(s, "v2") == [("v1", "v3")]  # deleting v2 re-points v1 to v3: the chain stays whole
