"""Write-time state diagnostics on Synthea FHIR R4 bundles: medication stops, condition abatements, repeated
observations.

Gold is read from the bundles' resources (``synthea_gold``), never from STAM's output; an entry counts only when
the loader published it (matched by its source resource, ``<type>/<id>``):

- ``med-renewal`` pairs: a patient's MedicationRequests of one RxNorm code in ``authoredOn`` order; Synthea
  stops a prescription when it renews it, so each stopped request -> the next request of that code.
- ``observation-repeat`` pairs: consecutive Observations of one code (first coding) with a strictly later
  ``effectiveDateTime``: the earlier -> the next (a newer value replaces the older one). Results of one code
  at the same time (a lab repeated inside a panel) are one reading: the last published of them pairs with
  the next time's first; the others end at their simultaneous twin and are not pairs.
- ended facts: Conditions with an ``abatementDateTime`` (reason ``resolved``) and stopped MedicationRequests
  that no later request of their code renews (reason ``stopped``) belong in HISTORY with that reason.
- held facts (false archival): Conditions without abatement whose clinical status is active, active
  MedicationRequests, the latest Observation of each code (a unique latest time).
- point in time: a Condition is current from its onset until its abatement (ACTIVE inside the interval, not
  ACTIVE from the abatement on); the latest Observation of each code at the sampled time is the current one.
  Synthea R4 MedicationRequests carry no stop time, so medications are not checked in time.

Same metrics and variants as :mod:`stam_lab.eval.state_eval` (``diagnose``).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from schemas import RecordEntry
from stam.sources.fhir_r4 import entries_from_bundle, iter_bundle_files, parse_time, status_code
from stam_lab.eval.state_eval import (
    Gold,
    GoldPair,
    ProgressFn,
    Replayed,
    diagnose,
    open_replay,
    patient_timeline,
    replay_entries,
    save_replay,
)

SYNTHEA_PAIR_KINDS = ("med-renewal", "observation-repeat")


def _first_code(concept: dict[str, Any] | None) -> str | None:
    codings = (concept or {}).get("coding") or []
    return f"{codings[0].get('system')}|{codings[0].get('code')}" if codings else None


def synthea_gold(bundles: Iterable[dict[str, Any]], entries: dict[str, list[RecordEntry]]) -> Gold:
    """Gold from raw bundles; ``entries`` are the loader's entries per patient (only those count)."""
    gold = Gold()
    for raw in bundles:
        resources = [e.get("resource") or {} for e in raw.get("entry", [])]
        patient = next((r.get("id") for r in resources if r.get("resourceType") == "Patient"), None)
        if patient is None or patient not in entries:
            continue
        published = {e.source_ref: e.entry_id for e in entries[patient] if e.source_ref}
        arrival = {e.entry_id: i for i, e in enumerate(entries[patient])}

        meds: dict[str, list[tuple[datetime, str, str]]] = defaultdict(list)
        observations: dict[str, list[tuple[datetime, str]]] = defaultdict(list)
        intervals: list[tuple[str, datetime, datetime | None]] = []
        for r in resources:
            eid = published.get(f"{r.get('resourceType')}/{r.get('id')}")
            if eid is None:
                continue
            rtype = r.get("resourceType")
            if rtype == "MedicationRequest":
                code, when = _first_code(r.get("medicationCodeableConcept")), parse_time(r.get("authoredOn"))
                if code and when:
                    meds[code].append((when, eid, r.get("status") or ""))
            elif rtype == "Observation":
                code, when = _first_code(r.get("code")), parse_time(r.get("effectiveDateTime"))
                if code and when:
                    observations[code].append((when, eid))
            elif rtype == "Condition":
                onset, abated = parse_time(r.get("onsetDateTime")), parse_time(r.get("abatementDateTime"))
                if abated is not None:
                    gold.ended[patient][eid] = "resolved"
                elif status_code(r.get("clinicalStatus")) == "active":
                    gold.holds[patient].add(eid)
                if onset is not None:
                    intervals.append((eid, onset, abated))
        for requests in meds.values():
            requests.sort()
            for (_, old, status), (_, new, _) in zip(requests, requests[1:], strict=False):
                if status == "stopped":
                    gold.pairs.append(GoldPair("med-renewal", patient, old, new))
            _, last, status = requests[-1]
            if status == "stopped":
                gold.ended[patient][last] = "stopped"
            elif status == "active":
                gold.holds[patient].add(last)
        for code, results in observations.items():
            results.sort(key=lambda r: (r[0], arrival[r[1]]))
            gold.labs.setdefault(patient, {})[code] = results
            # Results of one code at one time (Synthea repeats a lab inside a panel) are one reading: the last
            # published stands for the group and pairs with the first of the next time.
            for (t_old, old), (t_new, new) in zip(results, results[1:], strict=False):
                if t_new > t_old:
                    gold.pairs.append(GoldPair("observation-repeat", patient, old, new))
            if len(results) == 1 or results[-1][0] > results[-2][0]:
                gold.holds[patient].add(results[-1][1])
        gold.intervals[patient] = sorted(intervals, key=lambda x: x[1])
    return gold


