"""The load model: entries per inpatient-day of the MIMIC-IV demo, and from it the entries/s of a hospital and of a
network (the report's ``load_model``); the per-patient entry counts and record spans it and the simulation use."""

from __future__ import annotations

import csv
import gzip
import json
import re
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

from benchmarks.sizing.units import DAY_S


def _ts(value: str) -> datetime:
    return datetime.fromisoformat(value.strip())


def read_admissions(path: Path) -> dict[str, Any]:
    """Sum of admission lengths (days) of a MIMIC-shaped ``admissions.csv.gz`` (subject_id, hadm_id, admittime,
    dischtime), and each subject's first admission and last discharge."""
    days, n, skipped = 0.0, 0, 0
    first: dict[str, datetime] = {}
    last: dict[str, datetime] = {}
    with gzip.open(path, "rt", newline="") as fh:
        for row in csv.DictReader(fh):
            if not row.get("admittime") or not row.get("dischtime"):
                skipped += 1
                continue
            a, d = _ts(row["admittime"]), _ts(row["dischtime"])
            if d < a:
                skipped += 1
                continue
            days += (d - a).total_seconds() / DAY_S
            n += 1
            s = row["subject_id"]
            first[s] = min(first.get(s, a), a)
            last[s] = max(last.get(s, d), d)
    return {"inpatient_days": days, "admissions": n, "skipped": skipped, "subjects": len(first),
            "admission_span_days": sum(max(1.0, (last[s] - first[s]).total_seconds() / DAY_S) for s in first)}


def load_counts(path: Path | None) -> dict[str, int] | None:
    """``{subject_id: entries}`` from a JSON file, or None where there is no such file."""
    if path is None or not path.is_file():
        return None
    data = json.loads(path.read_text())
    return {str(k): int(v) for k, v in data.items()}


def count_entries(entries_jsonl: Path) -> dict[str, int] | None:
    """Entries per patient in a RecordEntry JSON Lines file (a kept replay's ``entries.jsonl``)."""
    if not entries_jsonl.is_file():
        return None
    pat = re.compile(rb'"patient_id":"([^"]+)"')
    found: Counter[str] = Counter()
    with entries_jsonl.open("rb") as fh:
        for line in fh:
            m = pat.search(line)
            if m is not None:
                found[m.group(1).decode()] += 1
    return dict(found) or None


def count_mimic(mimic: Path) -> dict[str, int] | None:
    """Entries per patient of the MIMIC-IV folder, every table (reads the folder: ~30 s for the demo)."""
    from stam.errors import SourceError
    from stam.sources.mimic import iter_mimic

    try:
        return {b[0].patient_id: len(b) for b in iter_mimic(mimic) if b} or None
    except (SourceError, OSError):  # not a MIMIC-IV folder: the counts fall back to the demo's total (reported)
        return None


def record_span_days(entries_jsonl: Path) -> float | None:
    """Sum over patients of (last - first clinical day + 1) in a RecordEntry JSON Lines file."""
    if not entries_jsonl.is_file():
        return None
    pat = re.compile(rb'"patient_id":"([^"]+)".*?"effective_at":"(\d{4}-\d\d-\d\d)')
    lo: dict[bytes, bytes] = {}
    hi: dict[bytes, bytes] = {}
    with entries_jsonl.open("rb") as fh:
        for line in fh:
            m = pat.search(line)
            if m is None:
                continue
            p, d = m.group(1), m.group(2)
            if p not in lo or d < lo[p]:
                lo[p] = d
            if p not in hi or d > hi[p]:
                hi[p] = d
    if not lo:
        return None
    return float(sum((datetime.fromisoformat(hi[p].decode()) - datetime.fromisoformat(lo[p].decode())).days + 1
                     for p in lo))


def rates(per_inpatient_day: float, beds: int, occupancy: float, peak_factor: float, hospitals: int = 1
          ) -> dict[str, float]:
    """Mean and peak entries/s of ``hospitals`` hospitals of ``beds`` beds at ``occupancy``."""
    occupied = beds * occupancy * hospitals
    mean = occupied * per_inpatient_day / DAY_S
    return {"occupied_beds": occupied, "entries_per_day": occupied * per_inpatient_day, "mean_entries_per_s": mean,
            "peak_entries_per_s": mean * peak_factor}


def load_model(total_entries: int, admissions: dict[str, Any], *, beds: int, occupancy: float, peak_factor: float,
               hospitals: int) -> dict[str, Any]:
    """The report's ``load_model``: entries per inpatient-day, and the rates of one hospital and of the network."""
    per_day = total_entries / admissions["inpatient_days"]
    return {
        "entries": total_entries, "admissions": admissions["admissions"],
        "inpatient_days": round(admissions["inpatient_days"], 2),
        "entries_per_inpatient_day": round(per_day, 2),
        "note": "every STAM entry of the demo (outpatient, pre-admission and post-discharge rows too) over the sum "
                "of admission lengths: an upper-ish estimate of the load per occupied bed",
        "peak_factor": peak_factor,
        "peak_factor_note": "assumed: the busiest hour (morning lab rounds, medication passes) at this many times "
                            "the daily mean",
        "hospital": {"beds": beds, "occupancy": occupancy,
                     **_rounded(rates(per_day, beds, occupancy, peak_factor))},
        "network": {"hospitals": hospitals, "beds": beds * hospitals, "occupancy": occupancy,
                    **_rounded(rates(per_day, beds, occupancy, peak_factor, hospitals))},
    }


def _rounded(d: dict[str, float], nd: int = 2) -> dict[str, float]:
    return {k: round(v, nd) for k, v in d.items()}
