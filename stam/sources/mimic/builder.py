"""What every MIMIC-IV table's rows are turned with: :class:`RowBuilder`, one patient's rows with the indexes the
tables are read against and :meth:`RowBuilder.emit`, which makes an entry and orders it among the patient's; and
the counts per table (:class:`MimicResult`). The tables' own readings are mixins of it (``encounters``,
``diagnoses``, ``orders``, ``measurements``), put together in ``patient``."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from schemas import Coding, RecordEntry
from stam.errors import SourceError
from stam.sources.base import SourceResult
from stam.sources.mimic.codes import SOURCE
from stam.sources.mimic.reading import TABLES, Lookups, Row


@dataclass
class TableCount:
    """One table's rows read, entries made, rows that could not be read, and rows folded into another entry."""

    rows: int = 0
    entries: int = 0
    bad: int = 0
    folded: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"rows": self.rows, "entries": self.entries, "bad": self.bad, "folded": self.folded}


@dataclass
class MimicResult(SourceResult):
    """Entries (filled by :func:`load_mimic`, not by :func:`iter_mimic`, which yields them), rows that could not
    be read, and counts per table."""

    tables: dict[str, TableCount] = field(default_factory=lambda: defaultdict(TableCount))
    patients: int = 0

    def counts(self) -> dict[str, dict[str, int]]:
        return {t: c.as_dict() for t, c in sorted(self.tables.items())}

    def detail(self) -> dict[str, Any]:
        return {"tables": self.counts()}


class RowBuilder:
    """One patient's rows, the indexes the orders and medications are read against, and the entries made from them:
    collects (sort time, table rank, entry)."""

    def __init__(self, subject: str, rows: dict[str, list[Row]], chosen: tuple[str, ...], lk: Lookups,
                 result: MimicResult) -> None:
        self.subject = subject
        self.rows = rows
        self.chosen = chosen
        self.lk = lk
        self.result = result
        self.out: list[tuple[datetime, int, int, int, RecordEntry]] = []
        self._seq = 0
        self.admissions = {r["hadm_id"]: r for r in rows.get("admissions", [])}
        # Drug names for orders: prescriptions (MAIN drug first), then pharmacy, then emar.
        self.rx_by_pharmacy: dict[str, list[Row]] = defaultdict(list)
        self.drug_by_poe: dict[str, list[Row]] = defaultdict(list)
        for r in rows.get("prescriptions", []):
            if r.get("pharmacy_id"):
                self.rx_by_pharmacy[r["pharmacy_id"]].append(r)
            if r.get("poe_id"):
                self.drug_by_poe[r["poe_id"]].append(r)
        for group in (*self.rx_by_pharmacy.values(), *self.drug_by_poe.values()):
            group.sort(key=lambda r: (r.get("drug_type") != "MAIN",))
        self.pharmacy_ids = {r["pharmacy_id"] for r in rows.get("pharmacy", [])} if "pharmacy" in chosen else set()
        self.pharmacy_by_poe = {r["poe_id"]: r for r in rows.get("pharmacy", []) if r.get("poe_id")}
        self.emar_by_poe = {r["poe_id"]: r for r in rows.get("emar", []) if r.get("poe_id")}
        self.poe = {r["poe_id"]: r for r in rows.get("poe", [])}
        # Which order ended which: from the discontinuing order's discontinue_of_poe_id (always set on Change and
        # D/C rows) and from the ended order's discontinued_by_poe_id (not always filled in).
        self.ended_by: dict[str, str] = {}
        for r in self.poe.values():
            if r.get("discontinued_by_poe_id") and r["discontinued_by_poe_id"] in self.poe:
                self.ended_by.setdefault(r["poe_id"], r["discontinued_by_poe_id"])
        for r in self.poe.values():
            if r.get("discontinue_of_poe_id") and r["transaction_type"] in ("Change", "D/C"):
                self.ended_by[r["discontinue_of_poe_id"]] = r["poe_id"]
        self.order_codes: dict[str, tuple[Coding, ...]] = {}

    def emit(self, table: str, key: str, when: datetime | None, *, last: bool = False, **fields: Any) -> None:
        """One entry at clinical time ``when``; ``last``: after every other entry of the same time (a discharge).
        Of one table's entries at one time, a stop comes before a start (unless it stops what started then): a pharmacy
        row that ends when the next row of the same order begins must not end the row that replaced it."""
        entry = RecordEntry(patient_id=self.subject, entry_id=f"{SOURCE}:{table}:{key}", source=SOURCE,
                            **fields)
        sort_time = when or entry.effective_at or entry.recorded_at
        if sort_time is None:
            raise SourceError(f"{table} row {key} has no time")
        began = entry.effective_at
        phase = 0 if key.endswith(":stop") and began is not None and began < sort_time else 1
        rank = -1 if table == "patients" else len(TABLES) if last else TABLES.index(table)
        self.out.append((sort_time, rank, phase, self._seq, entry))
        self._seq += 1
        self.result.tables[table].entries += 1

    def _encounter(self, hadm_id: str | None) -> str | None:
        """The admission a row belongs to, as the admission's own reference (rows without one: None)."""
        return f"Encounter/{hadm_id}" if hadm_id else None
