"""MIMIC-QA: a deterministic question set over the MIMIC-IV (demo) tables, answered from the rows themselves.

In the spirit of the paper's MIMIC-QA (template questions with answer operations, no language model anywhere,
a patient-disjoint split), restricted to what the project publishes: every question's ``evidence`` is a tuple of
entry ids that :mod:`stam.sources.mimic` produces for that patient (``mimic-iv:labevents:<labevent_id>``,
``mimic-iv:poe:<poe_id>``, ``mimic-iv:pharmacy:<pharmacy_id>:start|:stop``, ``mimic-iv:admissions:<hadm_id>``).

Times are MIMIC clinical times (lab ``charttime``, pharmacy ``starttime``/``stoptime``, POE ``ordertime``), read
as UTC like the loader does; ``as_of`` is an ISO string with ``+00:00`` and a row counts when its time is at or
before ``as_of`` (inclusive). Templates (``qtype``):

- ``first_value`` / ``last_value``: the earliest / latest result of a lab item (d_labitems ``label (fluid)``).
  Results sharing the first (last) ``charttime`` are all evidence; if they disagree, the question is skipped.
- ``min_value`` / ``max_value``: the lowest / highest numeric result; every row with that value is evidence.
- ``value_at_time``: the result in effect at ``as_of`` = the latest result at or before it. ``as_of`` is the
  midpoint (floored to the minute) between one result time and the item's next, so it is never the last one.
- ``previous_value``: "What was the <display> value before the most recent one?": the result of the time before
  the latest one. Half the items (by hash) ask it at a time instead ("As of <T>, ..."; ``as_of`` = the midpoint
  between a result time j >= 1 and the next one, so group j is the latest then); either form falls back to the
  other when it has no pair of agreed groups. Evidence: the rows of both times (a reader needs the latest to
  know which one is previous); skipped when either time's results disagree.
- ``change_since_first``: "How has the patient's <display> changed since the first result?" (whole record).
  Answer ``"<first> to <latest>"``, each value written as the other lab templates write it ("3.9 mEq/L to 4.4
  mEq/L", also when the two are equal); token F1 then credits each number and unit, one value with its unit
  gets 0.6, and only exact match checks the order. The signed difference with its unit ("+0.5 mEq/L", as the
  read path's computed fact writes it) is the same answer in another form and is scored as right too (``also``).
  Evidence: the rows of the first and latest times.
- ``current_medication``: at ``as_of`` (the moment some pharmacy order ended), among the pharmacy orders active
  then (start <= as_of < end), the drug of the one started most recently. An order's end is what the loader
  publishes: the ordertime of the POE 'Change'/'D/C' that ended it, else the pharmacy ``stoptime`` (orders with
  no stop, on hold, or ended before they started are never active). Evidence: the order's ``:start`` entry.
  Skipped when the most recent start is shared by two drugs, or when a POE medication order placed since then
  is still open at ``as_of`` (POE orders without pharmacy rows stay active in the published rows) for another
  drug.
- ``discontinued_medication``: at ``as_of`` (a discontinuation time), the medication order discontinued or
  changed most recently: a POE medication order ended by one 'D/C' or 'Change' (evidence: the order's row and
  the ending row), or a pharmacy order with a discontinued status that no POE order ended (evidence: its
  ``:start`` and ``:stop``). Skipped when something else ended at the same time: another drug, or an order
  whose drug the rows do not name (an order ended twice, an IV order, an unnamed medication).
- ``drug_active_at``: "As of <T>, was <drug> an active medication order?", "yes" or "no". The drug's orders
  (any spelling of the name: MIMIC writes tall-man letters, "LORazepam" / "Lorazepam") are its pharmacy
  orders, active over the loader's interval as for ``current_medication``, and its POE medication orders ended
  by a 'Change'/'D/C' (from ordertime to that row). "yes": an order is active at T (evidence: the ``:start``
  or POE entry of each one active); "no": none is, and one had ended by T (evidence: the start and ending
  entries of the order(s) that ended last: ``:start`` + ``:stop``, or + the POE row that ended it). Times:
  the midpoint of an active interval ("yes" candidates) and the midpoint between an end and the drug's next
  order or the discharge of the admission it ended in, whichever comes first ("no" candidates; none when it
  ended outside an admission or at discharge), floored to the minute and strictly inside. Skipped: an order of
  the drug starts or ends exactly at T; an order of the drug whose state the rows leave open covers T (a POE
  order with no pharmacy row and no Change/D/C, which the loader publishes active for good; a POE order
  between its ordertime and its first pharmacy start; a pharmacy order on hold or without a stoptime); and
  any case where the order's published versions disagree with the intervals: a POE order and its pharmacy
  rows share one order identity, and the answer must also hold when each order is as its latest published
  entry at T says (active, naming the drug, not ended by a Change/D/C since); e.g. a second pharmacy row of
  one POE order that stops while the first still runs, or an IV order's POE row (which names no drug)
  published after its pharmacy start. Unnamed drugs are never asked about. Per patient, "yes" and "no"
  candidates alternate (the first side by hash), so the chosen questions are about half yes.
- ``order_changed_into``: "What was the <drug> order of <ordertime> changed into?": a POE medication order
  ended by exactly one row, a 'Change'; answer: what the Change's own (new) order prescribes, ``"<drug>
  <dosage>"`` as the loader publishes it on the new order's first pharmacy version (its earliest start): the
  drug the loader names that row by and its ``dosage`` (dose_val_rx/dose_unit_rx of the same prescription,
  route, frequency), e.g. "Vancomycin 750 mg IV Q 8H". Evidence: the old order's and the Change's POE entries
  and the entry of each pharmacy row of the new order at that start (``:start``, or the single entry the loader
  publishes when the order was ended before it started or the row has no stop). ``as_of`` is that start, or
  the Change's ordertime when the pharmacy start is earlier: the new dosage is only in the record from the
  pharmacy start on (asked at the ordertime, the answer would postdate the question), and every evidence entry
  is in the record then. Skipped: either order unnamed, the old order ended more than once, another POE order
  of the same drug placed at the same ordertime (the question would not say which), the new order without a
  pharmacy row, rows of the new order at its first start without a dosage or disagreeing on drug + dosage,
  and changes the published rows cannot tell apart: the answer equals (case aside) the drug + dosage of one
  of the old order's pharmacy rows (under its own name or the question's), or the old order has no pharmacy
  row with a dosage. Most Changes alter dose, route or frequency and keep the drug; the answer never repeats
  the old order's published drug + dosage (about half the Changes only alter what the rows do not show).
- ``count``: the number of hospital admissions (whole record, ``as_of`` None; evidence: every admission), or
  the number of results of a lab item charted up to ``as_of`` (evidence: those rows).

Lab questions use only items with a d_labitems label that no other item of the same patient shares (the
published entry displays ``label (fluid)``: e.g. blood-gas and chemistry "Glucose (Blood)" would be the same
words) and, for the value templates, with >= 3 numeric results in one unit (MCHC is written in % and g/dL).
Numbers are ``valuenum`` as MIMIC writes it, followed by ``valueuom`` when there is one.

Choice: for each patient and template, candidates are ordered by a hash of (seed, question_id) (for
``drug_active_at``, yes and no alternating, each in that order); templates are taken round robin from a
per-patient rotation of :data:`QTYPES` until ``per_patient`` questions (the admissions count is the first
``count`` candidate; a template without candidates leaves its turn to the others). The default
:data:`PER_PATIENT` = 18 keeps 1.5 questions per template and patient with 12 templates, the share each had
with 8 templates and 12: every template gets one question per patient where it has one, and six of them a
second (which six turns with the rotation). The split is by a hash of the patient id (60/20/20), so a
patient's questions are all in one split whatever the seed.

The parts: :mod:`.question` (:class:`Question`, the stable hashes), :mod:`.rows` (the rows read, once per table),
:mod:`.templates` (each template's candidates); here the choice (round robin) and the question files.
"""