def load_synthea(folder: Path) -> tuple[list[dict[str, Any]], dict[str, list[RecordEntry]]]:
    """Every bundle of ``folder`` (raw, for the gold) and the loader's entries per patient (clinical order)."""
    raws, entries = [], {}
    for path in iter_bundle_files([folder]):
        raw = json.loads(path.read_bytes())  # read once: the gold reads the raw resources, the loader its entries
        raws.append(raw)
        result = entries_from_bundle(raw, validate=False)
        if result.patient_id:
            entries[result.patient_id] = result.entries
    return raws, entries


SYNTHEA_TABLES = ("synthea-r4-bundles",)
"""What a kept Synthea replay records as its tables (``replay.json``), so a MIMIC-IV replay is never reopened as
one."""


def replay_synthea(folder: Path, *, variant: str, workdir: Path, patients: Sequence[str] | None = None,
                   embedder: Any = None, progress: ProgressFn | None = None,
                   keep: bool = False) -> tuple[Replayed, list[dict[str, Any]]]:
    """The bundles of ``folder`` (``patients`` only, when given) through the write-path stages under ``variant``;
    ``keep``: as :func:`stam_lab.eval.state_eval.replay_mimic`'s (the replay stays in ``workdir``, and a later call for
    patients it holds reopens it)."""
    raws, entries = load_synthea(folder)
    chosen = [p for p in sorted(entries) if patients is None or p in set(patients)]
    wanted = chosen if patients is not None else None
    if keep:
        reopened = open_replay(workdir, variant=variant, tables=SYNTHEA_TABLES, subjects=wanted, embedder=embedder)
        if reopened is not None:
            return reopened, raws
    run = replay_entries((entries[p] for p in chosen), variant=variant, workdir=workdir, embedder=embedder,
                         progress=progress)
    if keep:
        save_replay(run, workdir, variant=variant, tables=SYNTHEA_TABLES, subjects=wanted)
    return run, raws


def evaluate_synthea(folder: Path, *, variant: str = "stam", workdir: Path, patients: Sequence[str] | None = None,
                     embedder: Any = None, progress: ProgressFn | None = None,
                     samples_per_patient: int = 10, timeline_patient: str | None = "auto") -> dict[str, Any]:
    """Replay the bundles of ``folder`` under ``variant`` and diagnose the final state against their gold."""
    run, raws = replay_synthea(folder, variant=variant, workdir=workdir, patients=patients, embedder=embedder,
                               progress=progress)
    try:
        states = {pid: run.deps.states.load(pid) for pid in run.events}
    finally:
        run.close()
    gold = synthea_gold(raws, dict(run.entries))
    report = diagnose(gold, states, run.router.candidates, dict(run.events), samples_per_patient=samples_per_patient)
    return {"variant": variant, "source": "synthea-r4", "entries": sum(len(v) for v in run.entries.values()),
            "transitions": sum(len(v) for v in run.events.values()), "seconds": round(run.seconds, 1), **report,
            "timeline": patient_timeline(run.events, timeline_patient)}
