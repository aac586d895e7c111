"""One patient's rows -> entries: :class:`PatientBuilder` reads each chosen table with its handler (a method
``_<table>`` of the mixins, one module per table family), then the death and the demographics, and sorts the
entries in clinical-event order."""

from __future__ import annotations

from collections.abc import Callable

from pydantic import ValidationError

from schemas import RecordEntry
from stam.errors import SourceError
from stam.sources.base import BadInput
from stam.sources.mimic.diagnoses import DiagnosisRows
from stam.sources.mimic.encounters import EncounterRows
from stam.sources.mimic.measurements import MeasurementRows
from stam.sources.mimic.orders import OrderRows
from stam.sources.mimic.reading import Row, row_bytes


class PatientBuilder(EncounterRows, DiagnosisRows, OrderRows, MeasurementRows):
    """Turns one patient's rows into entries (:meth:`run`), every table by its family's handler."""

    def run(self) -> list[RecordEntry]:
        for table in self.chosen:
            handler: Callable[[Row], None] = getattr(self, f"_{table}")
            for row in self.rows.get(table, []):
                self.result.tables[table].rows += 1
                try:
                    handler(row)
                except (SourceError, ValidationError, ValueError, KeyError) as exc:
                    self.result.tables[table].bad += 1
                    reason = exc.errors()[0]["msg"] if isinstance(exc, ValidationError) else str(exc)
                    self.result.bad.append(BadInput(f"{table}.csv", row_bytes(row), type(exc).__name__,
                                                    f"MIMIC-IV {table} row: {reason}"[:2000]))
        if "admissions" in self.chosen:
            try:
                self._death()
            except SourceError as exc:
                self.result.tables["admissions"].bad += 1
                self.result.bad.append(BadInput("admissions.csv", self.subject.encode(), "SourceError",
                                                f"MIMIC-IV death time: {exc}"))
            self._demographics()
        self.out.sort(key=lambda x: (x[0], x[1], x[2], x[3]))
        return [e for *_, e in self.out]