from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict
from pathlib import Path

from stam.errors import SourceError
from stam.sources.mimic import is_mimic_root
from stam_lab.eval.mimic_qa.question import Question, split_of, stable_hash
from stam_lab.eval.mimic_qa.rows import load_rows
from stam_lab.eval.mimic_qa.templates import Candidate, Templates

__all__ = ["PER_PATIENT", "QTYPES", "SPLITS", "Question", "balanced_sample", "build_questions", "read_jsonl", "split_of",
           "write_jsonl"]

QTYPES: tuple[str, ...] = ("first_value", "last_value", "previous_value", "change_since_first", "min_value",
                           "max_value", "value_at_time", "current_medication", "drug_active_at",
                           "discontinued_medication", "order_changed_into", "count", "currently_receiving",
                           "discharge_changes", "first_day", "hour_n", "billed_diagnoses", "age")
PER_PATIENT = 27  # questions per patient by default: 1.5 per template (see the module docstring)
SPLITS: tuple[str, ...] = ("train", "dev", "test")


def _select(patient: str, cands: dict[str, list[Candidate]], per_patient: int, seed: int) -> list[Question]:
    """Round robin over the templates (per-patient rotation), each template's candidates in hash order."""
    start = stable_hash("rotate", str(seed), patient) % len(QTYPES)
    order = [*QTYPES[start:], *QTYPES[:start]]
    queues = {qt: iter(sorted(cands.get(qt, []), key=lambda c: (c[0], c[1]))) for qt in order}
    out: list[Question] = []
    while len(out) < per_patient and queues:
        for qt in order:
            if qt not in queues or len(out) >= per_patient:
                continue
            q = next((q for _, _, make in queues[qt] if (q := make()) is not None), None)
            if q is None:
                del queues[qt]
            else:
                out.append(q)
    return out


def build_questions(root: Path, *, per_patient: int = PER_PATIENT, seed: int = 0,
                    subjects: Iterable[str] | None = None) -> list[Question]:
    """The question set of the MIMIC-IV folder ``root``: patients in ascending subject_id, up to ``per_patient``
    questions each. Same input, same output (everything is ordered explicitly; choices are hashes of the seed)."""
    root = Path(root)
    if not is_mimic_root(root):
        raise SourceError(f"{root} is not a MIMIC-IV folder (no hosp/admissions.csv.gz)")
    wanted = {str(s) for s in subjects} if subjects is not None else None
    patients, displays = load_rows(root, wanted)
    out: list[Question] = []
    for patient in sorted(patients, key=lambda s: (len(s), s)):
        out.extend(_select(patient, Templates(patient, patients[patient], displays, seed).all(), per_patient, seed))
    return out


def balanced_sample(questions: Sequence[Question], n: int, *, seed: int = 0) -> list[Question]:
    """``n`` questions with the types in equal shares (as far as each type has questions), each type's in a seeded
    order; returned in the input's order."""
    by_type: dict[str, list[Question]] = defaultdict(list)
    for q in sorted(questions, key=lambda q: stable_hash(str(seed), "sample", q.question_id)):
        by_type[q.qtype].append(q)
    chosen: set[str] = set()
    queues = {t: iter(v) for t, v in sorted(by_type.items())}
    while len(chosen) < min(n, len(questions)) and queues:
        for t in list(queues):
            if len(chosen) >= n:
                break
            nxt = next(queues[t], None)
            if nxt is None:
                del queues[t]
            else:
                chosen.add(nxt.question_id)
    return [q for q in questions if q.question_id in chosen]


def write_jsonl(questions: Iterable[Question], path: str | Path) -> int:
    """One JSON object a line (evidence as a list); returns the number written."""
    n = 0
    with Path(path).open("w", encoding="utf-8") as fh:
        for q in questions:
            fh.write(json.dumps(asdict(q), ensure_ascii=False) + "\n")
            n += 1
    return n


def read_jsonl(path: str | Path) -> list[Question]:
    out: list[Question] = []
    with Path(path).open(encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                d = json.loads(line)
                d["evidence"] = tuple(d["evidence"])
                d["also"] = tuple(d.get("also", ()))
                out.append(Question(**d))
    return out
